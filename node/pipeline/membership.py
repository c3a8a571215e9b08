"""Which signed group a pipeline node acts on: a pure decision over what it read from the DHT.

Every group record it is given has passed the swarm's checks (a pinned operator key signed it, its payload is
strict and bounded: p2p/swarm/records.py); a record failing those never reaches here. What remains is whether
*this* node should run a stage of it. A group is usable when it names this node, its id is the digest of its
run, step, members, layout and formation nonce (the id every stream of the group opens with), its layout is
the run's (boundaries, activation dtype and the batch's prompts and micro-batch size: run.pipeline, which the
node pinned against the operator's announcement), it is for the checkpoint this node holds, its stage for this
node is one the node offered, and every member's heartbeat is fresh: a group naming a node the node cannot see
(unknown, departed) is not run.

A node joins only a group of the newest round it has seen (the coordinator re-signs every standing group
under each new round, so an older record is one it dissolved), and stays in its group while the group is
usable, no newer round places the node elsewhere, and its record is of the newest round (or that round is
younger than `round_grace_s`). A group the node gave up (`avoided`: its batches kept breaking, host.py) is
unusable to it while it avoids it, so it leaves it and does not rejoin it. While it avoids a group it gave up
for its failed batches, its heartbeat names that group (`left_group`, `AvoidedGroups.declared`): the coordinator
then does not cool it down as a member that never confirmed, and keeps it apart from that group's members.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ...p2p.pipeline.layout import StageLayout, layout_differences
from ...p2p.swarm.group_records import GroupRecord, group_id
from ...p2p.swarm.records import Heartbeat


@dataclass(frozen=True)
class NodeView:
    node_id: str
    run_id: str
    now: float
    policy_step: int | None  # the checkpoint this node holds
    layout: StageLayout  # the run's announced layout
    offered: frozenset[int]  # the stages this node offered
    heartbeats: Mapping[str, Heartbeat]
    stale_after_s: float
    # How long a group of an older round is still run after a newer round appeared: the coordinator signs a
    # round's records one by one, so a reader may see a new group before its own group's re-signed record.
    round_grace_s: float = 10.0
    avoided: Mapping[str, str] = field(default_factory=dict)  # group id -> why this node will not run it now


# At most this many groups avoided at once: a node is in one group at a time and gives one up only after several
# broken batches, so a handful at once is all it ever needs; the oldest goes first.
MAX_AVOIDED = 64


class AvoidedGroups:
    """The groups this node gave up, each avoided for `avoid_s` (then it may run it again: a group broken by
    a neighbour's outage should not be lost for the whole step)."""

    def __init__(self, avoid_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.avoid_s, self.clock = avoid_s, clock
        self._until: dict[str, tuple[float, str]] = {}  # group id -> (until, on `clock`; why)
        self._declared: str | None = None  # the newest group given up for its failed batches

    def add(self, group_id: str, why: str, *, declare: bool = False) -> None:
        """Avoid `group_id` for `avoid_s`; with `declare` (its batches broke or none finished, not this node's
        own trouble) it is the group the heartbeat says this node left, replacing any named before."""
        self._until.pop(group_id, None)  # re-inserted last: the oldest is dropped first
        self._until[group_id] = (self.clock() + self.avoid_s, why)
        while len(self._until) > MAX_AVOIDED:
            del self._until[next(iter(self._until))]
        if declare:
            self._declared = group_id

    def declared(self) -> str | None:
        """The group the heartbeat names as left (`Heartbeat.left_group`): the newest one given up for its failed
        batches, for as long as it is avoided (the coordinator reads it within a few polls; naming it longer
        costs nothing), else None."""
        if self._declared is not None and self._declared not in self.now():
            self._declared = None
        return self._declared

    def now(self) -> dict[str, str]:
        """The groups avoided now (group id -> why), forgetting those whose time is up."""
        now = self.clock()
        self._until = {g: (until, why) for g, (until, why) in self._until.items() if until > now}
        return {g: why for g, (_, why) in self._until.items()}


def why_unusable(group: GroupRecord, view: NodeView) -> str | None:
    """None when this node may run its stage of `group`, else a one-line reason."""
    stage = group.stage_of(view.node_id)
    if stage is None:
        return "does not name this node"
    if group.group_id in view.avoided:
        return f"this node gave it up: {view.avoided[group.group_id]}"
    if group.group_id != group_id(view.run_id, group.policy_step, group.members, group.layout, group.nonce):
        return "its id is not the digest of its run, step, members, layout and formation nonce"
    if group.layout != view.layout:  # the batch's shape too: members cutting it otherwise break every batch
        found = "; ".join(
            f"{name} {theirs!r}, the run's {ours!r}"
            for name, ours, theirs in layout_differences(view.layout, group.layout)
        )
        return f"its layout is not the run's ({found})"
    if group.policy_step != view.policy_step:
        return f"it is for policy step {group.policy_step}; this node holds {view.policy_step}"
    if stage not in view.offered:
        return f"it puts this node at stage {stage}, which it did not offer"
    for member in group.members:
        beat = view.heartbeats.get(member)
        if beat is None:
            return f"member {member[:16]}… has no heartbeat (unknown or departed)"
        if view.now - beat.sent_at > view.stale_after_s:
            return f"member {member[:16]}…'s heartbeat is {view.now - beat.sent_at:.0f} s old"
    return None


def choose_group(
    groups: Mapping[str, GroupRecord], view: NodeView, current: str | None
) -> tuple[GroupRecord | None, str]:
    """The group to run (None: none) and why, given the node's current group id."""
    if not groups:
        return None, "no group records"
    newest = max(g.round for g in groups.values())
    newest_at = max(g.signed_at for g in groups.values() if g.round == newest)
    mine = sorted(
        (g for g in groups.values() if view.node_id in g.members), key=lambda g: (-g.round, g.group_id)
    )
    if current is not None and current in groups:
        group = groups[current]
        elsewhere = [g for g in mine if g.round > group.round and g.group_id != current]
        why = why_unusable(group, view)
        current_round = group.round == newest or view.now - newest_at < view.round_grace_s
        if why is None and not elsewhere and current_round:
            return group, "still standing"
    for group in mine:
        if group.round != newest:
            break
        if why_unusable(group, view) is None:
            return group, f"named at stage {group.stage_of(view.node_id)} in round {group.round}"
    return None, "no usable group of the newest round names this node"
