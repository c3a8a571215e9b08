"""A Sybil flood through the real hand-off: 50 fresh node ids on one machine cannot keep out an established
node's file."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import HandoffBusy, HandoffRefused, RolloutEnvelope
from prime_node.trainer.validator.intake import Tier

from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    bind_node_ids,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
    write_file,
)

SYBILS = 50
NEWCOMER_QUEUE = 6
HOLD_S = 8.0


@pytest.mark.slow
async def test_sybil_flood_fills_only_the_newcomer_slice(tmp_path: Path, world) -> None:  # noqa: ANN001
    checkpoint, engine, tasks = world
    honest, flooder = Identity.generate(), Identity.generate()
    sybils = [Identity.generate() for _ in range(SYBILS)]
    first, first_env = write_file(tmp_path / "honest-0.parquet", rows_for(engine, tasks, honest), honest)
    second, second_env = write_file(
        tmp_path / "honest-1.parquet", rows_for(engine, tasks, honest, batch_counter=1), honest
    )
    # Sybil files are well formed and signed, for the next step (within the margin, but never announced): they
    # pass the cheap checks and then wait for it, holding queue places for hold_timeout_s; each then costs its
    # sender a fault (trainer/validator/policy_steps.py).
    template = rows_for(engine, tasks, flooder, policy_step=1)
    blobs: list[tuple[bytes, RolloutEnvelope]] = []
    for i, sybil in enumerate(sybils):
        for k in range(2):
            rows = [dataclasses.replace(r, node_id=sybil.node_id, batch_counter=k) for r in template]
            path, envelope = write_file(tmp_path / f"sybil-{i}-{k}.parquet", rows, sybil)
            blobs.append((path.read_bytes(), envelope))
    settings = validator_settings(
        tmp_path / "validator",
        queue_size=24,
        newcomer_queue=NEWCOMER_QUEUE,
        newcomer_per_node=1,
        per_node_queue=4,
        rate_per_minute=600,
        burst=10,
        hold_timeout_s=HOLD_S,
        established_after=1,
    )
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        service = running.service
        flood_peer = await group.add(flooder, bootstrap=running.maddrs[:1], reachability="public")
        honest_peer = await group.add(honest, bootstrap=running.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(flood_peer), 15)
        await wait_until(lambda: sees_a_validator(honest_peer), 15)
        # The honest node earns its standing with real, verified work.
        await honest_peer.send_rollout(first, first_env)
        assert (await wait_verdict(running, first_env.sha256, 60)).document.accepted
        await wait_until(lambda: _established(service, honest.node_id), 5)
        await bind_node_ids(flood_peer, sybils)  # each Sybil id: a signed heartbeat naming the flooder
        target = (await flood_peer.list_validators())[OPERATOR.node_id]

        receipts: list[str] = []
        busy: list[tuple[str, float]] = []

        async def flood() -> None:
            for data, envelope in blobs:
                try:
                    await flood_peer.send_rollout(data, envelope, target)
                    receipts.append(envelope.sha256)
                except HandoffBusy as exc:
                    busy.append((exc.reason, exc.retry_after_s))

        async def honest_send() -> float:
            await wait_until(lambda: _newcomers_full(service), 60, interval=0.05)  # in the thick of it
            start = time.monotonic()
            await honest_peer.send_rollout(second, second_env)  # HandoffBusy here would fail the test
            verdict = (await wait_verdict(running, second_env.sha256, 30)).document
            assert verdict.accepted, verdict.reason
            return time.monotonic() - start

        start = time.monotonic()
        flooding = asyncio.create_task(flood(), name="sybil-flood")
        honest_seconds = await honest_send()
        await flooding
        flood_seconds = time.monotonic() - start
        # 100 headers from 50 ids: only the newcomer slice was let in (refilled as held files expire); the
        # rest was told to come back later (busy, not refused: an outbox keeps such a file and retries it).
        rounds = 1 + int(flood_seconds // HOLD_S)
        assert len(receipts) <= NEWCOMER_QUEUE * rounds, (len(receipts), flood_seconds)
        assert len(receipts) + len(busy) == len(blobs)
        assert busy and all("newcomer" in reason for reason, _ in busy), busy[:3]
        assert {hint for _, hint in busy} == {
            settings.intake.busy_retry_s
        }  # the hint travels with the answer
        assert honest_seconds < 20, honest_seconds
        # Nothing acknowledged is lost: every received Sybil file gets exactly one verdict (its step was never
        # announced: the sender's fault), and the places are free again.
        for sha in receipts:
            verdict = (await wait_verdict(running, sha, HOLD_S + 30)).document
            assert verdict.failed_check == "policy_step"
        # The verdict is in the ledger a moment before its admission slot is released (_decide): wait for it.
        await wait_until(lambda: _newcomers_empty(service), 10, interval=0.05)
        count = await service.ledger.query(
            "SELECT COUNT(*) AS n FROM contributions WHERE node_id != ?", (honest.node_id,)
        )
        assert count[0]["n"] == len(receipts)


async def _established(service, node_id: str) -> bool:  # noqa: ANN001
    return service.admission.tier_of(node_id) is Tier.ESTABLISHED


async def _newcomers_full(service) -> bool:  # noqa: ANN001
    return service.admission.in_tier(Tier.NEWCOMER) >= NEWCOMER_QUEUE


async def _newcomers_empty(service) -> bool:  # noqa: ANN001
    return service.admission.in_tier(Tier.NEWCOMER) == 0


def test_refusal_and_busy_are_distinct_errors() -> None:
    # A sender's outbox drops a refused file for good and keeps a busy one: the two must never be confused.
    assert not issubclass(HandoffBusy, HandoffRefused)
    assert HandoffBusy("queue full", 3.0).retry_after_s == 3.0
