"""Claimed policy steps through a live validator (issue 18 review, H6): a file may wait for its checkpoint only
when its step is one the run announced, or will within a margin. A far-future step is refused at once, and a
step within the margin that never comes is the sender's fault when its hold ends; both used to wait out the hold
and be excused. The honest controls in the same run: a node that saw the next policy a moment before the
validator is held, then accepted; a file for an announced step the validator could not fetch is excused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from prime_node.node.run.announcement import run_parameters
from prime_node.p2p.identity import Identity
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.store import Store

from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    announce_run,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
    write_file,
)

HOLD_S = 6.0
MARGIN = 1


@pytest.mark.slow
async def test_claimed_steps_the_run_never_announced_cost_the_sender(tmp_path: Path, world) -> None:  # noqa: ANN001
    checkpoint, engine, tasks = world
    honest, attacker = Identity.generate(), Identity.generate()

    def file(node: Identity, name: str, step: int):  # noqa: ANN202
        rows = rows_for(engine, tasks, node, policy_step=step)
        return write_file(tmp_path / f"{name}.parquet", rows, node)

    far, near = file(attacker, "far", 50), file(attacker, "near", 2)
    racing, unfetched = file(honest, "racing", 1), file(honest, "unfetched", 3)
    settings = validator_settings(tmp_path / "validator", hold_timeout_s=HOLD_S, step_margin=MARGIN)
    origin = tmp_path / "origin"
    publish_checkpoint(checkpoint, origin, 1)
    server = WeightsServer(Store(origin), ServeSettings(host="127.0.0.1", port=0))
    url = await server.start()
    try:
        async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:  # step 0 announced
            service = running.service
            join = dict(bootstrap=running.maddrs[:1], reachability="public")
            honest_peer, attacker_peer = await group.add(honest, **join), await group.add(attacker, **join)
            for peer in (honest_peer, attacker_peer):
                await wait_until(lambda p=peer: sees_a_validator(p), 20)

            # A step far beyond the newest announced one is refused at once, not held for hold_timeout_s.
            start = time.monotonic()
            await attacker_peer.send_rollout(*far)
            verdict = (await wait_verdict(running, far[1].sha256, 30)).document
            assert verdict.failed_check == "policy_step", verdict
            assert "beyond the newest announced step 0 by more than the margin of 1" in verdict.reason
            assert time.monotonic() - start < HOLD_S / 2

            # The honest race: a node that already sees step 1 (the validator does not yet) waits, and is
            # accepted once the policy comes.
            await honest_peer.send_rollout(*racing)
            await wait_until(lambda: _held(running, 1), 15)
            manifest = Store(origin).load_manifest(1, OPERATOR.node_id)
            await running.swarm.publish_policy(1, manifest.digest, [url], run_parameters(settings.run))
            verdict = (await wait_verdict(running, racing[1].sha256, 30)).document
            assert verdict.accepted and verdict.step == 1, verdict.reason

            # Within the margin, but never announced: it waits, and its hold ends in a fault, not an excuse.
            await attacker_peer.send_rollout(*near)
            await wait_until(lambda: _held(running, 1), 15)
            verdict = (await wait_verdict(running, near[1].sha256, HOLD_S + 20)).document
            assert verdict.failed_check == "policy_step", verdict
            assert "step 2, which was never announced (newest: 1)" in verdict.reason

            # The run moves on to step 4 (announced without a source the validator can use).
            await announce_run(running.swarm, settings.run, step=4)
            await wait_until(lambda: _newest(running, 4), 15)
            # Step 3 was announced (every step up to 4 was), but the validator never got it: excused.
            await honest_peer.send_rollout(*unfetched)
            verdict = (await wait_verdict(running, unfetched[1].sha256, HOLD_S + 20)).document
            assert verdict.failed_check == "checkpoint_unavailable", verdict

            records = await service.ledger.query(
                "SELECT node_id, check_class, failed_check FROM slashes WHERE node_id IN (?, ?)",
                (honest.node_id, attacker.node_id),
            )
            assert [(r["node_id"], r["check_class"], r["failed_check"]) for r in records] == [
                (attacker.node_id, "fault", "policy_step")
            ] * 2
            assert not service.held
    finally:
        await server.stop()


async def _held(running, count: int) -> bool:  # noqa: ANN001
    return len(running.service.held) == count


async def _newest(running, step: int) -> bool:  # noqa: ANN001
    return running.service.steps.newest() == step
