"""What a running contributor knows about itself: the one object its tasks update and the status API reads.

Every task runs on the one event loop, so plain attributes need no lock; the Prometheus metrics are
updated beside the fields so that /status and /metrics never disagree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .. import __version__
from .metrics import VERDICTS, NodeMetrics
from .status import LeaderboardEntry, NodeStatus, PipelineStatus, RolloutCounts

logger = logging.getLogger(__name__)


@dataclass
class NodeState:
    node_id: str
    operator_key: str | None
    metrics: NodeMetrics = field(default_factory=NodeMetrics)
    started: float = field(default_factory=time.monotonic)
    state: str = "starting"  # a few words for `prime-node status`
    peers_seen: int = 0
    announced_step: int | None = None
    local_step: int | None = None  # newest checkpoint held locally and verified
    working_step: int | None = None  # the checkpoint the rollout loop generates with
    rollouts: RolloutCounts = field(default_factory=RolloutCounts)
    tokens_per_second: float | None = None
    last_error: str | None = None
    leaderboard: LeaderboardEntry | None = None
    leaderboard_status: str = "not asked yet"
    awaiting_verdicts: int = 0
    serving_weights: str | None = None
    pipeline: PipelineStatus | None = None  # set on a --pipeline node

    def set_announced(self, step: int) -> None:
        self.announced_step = step
        self.metrics.announced_step.set(step)

    def set_local(self, step: int | None) -> None:
        self.local_step = step
        if step is not None:
            self.metrics.local_step.set(step)

    def set_peers(self, count: int) -> None:
        self.peers_seen = count
        self.metrics.peers.set(count)

    def count_rollout(self, outcome: str) -> None:
        """outcome: generated, handed_off, accepted or rejected (the RolloutCounts fields); the first two are
        pipeline stages, the last two verdicts, each its own metric."""
        setattr(self.rollouts, outcome, getattr(self.rollouts, outcome) + 1)
        if outcome in VERDICTS:
            self.metrics.verdicts.labels(verdict=outcome).inc()
        else:
            self.metrics.rollout_files.labels(stage=outcome).inc()

    def restore_verdicts(self, accepted: int, rejected: int) -> None:
        """Counts learned by earlier runs (from the outbox), so a restart keeps them, metrics included."""
        for outcome, count in (("accepted", accepted), ("rejected", rejected)):
            setattr(self.rollouts, outcome, getattr(self.rollouts, outcome) + count)
            self.metrics.verdicts.labels(verdict=outcome).inc(count)

    def set_leaderboard(self, entry: LeaderboardEntry | None, status: str) -> None:
        self.leaderboard_status = status[:500]
        self.leaderboard = entry  # shown only while a validator answers: a stale rank would mislead
        if entry is not None:
            self.metrics.rank.set(entry.rank)
            self.metrics.score.set(entry.score)

    def record_batch(self, tokens: int, seconds: float) -> None:
        self.metrics.tokens.inc(tokens)
        self.metrics.batch_seconds.observe(seconds)
        if seconds > 0:
            self.tokens_per_second = tokens / seconds
            self.metrics.tokens_per_second.set(self.tokens_per_second)

    def count_stage_batch(self) -> None:
        """A pipelined batch this node's stage finished."""
        assert self.pipeline is not None
        self.pipeline.batches += 1
        self.metrics.stage_batches.inc()

    def count_stage_abandoned(self, count: int) -> None:
        """`count` more pipelined batches this node's stage abandoned."""
        assert self.pipeline is not None
        self.pipeline.abandoned += count
        self.metrics.stage_batches_abandoned.inc(count)

    def count_stage_file(self, kind: str) -> None:
        """kind: stage, fraud or partial (a file written for the validator and put in the outbox)."""
        assert self.pipeline is not None
        field_name = {"stage": "stage_files", "fraud": "fraud_reports", "partial": "partial_records"}[kind]
        setattr(self.pipeline, field_name, getattr(self.pipeline, field_name) + 1)
        self.metrics.stage_files.labels(kind=kind).inc()

    def count_stage_withheld(self, reason: str) -> None:
        """A broken batch no file was written about; reason: outbox_full, group_limit or peer_limit."""
        assert self.pipeline is not None
        self.pipeline.withheld += 1
        self.metrics.stage_files_withheld.labels(reason=reason).inc()

    def error(self, message: str) -> None:
        """Remember the last problem for `prime-node status` (the caller logs it)."""
        self.last_error = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {message}"[:500]

    def to_status(self) -> NodeStatus:
        return NodeStatus(
            node_id=self.node_id,
            version=__version__,
            uptime_s=round(time.monotonic() - self.started, 1),
            state=self.state,
            peers_seen=self.peers_seen,
            operator_key=self.operator_key,
            announced_step=self.announced_step,
            local_step=self.local_step,
            local_verified=self.local_step is not None,  # only fully verified versions are ever held
            rollouts=self.rollouts.model_copy(),
            tokens_per_second=None if self.tokens_per_second is None else round(self.tokens_per_second, 2),
            last_error=self.last_error,
            leaderboard=self.leaderboard,
            leaderboard_status=self.leaderboard_status,
            awaiting_verdicts=self.awaiting_verdicts,
            serving_weights=self.serving_weights,
            pipeline=None if self.pipeline is None else self.pipeline.model_copy(),
        )
