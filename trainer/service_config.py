"""Typed settings of `prime-node trainer` (flags > env PRIME_NODE_* > TOML --config > defaults)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from ..node.config import CommonSettings, Section
from ..p2p.swarm import SwarmConfig
from ..p2p.weights.server import ServeSettings
from .config import TrainerSettings


class TrainerServiceSection(Section):
    """Where the trainer keeps its state and how it runs; the recipe itself is in [trainer]."""

    run_id: str = Field("local", min_length=1, max_length=128, description="Run id the rollout files must carry.")
    tasks: str | None = Field(None, description="The run's task file or builtin:arithmetic; checked at start-up.")
    accepted_dir: Path | None = Field(
        None, description="Inbox of validator-accepted files (+ .sig); default <data-dir>/accepted."
    )
    state_dir: Path | None = Field(None, description="Trainer checkpoints (weights + optimizer); default <data-dir>/trainer.")
    weights_dir: Path | None = Field(None, description="Published checkpoint store served to peers; default <data-dir>/weights.")
    keep_states: int = Field(2, ge=1, le=1000, description="Trainer states kept on disk (the newest resumes a crash).")
    poll_interval_s: float = Field(0.5, gt=0, le=60, description="How often the inbox is rescanned while waiting.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this policy step is published; default never.")
    dht: bool = Field(True, description="Announce policies in the DHT; off: serve weights over HTTP only.")
    announce_interval_s: float = Field(
        120.0, gt=0, le=3600, description="Re-announce the current policy this often (its DHT record has a TTL)."
    )
    public_sources: list[str] = Field(
        default_factory=list, max_length=32,
        description="Weights URLs announced to peers; default the local server's own URL.",
    )
    metrics_host: str = Field("127.0.0.1", description="Address of the Prometheus /metrics endpoint.")
    metrics_port: int | None = Field(0, ge=0, le=65535, description="Its port (0 picks one; unset: no endpoint).")
    threads: int | None = Field(None, ge=1, le=1024, description="torch CPU threads; unset keeps torch's default.")


class TrainerCommandSettings(CommonSettings):
    trainer: TrainerSettings = Field(default_factory=TrainerSettings, description="The GRPO recipe.")
    swarm: SwarmConfig = Field(default_factory=SwarmConfig, description="DHT membership.")
    serve: ServeSettings = Field(default_factory=ServeSettings, description="The weights server (origin).")
    service: TrainerServiceSection = Field(default_factory=TrainerServiceSection, description="Paths and loop.")

    def path(self, value: Path | None, default: str) -> Path:
        return (value or self.resolved_data_dir() / default).expanduser()
