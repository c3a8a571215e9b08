"""Typed settings of `prime-node validator` (flags > env PRIME_NODE_* > TOML --config > defaults)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from ...node.config import CommonSettings, Section
from ...node.engine import EngineSettings
from ...node.run.settings import VERIFIER_SETTINGS_SET_BY_RUN, RunSettings
from ...p2p.swarm import SwarmConfig
from ...p2p.weights.fetch import FetchSettings
from ...p2p.wire import HEX64_PATTERN
from ...proofs.verifier_settings import VerifierSettings
from ..ledger.db import LedgerSettings
from ..ledger.slashing import SlashingPolicy
from .dashboard import DashboardSettings


class IntakeSettings(Section):
    """Bounds on what the validator takes in, so that no peer can exhaust it or starve the others."""

    queue_size: int = Field(
        256, ge=2, le=100_000, description="Files waiting for verification, all nodes together."
    )
    per_node_queue: int = Field(
        16, ge=1, le=100_000, description="Files one established node may have waiting (queued or held)."
    )
    newcomer_queue: int = Field(
        64,
        ge=1,
        le=100_000,
        description="Slice of queue_size shared by all newcomers (nodes without accepted work); the rest "
        "is reserved for established nodes, so fresh node ids cannot fill the queue.",
    )
    newcomer_per_node: int = Field(
        4, ge=1, le=100_000, description="Files one newcomer may have waiting (queued or held)."
    )
    newcomer_share: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="Share of verification turns newcomers get while established nodes' files wait.",
    )
    established_after: int = Field(
        4,
        ge=1,
        le=10_000,
        description="Files accepted within established_window_s that make a node established (reserved "
        "queue places and receive slots).",
    )
    established_window_s: float = Field(
        3600.0,
        gt=0,
        le=30 * 86400,
        description="How far back accepted files count towards a node's standing; older work does not.",
    )
    busy_retry_s: float = Field(
        10.0, gt=0, le=3600, description="Retry hint sent with a 'queue is full' answer."
    )
    rate_per_minute: float = Field(
        30.0, gt=0, le=1e6, description="Files per minute one node may hand in (bucket refill)."
    )
    burst: int = Field(8, ge=1, le=100_000, description="Files one node may hand in at once (bucket size).")
    hold_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="How long a file waits for its checkpoint before it is rejected."
    )
    group_grace_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="How long a pipelined group's stage files wait, from the first, for the group's other "
        "stages before the group is judged incomplete (docs/pipeline.md, 'Verdicts').",
    )
    max_pending_groups: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="Pipelined groups collecting stage files at once; more wait (busy).",
    )
    group_records_keep_s: float = Field(
        1800.0,
        gt=0,
        le=30 * 86400,
        description="How long an operator-signed group record stays known after it was last read from the "
        "DHT: a group's files are accepted only while its record is (docs/pipeline.md, 'Groups at the validator').",
    )
    group_records_refresh_s: float = Field(
        2.0,
        gt=0,
        le=3600,
        description="Least time between two DHT reads of group records (a file of an unknown group waits for "
        "the next read).",
    )
    step_margin: int = Field(
        2,
        ge=0,
        le=1000,
        description="Policy steps a file may claim beyond the newest announced one and still wait for its "
        "checkpoint: a node may see a new policy before the validator. Beyond it: a fault (policy_step).",
    )

    @model_validator(mode="after")
    def _newcomer_slice(self) -> IntakeSettings:
        if self.newcomer_queue >= self.queue_size:
            raise ValueError(
                f"intake.newcomer_queue ({self.newcomer_queue}) must be below intake.queue_size "
                f"({self.queue_size}): the rest of the queue is what established nodes keep"
            )
        return self


class ValidatorServiceSettings(Section):
    spool_dir: Path | None = Field(
        None, description="Where received files wait for a verdict; default <data-dir>/spool."
    )
    accepted_dir: Path | None = Field(
        None, description="The trainer's inbox of accepted files (+ .sig); default <data-dir>/accepted."
    )
    weights_dir: Path | None = Field(
        None, description="Checkpoint store; default <data-dir>/validator-weights."
    )
    weights_key: str | None = Field(
        None,
        pattern=HEX64_PATTERN,
        description="Key that signs checkpoint manifests; default the first operator key.",
    )
    keep_checkpoints: int = Field(
        3, ge=1, le=64, description="Checkpoint versions kept (the async window + 1)."
    )
    announce_interval_s: float = Field(
        120.0, gt=0, le=3600, description="How often the validator re-announces itself."
    )
    ban_republish_s: float = Field(
        3600.0,
        gt=0,
        le=86400,
        description="How often bans in force are re-published in the DHT; below swarm.ban_ttl_s, the "
        "lifetime of one ban record (trainer/validator/bans.py).",
    )


class ValidatorSettings(CommonSettings):
    MOVED = VERIFIER_SETTINGS_SET_BY_RUN

    run: RunSettings = Field(default_factory=RunSettings, description="Run parameters the files must match.")
    engine: EngineSettings = Field(
        default_factory=EngineSettings, description="Engine that replays checkpoints."
    )
    verifier: VerifierSettings = Field(default_factory=VerifierSettings, description="Checks and thresholds.")
    swarm: SwarmConfig = Field(default_factory=SwarmConfig, description="DHT membership and hand-off.")
    fetch: FetchSettings = Field(default_factory=FetchSettings, description="Checkpoint download.")
    ledger: LedgerSettings = Field(default_factory=LedgerSettings, description="The contribution ledger.")
    slashing: SlashingPolicy = Field(default_factory=SlashingPolicy, description="What rejections cost.")
    dashboard: DashboardSettings = Field(
        default_factory=DashboardSettings, description="Leaderboard API and page."
    )
    intake: IntakeSettings = Field(
        default_factory=IntakeSettings, description="Queue bounds and rate limits."
    )
    validator: ValidatorServiceSettings = Field(
        default_factory=ValidatorServiceSettings, description="Validator paths and intervals."
    )

    @model_validator(mode="after")
    def _swarm_follows_the_run(self) -> ValidatorSettings:
        # Nodes take their DHT's run id from run.run_id (StartSettings.swarm_config): so does the validator,
        # unless swarm.run_id is set.
        if "run_id" not in self.swarm.model_fields_set:
            self.swarm = self.swarm.model_copy(update={"run_id": self.run.run_id})
        return self

    @model_validator(mode="after")
    def _bans_outlive_their_records(self) -> ValidatorSettings:
        if self.validator.ban_republish_s >= self.swarm.ban_ttl_s:
            raise ValueError(
                f"validator.ban_republish_s ({self.validator.ban_republish_s:g} s) must be below "
                f"swarm.ban_ttl_s ({self.swarm.ban_ttl_s:g} s), or ban records lapse between republications"
            )
        return self

    def path(self, value: Path | None, default: str) -> Path:
        return (value or self.resolved_data_dir() / default).expanduser()
