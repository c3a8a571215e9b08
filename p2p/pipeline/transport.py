"""Streams between stages: the route a hop's stream serves, a sender that holds each frame for an injected
one-way delay, and TCP endpoints.

Frames are written to any asyncio (StreamReader, StreamWriter) pair: asyncio TCP on 127.0.0.1 for stages of one
process (tests, benchmarks/pipeline.py), libp2p streams between processes and machines (libp2p.py).

The delay models network latency, not bandwidth: every frame is due `delay_s` after it was queued and frames
queued meanwhile wait concurrently, so several micro-batches can be in flight on one hop at once.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass
from typing import Protocol

from .errors import PipelineWireError
from .layout import MAX_STAGES

logger = logging.getLogger(__name__)

MAX_QUEUED_FRAMES = 1024  # frames in flight on one hop; a stage that outruns its link waits
# How long a close waits for the socket to shut after the flush: a peer that stops reading would otherwise
# hold it (and the stage) until its buffers drain; past this the connection is aborted.
CLOSE_TIMEOUT_S = 1.0
StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_ROUTE = struct.Struct(">32sQB")


@dataclass(frozen=True)
class Route:
    """Which hop a stream serves: the batch of a group, and the stage that *receives* it.

    On libp2p, the dialler sends it first (ROUTE_BYTES, fixed size) so the receiving node can hand the stream to
    the right stage and batch; the signed opening that follows must name the same: the receiving stage's
    ChainReader (GroupSpec.reader) refuses any opening but the one it expects (group, step, batch, stage), so a
    route that lies only misdirects the liar's own stream."""

    group_id: str  # 64 hex digits (records.GroupSpec.group_id)
    batch: int
    stage: int

    def encode(self) -> bytes:
        return _ROUTE.pack(bytes.fromhex(self.group_id), self.batch, self.stage)

    @classmethod
    def decode(cls, raw: bytes) -> Route:
        if len(raw) != _ROUTE.size:
            raise PipelineWireError(f"a route is {_ROUTE.size} bytes, got {len(raw)}")
        group, batch, stage = _ROUTE.unpack(raw)
        if stage >= MAX_STAGES or batch >= 1 << 63:
            raise PipelineWireError(f"route names stage {stage} of batch {batch}: out of range")
        return cls(group.hex(), batch, stage)


ROUTE_BYTES = _ROUTE.size


class Inbound(Protocol):
    """Where a stage waits for its predecessor's stream of one batch (the batch `route` names once accepted)."""

    route: Route

    async def accepted(self, timeout_s: float) -> StreamPair: ...

    def close(self) -> None: ...


class DelayedSender:
    """Writes frames in order, each no earlier than `delay_s` after it was queued."""

    def __init__(self, writer: asyncio.StreamWriter, delay_s: float, *, name: str) -> None:
        self.writer = writer
        self.delay_s = delay_s
        self.queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(MAX_QUEUED_FRAMES)
        self.task = asyncio.create_task(self._run(), name=name)

    async def send(self, data: bytes) -> None:
        if self.task.done():
            self.task.result()  # re-raise the writer's failure here, in the stage's own task
            raise PipelineWireError("the stream to the next stage is closed")
        await self.queue.put((time.monotonic() + self.delay_s, data))

    async def close(self, timeout_s: float, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Flush what is queued (within `timeout_s`: TimeoutError past it, the writer's failure if it failed),
        then close the stream (within `close_timeout_s`, aborted past it).

        A cancellation at any point propagates: the stage being stopped must stop here, not finish its batch
        and start the next one. (asyncio.timeout, not wait_for: on 3.11 wait_for can lose a cancellation that
        arrives as the awaited call completes.)"""
        try:
            async with asyncio.timeout(timeout_s):
                await self.queue.put(None)  # may wait for room: bounded by the same deadline
                await asyncio.shield(self.task)
        finally:
            self.task.cancel()  # a flush cut short (timeout, cancellation) leaves nothing writing behind
            self.writer.close()
            try:
                async with asyncio.timeout(close_timeout_s):
                    await self.writer.wait_closed()
            except TimeoutError:
                self.writer.transport.abort()  # the peer stopped reading: drop what it never took
            except (OSError, ConnectionError):
                pass  # the peer's side failed first; ours is closed either way

    async def _run(self) -> None:
        while (item := await self.queue.get()) is not None:
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.writer.write(data)
            await self.writer.drain()


async def open_tcp(
    host: str, port: int, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can lose a cancellation
            return await asyncio.open_connection(host, port)
    except (TimeoutError, OSError) as exc:
        raise PipelineWireError(f"cannot reach the next stage at {host}:{port}: {exc!r}") from None


class OneConnectionServer:
    """Accepts exactly one inbound stream (from the previous stage) on 127.0.0.1 or another host."""

    def __init__(self) -> None:
        self._accepted: asyncio.Future[StreamPair] | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def start(self, host: str = "127.0.0.1") -> int:
        self._accepted = asyncio.get_running_loop().create_future()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self._accepted is not None and not self._accepted.done():
                self._accepted.set_result((reader, writer))
                self._writer = writer
            else:  # a second caller: only the previous stage may stream to us
                writer.close()

        self._server = await asyncio.start_server(accept, host, 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def accepted(self, timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert self._accepted is not None, "start() first"
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(self._accepted)
        except TimeoutError:
            raise PipelineWireError(f"the previous stage did not connect within {timeout_s:.1f} s") from None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._writer is not None:
            self._writer.close()
