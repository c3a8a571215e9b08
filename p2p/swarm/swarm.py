"""The swarm library API: join, leave, heartbeats, policy, peers, validators, bans, rollout hand-off, and the
endpoint of pipeline hops.

Usually one Swarm per process (several work side by side: the tests and benchmarks/swarm.py run ten in
one). `start_dht()` forks the DHT child (call it before CUDA initialises); `join()` does that if needed,
tests reachability, and starts the heartbeat task. Reads return only records that pass the same checks
the DHT validator applies; bad entries are logged and skipped, never raised.

Layers: peer.py (`DHTPeer`: the DHT process, the p2p daemon, named tasks) -> directory.py
(`SwarmDirectory`: signed records in the DHT) -> this module (`Swarm`: the rollout hand-off over libp2p
streams).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from ..pipeline.libp2p import StageStreams, StreamLimits
from . import handoff
from .directory import SwarmDirectory
from .errors import HandoffError, SwarmError
from .records import Heartbeat, RecordKind, ValidatorAnnouncement
from .routing import Batch, owner

__all__ = ["Swarm"]

logger = logging.getLogger(__name__)


class Swarm(SwarmDirectory):
    """A node's membership in one run's swarm (see the module docstring); adds the rollout hand-off."""

    async def serve_rollouts(
        self,
        directory: Path,
        accept: handoff.AcceptCallback,
        admit: handoff.AdmitCallback | None = None,
    ) -> handoff.RolloutReceiver:
        """Receive rollout files into `directory`; `accept` sees each checked file and may refuse it.

        `admit`, when given, sees each checked header before the body is read and may refuse it too; what it
        returns says whether the sender may use the receive slots reserved for established nodes.
        """
        if self.client_mode:
            raise SwarmError(
                "a validator must be dialable; this node runs in client mode (see docs/swarm.md)"
            )

        async def peer_of(node_id: str) -> str | None:
            heartbeat = await self.heartbeat_of(node_id)
            return heartbeat.peer_id if heartbeat else None

        async def is_banned(node_id: str) -> bool:
            return node_id in await self._read_cached(RecordKind.BAN)

        receiver = handoff.RolloutReceiver(
            self.identity,
            directory,
            accept,
            peer_of,
            is_banned,
            self.config,
            admit,
        )
        await self._add_handler(handoff.protocol_name(self.config.run_id), receiver.handle)
        return receiver

    async def heartbeat_of(self, node_id: str) -> Heartbeat | None:
        """`node_id`'s live signed heartbeat (it binds the node id to a libp2p peer id), if the DHT holds one."""
        heartbeat = (await self._read_cached(RecordKind.HEARTBEAT)).get(node_id)
        if heartbeat is None:  # maybe it joined after our last read
            heartbeat = (await self._read(RecordKind.HEARTBEAT)).get(node_id)
        return heartbeat

    async def serve_pipeline(self, limits: StreamLimits | None = None) -> StageStreams:
        """This node's endpoint for pipeline hops (p2p/pipeline/libp2p.py); a node in client mode can dial out
        but only a stage whose predecessor shares a relay with it could be reached (not built: such a node is
        not offered as reachable, and the coordinator prefers reachable members)."""
        if self._p2p is None:
            raise SwarmError("not joined: call join() first")
        streams = StageStreams(self._p2p, self.config.run_id, limits)
        await self._add_handler(streams.name, streams.handle)
        return streams

    async def pipeline_peer(self, node_id: str) -> tuple[str, list[str]] | None:
        """(libp2p peer id, multiaddrs) of a pipeline member, from its live signed heartbeat."""
        heartbeat = await self.heartbeat_of(node_id)
        return (heartbeat.peer_id, list(heartbeat.addresses)) if heartbeat is not None else None

    async def owner_of(self, batch: Batch, *, fresh: bool = False) -> ValidatorAnnouncement | None:
        """The validator that judges `batch` in this peer's view of the swarm (routing.py); None if none does."""
        return owner(self.config.run_id, batch, (await self.live_validators(fresh=fresh)).values())

    async def route(self, envelope: handoff.RolloutEnvelope) -> ValidatorAnnouncement:
        """Where a file goes: the owner of the batch its envelope signs (routing.py). HandoffError when no
        validator is live yet, or for a v1 envelope (no batch: every validator of this version refuses it)."""
        if envelope.batch is None:
            raise HandoffError(
                f"envelope format {envelope.format} names no batch, so it has no validator; sign the file "
                f"again as {handoff.SIG_FORMAT}"
            )
        batch = envelope.routed_as
        assert batch is not None  # a batch is signed (checked above)
        found = await self.owner_of(batch)
        if found is None:
            raise HandoffError("no live validator is announced in the DHT yet; retry later")
        return found

    async def send_rollout(
        self,
        data: bytes | Path,
        envelope: handoff.RolloutEnvelope,
        validator: ValidatorAnnouncement | None = None,
    ) -> handoff.Receipt:
        """Stream a signed rollout file to `validator` (None: `route(envelope)`); returns its receipt."""
        if self._p2p is None:
            raise SwarmError("not joined: call join() first")
        if validator is None:
            validator = await self.route(envelope)
        if isinstance(data, Path):
            data = await asyncio.to_thread(data.read_bytes)
        p2p, peer = self._p2p, PeerID.from_base58(validator.peer_id)
        try:
            # Teach our daemon where the validator listens: the DHT may never have talked to it.
            await p2p._client.connect(peer, [Multiaddr(a) for a in validator.addresses])
        except Exception as exc:  # p2pd ControlFailure: the stream open below reports the real failure
            logger.debug("connect to validator %s failed: %s", validator.peer_id, exc)

        async def open_stream() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            try:
                _, reader, writer = await p2p.call_binary_stream_handler(
                    peer, handoff.protocol_name(self.config.run_id)
                )
            except (ControlFailure, P2PDaemonError, OSError) as exc:
                raise HandoffError(
                    f"cannot open a stream to validator {validator.node_id[:16]}…: {exc}"
                ) from exc
            return reader, writer

        return await handoff.send(
            open_stream,
            envelope,
            data,
            validator.node_id,
            self.config.handoff_timeout_s,
            handoff.body_deadline_s(self.config, len(data)),
        )
