"""The trainer's per-step metrics: Prometheus gauges, an append-only JSONL log, and a one-line progress display.

One rollout step produces one `StepRecord`: the loss metrics of `RolloutStepReport.summary()` (policy loss,
clip fractions, KL, entropy, gradient norm, lr, tokens/s) plus the batch's rewards (`Batch.reward_metrics()`:
task reward, length penalty, policy lag). The JSONL log is flushed and fsynced per line, so after a crash it
holds every step whose checkpoint may have been published.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from ...node.runtime.metrics import DURATION_BUCKETS, render, role_registry
from ...p2p.weights.metrics import WeightsServerMetrics

P = "prime_node_trainer_"

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
GAUGE_NAMES = {"tokens_per_s": "tokens_per_second"}  # base units spelled out, as every other metric


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
    """The trainer's metrics on a registry of their own (several trainers may live in one test process).

    Gauges carry the last rollout step's values (names as in the JSONL log, except `tokens_per_s`, exposed as
    `prime_node_trainer_tokens_per_second`); counters and histograms cover every step. docs/metrics.md.
    """

    def __init__(self) -> None:
        self.registry = r = role_registry("trainer")
        self.step = Gauge(P + "policy_step", "Newest policy step published", registry=r)
        self.gauges = {
            name: Gauge(
                P + GAUGE_NAMES.get(name, name), f"Last rollout step's {name.replace('_', ' ')}", registry=r
            )
            for name in GAUGES
        }
        self.files = Counter(
            P + "rollout_files_total", "Accepted rollout files read, by outcome", ["outcome"], registry=r
        )
        for outcome in ("used", "unreadable", "deferred"):  # present from the start, for rate()
            self.files.labels(outcome=outcome)
        self.buffered = Gauge(P + "buffered_samples", "Samples waiting for a batch", registry=r)
        self.samples = Counter(P + "samples_trained_total", "Samples trained on", registry=r)
        self.tokens = Counter(P + "tokens_trained_total", "Tokens trained on", registry=r)
        self.step_seconds = Histogram(
            P + "step_seconds",
            "One rollout step: training, checkpoint, publication",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.batch_wait_seconds = Histogram(
            P + "batch_wait_seconds",
            "Time from the end of a step (or the start) until the next batch was full",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.publish_seconds = Histogram(
            P + "publish_seconds",
            "Saving the trainer state and publishing the checkpoint of one step",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.weights = WeightsServerMetrics(r)  # the trainer's weights server

    def observe(self, record: StepRecord) -> None:
        self.step.set(record.step)
        for name, gauge in self.gauges.items():
            if name in record.values:
                gauge.set(record.values[name])
        self.samples.inc(record.values.get("samples", 0.0))
        self.step_seconds.observe(record.wall_s)

    def render(self) -> bytes:
        return render(self.registry)


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
