"""Typed settings of `prime-node validator` (flags > env PRIME_NODE_* > TOML --config > defaults)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from ..node.config import CommonSettings, Section
from ..node.engine import EngineSettings
from ..node.run_config import RunSettings
from ..p2p.swarm import SwarmConfig
from ..p2p.weights.fetch import FetchSettings
from ..proofs.verifier import VerifierSettings
from .dashboard import DashboardSettings
from .ledger_db import LedgerSettings
from .slashing import SlashingPolicy


class IntakeSettings(Section):
    """Bounds on what the validator takes in, so that no peer can exhaust it or starve the others."""

    queue_size: int = Field(
        256, ge=1, le=100_000, description="Files waiting for verification, all nodes together."
    )
    per_node_queue: int = Field(
        16, ge=1, le=100_000, description="Files one node may have waiting (queued or held)."
    )
    rate_per_minute: float = Field(
        30.0, gt=0, le=1e6, description="Files per minute one node may hand in (bucket refill)."
    )
    burst: int = Field(8, ge=1, le=100_000, description="Files one node may hand in at once (bucket size).")
    hold_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="How long a file waits for its checkpoint before it is rejected."
    )


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
        pattern=r"^[0-9a-f]{64}$",
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
        description="How often bans in force are re-published in the DHT (their TTL is finite).",
    )


class ValidatorSettings(CommonSettings):
    run: RunSettings = Field(
        default_factory=RunSettings, description="Run parameters the files must match."
    )
    engine: EngineSettings = Field(
        default_factory=EngineSettings, description="Engine that replays checkpoints."
    )
    verifier: VerifierSettings = Field(
        default_factory=VerifierSettings, description="Checks and thresholds."
    )
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

    def path(self, value: Path | None, default: str) -> Path:
        return (value or self.resolved_data_dir() / default).expanduser()
