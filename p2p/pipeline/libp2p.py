"""Pipeline hops over hivemind's libp2p streams: one binary stream handler per node, streams dialled by peer id.

A stage's stream to its successor opens `protocol_name(run_id)` on the successor's libp2p peer (the peer id its
signed heartbeat binds to its node id; the group record names the node). The exchange before the frames:

    dialler -> route (ROUTE_BYTES: group id, batch, receiving stage; transport.Route)
    receiver -> ACK (one byte) when a stage of this node takes the stream; otherwise the stream is closed
    dialler -> the signed, hash-chained frames of frames.py, read by the receiving stage's FrameReader

Who may stream to this node is decided before a byte is read: the libp2p peer id of the stream (authenticated
by libp2p's secure channel, not claimed by the peer) must be one a running stage admitted (`admit`: the
predecessor its group record names). A stranger's stream is closed unread: it costs a stream open and nothing
else (no read, no slot, no wait), and the stage's own predecessor still gets through. An admitted peer's route
must then name a (group, stage) it was admitted for; the stage's FrameReader checks the opening's signature,
group, batch and sender as it does on any stream.

A route may arrive before its stage waits for it (the predecessor starts the next batch first): it is held, at
most `max_held_per_peer` per peer and `hold_s` each, then closed. A dialler whose route is not acknowledged (the
stage is not there yet: the group was just formed) retries until its deadline, so members of a new group need
not start in any order. Every wait on a peer has a wall-clock deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from .errors import PipelineWireError
from .transport import ROUTE_BYTES, Route, StreamPair

logger = logging.getLogger(__name__)

ACK = b"\x01"
CANNOT_OPEN = "cannot open a stream"
MAX_REFUSALS_KEPT = 256  # the recent refusals kept for the status API and the tests


def protocol_name(run_id: str) -> str:
    return f"/prime-node/{run_id}/pipeline/1"


@dataclass(frozen=True)
class StreamLimits:
    route_timeout_s: float = 5.0  # an admitted peer must send its route within this
    hold_s: float = 30.0  # a stream whose stage has not asked for it yet is held this long, then closed
    max_held_per_peer: int = 2  # streams of one peer routed or being routed but not yet taken by a stage
    retry_s: float = 0.1  # the dialler's first pause before dialling again after a refusal (doubles to 1 s)


@dataclass
class _Slot:
    """One hop and batch: the stream, once it arrives, and whether its stage has finished with it."""

    stream: asyncio.Future[StreamPair]
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)


class InboundStream:
    """A stage's wait for its predecessor's stream of one batch (transport.Inbound).

    With `follow`, `route.batch` is only the lowest batch taken: the stage runs whichever batch its predecessor
    opens (the newest held, older held ones are stale and closed), and `route` then names it."""

    def __init__(self, streams: StageStreams, route: Route, follow: bool) -> None:
        self.streams, self.route, self.follow = streams, route, follow

    async def accepted(self, timeout_s: float) -> StreamPair:
        if self.follow:
            self.route = await self.streams._newest(self.route, timeout_s)
            self.follow = False
        slot = self.streams._slot(self.route)
        # asyncio.wait, not wait_for: a timeout must leave the slot's future alone (the stream may still come
        # while the caller decides), and a future cancelled by revoke() must not look like our cancellation.
        await asyncio.wait({slot.stream}, timeout=timeout_s)
        if not slot.stream.done():
            raise PipelineWireError(
                f"the previous stage did not open its stream for batch {self.route.batch} within {timeout_s:.1f} s"
            )
        if slot.stream.cancelled():
            raise PipelineWireError(
                f"the hop of batch {self.route.batch} was closed (this node left the group)"
            )
        slot.taken.set()
        return slot.stream.result()

    def close(self) -> None:
        if not self.follow:
            self.streams._release(self.route)


class StageStreams:
    """This node's libp2p endpoint for pipeline hops: serves inbound streams to admitted peers, dials out."""

    def __init__(self, p2p: P2P, run_id: str, limits: StreamLimits | None = None) -> None:
        self.p2p, self.run_id = p2p, run_id
        self.name = protocol_name(run_id)
        self.limits = limits or StreamLimits()
        self._admitted: dict[tuple[str, int], str] = {}  # (group id, receiving stage) -> the sender's peer id
        self._slots: dict[Route, _Slot] = {}
        self._held: Counter[str] = Counter()  # per peer: streams not yet taken by a stage
        self._arrived: dict[tuple[str, int], asyncio.Event] = {}  # (group, stage): set when a stream is held
        self.refusals: deque[tuple[float, str, str]] = deque(maxlen=MAX_REFUSALS_KEPT)  # (time, peer, why)
        self.refused = 0

    # ----- the receiving side ------------------------------------------------------------------------------

    def admit(self, group_id: str, stage: int, peer_id: str) -> None:
        """Let `peer_id` stream to `stage` of `group_id` (the predecessor its group record names)."""
        self._admitted[(group_id, stage)] = peer_id

    def revoke(self, group_id: str) -> None:
        """Forget a group this node left: its peers are strangers again, its held streams are closed."""
        for key in [k for k in self._admitted if k[0] == group_id]:
            del self._admitted[key]
        for route in [r for r in self._slots if r.group_id == group_id]:
            self._release(route)
        for key in [k for k in self._arrived if k[0] == group_id]:
            del self._arrived[key]

    def close(self) -> None:
        """Close every held and running stream (the node is leaving the swarm)."""
        self._admitted.clear()
        for route in list(self._slots):
            self._release(route)

    def inbound(self, route: Route, *, follow: bool = False) -> InboundStream:
        return InboundStream(self, route, follow)

    async def _newest(self, lowest: Route, timeout_s: float) -> Route:
        """The route of the newest stream held for `lowest`'s group and stage, batch >= lowest.batch; the older
        held ones are closed (the predecessor runs one batch at a time: they are abandoned)."""
        key = (lowest.group_id, lowest.stage)
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    held = sorted(
                        (
                            r
                            for r, slot in self._slots.items()
                            if (r.group_id, r.stage) == key
                            and r.batch >= lowest.batch
                            and slot.stream.done()
                            and not slot.taken.is_set()
                        ),
                        key=lambda r: r.batch,
                    )
                    if held:
                        for stale in held[:-1]:
                            self._release(stale)
                        return held[-1]
                    arrived = self._arrived.setdefault(key, asyncio.Event())
                    arrived.clear()
                    await arrived.wait()
        except TimeoutError:
            raise PipelineWireError(
                f"the previous stage opened no stream for batch {lowest.batch} or later within {timeout_s:.1f} s"
            ) from None

    def _slot(self, route: Route) -> _Slot:
        slot = self._slots.get(route)
        if slot is None:
            slot = self._slots[route] = _Slot(asyncio.get_running_loop().create_future())
        return slot

    def _release(self, route: Route) -> None:
        slot = self._slots.pop(route, None)
        if slot is None:
            return
        slot.released.set()
        slot.taken.set()  # wakes the handler holding it
        if slot.stream.done() and not slot.stream.cancelled():
            _close(slot.stream.result()[1])
        else:
            slot.stream.cancel()

    def _refuse(self, peer: str, why: str) -> None:
        self.refused += 1
        self.refusals.append((time.time(), peer, why))
        logger.info("refused a pipeline stream from peer %s: %s", peer, why)

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)
        try:
            if peer not in self._admitted.values():
                # Before a byte is read: a stranger's stream costs nothing but its open.
                self._refuse(peer, "not the member a group of this node names as its predecessor")
                return
            if self._held[peer] >= self.limits.max_held_per_peer:
                self._refuse(peer, f"already holds {self._held[peer]} streams no stage has taken")
                return
            self._held[peer] += 1
            try:
                slot = await self._route(peer, reader, writer)
            finally:
                self._held[peer] -= 1
                if self._held[peer] <= 0:
                    del self._held[peer]
            if slot is not None:
                await slot.released.wait()  # the stage's run ends by releasing it (InboundStream.close)
        except (OSError, ConnectionError) as exc:
            logger.info("pipeline stream from peer %s broke: %s", peer, exc)
        except asyncio.CancelledError:
            # The daemon's connection server owns this task and nobody awaits it: it is cancelled only when the
            # node leaves the swarm, and asyncio 3.11 would log a cancelled server task as an error.
            pass
        finally:
            _close(writer)

    async def _route(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> _Slot | None:
        try:
            async with asyncio.timeout(
                self.limits.route_timeout_s
            ):  # not wait_for (3.11 loses cancellations)
                raw = await reader.readexactly(ROUTE_BYTES)
            route = Route.decode(raw)
        except TimeoutError:
            self._refuse(peer, f"sent no route within {self.limits.route_timeout_s:.1f} s")
            return None
        except asyncio.IncompleteReadError as exc:
            self._refuse(peer, f"closed after {len(exc.partial)} of the {ROUTE_BYTES} route bytes")
            return None
        except PipelineWireError as exc:
            self._refuse(peer, str(exc))
            return None
        if self._admitted.get((route.group_id, route.stage)) != peer:
            self._refuse(peer, f"not admitted to stage {route.stage} of group {route.group_id[:16]}…")
            return None
        slot = self._slot(route)
        if slot.stream.done():
            self._refuse(peer, f"a second stream for stage {route.stage}, batch {route.batch}")
            return None
        slot.stream.set_result((reader, writer))
        self._arrived.setdefault((route.group_id, route.stage), asyncio.Event()).set()
        writer.write(ACK)
        try:
            async with asyncio.timeout(self.limits.route_timeout_s):
                await writer.drain()
            async with asyncio.timeout(self.limits.hold_s):
                await slot.taken.wait()
        except TimeoutError:
            logger.info("closed peer %s's stream for batch %d: no stage took it", peer, route.batch)
            if self._slots.get(route) is slot:
                self._release(route)
            return None
        return None if slot.released.is_set() else slot

    # ----- the sending side --------------------------------------------------------------------------------

    async def dial(self, peer_id: str, addresses: list[str], route: Route, timeout_s: float) -> StreamPair:
        """A stream to `route.stage` of `peer_id`, acknowledged by it; retried within `timeout_s` while it is
        refused (the stage may not wait for it yet). PipelineWireError past the deadline."""
        peer = PeerID.from_base58(peer_id)
        deadline = time.monotonic() + timeout_s
        pause, last = self.limits.retry_s, "no attempt"
        try:
            async with asyncio.timeout(timeout_s):
                connect = True
                while True:
                    if (
                        connect
                    ):  # teach our daemon where the peer listens: the DHT may never have talked to it
                        try:
                            await self.p2p._client.connect(peer, transport_addresses(addresses))
                        except (ControlFailure, P2PDaemonError, OSError, ValueError) as exc:
                            logger.debug(
                                "connect to %s failed (the stream open reports it): %s", peer_id, exc
                            )
                    pair, last = await self._attempt(peer, route)
                    if pair is not None:
                        return pair
                    connect = last.startswith(
                        CANNOT_OPEN
                    )  # unreachable so far: connect again before the next
                    await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                    pause = min(2 * pause, 1.0)
        except TimeoutError:
            raise PipelineWireError(
                f"stage {route.stage} at peer {peer_id} took no stream within {timeout_s:.1f} s ({last})"
            ) from None

    async def _attempt(self, peer: PeerID, route: Route) -> tuple[StreamPair | None, str]:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(peer, self.name)
        except (ControlFailure, P2PDaemonError, OSError) as exc:
            return None, f"{CANNOT_OPEN}: {exc}"
        try:
            writer.write(route.encode())
            await writer.drain()
            answer = await reader.read(1)  # the caller's deadline bounds it
        except (OSError, ConnectionError) as exc:  # the receiver closes a refused stream unread
            _close(writer)
            return None, f"refused (the stream was closed: {exc!r})"
        if answer != ACK:
            _close(writer)
            return None, "refused" if not answer else f"answered {answer!r}, not the acknowledgement"
        return (reader, writer), "acknowledged"


def transport_addresses(addresses: list[str]) -> list[Multiaddr]:
    """The transport part of each multiaddr: p2pd's connect refuses one that still ends in /p2p/<peer id>."""
    return [Multiaddr(a.split("/p2p/", 1)[0]) for a in addresses]


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (OSError, RuntimeError):
        pass  # a p2pd stream already reset: closed either way
