"""How a stage reaches its neighbours for one batch: `LoopbackHops` (TCP on 127.0.0.1, every stage in this
process: tests and benchmarks) or `SwarmHops` (libp2p streams between nodes, p2p/pipeline/libp2p.py).

A stage first opens its inbound side for the batch (naming the member that must send it), then dials its
successor; both are keyed by the `Route` (group, batch, receiving stage). Leaving a group forgets its hops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from ...p2p.pipeline.errors import PipelineWireError
from ...p2p.pipeline.libp2p import StageStreams
from ...p2p.pipeline.transport import Inbound, OneConnectionServer, Route, StreamPair, open_tcp

# node id -> (libp2p peer id, multiaddrs) from the node's live signed heartbeat; None when it has none
PeerLookup = Callable[[str], Awaitable[tuple[str, list[str]] | None]]


class Hops(Protocol):
    async def inbound(self, route: Route, sender: str, *, follow: bool = False) -> Inbound:
        """Be ready for `route`'s stream, which only the member `sender` (a node id) may open. With `follow`,
        take the batch the sender opens, `route.batch` or later (the Inbound's route names it once accepted)."""
        ...

    async def dial(self, route: Route, receiver: str, timeout_s: float) -> StreamPair:
        """The stream to `route.stage`, held by the member `receiver`; PipelineWireError past `timeout_s`."""
        ...

    def leave(self, group_id: str) -> None: ...


class LoopbackInbound:
    """A stage's TCP listener for one batch (or, following, the next batch its predecessor dials)."""

    def __init__(
        self, hops: LoopbackHops, server: OneConnectionServer, port: int, route: Route, follow: bool
    ) -> None:
        self.hops, self.server, self.port, self.route, self.follow = hops, server, port, route, follow
        self.claimed = False  # a dialler took it (and set `route` to its batch)

    async def accepted(self, timeout_s: float) -> StreamPair:
        return await self.server.accepted(timeout_s)

    def close(self) -> None:
        self.server.close()
        waiting = self.hops._listening.get((self.route.group_id, self.route.stage), [])
        if self in waiting:
            waiting.remove(self)


class LoopbackHops:
    """Every stage in this process: a TCP listener per stage and batch on 127.0.0.1, found by its route."""

    def __init__(self) -> None:
        self._listening: dict[tuple[str, int], list[LoopbackInbound]] = {}  # (group, stage) -> unclaimed
        self._changed = asyncio.Event()

    async def inbound(self, route: Route, sender: str, *, follow: bool = False) -> Inbound:
        server = OneConnectionServer()
        listener = LoopbackInbound(self, server, await server.start(), route, follow)
        self._listening.setdefault((route.group_id, route.stage), []).append(listener)
        self._changed.set()
        return listener

    def _claim(self, route: Route) -> LoopbackInbound | None:
        for listener in self._listening.get((route.group_id, route.stage), []):
            wanted = listener.route.batch <= route.batch if listener.follow else listener.route == route
            if wanted and not listener.claimed:
                listener.claimed, listener.route = True, route
                self._listening[(route.group_id, route.stage)].remove(listener)
                return listener
        return None

    async def dial(self, route: Route, receiver: str, timeout_s: float) -> StreamPair:
        try:
            async with asyncio.timeout(timeout_s):
                while (listener := self._claim(route)) is None:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise PipelineWireError(
                f"stage {route.stage} of group {route.group_id[:16]}… did not listen in {timeout_s:.0f} s"
            ) from None
        return await open_tcp("127.0.0.1", listener.port, timeout_s)

    def leave(self, group_id: str) -> None:
        for key in [k for k in self._listening if k[0] == group_id]:
            del self._listening[key]


class SwarmHops:
    """Stages on separate nodes: libp2p streams to the peer id each member's signed heartbeat names."""

    def __init__(self, streams: StageStreams, peers: PeerLookup) -> None:
        self.streams, self.peers = streams, peers

    async def _peer(self, node_id: str, timeout_s: float) -> tuple[str, list[str]]:
        try:
            async with asyncio.timeout(timeout_s):
                found = await self.peers(node_id)
        except TimeoutError:
            found = None
        if found is None:
            raise PipelineWireError(f"member {node_id[:16]}… has no live heartbeat naming its libp2p peer id")
        return found

    async def inbound(self, route: Route, sender: str, *, follow: bool = False) -> Inbound:
        peer_id, _ = await self._peer(sender, self.streams.limits.route_timeout_s)
        self.streams.admit(route.group_id, route.stage, peer_id)
        return self.streams.inbound(route, follow=follow)

    async def dial(self, route: Route, receiver: str, timeout_s: float) -> StreamPair:
        peer_id, addresses = await self._peer(receiver, timeout_s)
        return await self.streams.dial(peer_id, addresses, route, timeout_s)

    def leave(self, group_id: str) -> None:
        self.streams.revoke(group_id)
