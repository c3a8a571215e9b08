"""The operator's group coordinator: reads offers, heartbeats and bans, plans a round, signs group records.

It runs inside the trainer (trainer/service/service.py starts it when the run has a pipeline layout), because
the trainer already holds the operator key that group records must be signed with and knows the current
policy step; a separate process would need the key too. The planning itself is plan.py (pure); this module
only does the I/O around it and keeps the state between rounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ...p2p.errors import P2PError
from ...p2p.pipeline.layout import StageLayout
from ...p2p.swarm.directory import SwarmDirectory
from ...p2p.swarm.group_records import GroupRecord
from .formation import NodePair
from .plan import Plan, PlanSettings, View, plan_round

logger = logging.getLogger(__name__)


@dataclass
class CoordinatorState:
    round: int = 0
    current: list[GroupRecord] = field(default_factory=list)
    cooldown: dict[str, float] = field(default_factory=dict)
    # node pair -> until when no group holds both (a member that left a group for its failed batches, beside
    # each of that group's other members: plan.py); lost on a restart, as the cooldown is
    apart: dict[NodePair, float] = field(default_factory=dict)
    # group id -> the members seen confirming it, for each current group: only theirs is a claim to have left it
    # that escapes the cooldown (plan.py). A restart counts every member of an adopted group (`_resume`).
    confirmed: dict[str, frozenset[str]] = field(default_factory=dict)
    # node id -> when its claims to have left a group were honoured, within keep_apart_s (plan.py `free_leaves`)
    leaves: dict[str, tuple[float, ...]] = field(default_factory=dict)
    signed_at: float = 0.0  # when the current round's records were last published
    # (time, group id, why) of every dissolution, and (time, group id) of every formation: what tests and the
    # operator's logs read to see how long a regroup took.
    dissolved: list[tuple[float, str, str]] = field(default_factory=list)
    formed: list[tuple[float, str]] = field(default_factory=list)


def adopt(groups: Iterable[GroupRecord], step: int, layout: StageLayout) -> tuple[int, list[GroupRecord]]:
    """The newest round in the DHT and its groups that fit the current step and layout (kept by plan_round
    while their members stand), sorted by group id."""
    found = list(groups)
    newest = max((g.round for g in found), default=0)
    current = [g for g in found if g.round == newest and g.policy_step == step and g.layout == layout]
    return newest, sorted(current, key=lambda g: g.group_id)


class GroupCoordinator:
    def __init__(
        self,
        directory: SwarmDirectory,
        layout: StageLayout,
        policy_step: Callable[[], int | None],
        settings: PlanSettings | None = None,
        *,
        poll_s: float = 5.0,
    ) -> None:
        self.directory = directory
        self.layout = layout
        self.policy_step = policy_step  # the trainer's current step (None before its first checkpoint)
        self.settings = settings or PlanSettings()
        self.poll_s = poll_s
        self.state = CoordinatorState()
        self._started = False

    async def _resume(self, step: int) -> None:
        # A restarted coordinator continues the round count, so nodes never see rounds go backwards, and adopts
        # the groups of the newest round, so that a trainer restart does not break up groups that stand.
        groups = await self.directory.list_groups()
        self.state.round, self.state.current = adopt(groups.values(), step, self.layout)
        # The confirmations seen before the restart are lost: each member is given the benefit of the doubt, so
        # an honest member leaving after confirming is not cooled down. A member that never confirmed gains one
        # claim without a cooldown per adopted group and restart (the restart forgot the cooldowns too).
        self.state.confirmed = {g.group_id: frozenset(g.members) for g in self.state.current}

    async def tick(self) -> Plan | None:
        """One round: read, plan, publish what changed (and republish before the records expire)."""
        step = self.policy_step()
        if step is None:
            return None
        if not self._started:
            await self._resume(step)
            self._started = True
        heartbeats = await self.directory.list_peers()
        offers = await self.directory.list_stages()
        bans = await self.directory.read_bans()
        now = time.time()
        view = View(now, step, self.layout, heartbeats, offers, frozenset(bans))
        # Off the event loop: forming groups of a few hundred nodes takes seconds of CPU (docs/pipeline.md).
        plan = await asyncio.to_thread(
            plan_round,
            self.directory.config.run_id,
            view,
            self.state.current,
            self.state.round,
            self.state.cooldown,
            self.settings,
            self.state.apart,
            self.state.confirmed,
            self.state.leaves,
        )
        for gid, why in plan.dissolved.items():
            logger.info("group %s… dissolved: %s", gid[:16], why)
            self.state.dissolved.append((now, gid, why))
        known = {g.group_id for g in self.state.current}
        for g in plan.publish:
            if g.group_id not in known:
                logger.info(
                    "group %s… formed in round %d: %s",
                    g.group_id[:16],
                    plan.round,
                    [m[:8] for m in g.members],
                )
                self.state.formed.append((now, g.group_id))
        refresh = now - self.state.signed_at > self.directory.config.record_ttl_s / 2
        if plan.round != self.state.round or refresh:
            for g in plan.publish:
                await self.directory.publish_group(g)
            self.state.signed_at = now
        self.state.round, self.state.current, self.state.cooldown = plan.round, plan.publish, plan.cooldown
        self.state.apart, self.state.confirmed, self.state.leaves = plan.apart, plan.confirmed, plan.leaves
        return plan

    async def run(self) -> None:
        """tick every poll_s; a failed DHT read is logged and the round retried (a supervised task)."""
        while True:
            try:
                await self.tick()
            except (OSError, EOFError, P2PError) as exc:
                logger.warning("group round failed: %s", exc)
            await asyncio.sleep(self.poll_s)
