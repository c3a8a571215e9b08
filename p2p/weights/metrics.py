"""Prometheus metrics of a weights server, registered on the registry of the process that runs it.

The weights server has no /metrics route: its port is the one contributors reach (often public), and
what it serves is the operator's business. The trainer's /metrics and a serving contributor's /metrics
carry these, and a standalone `prime-node weights serve --metrics-port` serves them on a port of its own
(docs/metrics.md).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds of one request: a listing answers in milliseconds, a large shard to a slow peer takes minutes.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class WeightsServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "prime_node_weights_requests_total",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "prime_node_weights_request_seconds",
            "Time from a request's arrival to its last byte sent, by route",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.sent_bytes = Counter(
            "prime_node_weights_sent_bytes_total", "Shard bytes sent to clients", registry=r
        )
        self.active_connections = Gauge(
            "prime_node_weights_active_connections", "Open client connections", registry=r
        )
        self.versions = Gauge(
            "prime_node_weights_served_versions",
            "Checkpoint versions served (complete or arriving)",
            registry=r,
        )

    def watch(self, connections: Callable[[], int], versions: Callable[[], int]) -> None:
        """Read the gauges at scrape time from the running server."""
        self.active_connections.set_function(connections)
        self.versions.set_function(versions)
