"""The dashboard's swarm view (GET /api/swarm): who is in the swarm, in which state, doing what, and whether the
trainer is moving, composed from the validator's real state.

Sources: live heartbeats in the DHT (version, hardware, reachability, step), the operator's policy
announcements (the trainer's step and when it last re-announced), the ledger (work per node in the window,
totals, bans and the slash behind each, verdict latency) and the service itself (queue, held files, this
validator's own row).

A key that runs both trainer and validator (the operator's) publishes one heartbeat under one DHT subkey, so
the two overwrite each other there; the view never takes a role from that record alone: this validator's row
is built from its own state, the trainer's from the policy announcements (with the heartbeat's details when
the record in the DHT is the trainer's).

States (`NodeState`): banned (a ban in force) beats stale (unheard for `stale_after_s`), which beats active
(accepted work decided in the window) and idle (live, no accepted work in the window). The trainer is moving
while its newest step is younger than `trainer_stall_s`, stalled after that, and stopped when neither a
re-announcement nor a trainer heartbeat came for `trainer_stopped_s`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...p2p.swarm.hardware import software_version
from ...p2p.swarm.records import Heartbeat, PolicyAnnouncement
from ...p2p.validator_api import (
    MAX_TOP,
    LeaderboardRow,
    NodeBan,
    NodeState,
    QueueState,
    Reachability,
    SwarmNode,
    SwarmTotals,
    SwarmView,
    TrainerStatus,
)
from ..ledger import Ledger
from ..ledger.activity import Activity, ban_causes, recent_activity, totals, verdict_pace
from ..ledger.leaderboard import leaderboard

if TYPE_CHECKING:
    from .dashboard import DashboardSettings
    from .service import ValidatorService

CACHE_S = 2.0  # one build serves every poll within this long: each build reads the DHT twice
ROLE_ORDER = {"trainer": 0, "validator": 1, "contributor": 2, "relay": 3}
STATE_ORDER: dict[NodeState, int] = {"active": 0, "idle": 1, "stale": 2, "banned": 3}


# ----- reachability and the trainer's state: pure functions of what was read ------------------------------


def reachability(hb: Heartbeat | None, *, stale: bool) -> tuple[Reachability, str]:
    """How peers reach a node, from its heartbeat, with a hint for the operator."""
    if hb is None or stale:
        return "unreachable", "no live heartbeat: the node stopped, or cannot reach the swarm's DHT"
    if hb.client_mode:
        return "relayed", (
            "cannot be dialled (NAT or firewall): reached over its own outbound connections and relays; "
            "open its TCP port or set --announce-maddrs for direct connections"
        )
    if not hb.addresses:
        return "unreachable", "announces no address to dial; set --announce-maddrs"
    return "direct", f"accepts incoming connections ({len(hb.addresses)} announced address(es))"


def trainer_status(
    policy: tuple[str, PolicyAnnouncement] | None,
    step_at: float | None,
    heartbeat_at: float | None,
    now: float,
    *,
    stall_after_s: float,
    stopped_after_s: float,
) -> TrainerStatus:
    """moving / stalled / stopped / unknown from the newest policy, when its step was first seen, and the
    trainer's newest heartbeat (None when its key's record in the DHT is not a trainer's)."""
    if policy is None:
        return TrainerStatus(
            state="unknown",
            stall_after_s=stall_after_s,
            hint="no policy announced yet: start the trainer (docs/deploy.md)",
        )
    node_id, announced = policy
    heard = max(announced.published_at, heartbeat_at or 0.0)
    first = step_at if step_at is not None else announced.published_at
    moving = TrainerStatus(
        state="moving",
        node_id=node_id,
        step=announced.step,
        step_at=first,
        announced_at=announced.published_at,
        stall_after_s=stall_after_s,
    )
    if now - heard > stopped_after_s:
        hint = f"nothing heard from the trainer for {_span(now - heard)}: its process stopped or lost the DHT"
        return moving.model_copy(update={"state": "stopped", "hint": hint})
    if now - first > stall_after_s:
        hint = f"alive, but no new policy step for {_span(now - first)}: is it receiving accepted files?"
        return moving.model_copy(update={"state": "stalled", "hint": hint})
    return moving


