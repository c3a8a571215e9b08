"""Prometheus metrics of a node, on a registry of its own (so several nodes can live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["NodeMetrics", "CONTENT_TYPE_LATEST"]


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.announced_step = Gauge(
            "prime_node_announced_policy_step", "Newest policy step announced by the operator", registry=r
        )
        self.local_step = Gauge(
            "prime_node_local_policy_step", "Newest verified checkpoint step held locally", registry=r
        )
        self.peers = Gauge("prime_node_peers", "Peers seen in the DHT", registry=r)
        self.tokens = Counter("prime_node_generated_tokens", "Output tokens generated", registry=r)
        self.rollout_files = Counter(
            "prime_node_rollout_files", "Rollout files by outcome", ["outcome"], registry=r
        )  # outcome: generated, handed_off, accepted, rejected
        self.download_bytes = Counter("prime_node_download_bytes", "Checkpoint bytes downloaded", registry=r)
        self.verification_failures = Counter(
            "prime_node_checkpoint_verification_failures",
            "Checkpoints or shards that failed verification",
            registry=r,
        )
        self.verdict_lookup_failures = Counter(
            "prime_node_verdict_lookup_failures",
            "Verdict lookups that failed: validator unreachable, an error answer, or an unusable verdict",
            registry=r,
        )
        self.rank = Gauge(
            "prime_node_leaderboard_rank", "This node's rank on a validator's leaderboard", registry=r
        )
        self.score = Gauge(
            "prime_node_leaderboard_score", "This node's score on a validator's leaderboard", registry=r
        )
        self.tokens_per_second = Gauge(
            "prime_node_tokens_per_second", "Generation throughput of the last batch", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
