"""One round of the operator's group bookkeeping, as a pure function of what the DHT shows.

The coordinator (coordinator.py) reads heartbeats, stage offers and bans, calls `plan_round`, and signs what
it returns. A node is *live* when its heartbeat is fresh (`sent_at` within `stale_after_s`: a heartbeat lives
in the DHT much longer than that, so its age, not its presence, is what says a process died), it is not
banned, and it has a fresh stage offer. A group is kept while every member is live and, once
`confirm_within_s` has passed since it was formed, every member's heartbeat names it; otherwise it is
dissolved (its batch in flight is abandoned by its members, node/pipeline/membership.py) and its live members
return to the pool. Members that never confirmed sit out `cooldown_s`: a node that accepts groups and does
not run them would otherwise be drawn again at once. Kept groups are re-signed under the new round, so that
the newest round is the one set of groups every node may join; each keeps its formation nonce, and with it its
id. A newly formed group draws a fresh nonce (p2p/pipeline/group_ids.py), so the same members formed again are
another group with batch numbers of its own. The nonce is random, the one part of a round that is not a pure
function of the view.

A member whose fresh heartbeat says it left the group (`left_group`: it gave the group up because its batches
kept breaking or none finished, node/pipeline/host.py) dissolves it at once and is not cooled down: its
neighbour may have broken the batches while confirming the group, and cooling the honest leaver down while that
neighbour goes free would make each such group cost its honest members `cooldown_s`. Instead, for
`keep_apart_s`, no group puts the leaver beside any of that group's other members again. The claim is the
node's own word, so it buys nothing else, and it is honoured only from a member the coordinator saw confirm the
group (a fresh heartbeat naming it, in some round while the group stood: `Plan.confirmed`). An honest leaver
always confirmed first: it names the group in its heartbeat when it joins (node/pipeline/member.py), before its
stage runs a batch, and it can give the group up only after batches ran or `leave_without_batch_s` passed. A
member naming as left a group it never confirmed is taken as silent: the group dissolves at once (the member said
it will not run it) and the member sits out `cooldown_s`, kept apart from nobody; else a node placed in a new
group every round could dissolve each at once at no cost. Then a node that left escapes the cooldown only, and is
kept away from the members it may have broken. The heartbeat's `group` is the truth (a member still naming the
group has not left it), and a claim naming a group other than the one being judged is ignored.

A confirmation costs one heartbeat, so a node could still name a group in one heartbeat and claim to have left it
in the next, dissolving a group every two polls. So a node's honoured claims are counted: past `free_leaves`
within `keep_apart_s`, a leaver is cooled down as well (still kept apart). An honest node leaves a group only
after batches kept breaking or none finished for `leave_without_batch_s` (900 s by default), so it reaches that
count only beside several members that broke its batches in a row, and then sits out one cooldown.

The confirmations live in the coordinator's memory: a restarted coordinator adopts the standing groups with every
member counted as confirmed (coordinator.py `_resume`), so a restart never cools down a member that confirmed
before it; what that gives away is one claim without a cooldown per adopted group and restart, which the
operator's restarts bound, not a peer (a restart also forgets the cooldowns themselves).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...p2p.pipeline.group_ids import new_nonce
from ...p2p.pipeline.layout import StageLayout
from ...p2p.swarm.group_records import GroupRecord, StageAvailability, group_id
from ...p2p.swarm.records import Heartbeat
from .formation import FormationSettings, NodePair, form_groups, node_pair

# At most this many nodes with honoured leaves counted (`Plan.leaves`); past it the ones whose last leave is
# oldest are forgotten first.
MAX_LEAVERS_KEPT = 16_384
# At most this many pairs kept apart at once (each leaver adds one per other member of its group); past it the
# pairs whose time is nearest its end go first: a pair dropped early may only be grouped again sooner.
MAX_APART_PAIRS = 16_384


@dataclass(frozen=True)
class PlanSettings:
    stale_after_s: float = 45.0  # a heartbeat older than this is a departed node (3 x the default interval)
    confirm_within_s: float = 60.0  # members must name a new group in their heartbeat within this
    cooldown_s: float = 300.0  # how long a member that never confirmed is left out
    formation: FormationSettings = field(default_factory=FormationSettings)
    # How long a member that left a group for its failed batches is not grouped with that group's other members
    # (at least the members' `pipeline.avoid_s`, 600 s, for which the leaver still names the group).
    keep_apart_s: float = 600.0
    # How many honoured claims to have left a group a node makes within keep_apart_s before each further one is
    # cooled down as well (one heartbeat confirming a group, the next leaving it, would otherwise dissolve a
    # group every two polls at no cost).
    free_leaves: int = 2


@dataclass(frozen=True)
class View:
    """What the coordinator read from the DHT in one pass (all records already signature-checked)."""

    now: float
    policy_step: int
    layout: StageLayout
    heartbeats: Mapping[str, Heartbeat]
    offers: Mapping[str, StageAvailability]
    banned: frozenset[str]


@dataclass
class Plan:
    round: int
    publish: list[GroupRecord]  # every current group, kept and new, signed under `round`
    dissolved: dict[str, str]  # group id -> why
    cooldown: dict[str, float]  # node id -> until when it is left out
    apart: dict[NodePair, float] = field(default_factory=dict)  # node pair -> until when no group holds both
    # group id -> the members seen confirming it, for every group in `publish` (a dissolved group's are dropped)
    confirmed: dict[str, frozenset[str]] = field(default_factory=dict)
    # node id -> when its claims to have left a group were honoured, within keep_apart_s (at most free_leaves + 1)
    leaves: dict[str, tuple[float, ...]] = field(default_factory=dict)


def live_nodes(view: View, settings: PlanSettings) -> set[str]:
    live = set()
    for node_id, offer in view.offers.items():
        beat = view.heartbeats.get(node_id)
        if beat is None or node_id in view.banned:
            continue
        fresh = view.now - beat.sent_at <= settings.stale_after_s
        offered = view.now - offer.published_at <= settings.stale_after_s
        if fresh and offered and offer.policy_step == view.policy_step:
            live.add(node_id)
    return live


@dataclass(frozen=True)
class Dissolution:
    why: str
    cool: list[str] = field(default_factory=list)  # members that never confirmed it: left out for cooldown_s
    left: list[str] = field(default_factory=list)  # members that said they left it: kept apart from the rest


def claimants(group: GroupRecord, view: View) -> list[str]:
    """The members whose heartbeat says they gave `group` up for its failed batches (and no longer names it)."""
    return [
        m
        for m in group.members
        if (beat := view.heartbeats.get(m)) is not None
        and beat.group != group.group_id
        and beat.left_group == group.group_id
    ]


def leavers(group: GroupRecord, view: View, confirmed: frozenset[str]) -> list[str]:
    """The claimants whose claim is honoured: those seen confirming `group` before (in `confirmed`)."""
    return [m for m in claimants(group, view) if m in confirmed]


def confirming(group: GroupRecord, view: View, settings: PlanSettings) -> frozenset[str]:
    """The members whose fresh heartbeat names `group` in this view."""
    return frozenset(
        m
        for m in group.members
        if (beat := view.heartbeats.get(m)) is not None
        and view.now - beat.sent_at <= settings.stale_after_s
        and beat.group == group.group_id
    )


def _why_dissolved(
    group: GroupRecord, view: View, live: set[str], settings: PlanSettings, confirmed: frozenset[str]
) -> Dissolution | None:
    """None while `group` stands; else why, the members to cool down (those that never confirmed it, a claim
    to have left it without a confirmation seen before included) and those that left it after confirming it
    (`confirmed`: the members ever seen confirming it, this view's included)."""
    if group.policy_step != view.policy_step:
        return Dissolution(f"policy step {group.policy_step} is not the current {view.policy_step}")
    if group.layout != view.layout:
        return Dissolution("the run's layout changed")
    gone = [m for m in group.members if m not in live]
    if gone:
        return Dissolution(f"member {gone[0][:16]}… is gone (stale heartbeat, banned or no offer)")
    claimed = claimants(group, view)
    left = leavers(group, view, confirmed)
    # Said it will not run a group it never confirmed: silent, at once (the claim buys no cooldown's escape).
    disowned = [m for m in claimed if m not in left]
    silent: list[str] = []
    if view.now - group.formed_at > settings.confirm_within_s:
        silent = [m for m in group.members if view.heartbeats[m].group != group.group_id and m not in claimed]
    if left:  # at once: the group cannot stand without it, and the others need not wait for confirm_within_s
        return Dissolution(
            f"member {left[0][:16]}… left it (its batches broke or none finished)", disowned + silent, left
        )
    if disowned:
        return Dissolution(
            f"member {disowned[0][:16]}… named it as left without ever confirming it", disowned + silent
        )
    if silent:
        return Dissolution(
            f"member {silent[0][:16]}… did not confirm within {settings.confirm_within_s:.0f} s", silent
        )
    return None


def _counted_leaves(
    leaves: Mapping[str, tuple[float, ...]], now: float, settings: PlanSettings
) -> dict[str, tuple[float, ...]]:
    """The honoured leaves still within keep_apart_s, per node; nodes without any dropped."""
    since = now - settings.keep_apart_s
    recent = {n: tuple(t for t in times if t > since) for n, times in leaves.items()}
    return {n: times for n, times in recent.items() if times}


def _bounded_leaves(leaves: dict[str, tuple[float, ...]]) -> dict[str, tuple[float, ...]]:
    if len(leaves) <= MAX_LEAVERS_KEPT:
        return leaves
    latest = sorted(leaves.items(), key=lambda item: (-item[1][-1], item[0]))[:MAX_LEAVERS_KEPT]
    return dict(latest)


def _bounded(apart: dict[NodePair, float]) -> dict[NodePair, float]:
    if len(apart) <= MAX_APART_PAIRS:
        return apart
    latest = sorted(apart.items(), key=lambda item: (-item[1], item[0]))[:MAX_APART_PAIRS]
    return dict(latest)


def plan_round(
    run_id: str,
    view: View,
    current: list[GroupRecord],
    last_round: int,
    cooldown: Mapping[str, float],
    settings: PlanSettings,
    apart: Mapping[NodePair, float] | None = None,
    confirmed: Mapping[str, frozenset[str]] | None = None,
    leaves: Mapping[str, tuple[float, ...]] | None = None,
) -> Plan:
    """Keep the groups that still stand, dissolve the rest, form new groups from the free live nodes, none
    holding a pair kept `apart` (node pair -> until when; the plan returns them with the new ones added).
    `confirmed` is the previous plan's (group id -> the members seen confirming it; none seen where absent), and
    `leaves` its honoured leaves per node."""
    live = live_nodes(view, settings)
    cooling = {n: t for n, t in cooldown.items() if t > view.now}
    kept_apart = {p: t for p, t in (apart or {}).items() if t > view.now}
    counted = _counted_leaves(leaves or {}, view.now, settings)
    kept: list[GroupRecord] = []
    dissolved: dict[str, str] = {}
    seen: dict[str, frozenset[str]] = {}
    for group in current:
        members = frozenset(group.members)  # bounded by the group: a stale entry's other names are dropped
        earlier = (confirmed or {}).get(group.group_id, frozenset()) & members
        seen_now = earlier | confirming(group, view, settings)
        verdict = _why_dissolved(group, view, live, settings, seen_now)
        if verdict is None:
            kept.append(group)
            seen[group.group_id] = seen_now
            continue
        dissolved[group.group_id] = verdict.why
        cooling.update(dict.fromkeys(verdict.cool, view.now + settings.cooldown_s))
        for m in verdict.left:
            times = counted.get(m, ())
            if len(times) >= settings.free_leaves:  # past its free leaves: this one costs the cooldown too
                cooling[m] = view.now + settings.cooldown_s
            counted[m] = (*times, view.now)[-(settings.free_leaves + 1) :]
        if settings.keep_apart_s > 0:
            until = view.now + settings.keep_apart_s
            kept_apart.update(
                {node_pair(m, other): until for m in verdict.left for other in group.members if other != m}
            )
    kept_apart = _bounded(kept_apart)
    counted = _bounded_leaves(counted)
    busy = {m for g in kept for m in g.members}
    free = {n: view.offers[n] for n in sorted(live - busy) if n not in cooling}
    formed = form_groups(view.layout, free, settings.formation, frozenset(kept_apart))
    changed = bool(dissolved or formed)
    new_round = last_round + 1 if changed else last_round
    publish = [g.model_copy(update={"round": new_round, "signed_at": view.now}) for g in kept]
    for candidate in formed:
        # A new formation draws a new nonce, so its id is new even for members that formed a group before; a
        # kept group (above) keeps its own, so its id does not change while it stands.
        nonce = new_nonce(view.now)
        record = GroupRecord(
            group_id=group_id(run_id, view.policy_step, candidate.members, view.layout, nonce),
            round=new_round,
            policy_step=view.policy_step,
            layout=view.layout,
            members=list(candidate.members),
            formed_at=view.now,
            signed_at=view.now,
            nonce=nonce,
        )
        publish.append(record)
        seen[record.group_id] = frozenset()  # its id is new: nobody can have named it yet
    return Plan(new_round, publish, dissolved, cooling, kept_apart, seen, counted)
