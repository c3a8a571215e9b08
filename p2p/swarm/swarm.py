"""The swarm library API: join, leave, heartbeats, policy, peers, validators, bans, rollout hand-off.

Usually one Swarm per process (several work side by side: the tests and benchmarks/swarm.py run ten in
one). `start_dht()` forks the DHT child (call it before CUDA initialises); `join()` does that if needed,
tests reachability, and starts the heartbeat task. Reads return only records that pass the same checks
the DHT validator applies; bad entries are logged and skipped, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from ..identity import Identity
from . import handoff, reachability
from .config import SwarmConfig
from .errors import HandoffError, RecordError, SwarmError
from .process import DHTProcess, daemon_listen_maddr
from .records import (
    Ban,
    Hardware,
    Heartbeat,
    PolicyAnnouncement,
    RecordKind,
    RolloutAnnouncement,
    ValidatorAnnouncement,
    dht_key,
    key_id,
    open_record,
    seal,
)

logger = logging.getLogger(__name__)
Body = TypeVar("Body")
_LOOKUP_CACHE_S = 2.0  # how stale a peer/ban lookup made for an incoming hand-off may be


def _software_version() -> str:
    try:
        return version("prime-node")[:64]
    except PackageNotFoundError:
        return "0.0.0+unknown"


def local_hardware(gpu_model: str | None = None, gpu_memory_mb: int = 0) -> Hardware:
    """CPU and RAM from /proc; the GPU is passed in by the caller (probing it here would initialise CUDA)."""
    cpu, ram_mb = "", 0
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
        ram_mb = next((int(ln.split()[1]) // 1024 for ln in meminfo if ln.startswith("MemTotal")), 0)
    except (OSError, ValueError, IndexError):
        pass  # not Linux, or an unusual /proc: the heartbeat just carries less detail
    return Hardware(
        gpu_model=gpu_model,
        gpu_memory_mb=gpu_memory_mb,
        cpu=cpu[:64],
        cpu_cores=os.cpu_count() or 0,
        ram_mb=ram_mb,
    )


class Swarm:
    def __init__(
        self,
        config: SwarmConfig,
        identity: Identity,
        *,
        roles: tuple[str, ...] = ("contributor",),
        hardware: Hardware | None = None,
    ) -> None:
        self.config = config
        self.identity = identity
        self.node_id = identity.node_id
        self.roles = list(roles)
        self.hardware = hardware or local_hardware()
        self.policy_step: int | None = None  # set by the node; published in the next heartbeat
        self.serves_steps: list[int] = []
        self.weights_url: str | None = None  # set by a node serving weights; published with serves_steps
        self.api_url: str | None = None  # set by a validator: its HTTP API, published in its announcement
        self.process: DHTProcess | None = None
        self.crashed: BaseException | None = None  # a background task's unexpected error
        self._p2p: P2P | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._handlers: list[str] = []
        self._cache: dict[RecordKind, tuple[float, dict[str, Any]]] = {}

    # ----- lifecycle -----------------------------------------------------------------------------------

    def start_dht(self, *, client_mode: bool | None = None) -> None:
        """Blocking: fork the DHT process. Call before CUDA initialises; `join` calls it if you did not."""
        if self.process is not None:
            raise SwarmError("the DHT is already running; call leave() before starting it again")
        self.process = DHTProcess.start(
            self.config,
            client_mode=self.config.reachability == "private" if client_mode is None else client_mode,
        )

    @property
    def client_mode(self) -> bool:
        return self.process is not None and self.process.client_mode

    async def join(self, *, heartbeat: bool = True) -> None:
        if self.process is None:
            await asyncio.to_thread(self.start_dht)
        await self._attach()
        if self.config.reachability == "auto" and self.config.initial_peers and not self.client_mode:
            await self._self_test()
        if heartbeat:
            await self.publish_heartbeat()
            self._spawn("swarm-heartbeat", self.run_heartbeats())
        if self.client_mode:
            logger.info("joined swarm %r as %s in client mode", self.config.run_id, self.node_id[:16])
        else:
            logger.info(
                "joined swarm %r as %s; other nodes can use --peers %s",
                self.config.run_id,
                self.node_id[:16],
                " ".join(await self.maddrs()),
            )

    async def _attach(self) -> None:
        assert self.process is not None
        # Not dht.replicate_p2p(): it waits for the child's answer with a blocking, unbounded result() on
        # this thread, which freezes the whole event loop if the child never answers.
        listen_maddr = await self._await(
            self.process.dht.run_coroutine(daemon_listen_maddr, return_future=True)
        )
        try:
            self._p2p = await asyncio.wait_for(P2P.replicate(listen_maddr), self.config.startup_timeout_s)
        except asyncio.TimeoutError:
            raise SwarmError(
                f"could not attach to the DHT process's p2p daemon within {self.config.startup_timeout_s:.0f} s"
            ) from None
        if not self.client_mode:
            server = reachability.DialBackServer(self.config.run_id, self.config.reachability_timeout_s)
            await self._add_handler(server.name, server.handle)

    async def _self_test(self) -> None:
        assert self._p2p is not None
        ports = reachability.tcp_ports(self.config.announce_maddrs or await self.maddrs())
        reached = await reachability.probe(
            self._p2p,
            self.config.run_id,
            self.config.initial_peers[:3],
            ports,
            self.config.reachability_timeout_s,
        )
        if reached is None:
            logger.warning(
                "could not test whether this node can be dialled (no bootstrap peer answered the "
                "dial-back probe); staying a full DHT peer"
            )
        elif not reached:
            logger.warning(reachability.unreachable_message(ports, self.config.host_maddrs))
            await self._stop_process()
            await asyncio.to_thread(self.start_dht, client_mode=True)
            await self._attach()

    async def leave(self) -> None:
        """Stop the heartbeat, unregister handlers, shut the DHT process down (ending it by PID if needed)."""
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            # Bounded: shutdown must finish even if a task swallows its cancellation.
            await asyncio.wait(list(self._tasks.values()), timeout=self.config.shutdown_timeout_s)
        self._tasks.clear()
        await self._stop_process()

    async def _stop_process(self) -> None:
        if self._p2p is not None:
            for name in self._handlers:
                try:
                    await asyncio.wait_for(self._p2p.remove_binary_stream_handler(name), 2)
                except Exception as exc:  # the daemon may already be gone; nothing left to unregister
                    logger.debug("could not remove handler %s: %s", name, exc)
            try:  # a replica: closes our client sockets, not the daemon; bounded like every other step
                await asyncio.wait_for(self._p2p.shutdown(), self.config.shutdown_timeout_s)
            except (asyncio.TimeoutError, OSError) as exc:
                logger.warning("closing the p2p client took too long or failed (%r); ending the DHT process anyway", exc)
        self._handlers, self._p2p = [], None
        if self.process is not None:
            process, self.process = self.process, None
            await asyncio.to_thread(process.stop)

    def _spawn(self, name: str, coro: Any) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task

        def _done(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                self.crashed = t.exception()
                logger.error("swarm task %s crashed: %r", name, t.exception())

        task.add_done_callback(_done)

    @property
    def tasks(self) -> dict[str, asyncio.Task[None]]:
        """The named background tasks, for the caller's supervisor to watch."""
        return dict(self._tasks)

    async def maddrs(self) -> list[str]:
        """This node's dialable multiaddrs (with /p2p/<peer id>), for other nodes' --peers."""
        if self._p2p is None:
            raise SwarmError("not joined: call join() first")
        # Asked of p2pd over our replica's own socket. Not dht.get_visible_maddrs() from a thread: the
        # DHT's command pipe is not thread-safe, and two writers interleave and garble its messages.
        return [str(m) for m in await self._p2p.get_visible_maddrs()]

    @property
    def peer_id(self) -> str:
        if self._p2p is None:
            raise SwarmError("not joined: call join() first")
        return self._p2p.peer_id.to_base58()

    async def _await(self, future: Any) -> Any:
        # An MPFuture from the DHT child never resolves if the child died: bound every wait.
        try:
            return await asyncio.wait_for(future, self.config.request_timeout_s)
        except asyncio.TimeoutError:
            alive = self.process is not None and self.process.dht.is_alive()
            raise SwarmError(
                f"the DHT process did not answer within {self.config.request_timeout_s:.0f} s"
                + ("" if alive else " (it has exited; leave() and join() again)")
            ) from None

    def _dht(self) -> Any:
        if self.process is None:
            raise SwarmError("not joined: call join() first")
        if not self.process.dht.is_alive():
            # Checked before each command: a dead child leaves its pipe unread, and once the pipe is full
            # the next send would block this thread (and with it the event loop) for good.
            raise SwarmError("the DHT process has exited; leave() and join() again")
        return self.process.dht

    # ----- records ---------------------------------------------------------------------------------------

    async def _publish(self, kind: RecordKind, subkey: str, body: Any, ttl: float) -> bool:
        expiration = get_dht_time() + ttl
        value = seal(self.identity, self.config.run_id, kind, subkey, body, expiration)
        stored = await self._await(
            self._dht().store(
                dht_key(self.config.run_id, kind), value, expiration, subkey=subkey, return_future=True
            )
        )
        if not stored:
            # Also the answer when peers hold a newer record under this subkey (a concurrent publish).
            logger.warning("no DHT peer stored this node's %s record (is the swarm reachable?)", kind.value)
        return bool(stored)

    async def _read(self, kind: RecordKind) -> dict[str, Any]:
        found = await self._await(
            self._dht().get(dht_key(self.config.run_id, kind), latest=True, return_future=True)
        )
        if found is None:
            return {}
        if not isinstance(found.value, dict):
            logger.warning("skipping a %s entry that is not a table of signed records", kind.value)
            return {}
        kid, now, operators = (
            key_id(self.config.run_id, kind),
            get_dht_time(),
            frozenset(self.config.operator_keys),
        )
        records: dict[str, Any] = {}
        for subkey, item in found.value.items():
            try:
                if item.expiration_time < now:
                    continue
                body = open_record(
                    kind,
                    kid,
                    MSGPackSerializer.dumps(subkey),
                    item.value,
                    item.expiration_time,
                    operators,
                    now,
                )
            except (RecordError, TypeError, ValueError) as exc:
                logger.warning("skipping a bad %s record under subkey %.40r: %s", kind.value, subkey, exc)
                continue
            records[subkey] = body
        self._cache[kind] = (time.monotonic(), records)
        return records

    async def _read_cached(self, kind: RecordKind) -> dict[str, Any]:
        stamp, records = self._cache.get(kind, (0.0, {}))
        return records if time.monotonic() - stamp < _LOOKUP_CACHE_S else await self._read(kind)

    def _require_operator(self, what: str) -> None:
        if self.node_id not in self.config.operator_keys:
            raise SwarmError(
                f"only a pinned operator key may publish {what}; this node's key {self.node_id[:16]}… "
                f"is not in operator_keys"
            )

    async def publish_heartbeat(self) -> bool:
        addresses = [] if self.client_mode else (await self.maddrs())[:8]
        body = Heartbeat(
            node_id=self.node_id,
            peer_id=self.peer_id,
            version=_software_version(),
            roles=self.roles,
            hardware=self.hardware,
            addresses=addresses,
            client_mode=self.client_mode,
            policy_step=self.policy_step,
            serves_steps=self.serves_steps[-16:],
            sent_at=time.time(),
            weights_url=self.weights_url if self.serves_steps else None,
        )
        return await self._publish(RecordKind.HEARTBEAT, self.node_id, body, self.config.heartbeat_ttl_s)

    async def run_heartbeats(self) -> None:
        """Republish the heartbeat every heartbeat_interval_s; a failed round is logged and retried."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await self.publish_heartbeat()
            except (OSError, EOFError, RecordError) as exc:  # DHT pipe trouble or a record we cannot build
                logger.warning("heartbeat not published: %s", exc)

    async def publish_policy(self, step: int, manifest_sha256: str, sources: list[str]) -> bool:
        self._require_operator("a policy")
        body = PolicyAnnouncement(
            step=step, manifest_sha256=manifest_sha256, sources=sources, published_at=time.time()
        )
        return await self._publish(RecordKind.POLICY, self.node_id, body, self.config.record_ttl_s)

    async def publish_validator(self, announcement: ValidatorAnnouncement | None = None) -> bool:
        """Announce a validator (this node when None): operator-signed, so only the operator can add one."""
        self._require_operator("a validator announcement")
        if announcement is None:
            announcement = ValidatorAnnouncement(
                node_id=self.node_id,
                peer_id=self.peer_id,
                addresses=(await self.maddrs())[:8],
                max_rollout_bytes=self.config.max_rollout_bytes,
                published_at=time.time(),
                api_url=self.api_url,
            )
        return await self._publish(
            RecordKind.VALIDATOR, announcement.node_id, announcement, self.config.record_ttl_s
        )

    async def publish_ban(self, node_id: str, reason: str, ttl_s: float | None = None) -> bool:
        """Publish a ban record for `ttl_s` seconds (at most ban_ttl_s); republish to extend it."""
        self._require_operator("a ban")
        body = Ban(node_id=node_id, reason=reason[:256], banned_at=time.time())
        ttl = self.config.ban_ttl_s if ttl_s is None else min(ttl_s, self.config.ban_ttl_s)
        return await self._publish(RecordKind.BAN, node_id, body, ttl)

    async def announce_rollout(self, sha256: str, size_bytes: int, step: int, samples: int) -> bool:
        body = RolloutAnnouncement(
            node_id=self.node_id,
            sha256=sha256,
            size_bytes=size_bytes,
            step=step,
            samples=samples,
            announced_at=time.time(),
        )
        return await self._publish(
            RecordKind.ROLLOUT, f"{self.node_id}:{sha256}", body, self.config.record_ttl_s
        )

    async def list_peers(self) -> dict[str, Heartbeat]:
        """Live nodes by node id (heartbeats that have not expired), this one included."""
        return await self._read(RecordKind.HEARTBEAT)

    async def list_validators(self) -> dict[str, ValidatorAnnouncement]:
        return await self._read(RecordKind.VALIDATOR)

    async def read_bans(self) -> dict[str, Ban]:
        return await self._read(RecordKind.BAN)

    async def list_rollouts(self) -> dict[str, RolloutAnnouncement]:
        return await self._read(RecordKind.ROLLOUT)

    async def current_policy(self) -> PolicyAnnouncement | None:
        """The newest policy announced by any pinned operator key, or None."""
        policies = list((await self._read(RecordKind.POLICY)).values())
        return max(policies, key=lambda p: (p.step, p.published_at)) if policies else None

    async def watch_policy(self) -> AsyncIterator[PolicyAnnouncement]:
        """Yield each newer policy as it appears (polling every policy_poll_s); never yields a step twice."""
        last_step = -1
        while True:
            try:
                policy = await self.current_policy()
            except (OSError, EOFError) as exc:
                logger.warning("policy lookup failed: %s", exc)
                policy = None
            if policy is not None and policy.step > last_step:
                last_step = policy.step
                yield policy
            await asyncio.sleep(self.config.policy_poll_s)

    # ----- rollout hand-off ------------------------------------------------------------------------------

    async def _add_handler(self, name: str, handler: Any) -> None:
        assert self._p2p is not None
        await self._p2p.add_binary_stream_handler(name, handler)
        self._handlers.append(name)

    async def serve_rollouts(
        self,
        directory: Path,
        accept: handoff.AcceptCallback,
        admit: handoff.AdmitCallback | None = None,
    ) -> handoff.RolloutReceiver:
        """Receive rollout files into `directory`; `accept` sees each checked file and may refuse it.

        `admit`, when given, sees each checked header before the body is read and may refuse it too.
        """
        if self.client_mode:
            raise SwarmError(
                "a validator must be dialable; this node runs in client mode (see docs/swarm.md)"
            )

        async def peer_of(node_id: str) -> str | None:
            heartbeat = (await self._read_cached(RecordKind.HEARTBEAT)).get(node_id)
            if heartbeat is None:  # maybe it joined after our last read
                heartbeat = (await self._read(RecordKind.HEARTBEAT)).get(node_id)
            return heartbeat.peer_id if heartbeat else None

        async def is_banned(node_id: str) -> bool:
            return node_id in await self._read_cached(RecordKind.BAN)

        receiver = handoff.RolloutReceiver(
            self.identity,
            directory,
            accept,
            peer_of,
            is_banned,
            max_bytes=self.config.max_rollout_bytes,
            timeout_s=self.config.handoff_timeout_s,
            max_concurrent=self.config.max_concurrent_handoffs,
            admit=admit,
        )
        await self._add_handler(handoff.protocol_name(self.config.run_id), receiver.handle)
        return receiver

    async def send_rollout(
        self,
        data: bytes | Path,
        envelope: handoff.RolloutEnvelope,
        validator: ValidatorAnnouncement | None = None,
    ) -> handoff.Receipt:
        """Stream a signed rollout file to `validator` (None: a random announced one); returns its receipt."""
        if self._p2p is None:
            raise SwarmError("not joined: call join() first")
        if validator is None:
            validators = list((await self.list_validators()).values())
            if not validators:
                raise HandoffError("no validator is announced in the DHT yet; retry later")
            validator = random.choice(validators)
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
            open_stream, envelope, data, validator.node_id, self.config.handoff_timeout_s
        )
