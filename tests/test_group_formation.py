"""Group formation, the coordinator's round plan and a node's choice of group: pure functions, checked on
hand-built offers whose best answer is known, and against an exhaustive search on random offers."""

from __future__ import annotations

import itertools
import random

import pytest
from pydantic import ValidationError

from prime_node.node.pipeline.membership import (
    MAX_AVOIDED,
    AvoidedGroups,
    NodeView,
    choose_group,
    why_unusable,
)
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.swarm.group_records import GroupRecord, PeerRtt, StageAvailability, group_id
from prime_node.p2p.swarm.records import Hardware, Heartbeat
from prime_node.trainer.groups.config import GroupsSection
from prime_node.trainer.groups.coordinator import adopt
from prime_node.trainer.groups.formation import FormationSettings, form_groups, group_cost
from prime_node.trainer.groups.plan import PlanSettings, View, plan_round

from support.nonces import nonce_at

RUN = "unit-run"
LAYOUT = StageLayout(boundaries=[0, 2, 4])
IDS = sorted(Identity.from_seed(bytes([60 + i]) * 32).node_id for i in range(8))


def offer(
    node: str, tps: float = 1000.0, rtts: dict[str, float] | None = None, **changes: object
) -> StageAvailability:
    fields: dict[str, object] = dict(
        node_id=node,
        stages=[0, 1],
        layer_tokens_per_s=tps,
        rtts=[PeerRtt(node_id=p, rtt_ms=v) for p, v in sorted((rtts or {}).items())],
        reachable=True,
        policy_step=3,
        published_at=100.0,
    )
    fields.update(changes)
    return StageAvailability(**fields)


def beat(node: str, sent_at: float = 100.0, group: str | None = None) -> Heartbeat:
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
        sent_at=sent_at,
        group=group,
    )


def test_the_slowest_stage_and_the_ring_latency_decide() -> None:
    a, b, c, d = IDS[:4]
    # a and b are fast but 400 ms apart; c and d slower (2 ms/token at 2 layers) but 1 ms apart.
    offers = {
        a: offer(a, 4000.0, {b: 200.0}),
        b: offer(b, 4000.0, {a: 200.0}),
        c: offer(c, 1000.0, {d: 0.5}),
        d: offer(d, 1000.0, {c: 0.5}),
    }
    groups = form_groups(LAYOUT, offers)
    assert [set(g.members) for g in groups][0] == {c, d}
    assert groups[0].cost_s == pytest.approx(2 / 1000 + 1 / 1000)
    # Without the latency, the fast pair wins.
    near = {n: o.model_copy(update={"rtts": []}) for n, o in offers.items()}
    assert set(form_groups(LAYOUT, near, FormationSettings(unknown_rtt_ms=0.0))[0].members) == {a, b}


def test_reachable_nodes_are_preferred_and_stages_must_be_offered() -> None:
    a, b, c = IDS[:3]
    offers = {a: offer(a, reachable=False), b: offer(b, stages=[1]), c: offer(c, stages=[0])}
    (g,) = form_groups(LAYOUT, offers)
    assert g.members == (c, b)
    assert form_groups(LAYOUT, {b: offers[b], a: offers[a].model_copy(update={"stages": [1]})}) == []


def test_the_slowest_hop_side_counts_so_no_node_can_shrink_it() -> None:
    a, b, c = IDS[:3]
    honest = {a: offer(a, rtts={b: 300.0}), b: offer(b, rtts={a: 0.0})}  # b lies that it is next door
    assert group_cost(LAYOUT, (a, b), honest, FormationSettings()) == pytest.approx(2 / 1000 + 0.6)
    assert group_cost(LAYOUT, (b, a), honest, FormationSettings()) == pytest.approx(2 / 1000 + 0.6)
    # The lie buys b no place: c, honestly 100 ms from a (as a measured too), is chosen over it, although
    # b is faster and claims to be 0 ms away.
    offers = {
        a: offer(a, stages=[0], rtts={b: 300.0, c: 100.0}),
        b: offer(b, 4000.0, stages=[1], rtts={a: 0.0}),
        c: offer(c, stages=[1], rtts={a: 100.0}),
    }
    (g,) = form_groups(LAYOUT, offers)
    assert g.members == (a, c)
    assert g.cost_s == pytest.approx(2 / 1000 + 0.2)


