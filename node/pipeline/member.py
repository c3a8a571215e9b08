"""A pipeline node's side of the groups: offer stages, follow the signed group records, confirm, run.

Every `poll_s` the member republishes its stage offer when a heartbeat interval has passed (both say it is
alive), re-measures round trips every `rtt_interval_s`, reads the group records and heartbeats, and asks
membership.choose_group which group, if any, it runs. When the answer changes it names the new group in its
heartbeat at once (the confirmation the coordinator waits for) and tells its owner through `on_change`: the
owner abandons the batch in flight of a group it left (its stage task is cancelled: no partial record is ever
produced) and starts its stage in the new one.

A group its owner gave up (`avoid`: its batches kept breaking) is left at the next poll and not rejoined for
`avoid_s`: the coordinator, seeing this node no longer confirm it, dissolves it and the members regroup. When
the batches were at fault (`declare`), the heartbeat that withdraws the confirmation names the group as left
(`left_group`, for as long as it is avoided), so the coordinator does not cool this node down for leaving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ...p2p.errors import P2PError
from ...p2p.pipeline.layout import StageLayout
from ...p2p.swarm.directory import SwarmDirectory
from ...p2p.swarm.group_records import GroupRecord, PeerRtt, StageAvailability
from .membership import AvoidedGroups, NodeView, choose_group
from .offer import measure_rtts

logger = logging.getLogger(__name__)

# Called with (the group now run or None, why); awaited before the next poll.
OnChange = Callable[[GroupRecord | None, str], Awaitable[None]]


@dataclass(frozen=True)
class MemberSettings:
    stages: frozenset[int]  # the stages of the run's layout this node offers
    layer_tokens_per_s: float  # measured (offer.measure_layer_throughput)
    poll_s: float = 5.0
    stale_after_s: float = 45.0  # as the coordinator's PlanSettings.stale_after_s
    round_grace_s: float = 10.0
    measure_rtts: bool = True
    rtt_interval_s: float = 60.0  # round trips change slowly; measuring them costs 3 handshakes per peer
    avoid_s: float = 600.0  # how long a group this node gave up is not rejoined


class PipelineMember:
    def __init__(
        self,
        directory: SwarmDirectory,
        layout: StageLayout,
        settings: MemberSettings,
        on_change: OnChange | None = None,
    ) -> None:
        self.directory, self.layout, self.settings, self.on_change = directory, layout, settings, on_change
        self.group: GroupRecord | None = None
        self.rtts: list[PeerRtt] = []
        self.events: list[tuple[float, str | None, str]] = []  # (time, group id or None, why) per change
        self._measured_at = float("-inf")
        self._offered_at = float("-inf")
        self.avoided = AvoidedGroups(settings.avoid_s)

    def avoid(self, group: GroupRecord, why: str, *, declare: bool = False) -> None:
        """Leave `group` at the next poll and do not rejoin it for `avoid_s`; with `declare` (its batches broke
        or none finished) the heartbeat names it as left meanwhile."""
        self.avoided.add(group.group_id, why, declare=declare)

    def offer(self) -> StageAvailability:
        return StageAvailability(
            node_id=self.directory.node_id,
            stages=sorted(self.settings.stages),
            layer_tokens_per_s=self.settings.layer_tokens_per_s,
            rtts=self.rtts,
            reachable=not self.directory.client_mode,
            policy_step=self.directory.policy_step,
            published_at=time.time(),
        )

    async def tick(self) -> GroupRecord | None:
        heartbeats = await self.directory.list_peers()
        now = time.monotonic()
        if self.settings.measure_rtts and now - self._measured_at >= self.settings.rtt_interval_s:
            self.rtts = await measure_rtts(self.directory.node_id, heartbeats)
            self._measured_at = now
        # As often as the heartbeat: the coordinator judges both by age (plan.py live_nodes).
        if now - self._offered_at >= self.directory.config.heartbeat_interval_s:
            await self.directory.publish_stages(self.offer())
            self._offered_at = now
        groups = await self.directory.list_groups()
        view = NodeView(
            node_id=self.directory.node_id,
            run_id=self.directory.config.run_id,
            now=time.time(),
            policy_step=self.directory.policy_step,
            layout=self.layout,
            offered=self.settings.stages,
            heartbeats=heartbeats,
            stale_after_s=self.settings.stale_after_s,
            round_grace_s=self.settings.round_grace_s,
            avoided=self.avoided.now(),
        )
        current = self.group.group_id if self.group is not None else None
        chosen, why = choose_group(groups, view, current)
        # Set with the switch below (no await between): the heartbeat that stops naming a group given up for its
        # failed batches is the one that names it as left, so the coordinator never sees the one without the other.
        self.directory.left_group = self.avoided.declared()
        if (chosen.group_id if chosen else None) != current:
            await self._switch(chosen, why)
        return chosen

    async def _switch(self, group: GroupRecord | None, why: str) -> None:
        left = self.group
        self.group = group
        self.directory.group_id = group.group_id if group is not None else None
        self.events.append((time.time(), self.directory.group_id, why))
        if left is not None:
            logger.info("left group %s…: %s", left.group_id[:16], why)
        if group is not None:
            logger.info(
                "joined group %s… at stage %s: %s",
                group.group_id[:16],
                group.stage_of(self.directory.node_id),
                why,
            )
        await self.directory.publish_heartbeat()  # confirm (or withdraw) at once, not at the next beat
        if self.on_change is not None:
            await self.on_change(group, why)

    async def run(self) -> None:
        """tick every poll_s; a failed DHT round is logged and retried (a supervised task)."""
        while True:
            try:
                await self.tick()
            except (OSError, EOFError, P2PError) as exc:
                logger.warning("pipeline membership round failed: %s", exc)
            await asyncio.sleep(self.settings.poll_s)
