"""Slow hand-offs against a live validator (issue 18, class 6): newcomers that drip their bodies on every
stream they can open are cut at the rate floor, and an established node's real files are received and
accepted meanwhile, within a bound."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from prime_node.p2p.identity import Identity
from prime_node.trainer.validator.intake import Tier

from support.slow_sender import drip, signed_blob
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

FLOOR = 64 * 1024
WINDOW_S = 4.0
DRIP_RATE = 32 * 1024  # below the floor; 256 KiB in 8 s kept the old receiver (10 s a read) waiting for ever
DRIP_SIZE = 2 << 20
SWARM = dict(
    max_concurrent_handoffs=4,
    handoff_reserved_slots=2,
    handoff_slots_per_sender=1,
    handoff_slots_per_network=2,
    handoff_group_loopback=True,  # every peer here is on 127.0.0.1: one network, as a /24 of Sybils would be
    handoff_min_bytes_per_s=FLOOR,
    handoff_rate_window_s=WINDOW_S,
    handoff_deadline_grace_s=3.0,
    handoff_slot_wait_s=0.5,
    handoff_cooldown_s=30.0,
)


async def test_drip_fed_newcomers_cannot_starve_an_established_node(
    tmp_path: Path,
    world,
    caplog: pytest.LogCaptureFixture,  # noqa: ANN001
) -> None:
    caplog.set_level(logging.WARNING, logger="prime_node.p2p.swarm.handoff")  # the cuts' log lines
    checkpoint, engine, tasks = world
    honest = Identity.generate()
    files = [
        write_file(tmp_path / f"honest-{k}.parquet", rows_for(engine, tasks, honest, batch_counter=k), honest)
        for k in range(3)
    ]
    settings = validator_settings(tmp_path / "validator", swarm=SWARM)
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        service, receiver = running.service, running.service.receiver
        assert receiver is not None
        honest_peer = await group.add(honest, bootstrap=running.maddrs[:1], reachability="public")
        newcomers = [await group.add(bootstrap=running.maddrs[:1], reachability="public") for _ in range(3)]
        for peer in [honest_peer, *newcomers]:
            await wait_until(lambda p=peer: sees_a_validator(p), 20)
            await wait_until(lambda p=peer: _bound(running.swarm, p.node_id), 20)
        # The honest node earns its standing with real, verified work.
        path, envelope = files[0]
        await honest_peer.send_rollout(path, envelope)
        assert (await wait_verdict(running, envelope.sha256, 60)).document.accepted
        await wait_until(lambda: _established(service, honest.node_id), 5)

        target = running.swarm.peer_id

        def start_drip(peer, i: int) -> asyncio.Task:  # noqa: ANN001
            blob = signed_blob(peer.identity, DRIP_SIZE)
            sending = drip(peer, target, *blob, bytes_per_s=DRIP_RATE, limit_s=60)
            return asyncio.create_task(sending, name=f"drip-{i}")

        # Four drip-fed streams from one newcomer (the reported attack), then one from each of two more.
        attack = [start_drip(newcomers[0], i) for i in range(4)]
        await wait_until(lambda: _holding(receiver, 1), 15, interval=0.02)
        attack += [start_drip(peer, 4 + i) for i, peer in enumerate(newcomers[1:])]
        await wait_until(lambda: _holding(receiver, 2), 15, interval=0.02)
        # In the thick of it the established node hands off its real files: each is received at once
        # (HandoffBusy, every slot held, would fail here) and accepted.
        for path, envelope in files[1:]:
            start = time.monotonic()
            receipt = await honest_peer.send_rollout(path, envelope)
            received_s = time.monotonic() - start
            assert receipt.body.sha256 == envelope.sha256 and received_s < 8.0, received_s
            verdict = (await wait_verdict(running, envelope.sha256, 60)).document
            assert verdict.accepted, verdict.reason
        drips = await asyncio.wait_for(asyncio.gather(*attack), 90)

        went = [d for d in drips if d.went]
        # Each drip that got a slot was cut at the floor within a window (plus slack for a loaded machine).
        assert went and all(d.held_s is not None and d.held_s < WINDOW_S + 2.5 for d in went), drips
        assert all("below the floor" in d.busy_reason() for d in went), [d.busy_reason() for d in went]
        cut_logs = [r.getMessage() for r in caplog.records if "cut off the hand-off" in r.getMessage()]
        assert len(cut_logs) == len(went) and all("below the floor" in m for m in cut_logs), cut_logs
        # One newcomer held one slot with four streams; the three newcomers of one network held at most two.
        assert sum(d.went for d in drips[:4]) == 1, [d.answer for d in drips[:4]]
        assert len(went) <= 2 + 1, drips  # two at once, and at most one more after a cut freed a slot
        told = " | ".join(
            d.busy_reason() for d in drips[4:]
        )  # here the newcomer and network shares are equal
        assert "newcomers hold their 2 receive slots" in told or "network 127.0.0.0/24 hold 2" in told, told
        # Nothing of theirs was stored or judged, and their admission places were freed when they were cut,
        # not left to lapse.
        assert service.admission.in_tier(Tier.NEWCOMER) == 0
        ids = [p.node_id for p in newcomers]
        marks = ",".join("?" * len(ids))
        rows = await service.ledger.query(
            f"SELECT COUNT(*) AS n FROM contributions WHERE node_id IN ({marks})", tuple(ids)
        )
        assert rows[0]["n"] == 0
        # The cut costs the dripping newcomer a cooldown; the established node pays nothing.
        again = await drip(newcomers[0], target, *signed_blob(newcomers[0].identity, 4096), bytes_per_s=FLOOR)
        assert not again.went and "cooling down" in again.busy_reason(), again
        assert receiver.cooldowns.remaining(honest.node_id, honest_peer.peer_id) == 0.0


async def _bound(validator_swarm, node_id: str) -> bool:  # noqa: ANN001
    return (await validator_swarm.list_peers()).get(node_id) is not None


async def _established(service, node_id: str) -> bool:  # noqa: ANN001
    return service.admission.tier_of(node_id) is Tier.ESTABLISHED


async def _holding(receiver, count: int) -> bool:  # noqa: ANN001
    return receiver.slots.in_use >= count
