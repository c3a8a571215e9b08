"""Slow hand-offs against a live validator (issue 18, class 6): newcomers that drip their bodies on every
stream they can open are cut at the rate floor; a sender that hangs up just before its window ends is cut
and cooled down as well; one network cannot take every receive slot, whatever mix of established and newcomer
ids it uses; and an established node's real files are received and accepted meanwhile, within a bound."""

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
ABOVE_FLOOR = FLOOR + 16 * 1024  # attackers that keep the floor: never cut, so their slots stay held
ABOVE_FLOOR_SIZE = 4 << 20  # about 50 s at that rate: longer than the test needs them
LOOPBACK_NET = "127.0.0.0/24"
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
    # A network's share of 3: its newcomers may hold 2, the third is kept for its established nodes.
    swarm = {**SWARM, "handoff_slots_per_network": 3}
    settings = validator_settings(tmp_path / "validator", swarm=swarm, established_after=1)
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
        assert (
            "newcomers hold their 2 receive slots" in told or "nodes of network 127.0.0.0/24 hold 2" in told
        ), told
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


OTHER_NETWORK = ["/ip4/127.0.1.1/tcp/0"]  # 127.0.1.0/24: another /24 than 127.0.0.1's, on this host's lo


@pytest.mark.slow
async def test_one_network_cannot_take_every_slot_with_established_and_newcomer_ids(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    """Two ids on one /24 that earned their standing with real work, plus two newcomers there, stream at the
    floor (they pay for it, and are never cut): before, each tier had its own share of the network and the
    four held all four slots, so the established node of another network was told busy. The network's share
    now holds across tiers."""
    checkpoint, engine, tasks = world
    honest = Identity.generate()
    veterans = [Identity.generate() for _ in range(2)]  # the attackers with standing
    files = {
        node.node_id: [
            write_file(
                tmp_path / f"{node.node_id[:8]}-{k}.parquet",
                rows_for(engine, tasks, node, batch_counter=k),
                node,
            )
            for k in range(3)
        ]
        for node in [honest, *veterans]
    }
    settings = validator_settings(tmp_path / "validator", swarm=SWARM, established_after=2)
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        service, receiver = running.service, running.service.receiver
        assert receiver is not None
        join = dict(bootstrap=running.maddrs[:1], reachability="public")
        honest_peer = await group.add(honest, host_maddrs=OTHER_NETWORK, **join)
        veteran_peers = [await group.add(v, **join) for v in veterans]
        newcomers = [await group.add(**join) for _ in range(2)]
        for peer in [honest_peer, *veteran_peers, *newcomers]:
            await wait_until(lambda p=peer: sees_a_validator(p), 20)
            await wait_until(lambda p=peer: _bound(running.swarm, p.node_id), 20)
        # Standing is earned with verified work: two accepted files each, the honest node's and the attackers'.
        for peer in [honest_peer, *veteran_peers]:
            for path, envelope in files[peer.node_id][:2]:
                await peer.send_rollout(path, envelope)
                assert (await wait_verdict(running, envelope.sha256, 60)).document.accepted
        for node in [honest, *veterans]:
            await wait_until(lambda n=node.node_id: _established(service, n), 5)

        target = running.swarm.peer_id
        attack = [
            asyncio.create_task(
                drip(
                    peer,
                    target,
                    *signed_blob(peer.identity, ABOVE_FLOOR_SIZE),
                    bytes_per_s=ABOVE_FLOOR,
                    limit_s=60,
                ),
                name=f"at-the-floor-{i}",
            )
            for i, peer in enumerate([*veteran_peers, *newcomers])
        ]
        peak = {"network": 0, "in_use": 0}

        async def watch() -> None:
            while True:
                peak["network"] = max(peak["network"], receiver.slots.held("net", LOOPBACK_NET))
                peak["in_use"] = max(peak["in_use"], receiver.slots.in_use)
                await asyncio.sleep(0.02)

        watching = asyncio.create_task(watch(), name="slot-watch")
        try:
            await wait_until(lambda: _holding(receiver, 2), 15, interval=0.02)
            await asyncio.sleep(1.0)  # every attacker's header has had its answer
            # The established node of another network hands off its file at once (busy here fails the test).
            path, envelope = files[honest.node_id][2]
            start = time.monotonic()
            await honest_peer.send_rollout(path, envelope)
            assert time.monotonic() - start < 8.0
            verdict = (await wait_verdict(running, envelope.sha256, 60)).document
            assert verdict.accepted, verdict.reason
            # The attackers' network never held more than its share, across tiers, and a slot was always free.
            assert peak["network"] == 2 and peak["in_use"] <= 3, peak
        finally:
            watching.cancel()
            for task in attack:
                task.cancel()
            await asyncio.gather(*attack, return_exceptions=True)


@pytest.mark.slow
async def test_a_sender_that_hangs_up_before_its_window_ends_is_cut_and_cooled_down(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    """Sending nothing and closing just before the window's floor is due, then opening the next stream at once,
    held a slot nearly all the time at no cost: the close was a plain transport failure. It is a cut now, for a
    newcomer and for an id with standing (which may use the reserved slots) alike. A sender above the floor whose
    stream breaks pays nothing, and an established node's files get through."""
    checkpoint, engine, tasks = world
    honest, veteran = Identity.generate(), Identity.generate()
    files = [
        write_file(tmp_path / f"honest-{k}.parquet", rows_for(engine, tasks, honest, batch_counter=k), honest)
        for k in range(2)
    ]
    earned = write_file(tmp_path / "veteran.parquet", rows_for(engine, tasks, veteran), veteran)
    settings = validator_settings(tmp_path / "validator", swarm=SWARM, established_after=1)
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        service, receiver = running.service, running.service.receiver
        assert receiver is not None
        join = dict(bootstrap=running.maddrs[:1], reachability="public")
        honest_peer = await group.add(honest, **join)
        hangers = [
            await group.add(veteran, **join),
            await group.add(**join),
        ]  # one with standing, one without
        for peer in [honest_peer, *hangers]:
            await wait_until(lambda p=peer: sees_a_validator(p), 20)
            await wait_until(lambda p=peer: _bound(running.swarm, p.node_id), 20)
        for peer, (path, envelope) in ((honest_peer, files[0]), (hangers[0], earned)):  # standing: real work
            await peer.send_rollout(path, envelope)
            assert (await wait_verdict(running, envelope.sha256, 60)).document.accepted
        for node in (honest, veteran):
            await wait_until(lambda n=node.node_id: _established(service, n), 5)
        target = running.swarm.peer_id

        # Each hangs up at 80% of the window having sent nothing, and tries again at once.
        rounds = []
        for peer in hangers:
            blob = signed_blob(peer.identity, DRIP_SIZE)
            first = await drip(peer, target, *blob, bytes_per_s=0, hang_up_after_s=0.8 * WINDOW_S)
            await wait_until(lambda: _idle(receiver), 5, interval=0.02)  # it has seen the first stream end
            again = await drip(peer, target, *blob, bytes_per_s=0, hang_up_after_s=0.8 * WINDOW_S)
            rounds.append((first, again))
        for first, again in rounds:
            assert first.went and first.held_s is not None and first.held_s < WINDOW_S, first
            assert not again.went and "cooling down" in again.busy_reason(), again.answer
        assert receiver.cut_off == len(hangers)
        for peer in hangers:
            assert (
                receiver.cooldowns.remaining(peer.node_id, peer.peer_id) > 0.5 * SWARM["handoff_cooldown_s"]
            )

        # The honest control: above the floor, its link drops mid-file (twice the floor, for two windows): no
        # cut, no cooldown; its next hand-off goes, and its real file is accepted.
        blob = signed_blob(honest, DRIP_SIZE)
        broken = await drip(honest_peer, target, *blob, bytes_per_s=2 * FLOOR, hang_up_after_s=2 * WINDOW_S)
        assert broken.went and broken.sent < DRIP_SIZE, broken
        await wait_until(lambda: _idle(receiver), 5, interval=0.02)
        assert receiver.cooldowns.remaining(honest.node_id, honest_peer.peer_id) == 0.0
        assert receiver.cut_off == len(hangers)
        path, envelope = files[1]
        await honest_peer.send_rollout(path, envelope)
        assert (await wait_verdict(running, envelope.sha256, 60)).document.accepted


async def _bound(validator_swarm, node_id: str) -> bool:  # noqa: ANN001
    return (await validator_swarm.list_peers()).get(node_id) is not None


async def _established(service, node_id: str) -> bool:  # noqa: ANN001
    return service.admission.tier_of(node_id) is Tier.ESTABLISHED


async def _holding(receiver, count: int) -> bool:  # noqa: ANN001
    return receiver.slots.in_use >= count


async def _idle(receiver) -> bool:  # noqa: ANN001
    return receiver.slots.in_use == 0 and not receiver._in_progress  # every stream's end has been handled
