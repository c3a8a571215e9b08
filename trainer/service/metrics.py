"""The trainer's per-step metrics: Prometheus gauges, an append-only JSONL log, and a one-line progress display.

One rollout step produces one `StepRecord`: the loss metrics of `RolloutStepReport.summary()` (policy loss,
clip fractions, KL, entropy, gradient norm, lr, tokens/s) plus the batch's rewards (`Batch.reward_metrics()`:
task reward, length penalty, policy lag). The JSONL log is flushed and fsynced per line, so after a crash it
holds every step whose checkpoint may have been published.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Reported as gauges (last step's value) and written to the log; names as in docs/trainer.md.
GAUGES = (
    "rollout_reward",
    "task_reward",
    "length_penalty",
    "policy_lag",
    "policy_loss",
    "ratio",
    "clip_fraction",
    "clip_low",
    "clip_high",
    "clip_delta",
    "kl",
    "entropy",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "samples",
    "groups",
)


@dataclass(frozen=True)
class StepRecord:
    step: int  # the policy step produced by this rollout step (weights step - 1 -> step)
    values: dict[str, float]
    wall_s: float  # whole rollout step: training, checkpoint, publication
    groups_used: tuple[str, ...] = ()  # "<file sha256>:<prompt key>" of every group trained on (audit trail)

    def as_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "time": round(time.time(), 3),
            "wall_s": round(self.wall_s, 3),
            **self.values,
            "groups_used": list(self.groups_used),
        }


class TrainerMetrics:
    """Gauges on a registry of their own (several trainers may live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step = Gauge("prime_trainer_policy_step", "Newest policy step published", registry=r)
        self.gauges = {
            name: Gauge(f"prime_trainer_{name}", f"Last rollout step's {name.replace('_', ' ')}", registry=r)
            for name in GAUGES
        }
        self.files = Counter(
            "prime_trainer_rollout_files", "Accepted rollout files read, by outcome", ["outcome"], registry=r
        )  # outcome: used, unreadable, deferred
        self.buffered = Gauge("prime_trainer_buffered_samples", "Samples waiting for a batch", registry=r)

    def observe(self, record: StepRecord) -> None:
        self.step.set(record.step)
        for name, gauge in self.gauges.items():
            if name in record.values:
                gauge.set(record.values[name])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StepLog:
    """Append-only JSONL, one object per rollout step."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: StepRecord) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record.as_dict(), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict[str, object]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def progress_line(record: StepRecord) -> str:
    """A compact line per step, e.g. `step    3 rollouts 0.270 batch 0.412 len 0.003 H 1.21 clip 0.04 ...`."""
    v = record.values.get
    return (
        f"step {record.step:>5} rollouts {v('rollout_reward', 0.0):.3f} batch {v('task_reward', 0.0):.3f} "
        f"len {v('length_penalty', 0.0):.3f} "
        f"H {v('entropy', 0.0):.3f} clip {v('clip_fraction', 0.0):.3f} |g| {v('grad_norm', 0.0):.3f} "
        f"kl {v('kl', 0.0):.4f} lag {v('policy_lag', 0.0):.1f} {v('tokens_per_s', 0.0):.0f} tok/s "
        f"({record.wall_s:.1f} s)"
    )


async def start_metrics_server(metrics: TrainerMetrics, host: str, port: int) -> tuple[web.AppRunner, str]:
    """GET /metrics on host:port (0 picks a free port); returns the runner (to clean up) and the URL."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = site._server.sockets if isinstance(site._server, asyncio.Server) else []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, f"http://{host}:{bound}/metrics"
