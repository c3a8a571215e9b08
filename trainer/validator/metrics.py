"""Prometheus metrics of a validator, served at /metrics beside its API and dashboard (docs/metrics.md).

What an operator alerts on: the queue (files waiting, files held for a checkpoint, receive slots in use),
the verdict rate by outcome and failed check, and how long a file waits from its receipt to its verdict.
Gauges of the service's own state are read at scrape time, so they never drift from it.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from ...node.runtime.metrics import CONTENT_TYPE_LATEST, DURATION_BUCKETS, render, role_registry

__all__ = ["CONTENT_TYPE_LATEST", "ValidatorMetrics"]

P = "prime_node_validator_"


class ValidatorMetrics:
    def __init__(self) -> None:
        self.registry = r = role_registry("validator")
        self.queue_depth = Gauge(P + "queue_depth", "Received files waiting for verification", registry=r)
        self.held = Gauge(P + "held_files", "Files waiting for their checkpoint to arrive", registry=r)
        self.slots_in_use = Gauge(P + "receive_slots_in_use", "Hand-off receive slots in use", registry=r)
        self.slots_total = Gauge(P + "receive_slots", "Hand-off receive slots in all", registry=r)
        self.received = Counter(P + "files_received_total", "Files received and spooled", registry=r)
        self.accepted = Counter(P + "files_accepted_total", "Files accepted", registry=r)
        self.rejected = Counter(
            P + "files_rejected_total", "Files rejected, by the check that failed", ["check"], registry=r
        )  # check: a failed_check name of the verdict (docs/validator.md), a bounded set of our own
        self.verdict_latency = Histogram(
            P + "verdict_latency_seconds",
            "Time from a file's receipt to its verdict (queue, holds and verification)",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.verification_seconds = Histogram(
            P + "verification_seconds",
            "Time to verify one file (the checks alone)",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.bans = Counter(P + "bans_total", "Bans imposed by this validator", registry=r)

    def watch(
        self,
        queue: Callable[[], int],
        held: Callable[[], int],
        slots_in_use: Callable[[], int],
        slots: Callable[[], int],
    ) -> None:
        """Read the state gauges from the running service at scrape time."""
        self.queue_depth.set_function(queue)
        self.held.set_function(held)
        self.slots_in_use.set_function(slots_in_use)
        self.slots_total.set_function(slots)

    def verdict(self, accepted: bool, failed_check: str | None, latency_s: float) -> None:
        if accepted:
            self.accepted.inc()
        else:
            self.rejected.labels(check=failed_check or "unknown").inc()
        self.verdict_latency.observe(max(0.0, latency_s))

    def render(self) -> bytes:
        return render(self.registry)
