"""The coordinator's formation nonce (p2p/pipeline/group_ids.py, trainer/groups/plan.py): a standing group keeps
its nonce, and so its id, while it is re-signed round after round; the same members formed again get a new nonce
and so a new id, which in a frozen run (the step never advances) is what lets every formation number its
batches from 0 without signing an opening twice."""

from __future__ import annotations

import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.group_ids import (
    NONCE_DIGITS,
    formed_ms,
    group_id_of,
    is_nonce,
    new_nonce,
    nonce_formed_ms,
)
from prime_node.p2p.pipeline.layout import StageLayout, layout_digest
from prime_node.p2p.swarm.group_records import StageAvailability, group_id
from prime_node.p2p.swarm.records import Hardware, Heartbeat
from prime_node.trainer.groups.plan import PlanSettings, View, plan_round

RUN = "nonce-run"
LAYOUT = StageLayout(boundaries=[0, 2, 4])
A, B, C, D = sorted(Identity.from_seed(bytes([80 + i]) * 32).node_id for i in range(4))
STAGE = {A: 0, B: 1, C: 0, D: 1}  # each node offers one stage, so a pair's order is fixed
SETTINGS = PlanSettings(stale_after_s=5.0, confirm_within_s=10.0, cooldown_s=60.0)


def _beat(node: str, now: float, group: str | None) -> Heartbeat:
    return Heartbeat(
        node_id=node,
        peer_id="12D3KooWLtPGnEYZ57XxMm1XZVfb9vLStjt5xvxMGaYtTKhRbtFK",
        version="0.1.0",
        roles=["contributor"],
        hardware=Hardware(),
        addresses=[],
        client_mode=False,
        policy_step=3,
        serves_steps=[],
        sent_at=now,
        group=group,
    )


def _view(now: float, nodes: list[str], named: dict[str, str]) -> View:
    offers = {
        n: StageAvailability(
            node_id=n, stages=[STAGE[n]], layer_tokens_per_s=1000.0, rtts=[], reachable=True, policy_step=3,
            published_at=now,
        )
        for n in nodes
    }  # fmt: skip
    beats = {n: _beat(n, now, named.get(n)) for n in nodes}
    return View(now, 3, LAYOUT, beats, offers, frozenset())


def test_a_standing_group_keeps_its_nonce_and_a_re_formed_one_gets_a_new_id() -> None:
    first = plan_round(RUN, _view(100.0, [A, B], {}), [], 0, {}, SETTINGS)
    (ab,) = first.publish
    assert ab.members == [A, B] and nonce_formed_ms(ab.nonce) == formed_ms(100.0)
    assert ab.group_id == group_id(RUN, 3, [A, B], LAYOUT, ab.nonce)
    # Two more nodes: a new round re-signs the standing group unchanged in id and nonce, and forms another.
    named = {A: ab.group_id, B: ab.group_id}
    second = plan_round(RUN, _view(101.0, [A, B, C, D], named), first.publish, first.round, {}, SETTINGS)
    assert second.round == 2
    kept = next(g for g in second.publish if g.members == [A, B])
    assert (kept.group_id, kept.nonce, kept.formed_at, kept.round) == (ab.group_id, ab.nonce, 100.0, 2)
    (cd,) = [g for g in second.publish if g.members == [C, D]]
    assert cd.nonce != ab.nonce and nonce_formed_ms(cd.nonce) == formed_ms(101.0)
    # B departs (its heartbeat stops): the group dissolves. B comes back; the same members, the same step and
    # layout are formed again, under a new nonce: another group, whose batch numbers are its own.
    third = plan_round(RUN, _view(107.0, [A, C, D], named), second.publish, second.round, {}, SETTINGS)
    assert ab.group_id in third.dissolved
    fourth = plan_round(RUN, _view(108.0, [A, B, C, D], named), third.publish, third.round, {}, SETTINGS)
    (again,) = [g for g in fourth.publish if g.members == [A, B]]
    assert again.group_id != ab.group_id and again.nonce != ab.nonce
    assert again.group_id == group_id(RUN, 3, [A, B], LAYOUT, again.nonce)


def test_nonces_are_fresh_well_formed_and_carry_their_formation_time() -> None:
    nonces = {new_nonce(1_700_000_000.25) for _ in range(64)}
    assert len(nonces) == 64  # 16 random bytes each
    for nonce in nonces:
        assert is_nonce(nonce) and len(nonce) == NONCE_DIGITS and nonce_formed_ms(nonce) == 1_700_000_000_250
    for bad in ("", "ab" * 24 + "\n", "AB" * 24, "g" * 48, "ab" * 23, "ab" * 25, 7, None):
        assert not is_nonce(bad)
    with pytest.raises(ValueError, match="not 48 lowercase hex digits"):
        nonce_formed_ms("zz" * 24)
    # The id binds the nonce: one digit of it, or its time, gives another id.
    nonce = next(iter(nonces))
    ids = {
        group_id_of(RUN, 3, [A, B], layout_digest(LAYOUT), n)
        for n in (nonce, nonce[:-1] + ("0" if nonce[-1] != "0" else "1"), new_nonce(1_700_000_000.0))
    }
    assert len(ids) == 3