def test_a_node_holds_one_stage_so_a_lone_node_forms_no_group() -> None:
    a, b, c = IDS[:3]
    assert form_groups(LAYOUT, {a: offer(a)}) == []
    assert form_groups(LAYOUT, {a: offer(a, stages=[0]), b: offer(b, stages=[0])}) == []
    (g,) = form_groups(LAYOUT, {a: offer(a), c: offer(c, stages=[1])})
    assert g.members == (a, c)


def test_disjoint_groups_cheapest_first_until_none_is_full() -> None:
    # Five nodes, stage k on every other one, all 5 ms apart: the fastest pair first, then the next, and the
    # fifth is left out (no partner for its stage).
    nodes = IDS[:5]
    rtt = 5.0
    offers = {
        n: offer(n, 4000.0 / (1 + i), {p: rtt for p in nodes if p != n}, stages=[i % 2])
        for i, n in enumerate(nodes)
    }
    groups = form_groups(LAYOUT, offers)
    assert [g.members for g in groups] == [(nodes[0], nodes[1]), (nodes[2], nodes[3])]
    assert [g.cost_s for g in groups] == sorted(g.cost_s for g in groups)


@pytest.mark.parametrize("seed", range(6))
def test_the_first_group_is_the_exhaustive_optimum_and_formation_is_deterministic(seed: int) -> None:
    rng = random.Random(seed)
    layout = StageLayout(boundaries=[0, 1, 3, 4])
    nodes = IDS[: rng.randrange(3, 8)]
    offers = {
        n: offer(
            n,
            rng.uniform(100, 5000),
            {p: rng.uniform(0, 100) for p in nodes if p != n and rng.random() < 0.7},
            stages=sorted(rng.sample(range(3), rng.randrange(1, 4))),
            reachable=rng.random() < 0.8,
        )
        for n in nodes
    }
    settings = FormationSettings()
    tuples = [
        t for t in itertools.permutations(nodes, 3) if all(k in offers[m].stages for k, m in enumerate(t))
    ]
    groups = form_groups(layout, offers, settings)
    if not tuples:
        assert groups == []
        return
    best = min(group_cost(layout, t, offers, settings) for t in tuples)
    assert groups[0].cost_s == pytest.approx(best)
    assert form_groups(layout, dict(reversed(list(offers.items()))), settings) == groups
    beam = form_groups(layout, offers, FormationSettings(exact_limit=0, beam_width=512))
    assert beam[0].cost_s == pytest.approx(best)  # a wide enough beam is exhaustive
    members = [m for g in groups for m in g.members]
    assert len(members) == len(set(members))


def _view(now: float, beats: dict[str, Heartbeat], offers: dict[str, StageAvailability]) -> View:
    fresh = {n: o.model_copy(update={"published_at": now}) for n, o in offers.items()}  # offers republished
    return View(now, 3, LAYOUT, beats, fresh, frozenset())


