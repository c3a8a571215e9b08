"""Validator intake: fair scheduling, a flooding peer, and files held for their checkpoint."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from prime_node.node.run.announcement import run_parameters
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import HandoffBusy, HandoffRefused, RolloutEnvelope
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.store import Store
from prime_node.trainer.validator.intake import FairQueue

from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
    write_file,
)


async def test_fair_queue_serves_nodes_in_turn() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(50):
        queue.put("flooder", f"f{i}")
    queue.put("honest", "h0")
    assert [await queue.get() for _ in range(3)] == ["f0", "h0", "f1"]
    queue.put("honest", "h2")
    queue.put("honest", "h1", front=True)  # a released held file goes first in its node's lane
    assert [await queue.get() for _ in range(3)] == ["f2", "h1", "f3"]  # a new lane joins the rotation's end
    assert len(queue) == 47
    small: FairQueue[str] = FairQueue()
    waiter = asyncio.create_task(small.get())
    await asyncio.sleep(0.01)
    assert not waiter.done()  # an empty queue waits
    small.put("a", "x")
    assert await asyncio.wait_for(waiter, 1) == "x"


async def _send_all(sender, blobs: list[tuple[bytes, RolloutEnvelope]]) -> tuple[int, list[str], list[str]]:  # noqa: ANN001
    receipts, refusals, busy = 0, [], []
    for data, envelope in blobs:
        try:
            await sender.send_rollout(data, envelope)
            receipts += 1
        except HandoffRefused as exc:
            refusals.append(exc.reason)
        except HandoffBusy as exc:
            busy.append(exc.reason)
    return receipts, refusals, busy


async def test_flooding_peer_is_rate_limited_while_an_honest_file_is_verified(tmp_path: Path, world) -> None:  # noqa: ANN001
    checkpoint, engine, tasks = world
    honest, flooder = Identity.generate(), Identity.generate()
    path, envelope = write_file(tmp_path / "honest.parquet", rows_for(engine, tasks, honest), honest)
    junk = [
        os.urandom(2048) for _ in range(40)
    ]  # 40 signed files of garbage, sent as fast as the stream goes
    blobs = [(data, RolloutEnvelope.sign(flooder, data, (0, i))) for i, data in enumerate(junk)]
    settings = validator_settings(tmp_path / "validator", rate_per_minute=60, burst=4, per_node_queue=8)
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        flood_peer = await group.add(flooder, bootstrap=running.maddrs[:1], reachability="public")
        honest_peer = await group.add(honest, bootstrap=running.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(flood_peer), 15)
        await wait_until(lambda: sees_a_validator(honest_peer), 15)

        async def honest_send() -> float:
            await asyncio.sleep(0.5)  # in the middle of the flood
            start = time.monotonic()
            await honest_peer.send_rollout(path, envelope)
            verdict = (await wait_verdict(running, envelope.sha256, 30)).document
            assert verdict.accepted, verdict.reason
            return time.monotonic() - start

        start = time.monotonic()
        (receipts, refusals, busy), honest_seconds = await asyncio.gather(
            _send_all(flood_peer, blobs), honest_send()
        )
        flood_seconds = time.monotonic() - start
        # The bucket admits its burst plus one file per second of flooding; everything else is turned away.
        assert receipts <= 4 + int(flood_seconds) + 1, (receipts, flood_seconds)
        assert receipts + len(refusals) + len(busy) == len(blobs)
        # Back-pressure (busy: come back later) names the rate limit or the newcomer's bound on waiting files;
        # a refusal (final) is only the ban that the junk files soon earn. Which comes first depends on how
        # fast the validator verifies.
        assert busy and all("rate limit" in r or "files waiting" in r for r in busy), busy
        assert all("banned" in r for r in refusals), refusals
        assert honest_seconds < 20, honest_seconds
        # The junk that got in was verified and rejected as malformed, never credited.
        await wait_until(lambda: _decided(running, flooder.node_id, receipts), 30)
        rows = running.service.ledger.ledger.query(
            "SELECT accepted, failed_check FROM contributions WHERE node_id = ?", (flooder.node_id,)
        )
        assert {(r["accepted"], r["failed_check"]) for r in rows} <= {(0, "schema"), (0, "banned")}


async def _decided(running, node_id: str, count: int) -> bool:  # noqa: ANN001
    rows = await running.service.ledger.query(
        "SELECT COUNT(*) AS n FROM contributions WHERE node_id = ?", (node_id,)
    )
    return rows[0]["n"] >= count


@pytest.mark.slow
async def test_files_wait_for_their_checkpoint_then_are_verified_or_expire(tmp_path: Path, world) -> None:  # noqa: ANN001
    checkpoint, engine, tasks = world
    node = Identity.generate()
    early, early_env = write_file(
        tmp_path / "step1.parquet", rows_for(engine, tasks, node, policy_step=1), node
    )
    # Within the margin of the announced step 0; announced later, but with no source the validator can use.
    never, never_env = write_file(
        tmp_path / "step2.parquet", rows_for(engine, tasks, node, policy_step=2), node
    )
    settings = validator_settings(tmp_path / "validator", hold_timeout_s=10.0)
    origin = tmp_path / "origin"
    publish_checkpoint(checkpoint, origin, 1)
    server = WeightsServer(Store(origin), ServeSettings(host="127.0.0.1", port=0))
    url = await server.start()
    try:
        async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
            sender = await group.add(node, bootstrap=running.maddrs[:1], reachability="public")
            await wait_until(lambda: sees_a_validator(sender), 15)
            await sender.send_rollout(early, early_env)
            await sender.send_rollout(never, never_env)
            await wait_until(lambda: _held(running, 2), 15)  # no checkpoint yet: both wait, no verdict
            assert await running.service.ledger.verdict_for(early_env.sha256, node.node_id) is None

            manifest = Store(origin).load_manifest(1, OPERATOR.node_id)
            await running.swarm.publish_policy(1, manifest.digest, [url], run_parameters(settings.run))
            verdict = (await wait_verdict(running, early_env.sha256, 30)).document
            assert verdict.accepted and verdict.step == 1, verdict.reason
            await running.swarm.publish_policy(2, "00" * 32, [], run_parameters(settings.run))

            expired = (await wait_verdict(running, never_env.sha256, 20)).document
            assert not expired.accepted and expired.failed_check == "checkpoint_unavailable"
            assert "no checkpoint for step 2 arrived within 10 s" in expired.reason
            assert await running.service.ledger.active_ban(node.node_id) is None  # not the sender's fault
            score = running.service.ledger.ledger.query(
                "SELECT score FROM nodes WHERE node_id = ?", (node.node_id,)
            )
            assert score[0]["score"] > 0
    finally:
        await server.stop()


async def _held(running, count: int) -> bool:  # noqa: ANN001
    return len(running.service.held) == count
