"""StageHost.stop: the stage task ends even if something inside it swallows one cancellation, and a batch it
had in flight is counted as abandoned, not done."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from prime_node.node.pipeline.group import HopSettings
from prime_node.node.pipeline.host import LocalRendezvous, StageHost
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout


def _host() -> StageHost:
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
        LocalRendezvous(),
        HopSettings(),
        on_batch,  # type: ignore[arg-type]
    )


async def test_stop_ends_a_task_that_swallows_a_cancellation() -> None:
    host = _host()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # as a close() waiting on a socket may do
            pass
        await asyncio.sleep(30)

    host.task = asyncio.create_task(stubborn())
    host.in_flight = ("ab" * 32, 4)
    await asyncio.sleep(0)
    started = time.monotonic()
    await host.stop("killed")
    assert time.monotonic() - started < 5.0
    assert host.task is None and host.in_flight is None
    assert host.abandoned == [("ab" * 32, 4, "killed")]


async def test_stop_raises_what_the_stage_task_raised() -> None:
    host = _host()

    async def broken() -> None:
        raise ValueError("a bug in the stage")

    host.task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="bug"):
        await host.stop()