def test_a_departed_member_dissolves_its_group_and_the_rest_regroup() -> None:
    a, b, c, d, e = IDS[:5]
    settings = PlanSettings(stale_after_s=5.0, confirm_within_s=10.0, cooldown_s=60.0)
    offers = {n: offer(n) for n in (a, b, c, d, e)}
    first = plan_round(RUN, _view(100.0, {n: beat(n) for n in offers}, offers), [], 0, {}, settings)
    assert first.round == 1 and len(first.publish) == 2
    spare = (set(offers) - {m for g in first.publish for m in g.members}).pop()
    # Members confirm; then one member of the first group stops sending heartbeats.
    named = {m: g.group_id for g in first.publish for m in g.members}
    victim = first.publish[0].members[0]
    beats = {n: beat(n, 106.0 if n != victim else 100.0, named.get(n)) for n in offers}
    second = plan_round(RUN, _view(106.0, beats, offers), first.publish, first.round, {}, settings)
    assert list(second.dissolved) == [first.publish[0].group_id]
    assert "gone" in second.dissolved[first.publish[0].group_id]
    assert second.round == 2
    ids = {g.group_id for g in second.publish}
    assert first.publish[1].group_id in ids  # the standing group is kept, re-signed under round 2
    survivors = {m for m in first.publish[0].members if m != victim} | {spare}
    new = [g for g in second.publish if g.group_id != first.publish[1].group_id]
    assert len(new) == 1 and set(new[0].members) == survivors
    # Nothing changes: the round stays.
    beats = {n: beat(n, 107.0, named.get(n)) for n in offers if n != victim}
    beats.update({m: beat(m, 107.0, new[0].group_id) for m in new[0].members})
    third = plan_round(RUN, _view(107.0, beats, offers), second.publish, second.round, {}, settings)
    assert third.round == 2 and not third.dissolved


def test_members_that_never_confirm_dissolve_the_group_and_cool_down() -> None:
    a, b = IDS[:2]
    settings = PlanSettings(stale_after_s=5.0, confirm_within_s=3.0, cooldown_s=60.0)
    offers = {a: offer(a), b: offer(b)}
    first = plan_round(RUN, _view(100.0, {a: beat(a), b: beat(b)}, offers), [], 0, {}, settings)
    (g,) = first.publish
    beats = {a: beat(a, 104.0, g.group_id), b: beat(b, 104.0)}  # b never names the group
    later = plan_round(RUN, _view(104.0, beats, offers), first.publish, 1, {}, settings)
    assert "did not confirm" in later.dissolved[g.group_id]
    assert b in later.cooldown and a not in later.cooldown and later.publish == []


def _node_view(node: str, beats: dict[str, Heartbeat], now: float = 100.0, **changes: object) -> NodeView:
    fields: dict[str, object] = dict(
        node_id=node,
        run_id=RUN,
        now=now,
        policy_step=3,
        layout=LAYOUT,
        offered=frozenset({0, 1}),
        heartbeats=beats,
        stale_after_s=5.0,
        round_grace_s=2.0,
    )
    fields.update(changes)
    return NodeView(**fields)


def _group(members: list[str], round_: int = 1, **changes: object) -> GroupRecord:
    fields: dict[str, object] = dict(
        round=round_,
        policy_step=3,
        layout=LAYOUT,
        members=members,
        formed_at=100.0,
        signed_at=100.0,
        nonce=nonce_at(100.0),
    )
    fields.update(changes)
    if "group_id" not in changes:  # the digest of what the record names, its layout and nonce included
        fields["group_id"] = group_id(
            RUN,
            fields["policy_step"],  # type: ignore[arg-type]
            members,
            fields["layout"],  # type: ignore[arg-type]
            fields["nonce"],  # type: ignore[arg-type]
        )
    return GroupRecord(**fields)


