"""A member that gives a group up because its batches kept breaking (or none finished) says so in its heartbeat
(`left_group`); the coordinator then dissolves the group at once, does not cool that member down as a silent
one, and keeps it apart from the group's other members for `keep_apart_s` (trainer/groups/plan.py), provided it
saw that member confirm the group before; a claim from a member never seen confirming it is taken as silence.
Pure functions, and the heartbeat's bytes through the swarm's record checks."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from prime_node.node.pipeline.membership import MAX_AVOIDED, AvoidedGroups
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.swarm.errors import RecordError
from prime_node.p2p.swarm.group_records import GroupRecord, StageAvailability
from prime_node.p2p.swarm.records import (
    MAX_PAYLOAD_BYTES,
    Hardware,
    Heartbeat,
    RecordKind,
    payload_of,
    reopen_record,
    seal,
    seal_payload,
)
from prime_node.trainer.groups.config import GroupsSection
from prime_node.trainer.groups.formation import FormationSettings, form_groups, node_pair
from prime_node.trainer.groups.plan import MAX_APART_PAIRS, Plan, PlanSettings, View, plan_round

RUN = "unit-run"
LAYOUT = StageLayout(boundaries=[0, 2, 4])
IDS = sorted(Identity.from_seed(bytes([90 + i]) * 32).node_id for i in range(6))
SETTINGS = PlanSettings(stale_after_s=5.0, confirm_within_s=10.0, cooldown_s=300.0, keep_apart_s=600.0)
ELSEWHERE = "ab" * 32  # a group id none of the test's groups has


def offer(node: str, now: float) -> StageAvailability:
    return StageAvailability(
        node_id=node,
        stages=[0, 1],
        layer_tokens_per_s=1000.0,
        rtts=[],
        reachable=True,
        policy_step=3,
        published_at=now,
    )


def beat(node: str, now: float, group: str | None = None, left_group: str | None = None) -> Heartbeat:
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
        left_group=left_group,
    )


def view(now: float, beats: dict[str, Heartbeat]) -> View:
    return View(now, 3, LAYOUT, beats, {n: offer(n, now) for n in beats}, frozenset())


def formed_pair(nodes: list[str]) -> tuple[Plan, GroupRecord, str, str, list[str]]:
    """The first round over `nodes`: its one group (stage 0, stage 1) and the nodes left out of it."""
    first = plan_round(RUN, view(100.0, {n: beat(n, 100.0) for n in nodes}), [], 0, {}, SETTINGS)
    (group,) = first.publish
    leader, follower = group.members
    return first, group, leader, follower, [n for n in nodes if n not in group.members]


def together(plan: Plan, a: str, b: str) -> bool:
    return any(a in g.members and b in g.members for g in plan.publish)


def confirmed_round(first: Plan, group: GroupRecord, others: list[str], now: float) -> Plan:
    """A round at `now` in which every member of `group` names it (the others free): the group stands, and the
    plan records each member as having confirmed it."""
    beats = {m: beat(m, now, group.group_id) for m in group.members} | {n: beat(n, now) for n in others}
    plan = plan_round(
        RUN,
        view(now, beats),
        first.publish,
        first.round,
        first.cooldown,
        SETTINGS,
        first.apart,
        first.confirmed,
    )
    assert not plan.dissolved and plan.confirmed == {group.group_id: frozenset(group.members)}
    return plan


def test_a_member_that_left_for_failed_batches_is_not_cooled_down_and_kept_apart() -> None:
    """Both members confirm; then the leader keeps confirming (it broke the batches, say) and the follower gives
    the group up and says so: the group is dissolved at once (within confirm_within_s), nobody is cooled down,
    and the pair is not grouped again for keep_apart_s while each may be grouped with a third node."""
    formed, group, leader, follower, (spare,) = formed_pair(IDS[:3])
    assert formed.confirmed == {group.group_id: frozenset()}  # nobody can have named a new group yet
    first = confirmed_round(formed, group, [spare], 101.0)
    beats = {
        leader: beat(leader, 102.0, group.group_id),
        follower: beat(follower, 102.0, left_group=group.group_id),
        spare: beat(spare, 102.0),
    }
    second = plan_round(
        RUN,
        view(102.0, beats),
        first.publish,
        first.round,
        first.cooldown,
        SETTINGS,
        first.apart,
        first.confirmed,
    )
    assert "left it" in second.dissolved[group.group_id]
    assert second.cooldown == {}  # before, the follower sat out cooldown_s once confirm_within_s had passed
    assert second.apart == {node_pair(leader, follower): 702.0}
    (regrouped,) = second.publish
    assert spare in regrouped.members and not together(second, leader, follower)
    # The new group's members confirm; the one left out waits. Still apart later in the window...
    beats = {n: beat(n, 500.0, regrouped.group_id if n in regrouped.members else None) for n in beats}
    beats = {**beats, follower: beats[follower].model_copy(update={"left_group": group.group_id})}
    third = plan_round(
        RUN,
        view(500.0, beats),
        second.publish,
        second.round,
        second.cooldown,
        SETTINGS,
        second.apart,
        second.confirmed,
    )
    assert not third.dissolved and third.publish == [
        g.model_copy(update={"signed_at": 500.0}) for g in second.publish
    ]
    # ... and the pair is the only group three nodes without the spare could form: not before the window ends.
    alone = {n: beat(n, 701.0) for n in (leader, follower)}
    assert plan_round(RUN, view(701.0, alone), [], third.round, {}, SETTINGS, third.apart).publish == []
    after = plan_round(
        RUN, view(703.0, {n: beat(n, 703.0) for n in alone}), [], third.round, {}, SETTINGS, third.apart
    )
    assert after.apart == {} and together(after, leader, follower)


def test_a_claim_to_have_left_a_group_never_confirmed_is_silence_and_buys_nothing() -> None:
    """A member placed in a group that never names it, only names it as left (a node that would dissolve every
    group it is drawn into at no cost): the group still dissolves at once (the member said it will not run it),
    but the member is cooled down as a silent one and kept apart from nobody; a confirmation of another group,
    or one the coordinator never saw, counts for nothing. Its partner is free and grouped at once."""
    formed, group, leader, follower, (spare,) = formed_pair(IDS[:3])
    beats = {
        leader: beat(leader, 102.0, group.group_id),
        follower: beat(follower, 102.0, left_group=group.group_id),
        spare: beat(spare, 102.0),
    }
    for confirmed in (
        formed.confirmed,  # nothing seen yet
        {},  # none recorded at all
        {group.group_id: frozenset({leader}), ELSEWHERE: frozenset({follower})},  # only the leader's seen
        {group.group_id: frozenset({IDS[5]})},  # a name the group does not hold
    ):
        plan = plan_round(
            RUN, view(102.0, beats), formed.publish, formed.round, {}, SETTINGS, formed.apart, confirmed
        )
        assert "without ever confirming it" in plan.dissolved[group.group_id]
        assert plan.cooldown == {follower: 402.0}  # before: none (the claim escaped the cooldown)
        assert plan.apart == {}
        (regrouped,) = plan.publish  # the leader and the spare: the follower sits out
        assert set(regrouped.members) == {leader, spare}
        assert plan.confirmed == {regrouped.group_id: frozenset()}  # the dissolved group's are dropped
    # Beside a leaver that did confirm it, the one that never did is still cooled down, and only the leaver's
    # pairs are kept apart.
    three = LAYOUT.model_copy(update={"boundaries": [0, 1, 2, 4]})
    first = plan_round(
        RUN,
        View(100.0, 3, three, {n: beat(n, 100.0) for n in IDS[:3]}, offers3(IDS[:3], 100.0), frozenset()),
        [],
        0,
        {},
        SETTINGS,
    )
    (trio,) = first.publish
    a, b, c = trio.members
    named = {a: beat(a, 101.0, trio.group_id), b: beat(b, 101.0, trio.group_id), c: beat(c, 101.0)}
    seen = plan_round(
        RUN,
        View(101.0, 3, three, named, offers3(IDS[:3], 101.0), frozenset()),
        first.publish,
        first.round,
        {},
        SETTINGS,
        first.apart,
        first.confirmed,
    )
    assert not seen.dissolved and seen.confirmed == {trio.group_id: frozenset({a, b})}
    claims = {
        a: beat(a, 103.0, trio.group_id),
        b: beat(b, 103.0, left_group=trio.group_id),
        c: beat(c, 103.0, left_group=trio.group_id),
    }
    plan = plan_round(
        RUN,
        View(103.0, 3, three, claims, offers3(IDS[:3], 103.0), frozenset()),
        seen.publish,
        seen.round,
        {},
        SETTINGS,
        seen.apart,
        seen.confirmed,
    )
    assert f"member {b[:16]}… left it" in plan.dissolved[trio.group_id]
    assert plan.cooldown == {c: 403.0}
    assert plan.apart == {node_pair(b, a): 703.0, node_pair(b, c): 703.0}


def offers3(nodes: list[str], now: float) -> dict[str, StageAvailability]:
    return {n: offer(n, now).model_copy(update={"stages": [0, 1, 2]}) for n in nodes}


def test_a_silent_member_is_still_cooled_down_and_a_claim_naming_another_group_changes_nothing() -> None:
    first, group, leader, follower, _ = formed_pair(IDS[:2])
    for left_group in (None, ELSEWHERE):  # silent, or naming a group it was never in (ignored)
        beats = {
            leader: beat(leader, 111.0, group.group_id),
            follower: beat(follower, 111.0, left_group=left_group),
        }
        # Within confirm_within_s the group stands: the follower may not have read it yet.
        early = {n: b.model_copy(update={"sent_at": 105.0}) for n, b in beats.items()}
        kept = plan_round(RUN, view(105.0, early), first.publish, first.round, {}, SETTINGS, first.apart)
        assert not kept.dissolved and kept.apart == {}
        later = plan_round(RUN, view(111.0, beats), first.publish, first.round, {}, SETTINGS, first.apart)
        assert "did not confirm" in later.dissolved[group.group_id]
        assert later.cooldown == {follower: 411.0} and later.apart == {}


def test_a_claim_of_leaving_a_group_still_confirmed_or_by_a_stranger_changes_nothing() -> None:
    """The heartbeat's `group` is the truth: a member cannot both confirm the group and have left it (the record
    is refused on the wire; a body built past the schema is still not taken as leaving). A node outside the group
    naming it changes nothing either."""
    first, group, leader, follower, (stranger,) = formed_pair(IDS[:3])
    with pytest.raises(ValidationError, match="left_group names the group this heartbeat confirms"):
        beat(leader, 102.0, group.group_id, left_group=group.group_id)
    both = beat(leader, 102.0, group.group_id).model_copy(
        update={"left_group": group.group_id}
    )  # unvalidated
    beats = {
        leader: both,
        follower: beat(follower, 102.0, group.group_id),
        stranger: beat(stranger, 102.0, left_group=group.group_id),
    }
    plan = plan_round(RUN, view(102.0, beats), first.publish, first.round, {}, SETTINGS, first.apart)
    assert not plan.dissolved and plan.apart == {} and plan.cooldown == {} and plan.round == first.round


def test_pairs_kept_apart_expire_and_their_number_is_bounded() -> None:
    nodes = IDS[:2]
    beats = {n: beat(n, 100.0) for n in nodes}
    apart = {(f"{k:064x}", f"{k + 1:064x}"): 200.0 + k for k in range(MAX_APART_PAIRS + 5)}
    apart[node_pair(*nodes)] = 99.0  # expired: the two may be grouped
    plan = plan_round(RUN, view(100.0, beats), [], 0, {}, SETTINGS, apart)
    assert len(plan.apart) == MAX_APART_PAIRS and node_pair(*nodes) not in plan.apart
    assert min(plan.apart.values()) == 205.0  # the pairs nearest their end went first
    assert together(plan, *nodes)
    no_pairs = PlanSettings(stale_after_s=5.0, confirm_within_s=10.0, keep_apart_s=0.0)
    formed, group, leader, follower, _ = formed_pair(nodes)
    first = confirmed_round(formed, group, [], 101.0)
    beats = {
        leader: beat(leader, 102.0, group.group_id),
        follower: beat(follower, 102.0, left_group=group.group_id),
    }
    plan = plan_round(
        RUN, view(102.0, beats), first.publish, first.round, {}, no_pairs, first.apart, first.confirmed
    )
    assert group.group_id in plan.dissolved and plan.apart == {} and plan.cooldown == {}


@pytest.mark.parametrize("exact_limit", [20_000, 0])  # exhaustive search, and the beam search beyond it
def test_formation_never_puts_a_pair_kept_apart_in_one_group(exact_limit: int) -> None:
    settings = FormationSettings(exact_limit=exact_limit)
    offers = {n: offer(n, 100.0) for n in IDS[:4]}
    free = form_groups(LAYOUT, offers, settings)
    assert [g.members for g in free] == [(IDS[0], IDS[1]), (IDS[2], IDS[3])]  # ties go to the smaller ids
    apart = frozenset({node_pair(IDS[0], IDS[1]), node_pair(IDS[0], IDS[2])})
    formed = form_groups(LAYOUT, offers, settings, apart)
    assert [g.members for g in formed] == [(IDS[0], IDS[3]), (IDS[1], IDS[2])]
    three = LAYOUT.model_copy(update={"boundaries": [0, 1, 2, 4]})
    offers3 = {n: offer(n, 100.0).model_copy(update={"stages": [0, 1, 2]}) for n in IDS[:3]}
    assert form_groups(three, offers3, settings, frozenset({node_pair(IDS[0], IDS[2])})) == []


def _sealed(body: Heartbeat) -> bytes:
    return seal(IDENTITY, RUN, RecordKind.HEARTBEAT, IDENTITY.node_id, body, 1e9)


def _open(value: bytes) -> Heartbeat:
    body = reopen_record(RUN, RecordKind.HEARTBEAT, IDENTITY.node_id, value, 1e9, frozenset(), 1e9 - 30)
    assert isinstance(body, Heartbeat)
    return body


IDENTITY = Identity.from_seed(bytes([77]) * 32)


def test_left_group_round_trips_and_is_parsed_strictly() -> None:
    sent = beat(IDENTITY.node_id, 100.0, left_group=ELSEWHERE)
    assert _open(_sealed(sent)) == sent
    # An older node's heartbeat has no such key: it still parses, as leaving nothing.
    old = json.loads(payload_of(RecordKind.HEARTBEAT, beat(IDENTITY.node_id, 100.0)))
    del old["left_group"]
    value = seal_payload(IDENTITY, RUN, RecordKind.HEARTBEAT, IDENTITY.node_id, canonical_json(old), 1e9)
    assert _open(value).left_group is None
    for bad, reason in [
        ("AB" * 32, "left_group"),  # upper case
        ("ab" * 31, "left_group"),  # short
        ("ab" * 32 + "a", "left_group"),  # long
        (7, "left_group"),  # not a string
        ("cd" * 32, "left_group names the group this heartbeat confirms"),  # the group it confirms
    ]:
        payload = json.loads(payload_of(RecordKind.HEARTBEAT, beat(IDENTITY.node_id, 100.0, group="cd" * 32)))
        payload["left_group"] = bad
        value = seal_payload(
            IDENTITY, RUN, RecordKind.HEARTBEAT, IDENTITY.node_id, canonical_json(payload), 1e9
        )
        with pytest.raises(RecordError, match=reason):
            _open(value)
    # The largest heartbeat the schema allows, with both group fields, still fits the kind's payload limit.
    largest = beat(IDENTITY.node_id, 100.0, group="cd" * 32, left_group=ELSEWHERE).model_copy(
        update={
            "version": "v" * 64,
            "roles": ["contributor", "trainer", "validator", "relay"],
            "hardware": Hardware(gpu_model="g" * 64, gpu_memory_mb=1 << 24, cpu="c" * 64, cpu_cores=1 << 16),
            "addresses": ["/" + "a" * 255] * 8,
            "serves_steps": [1 << 40] * 16,
            "weights_url": "http://" + "w" * 249,
            "policy_step": 1 << 40,
        }
    )
    assert len(payload_of(RecordKind.HEARTBEAT, largest)) <= MAX_PAYLOAD_BYTES[RecordKind.HEARTBEAT]


def test_a_group_given_up_for_failed_batches_is_named_while_avoided() -> None:
    clock = [0.0]
    avoided = AvoidedGroups(600.0, clock=lambda: clock[0])
    avoided.add("aa" * 32, "its batch numbers cannot be kept")  # this node's own trouble: not named
    assert avoided.declared() is None
    avoided.add("bb" * 32, "8 batches in a row broke", declare=True)
    assert avoided.declared() == "bb" * 32
    clock[0] = 100.0
    avoided.add("cc" * 32, "no batch finished in 900 s", declare=True)  # the newest one is named
    assert avoided.declared() == "cc" * 32
    clock[0] = 699.0
    assert avoided.declared() == "cc" * 32
    clock[0] = 700.0  # avoided no more: named no more
    assert avoided.declared() is None and avoided.now() == {}
    avoided.add("dd" * 32, "8 batches in a row broke", declare=True)
    for k in range(MAX_AVOIDED):  # pushed out of the bounded set: no longer avoided, so no longer named
        avoided.add(f"{k:064x}", "broke")
    assert avoided.declared() is None


def test_keep_apart_is_a_bounded_setting_passed_to_the_plan() -> None:
    assert GroupsSection().plan_settings().keep_apart_s == 600.0 >= GroupsSection().cooldown_s
    assert GroupsSection(keep_apart_s=0).plan_settings().keep_apart_s == 0.0
    for bad in (-1.0, float("nan"), 86_401.0):
        with pytest.raises(ValidationError, match="keep_apart_s"):
            GroupsSection(keep_apart_s=bad)


def test_a_node_that_keeps_leaving_groups_is_cooled_down_past_its_free_leaves() -> None:
    """Confirming costs one heartbeat, so a node could confirm a group and claim to have left it in the next
    heartbeat, dissolving a group every two polls. Its first `free_leaves` (2) honoured leaves within
    keep_apart_s cost no cooldown; the next one does (it is still kept apart); once keep_apart_s has passed
    since them, a leave is free again."""
    leaver, partners = IDS[0], IDS[1:5]
    plan = Plan(0, [], {}, {})

    def leave_with(partner: str, now: float) -> Plan:
        nonlocal plan
        for step, (lbeat, pbeat) in enumerate(
            (
                (lambda g: beat(leaver, now), lambda g: beat(partner, now)),  # formed
                (lambda g: beat(leaver, now + 1, g), lambda g: beat(partner, now + 1, g)),  # both confirm
                (
                    lambda g: beat(leaver, now + 2, left_group=g),
                    lambda g: beat(partner, now + 2, g),
                ),  # it leaves
            )
        ):
            gid = plan.publish[0].group_id if plan.publish else None
            beats = {leaver: lbeat(gid), partner: pbeat(gid)}
            args = (
                plan.publish,
                plan.round,
                plan.cooldown,
                SETTINGS,
                plan.apart,
                plan.confirmed,
                plan.leaves,
            )
            plan = plan_round(RUN, view(now + step, beats), *args)
        assert (
            not plan.publish and len(plan.dissolved) >= 1
        )  # dissolved; the pair is kept apart, nobody regrouped
        return plan

    assert leaver not in leave_with(partners[0], 100.0).cooldown
    assert leaver not in leave_with(partners[1], 110.0).cooldown
    third = leave_with(partners[2], 120.0)
    assert third.cooldown[leaver] == 122.0 + SETTINGS.cooldown_s and partners[2] not in third.cooldown
    assert node_pair(leaver, partners[2]) in third.apart
    plan = Plan(third.round, [], {}, {}, {}, {}, third.leaves)  # cooldowns and pairs over; the count kept
    assert leaver not in leave_with(partners[3], 120.0 + SETTINGS.keep_apart_s).cooldown
    assert len(plan.leaves[leaver]) == 1  # the older leaves fell out of the window