def _span(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class StepClock:
    """When each newest policy step was first seen (re-announcements refresh `published_at`, not the step)."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._at: float | None = None

    def note(self, policy: PolicyAnnouncement | None) -> float | None:
        if policy is None:
            return self._at
        if self._step is None or policy.step > self._step:
            # The first announcement seen: its own time is the best bound (the validator may start later).
            self._step, self._at = policy.step, policy.published_at
        return self._at


# ----- composing the view --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ledgered:
    """What the ledger says, read in one worker thread."""

    rows: list[LeaderboardRow]
    recent: dict[str, Activity]
    bans: dict[str, NodeBan]
    totals: SwarmTotals
    queue: QueueState


def _read_ledger(ledger: Ledger, now: float, window_s: float) -> _Ledgered:
    since = now - window_s
    pace = verdict_pace(ledger, since)
    t = totals(ledger)
    return _Ledgered(
        rows=leaderboard(ledger, top=MAX_TOP, now=now),
        recent=recent_activity(ledger, since),
        bans=ban_causes(ledger, now),
        totals=SwarmTotals(
            accepted_files=t.accepted_files,
            rejected_files=t.rejected_files,
            accepted_tokens=t.accepted_tokens,
            accepted_samples=t.accepted_samples,
        ),
        queue=QueueState(
            verdict_latency_s=pace.latency_s,
            latency_over=pace.latency_over,
            verdicts_per_min=pace.verdicts * 60.0 / window_s,
        ),
    )


class SwarmViewSource:
    """The `swarm` source of the dashboard (trainer/validator/dashboard.py) over a running validator."""

    def __init__(self, service: ValidatorService, settings: DashboardSettings) -> None:
        self.service = service
        self.window_s = settings.window_s
        self.stale_after_s = settings.stale_after_s or service.settings.swarm.heartbeat_ttl_s
        self.stall_after_s = settings.trainer_stall_s
        self.stopped_after_s = settings.trainer_stopped_s
        self.clock = StepClock()
        self._cached: tuple[float, SwarmView] | None = None
        self._lock = asyncio.Lock()

    async def __call__(self) -> SwarmView:
        async with self._lock:  # concurrent polls share one build
            if self._cached is not None and time.monotonic() - self._cached[0] < CACHE_S:
                return self._cached[1]
            view = await self.build()
            self._cached = (time.monotonic(), view)
            return view

    async def build(self) -> SwarmView:
        swarm, service = self.service.swarm, self.service
        peers = await swarm.list_peers()
        policies = await swarm.list_policies()
        now = time.time()
        ledgered = await asyncio.to_thread(_read_ledger, service.ledger.ledger, now, self.window_s)
        newest = max(policies.items(), key=lambda kv: (kv[1].step, kv[1].published_at), default=None)
        step_at = self.clock.note(newest[1] if newest else None)
        trainer_hb = peers.get(newest[0]) if newest else None
        if trainer_hb is not None and "trainer" not in trainer_hb.roles:
            trainer_hb = None  # the shared key's record is the validator's: no trainer details in it
        trainer = trainer_status(
            newest,
            step_at,
            trainer_hb.sent_at if trainer_hb else None,
            now,
            stall_after_s=self.stall_after_s,
            stopped_after_s=self.stopped_after_s,
        )
        rows = [self._own_row(now)]
        if newest is not None:
            rows.append(self._trainer_row(trainer, trainer_hb))
        rows += self._peer_rows(peers, ledgered, now, skip={swarm.node_id, *(newest[:1] if newest else ())})
        rows.sort(key=lambda r: (ROLE_ORDER.get(r.role, 9), STATE_ORDER[r.state], -r.tokens_per_s, r.node_id))
        counts: dict[str, int] = {state: sum(r.state == state for r in rows) for state in STATE_ORDER}
        queue = ledgered.queue.model_copy(update={"depth": len(service.queue), "held": len(service.held)})
        return SwarmView(
            available=True,
            policy_step=service.keeper.latest_policy,
            nodes=rows[: MAX_TOP + 8],
            generated_at=now,
            window_s=self.window_s,
            stale_after_s=self.stale_after_s,
            totals=ledgered.totals.model_copy(update={"nodes": len(rows), **counts}),
            queue=queue,
            trainer=trainer,
        )

    def _own_row(self, now: float) -> SwarmNode:
        swarm = self.service.swarm
        reach, hint = (
            ("relayed", "this validator cannot be dialled: contributors reach it through relays")
            if swarm.client_mode
            else ("direct", "this validator accepts incoming connections")
        )
        return SwarmNode.outgoing(
            node_id=swarm.node_id,
            role="validator",
            roles=["validator"],
            state="active",
            version=software_version(),
            reachability=reach,
            reachability_hint=hint,
            hardware=swarm.hardware.model_dump(),
            step=self.service.keeper.latest_policy,
            last_seen=now,
        )

    def _trainer_row(self, trainer: TrainerStatus, hb: Heartbeat | None) -> SwarmNode:
        states: dict[str, NodeState] = {"moving": "active", "stalled": "idle"}
        state = states.get(trainer.state, "stale")  # stopped (or unknown): no live trainer
        reach, hint = reachability(hb, stale=state == "stale")
        if hb is None and state != "stale":
            shared = trainer.node_id == self.service.swarm.node_id
            reach, hint = (
                "unknown",
                "no trainer heartbeat in the DHT: the trainer shares this validator's key, and the DHT keeps one "
                "heartbeat per key"
                if shared
                else "no trainer heartbeat in the DHT",
            )
        seen = max(trainer.announced_at or 0.0, hb.sent_at if hb else 0.0)
        return SwarmNode.outgoing(
            node_id=trainer.node_id,
            role="trainer",
            roles=list(hb.roles) if hb else ["trainer"],
            state=state,
            version=hb.version if hb else None,
            reachability=reach,
            reachability_hint=hint,
            hardware=hb.hardware.model_dump() if hb else {},
            step=trainer.step,
            last_seen=seen or None,
        )

    def _peer_rows(
        self, peers: dict[str, Heartbeat], ledgered: _Ledgered, now: float, skip: set[str]
    ) -> list[SwarmNode]:
        ranked = {r.node_id: r for r in ledgered.rows}
        rows = []
        for node_id in [*peers, *(n for n in ranked if n not in peers)]:
            if node_id in skip:
                continue
            hb, row = peers.get(node_id), ranked.get(node_id)
            seen = max(hb.sent_at if hb else 0.0, row.last_seen if row else 0.0)
            stale = hb is None or now - seen > self.stale_after_s
            work = ledgered.recent.get(node_id)
            ban = ledgered.bans.get(node_id)
            state: NodeState = (
                "banned"
                if ban
                else "stale"
                if stale
                else "active"
                if work and work.accepted_files
                else "idle"
            )
            reach, hint = reachability(hb, stale=stale)
            roles = list(hb.roles) if hb else ["contributor"]
            rows.append(
                SwarmNode.outgoing(
                    node_id=node_id,
                    role=min(roles, key=lambda r: ROLE_ORDER.get(r, 9)) if roles else "contributor",
                    roles=roles,
                    state=state,
                    version=hb.version if hb else None,
                    reachability=reach,
                    reachability_hint=hint,
                    hardware=hb.hardware.model_dump() if hb else (row.hardware if row else {}),
                    step=hb.policy_step if hb else (row.last_step if row else None),
                    last_seen=seen or None,
                    accepted_files=row.accepted_files if row else 0,
                    rejected_files=row.rejected_files if row else 0,
                    accepted_tokens=row.accepted_tokens if row else 0,
                    tokens_per_s=(work.tokens / self.window_s) if work else 0.0,
                    rollouts_per_min=(work.samples * 60.0 / self.window_s) if work else 0.0,
                    slashes=row.slashes if row else 0,
                    ban=ban,
                )
            )
        return rows