def test_a_node_runs_only_a_usable_group_of_the_newest_round_that_names_it() -> None:
    a, b, c, stranger = IDS[:4]
    beats = {n: beat(n) for n in (a, b, c)}
    good = _group([a, b])
    cases = {
        "does not name this node": _group([b, c]),
        "not the digest": _group([a, b], group_id=group_id(RUN, 3, [b, a], LAYOUT, nonce_at(100.0))),
        # The same record under another nonce's id: the nonce is part of the digest.
        "formation nonce": _group([a, b], group_id=_group([a, b], nonce=nonce_at(100.0, salt=1)).group_id),
        "boundaries [0, 1, 4], the run's [0, 2, 4]": _group([a, b], layout=StageLayout(boundaries=[0, 1, 4])),
        # A group whose batches are cut otherwise than the run's pinned shape: its members' frames would disagree.
        "micro_batch_size 4, the run's 2": _group(
            [a, b], layout=StageLayout(boundaries=[0, 2, 4], micro_batch_size=4)
        ),
        "prompts 8, the run's 4": _group([a, b], layout=StageLayout(boundaries=[0, 2, 4], prompts=8)),
        "policy step 4": _group([a, b], policy_step=4),
        "no heartbeat (unknown": _group([a, stranger]),
    }
    for reason, g in cases.items():
        assert reason in (why_unusable(g, _node_view(a, beats)) or ""), reason
        assert choose_group({g.group_id: g}, _node_view(a, beats), None)[0] is None
    assert "did not offer" in (why_unusable(good, _node_view(b, beats, offered=frozenset({0}))) or "")
    stale = dict(beats, **{b: beat(b, 90.0)})
    assert "old" in (why_unusable(good, _node_view(a, stale)) or "")
    assert choose_group({good.group_id: good}, _node_view(a, beats), None)[0] == good
    # A newer round that does not name it: the older record is one the coordinator dissolved.
    other = _group([b, c], round_=2)
    both = {good.group_id: good, other.group_id: other}
    assert choose_group(both, _node_view(a, beats), None)[0] is None
    # But a member already running it keeps it for the grace while the new round propagates.
    assert choose_group(both, _node_view(a, beats, now=101.0), good.group_id)[0] == good
    assert choose_group(both, _node_view(a, beats, now=103.0), good.group_id)[0] is None


def test_a_node_leaves_a_group_it_gave_up_and_does_not_rejoin_it() -> None:
    """A group whose batches kept breaking (node/pipeline/host.py gave it up) is unusable to this node while it
    avoids it: a member running it leaves it, and the same group signed again is not joined."""
    a, b = IDS[:2]
    beats = {n: beat(n) for n in (a, b)}
    good = _group([a, b])
    avoided = {good.group_id: "8 batches in a row broke"}
    view = _node_view(a, beats, avoided=avoided)
    assert "gave it up: 8 batches in a row broke" in (why_unusable(good, view) or "")
    assert choose_group({good.group_id: good}, view, good.group_id) == (
        None,
        "no usable group of the newest round names this node",
    )
    assert choose_group({good.group_id: good}, view, None)[0] is None
    assert (
        choose_group({good.group_id: good}, _node_view(a, beats), None)[0] == good
    )  # once no longer avoided


def test_a_group_given_up_is_avoided_for_a_while_and_the_set_is_bounded() -> None:
    clock = [0.0]
    avoided = AvoidedGroups(600.0, clock=lambda: clock[0])
    avoided.add("aa" * 32, "broke")
    clock[0] = 599.0
    assert avoided.now() == {"aa" * 32: "broke"}
    clock[0] = 600.0
    assert avoided.now() == {}
    for k in range(MAX_AVOIDED + 5):
        avoided.add(f"{k:064x}", "broke")
    kept = avoided.now()
    assert len(kept) == MAX_AVOIDED and f"{0:064x}" not in kept and f"{MAX_AVOIDED + 4:064x}" in kept


def test_a_restarted_coordinator_adopts_the_newest_round() -> None:
    a, b, c, d = IDS[:4]
    old = _group([a, b], round_=1)
    standing = _group([c, d], round_=2)
    stale_step = _group([a, c], round_=2, policy_step=2)
    assert adopt([old, standing, stale_step], 3, LAYOUT) == (2, [standing])
    assert adopt([], 3, LAYOUT) == (0, [])


def test_groups_settings_are_bounded_and_checked() -> None:
    assert GroupsSection().plan_settings().stale_after_s == 45.0
    with pytest.raises(ValidationError, match="confirm_within_s"):
        GroupsSection(poll_s=30.0, confirm_within_s=10.0)
    with pytest.raises(ValidationError):
        GroupsSection(stale_after_s=float("nan"))
