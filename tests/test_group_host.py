"""StageHost.stop: a stage task cancelled while its stream to the next stage closes ends there (it neither
finishes its batch nor starts the next), the close is bounded when the peer stops reading, a task that ignores
its cancellation is reported, and a batch in flight is counted as abandoned, not done."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prime_node.node.pipeline.errors import PipelineError
from prime_node.node.pipeline.group import HopSettings
from prime_node.node.pipeline.hops import LoopbackHops
from prime_node.node.pipeline.host import StageHost
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.pipeline.transport import DelayedSender

# More than loopback's socket buffers hold on both ends (Linux caps them at a few to 32 MiB by default), so a
# peer that reads nothing keeps the close waiting.
UNREAD_BYTES = 64 << 20


def _host(stop_timeout_s: float = 10.0) -> StageHost:
    async def on_batch(_: object) -> None:
        raise AssertionError("no batch runs here")

    def work_for(*_: object) -> None:
        raise AssertionError("no batch runs here")

    return StageHost(
        Identity.from_seed(b"\x03" * 32),
        "unit-run",
        Path("unused"),
        StageLayout(boundaries=[0, 2, 4]),
        work_for,  # type: ignore[arg-type]
        LoopbackHops(),
        HopSettings(),
        on_batch,  # type: ignore[arg-type]
        stop_timeout_s=stop_timeout_s,
    )


@pytest.fixture
async def stalled_stream() -> AsyncIterator[asyncio.StreamWriter]:
    """A TCP stream on 127.0.0.1 to a peer that accepts and then never reads, its buffers already full."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    writer.write(
        bytes(UNREAD_BYTES)
    )  # sits in this side's buffers: the peer takes only what its socket holds
    yield writer
    writer.transport.abort()
    for w in held:
        w.transport.abort()
    server.close()
    await server.wait_closed()


async def _until_closing(writer: asyncio.StreamWriter) -> None:
    for _ in range(500):  # 5 s at most
        if writer.is_closing():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the sender never started closing its stream")


async def test_a_stage_cancelled_while_its_stream_closes_ends_there(
    stalled_stream: asyncio.StreamWriter,
) -> None:
    """The kill arrives while the stage's sender waits for the socket to close: the stage task ends with its
    cancellation, before the code after the close (recording the batch, starting the next) runs."""
    host = _host()
    after_close: list[str] = []

    async def stage() -> None:  # the end of StageRunner.run, then what StageHost._run does next
        out = DelayedSender(stalled_stream, 0.0, name="pipeline-send-test")
        await out.close(timeout_s=5.0, close_timeout_s=30.0)
        after_close.append("recorded the batch and started the next")

    host.task = asyncio.create_task(stage(), name="pipeline-stage-test")
    host.in_flight = ("cd" * 32, 7)
    await _until_closing(stalled_stream)
    await asyncio.sleep(0.05)  # well inside wait_closed, which the peer holds for close_timeout_s
    started = time.monotonic()
    await host.stop("killed")
    assert time.monotonic() - started < 1.0
    assert after_close == []
    assert list(host.abandoned) == [("cd" * 32, 7, "killed")]


async def test_close_gives_up_on_a_peer_that_stops_reading(stalled_stream: asyncio.StreamWriter) -> None:
    out = DelayedSender(stalled_stream, 0.0, name="pipeline-send-test")
    started = time.monotonic()
    await out.close(timeout_s=5.0, close_timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0
    await asyncio.sleep(0)  # the abort takes effect on the next loop iteration
    assert stalled_stream.transport.get_write_buffer_size() == 0  # aborted: what it never took is dropped


async def test_stop_reports_a_task_that_ignores_its_cancellation() -> None:
    host = _host(stop_timeout_s=0.3)
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():  # swallows every kill, as the bug close() used to have did once
            try:
                await release.wait()
            except asyncio.CancelledError:
                pass

    host.task = asyncio.create_task(stubborn(), name="pipeline-stage-stubborn")
    await asyncio.sleep(0)
    task = host.task
    started = time.monotonic()
    with pytest.raises(PipelineError, match="ignored its cancellation"):
        await host.stop("killed")
    assert time.monotonic() - started < 2.0
    release.set()
    await task


async def test_stop_cancels_again_a_task_that_lost_one_cancellation() -> None:
    # asyncio.wait_for before 3.12 can lose a cancellation that arrives as its inner wait completes (bpo-42130):
    # the task then runs on, and one cancel() would leave stop() waiting out its whole timeout.
    host = _host(stop_timeout_s=5.0)

    async def loses_one() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(30)

    host.task = asyncio.create_task(loses_one(), name="pipeline-stage-loses-one")
    await asyncio.sleep(0)
    task = host.task
    started = time.monotonic()
    await host.stop("killed")
    assert task.cancelled() and time.monotonic() - started < 2.0


async def test_stop_raises_what_the_stage_task_raised() -> None:
    host = _host()

    async def broken() -> None:
        raise ValueError("a bug in the stage")

    host.task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="bug"):
        await host.stop()
