"""Daemon groundwork: supervised tasks and bounded shutdown, preflight checks, the status API."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from prime_node.node.contributor.metrics import NodeMetrics
from prime_node.node.contributor.preflight import (
    PreflightError,
    check_data_dir,
    check_disk,
    check_key,
    check_memory,
    run_checks,
)
from prime_node.node.contributor.status import (
    STATUS_FILE,
    DaemonNotRunning,
    NodeStatus,
    StatusServer,
    fetch_status,
)
from prime_node.node.runtime.supervisor import Supervisor, TaskCrashed
from prime_node.p2p.identity import Identity

from support.swarm import fleet


async def test_crashed_task_surfaces_in_main_and_others_are_stopped():
    sup = Supervisor()
    stopped = asyncio.Event()

    async def steady():
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    async def faulty():
        await asyncio.sleep(0.01)
        raise RuntimeError("disk on fire")

    sup.spawn("steady", steady())
    sup.spawn("faulty", faulty())
    with pytest.raises(TaskCrashed, match="faulty.*disk on fire"):
        await asyncio.wait_for(sup.wait(), 5)
    report = await sup.shutdown(timeout=5)
    assert stopped.is_set() and report.clean


async def test_shutdown_is_bounded_and_runs_cleanups_in_reverse_order():
    sup = Supervisor()
    order: list[str] = []

    hold = True

    async def stubborn():
        while hold:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # ignores cancellation: must not hang shutdown

    async def cleanup(name: str):
        order.append(name)
        if name == "b":
            raise OSError("b failed")

    task = sup.spawn("stubborn", stubborn())
    sup.on_shutdown("a", lambda: cleanup("a"))
    sup.on_shutdown("b", lambda: cleanup("b"))
    sup.on_shutdown("c", lambda: cleanup("c"))
    await asyncio.sleep(0)  # let the task start, so it is inside its loop when cancelled
    report = await sup.shutdown(timeout=0.5)
    assert report.stuck_tasks == ["stubborn"]
    assert order == ["c", "b", "a"]  # a failing cleanup does not skip the rest
    assert [name for name, _ in report.errors] == ["b"]
    assert report.seconds < 3
    hold = False  # release it so the test leaves no task behind
    task.cancel()
    await asyncio.wait_for(task, 5)


async def test_shutdown_cancels_supervised_tasks_in_their_place_in_the_order():
    sup = Supervisor()
    order: list[str] = []

    async def until_cancelled(name: str):
        try:
            await asyncio.sleep(3600)
        finally:
            order.append(name)

    sup.spawn("first", until_cancelled("first"))
    sup.supervise(asyncio.create_task(until_cancelled("started-elsewhere"), name="started-elsewhere"))
    sup.spawn("last", until_cancelled("last"))
    await asyncio.sleep(0)
    report = await sup.shutdown(timeout=5)
    assert order == ["last", "started-elsewhere", "first"] and report.clean


async def test_the_swarms_own_heartbeat_is_supervised_by_its_owner_and_its_crash_stops_the_process():
    # p2p/ may not import the Supervisor: the swarm starts its heartbeat itself and exposes it, its owner
    # supervises it. A DHT child that dies makes the next heartbeat fail; that must stop the process, not set a
    # flag nobody reads (what the trainer did: it went on announcing into a dead DHT).
    operator = Identity.generate()
    async with fleet("supervised", operator) as group:
        peer = await group.add(operator, heartbeat_interval_s=0.3)
        sup = Supervisor("test")
        steady = sup.spawn("steady", asyncio.sleep(3600))
        sup.supervise(*peer.tasks.values())
        assert list(peer.tasks) == ["swarm-heartbeat"]
        assert not await sup.sleep_or_stop(1.0)  # the honest control: a live heartbeat runs on
        assert peer.process is not None
        await asyncio.to_thread(peer.process.kill)
        with pytest.raises(TaskCrashed, match="swarm-heartbeat.*has exited"):
            await asyncio.wait_for(sup.wait(), 15)
        report = await sup.shutdown(timeout=5)
        assert report.clean and steady.cancelled()


async def test_finished_tasks_are_not_kept():
    sup = Supervisor()

    async def done_at_once() -> None:
        return None

    for k in range(50):
        sup.spawn(f"short-{k}", done_at_once())
    cancelled = sup.spawn("cancelled", asyncio.sleep(60))
    running = sup.spawn("running", asyncio.sleep(60))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    await asyncio.sleep(0.05)
    assert sup._tasks == [running]  # one task per joined pipeline group must not pile up over a daemon's life
    report = await sup.shutdown(timeout=5)
    assert report.clean and running.cancelled()


async def test_sleep_or_stop_wakes_on_stop():
    sup = Supervisor()
    asyncio.get_running_loop().call_later(0.05, sup.request_stop, "test")
    assert await asyncio.wait_for(sup.sleep_or_stop(60), 5) is True
    assert sup.stop_reason == "test"


def test_preflight_reports_every_failure_with_advice(tmp_path):
    key = tmp_path / "node.key"
    Identity.generate().save(key)
    assert check_key(key).ok
    key.chmod(0o644)
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    checks = [
        check_key(key),
        check_data_dir(tmp_path / "data"),
        check_disk(tmp_path, needed_bytes=1 << 60),
        check_memory(needed_bytes=1 << 60),
    ]
    if os.geteuid() != 0:  # root can write anywhere, so this check cannot fail for root
        checks.append(check_data_dir(readonly / "sub"))
    with pytest.raises(PreflightError) as err:
        run_checks(checks)
    text = str(err.value)
    assert "chmod 600" in text and "--data-dir" in text and "GiB RAM available" in text
    assert [f.name for f in err.value.failures][:3] == ["key file", "free disk", "memory"]


async def test_status_api_serves_json_and_metrics_on_loopback(tmp_path):
    metrics = NodeMetrics()
    metrics.tokens.inc(42)
    metrics.verdicts.labels(verdict="accepted").inc()
    status = NodeStatus(node_id="ab" * 32, version="test", uptime_s=1.5, state="generating", announced_step=3)
    server = StatusServer(tmp_path, lambda: status, metrics)
    await server.start()
    try:
        assert (tmp_path / STATUS_FILE).exists()
        got = await fetch_status(tmp_path)
        assert got == status
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
                text = await resp.text()
        assert "prime_node_contributor_generated_tokens_total 42.0" in text
        assert 'prime_node_contributor_verdicts_total{verdict="accepted"} 1.0' in text
    finally:
        await server.stop()
    assert not (tmp_path / STATUS_FILE).exists()
    with pytest.raises(DaemonNotRunning, match="prime-node start"):
        await fetch_status(tmp_path)


async def test_stale_status_file_reads_as_not_running(tmp_path):
    (tmp_path / STATUS_FILE).write_text('{"pid": 999999999, "host": "127.0.0.1", "port": 1}')
    with pytest.raises(DaemonNotRunning, match="has exited"):
        await fetch_status(tmp_path)
