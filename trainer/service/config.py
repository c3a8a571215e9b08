"""Typed settings of `prime-node trainer` (flags > env PRIME_NODE_* > TOML --config > defaults)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from ...node.config import CommonSettings, Section
from ...node.run.settings import RunSettings
from ...node.runtime.metrics import PORTS
from ...p2p.swarm import SwarmConfig
from ...p2p.weights.server import ServeSettings
from ..groups.config import GroupsSection
from ..grpo.config import TrainerSettings

# What a policy record allows in its sources (p2p/swarm/records.py): refused here, at start, not at announcement.
SourceUrl = Annotated[str, StringConstraints(max_length=512, pattern=r"^https?://[^\s/?#]+")]


class TrainerServiceSection(Section):
    """Where the trainer keeps its state and how it runs; the recipe itself is in [trainer]."""

    accepted_dir: Path | None = Field(
        None, description="Inbox of validator-accepted files (+ .sig); default <data-dir>/accepted."
    )
    state_dir: Path | None = Field(
        None, description="Trainer checkpoints (weights + optimizer); default <data-dir>/trainer."
    )
    weights_dir: Path | None = Field(
        None, description="Published checkpoint store served to peers; default <data-dir>/weights."
    )
    keep_states: int = Field(
        2, ge=1, le=1000, description="Trainer states kept on disk (the newest resumes a crash)."
    )
    poll_interval_s: float = Field(
        0.5, gt=0, le=60, description="How often the inbox is rescanned while waiting."
    )
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this policy step is published; default never."
    )
    dht: bool = Field(True, description="Announce policies in the DHT; off: serve weights over HTTP only.")
    announce_interval_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Re-announce the current policy this often (its DHT record has a TTL).",
    )
    public_sources: list[SourceUrl] = Field(
        default_factory=list,
        max_length=32,
        description="Weights URLs announced to peers; default the server's own URL, a 0.0.0.0 host replaced "
        "by the first announced IP.",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address of the Prometheus /metrics endpoint; 0.0.0.0 opens it to the network.",
    )
    metrics_port: int | None = Field(
        PORTS["trainer"],
        ge=0,
        le=65535,
        description="Port of the Prometheus /metrics endpoint (docs/metrics.md; 0 picks one; unset: none).",
    )
    threads: int | None = Field(
        None, ge=1, le=1024, description="torch CPU threads; unset keeps torch's default."
    )


class TrainerCommandSettings(CommonSettings):
    # The run's parameters are one section shared with `start` and `validator` (one TOML file can configure
    # all three), and the trainer announces them with every policy (node/run/announcement.py). These used to
    # be the trainer's own, free to disagree with the nodes'.
    MOVED = {
        "trainer.temperature": "run.temperature",
        "trainer.length_targets": "run.length_targets",
        "trainer.length_alpha": "run.length_alpha",
        "service.run_id": "run.run_id",
        "service.tasks": "run.tasks",
    }

    run: RunSettings = Field(
        default_factory=RunSettings, description="Run parameters, announced to every party."
    )
    trainer: TrainerSettings = Field(default_factory=TrainerSettings, description="The GRPO recipe.")
    swarm: SwarmConfig = Field(default_factory=SwarmConfig, description="DHT membership.")
    serve: ServeSettings = Field(default_factory=ServeSettings, description="The weights server (origin).")
    service: TrainerServiceSection = Field(
        default_factory=TrainerServiceSection, description="Paths and loop."
    )
    groups: GroupsSection = Field(
        default_factory=GroupsSection, description="Pipelined groups (trainer/groups/; docs/pipeline.md)."
    )

    def path(self, value: Path | None, default: str) -> Path:
        return (value or self.resolved_data_dir() / default).expanduser()

    @model_validator(mode="after")
    def _follow_the_run(self) -> TrainerCommandSettings:
        # The log-probabilities must be those of the distribution the nodes sampled from.
        if self.trainer.temperature != self.run.temperature:
            self.trainer = self.trainer.model_copy(update={"temperature": self.run.temperature})
        # Nodes take their DHT's run id from run.run_id (StartSettings.swarm_config): so does the trainer,
        # unless swarm.run_id is set (--swarm-run-id).
        if "run_id" not in self.swarm.model_fields_set:
            self.swarm = self.swarm.model_copy(update={"run_id": self.run.run_id})
        return self
