"""What every role's Prometheus registry holds besides its own metrics, and the fixed default ports.

Each role keeps its metrics on a registry of its own (several roles or nodes may live in one test process,
and prometheus-client's global registry would mix them). `role_registry` gives that registry the parts
every role exposes alike: `prime_node_build_info{role, version}` (always 1: a version label to join on),
prometheus-client's process collector (`process_cpu_seconds_total`, `process_resident_memory_bytes`, open
file descriptors, start time) and its platform collector (`python_info`). Names follow Prometheus's
conventions: `prime_node_<role>_<what>_<unit>`, base units (seconds, bytes), `_total` on counters;
docs/metrics.md lists every metric.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .. import __version__
from .ports import Listener, port_in_use

# No `<counter>_created` series beside every counter and histogram: Prometheus's own text format ignores
# them, and they would double what an operator reads on /metrics.
disable_created_metrics()

__all__ = [
    "CONTENT_TYPE_LATEST",
    "DURATION_BUCKETS",
    "PORTS",
    "render",
    "role_registry",
    "serve_metrics",
]

# Fixed default ports of each role's HTTP endpoints (docs/metrics.md): a scrape config written once keeps
# working after a restart. 0 picks a free port (tests, several nodes on one host).
PORTS = {
    "weights": 8470,  # the trainer's weights server (public: contributors fetch checkpoints from it)
    "validator": 8471,  # the validator's API, dashboard and /metrics
    "trainer": 8473,  # the trainer's /metrics (loopback by default; its weights server is another port)
    "contributor": 8472,  # a contributor's status API and /metrics
    "relay": 8474,  # a standalone weights server's /metrics (`weights serve --metrics-port`; off by default)
}

# Seconds, from a fast HTTP answer to a long training step or a verdict that waited for its checkpoint.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def role_registry(role: str) -> CollectorRegistry:
    """A new registry with the build-info gauge and the process and platform collectors."""
    registry = CollectorRegistry(auto_describe=True)
    Gauge(
        "prime_node_build_info",
        "Always 1; labels name the role and the prime-node version",
        ["role", "version"],
        registry=registry,
    ).labels(role=role, version=__version__).set(1)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus's text format (served with CONTENT_TYPE_LATEST)."""
    return generate_latest(registry)


async def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, flag: str = "--metrics-port"
) -> tuple[web.AppRunner, str]:
    """GET /metrics on host:port (0 picks a free port) for a role without an HTTP API of its own to put it
    beside; returns the runner (to clean up) and the URL. A port taken since the command's probe is reported
    as the probe reports it (node/runtime/ports.py)."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=render(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise port_in_use(Listener(host, port, flag, "/metrics"), exc) from None
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, f"http://{host}:{bound}/metrics"
