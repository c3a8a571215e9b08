"""Prometheus metrics of a contributor node, on a registry of its own (so several nodes can live in one test
process). Pipeline stages (a file generated, handed off) and the validator's verdicts on it are separate
metrics, so that a rate of one is never summed with the other. docs/metrics.md lists them all.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from ...p2p.weights.metrics import WeightsServerMetrics
from ..runtime.metrics import CONTENT_TYPE_LATEST, DURATION_BUCKETS, render, role_registry

__all__ = ["NodeMetrics", "CONTENT_TYPE_LATEST", "STAGES", "VERDICTS"]

STAGES = ("generated", "handed_off")  # label `stage` of prime_node_contributor_rollout_files_total
VERDICTS = ("accepted", "rejected")  # label `verdict` of prime_node_contributor_verdicts_total
STAGE_FILES = ("stage", "fraud", "partial")  # label `kind` of prime_node_contributor_stage_files_total
# label `reason` of prime_node_contributor_stage_files_withheld_total
STAGE_WITHHELD = ("outbox_full", "group_limit", "peer_limit")
P = "prime_node_contributor_"


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = r = role_registry("contributor")
        self.announced_step = Gauge(
            P + "announced_policy_step", "Newest policy step announced by the operator", registry=r
        )
        self.local_step = Gauge(
            P + "local_policy_step", "Newest verified checkpoint step held locally", registry=r
        )
        self.peers = Gauge(P + "peers", "Peers seen in the DHT", registry=r)
        self.tokens = Counter(P + "generated_tokens_total", "Output tokens generated", registry=r)
        self.rollout_files = Counter(
            P + "rollout_files_total", "Rollout files through each pipeline stage", ["stage"], registry=r
        )
        self.verdicts = Counter(
            P + "verdicts_total", "Validators' verdicts on this node's files", ["verdict"], registry=r
        )
        for stage in STAGES:  # present from the start, so rate() sees the first increment
            self.rollout_files.labels(stage=stage)
        for verdict in VERDICTS:
            self.verdicts.labels(verdict=verdict)
        self.batch_seconds = Histogram(
            P + "batch_seconds", "Time to generate one rollout batch", buckets=DURATION_BUCKETS, registry=r
        )
        self.download_bytes = Counter(
            P + "checkpoint_download_bytes_total", "Checkpoint bytes downloaded", registry=r
        )
        self.held_fraction = Gauge(
            P + "checkpoint_held_fraction",
            "Fraction of the last verified checkpoint's bytes held here (under 1 for a pipeline node, which "
            "fetches only its stages' shards)",
            registry=r,
        )
        self.verification_failures = Counter(
            P + "checkpoint_verification_failures_total",
            "Checkpoints or shards that failed verification",
            registry=r,
        )
        self.weights_claims_disproved = Counter(
            P + "weights_claims_disproved_total",
            "Peers whose heartbeat named a weights server that then signed as another peer (a false claim, or "
            "a heartbeat from before an address change)",
            registry=r,
        )
        self.verdict_lookup_failures = Counter(
            P + "verdict_lookup_failures_total",
            "Verdict lookups that failed: validator unreachable, an error answer, or an unusable verdict",
            registry=r,
        )
        self.rank = Gauge(P + "leaderboard_rank", "This node's rank on a validator's leaderboard", registry=r)
        self.score = Gauge(
            P + "leaderboard_score", "This node's score on a validator's leaderboard", registry=r
        )
        self.tokens_per_second = Gauge(
            P + "tokens_per_second", "Generation throughput of the last batch", registry=r
        )
        # A pipeline node's stage (`start --pipeline`): batches its stage finished or abandoned, and what it wrote
        # for its validator (a stage file per finished batch; a fraud report or a partial record per broken one).
        self.stage_batches = Counter(
            P + "stage_batches_total", "Pipelined batches this node's stage finished", registry=r
        )
        self.stage_batches_abandoned = Counter(
            P + "stage_batches_abandoned_total",
            "Pipelined batches this node's stage abandoned (a peer gone or late, a frame refused, the group left)",
            registry=r,
        )
        self.stage_files = Counter(
            P + "stage_files_total",
            "Files this pipeline stage wrote for its validator, by kind",
            ["kind"],
            registry=r,
        )
        for kind in STAGE_FILES:
            self.stage_files.labels(kind=kind)
        self.stage_files_withheld = Counter(
            P + "stage_files_withheld_total",
            "Broken batches this pipeline stage wrote no file about (its outbox full, or the per-group or "
            "per-peer limit reached), by reason",
            ["reason"],
            registry=r,
        )
        for reason in STAGE_WITHHELD:
            self.stage_files_withheld.labels(reason=reason)
        self.weights = WeightsServerMetrics(r)  # filled when the node serves weights (serve_weights)

    def render(self) -> bytes:
        return render(self.registry)
