"""Typed settings of `prime-node start` (flags > env PRIME_NODE_* > TOML --config > defaults).

The run's shared parameters (`run`) are the same section `prime-node rollout` and `verify` use, so a node
and a validator configured from one TOML file agree on the work assignment and the rewards. The swarm,
weights fetch/serve and engine sections are the lower packages' own models, loaded here.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from ...p2p.swarm.config import SwarmConfig
from ...p2p.weights.fetch import FetchSettings
from ...p2p.weights.server import ServeSettings
from ...p2p.wire import is_hex64
from ..config import CommonSettings, Section
from ..engine import EngineSettings
from ..run.settings import MOVED_TO_RUN, RunSettings
from ..runtime.metrics import PORTS

KEY_FILE_NAME = "node.key"

# A node re-serving weights sends at most this many shards at once (serve.upload_slots; more requests get a busy
# 503 and ask another holder). A shard is served on only once its last byte verified, so on a capped home line
# two shards at half the line each spread a checkpoint faster than every requester's shard at a crawl: at
# N = 32 on 10 Mbit/s lines the last node took 1.9-2.0x one node's time with 2 slots, 2.3x without a limit
# (benchmarks/broadcast.py, docs/network.md "Upload slots on re-serving nodes").
NODE_UPLOAD_SLOTS = 2


class NodeServeSettings(ServeSettings):
    """A node's weights server: ServeSettings with a node's own defaults. A class of its own, not a
    default_factory, so that they hold when an operator sets only some `serve.*` keys (a factory's values are
    dropped as soon as any key of the section is given)."""

    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the weights server (0 picks a free one, which is advertised).",
    )
    upload_slots: int = Field(
        NODE_UPLOAD_SLOTS,
        ge=0,
        le=65536,
        description="Shards sent at once (0: no limit); more requests get 503 with Retry-After busy_retry_s. A "
        "node passes a shard on only once it verified, so a few at full speed spread a checkpoint faster than "
        "every requester's at a crawl.",
    )


class PipelineNodeSettings(Section):
    """Serving a stage of pipelined groups (`start --pipeline`; docs/pipeline.md, "The pipeline node")."""

    enabled: bool = Field(
        False,
        description="Serve a stage of the operator's pipelined groups instead of generating rollouts alone "
        "(the run must announce a stage layout, run.pipeline).",
    )
    stages: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="The stages of the run's layout this node offers; empty: every stage.",
    )
    poll_s: float = Field(
        5.0, gt=0, le=600, description="How often group records and heartbeats are read (and offers renewed)."
    )
    stale_after_s: float = Field(
        45.0,
        gt=0,
        le=3600,
        description="A member whose heartbeat is older than this is gone (as the trainer's).",
    )
    round_grace_s: float = Field(
        10.0, ge=0, le=600, description="How long a group of an older round is still run after a newer round."
    )
    frame_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Longest wait for a neighbour's next frame."
    )
    connect_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Longest wait for a neighbour's stream, either way."
    )
    retry_s: float = Field(0.5, gt=0, le=600, description="Pause after a batch was abandoned.")
    max_batch_jump: int = Field(
        1 << 20,
        ge=1,
        le=1 << 40,
        description="How far past this node's next batch number of a group a predecessor's batch is taken "
        "(further: refused, so no peer can push the number to the end of its range).",
    )
    # A broken batch makes a file for the validator at every member (a partial record or a fraud report), and a
    # neighbour can break one every retry_s. Only batches every member took count (node/pipeline/host.py): an
    # honest departure breaks one such (the batch in flight; the next ones never reach every member), so 8 in a
    # row is a neighbour breaking them on purpose or a group that cannot work.
    leave_after_broken: int = Field(
        8,
        ge=1,
        le=100_000,
        description="Leave a group after this many of its batches in a row broke (none finished between them).",
    )
    # Batches that break before every member took them do not count toward leave_after_broken (a member still
    # loading its stage, or holding back while its outbox is full, breaks one every connect_timeout_s without
    # fault), so this bounds how long a group none of whose batches finish is kept: well past loading a stage of
    # a large checkpoint from disk (minutes) and the validator's usual hand-off pauses, yet a member that never
    # takes a batch holds the others for no more than this.
    leave_without_batch_s: float = Field(
        900.0,
        gt=0,
        le=86_400,
        description="Leave a group none of whose batches finished in this long (since this node's stage was "
        "loaded or its last batch of the group finished).",
    )
    avoid_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="How long a group left for its broken batches is not rejoined (longer than the "
        "coordinator's 300 s cooldown of a member that does not confirm its group).",
    )
    # The validator needs every member's file of the same broken batch to blame its culprit; each member keeps
    # the first ones of a group (mostly the same batches at every honest member: a full outbox or a peer's limit
    # spent elsewhere can differ), so a handful per group is enough evidence, and a neighbour breaking batches
    # on purpose gets no more than this written about it.
    max_broken_files_per_group: int = Field(
        4,
        ge=1,
        le=10_000,
        description="Partial records and fraud reports written per group within broken_files_window_s; "
        "further broken batches are counted and logged, not written.",
    )
    max_broken_files_per_peer: int = Field(
        8,
        ge=1,
        le=10_000,
        description="Partial records and fraud reports written per neighbour (over all groups) within "
        "broken_files_window_s: two groups' worth, so regrouping with the same peer writes little more.",
    )
    # Fraud reports are counted apart, so a peer that first hangs up a few times cannot spend the budget that
    # would report its bad frames; one report bans its sender, and only the sender of a bad frame spends these.
    max_fraud_reports_per_group: int = Field(
        2,
        ge=1,
        le=10_000,
        description="Fraud reports written per group within broken_files_window_s (apart from the partial "
        "records' limits).",
    )
    max_fraud_reports_per_peer: int = Field(
        2,
        ge=1,
        le=10_000,
        description="Fraud reports written against one predecessor (over all groups) within "
        "broken_files_window_s.",
    )
    broken_files_window_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="The window of the broken-file limits.",
    )


class StartSettings(CommonSettings):
    """Everything a contributor node needs to join a run and work unattended."""

    # A group's micro-batch cut is the run's (run.pipeline, pinned by the announcement and the group record):
    # every member must cut alike, so it is no node's own setting.
    MOVED = {**MOVED_TO_RUN, "pipeline.micro_batch_size": "run.pipeline.micro_batch_size"}

    key_file: Path | None = Field(None, description="The node's secret key; default <data-dir>/node.key.")
    operator_key: str | None = Field(
        None,
        description="The run operator's public key (64 hex): the only signer of policies and checkpoints.",
    )
    run: RunSettings = Field(
        default_factory=RunSettings, description="Run parameters shared with validators."
    )
    swarm: SwarmConfig = Field(default_factory=SwarmConfig, description="DHT membership and hand-off limits.")
    pipeline: PipelineNodeSettings = Field(
        default_factory=PipelineNodeSettings, description="Serving a stage of pipelined groups."
    )
    engine: EngineSettings = Field(default_factory=EngineSettings, description="Inference engine.")
    fetch: FetchSettings = Field(default_factory=FetchSettings, description="Checkpoint download.")
    serve_weights: bool = Field(False, description="Serve verified checkpoints to other peers over HTTP.")
    weights_public_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/?#]+$",
        description="URL peers use to reach this node's weights server; default: its bound address (an "
        "unspecified one replaced by the node's first announced IP).",
    )
    peer_weights_networks: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Networks (CIDR) beyond public addresses that weights URLs from peers' heartbeats may point "
        "into, e.g. 127.0.0.0/8 for peers on one machine or 10.0.0.0/8 in a cluster; others are never fetched from.",
    )
    serve: NodeServeSettings = Field(
        default_factory=NodeServeSettings, description="The weights server (when serve_weights)."
    )
    async_level: int = Field(
        2, ge=0, le=64, description="Use checkpoints at most this many steps behind the announced one."
    )
    prompts: int = Field(4, ge=1, le=4096, description="Prompts per rollout batch (one file per batch).")
    max_batches: int | None = Field(
        None, ge=1, description="Stop cleanly after this many batches (benchmarks)."
    )
    max_pending_files: int = Field(
        4,
        ge=1,
        le=100_000,
        description="Generate no further while this many files wait for hand-off (the validator's back-pressure).",
    )
    status_host: str = Field(
        "127.0.0.1",
        description="Address of the local status API and /metrics; 0.0.0.0 opens it to the network.",
    )
    status_port: int = Field(
        PORTS["contributor"],
        ge=0,
        le=65535,
        description="Port of the status API and /metrics (docs/metrics.md); 0 picks a free one.",
    )
    shutdown_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Bound on a graceful stop (SIGINT/SIGTERM)."
    )
    fetch_retry_s: float = Field(5.0, gt=0, le=3600, description="First wait before retrying a failed fetch.")
    handoff_retry_s: float = Field(
        2.0, gt=0, le=3600, description="First wait before retrying a failed hand-off."
    )
    max_retry_s: float = Field(
        120.0, gt=0, le=86400, description="Longest wait between retries (backoff cap)."
    )
    verdict_poll_s: float = Field(
        5.0, gt=0, le=3600, description="First wait before asking for a file's verdict."
    )
    verdict_timeout_s: float = Field(
        86400.0, gt=0, description="Stop asking for a file's verdict this long after its receipt."
    )
    leaderboard_refresh_s: float = Field(
        60.0, gt=0, le=86400, description="How often the rank and score are refreshed."
    )
    announcement_wait_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="Say so (log and status) when no run announcement signed by the operator key has been "
        "found after this many seconds (a wrong key, no trainer, unreachable peers); again at doubling intervals.",
    )
    validator_api_timeout_s: float = Field(
        10.0, gt=0, le=300, description="Bound on one request to a validator's API."
    )
    checkpoint_disk_mb: int = Field(
        256, ge=1, description="Disk reserved per checkpoint; async_level + 1 of them must fit at start."
    )
    min_ram_mb: int = Field(512, ge=0, description="Available RAM required at start.")
    min_gpu_memory_mb: int = Field(2048, ge=0, description="Free GPU memory required with --gpu.")

    @field_validator("operator_key")
    @classmethod
    def _node_id(cls, key: str | None) -> str | None:
        # A field's own rule, so that the error names the flag or the setting and quotes the value.
        if key is not None and not is_hex64(key):
            raise ValueError("must be the operator's node id: 64 lowercase hex digits")
        return key

    @model_validator(mode="after")
    def _consistent(self) -> StartSettings:
        if self.fetch_retry_s > self.max_retry_s or self.handoff_retry_s > self.max_retry_s:
            raise ValueError("fetch_retry_s and handoff_retry_s must not exceed max_retry_s")
        layout = self.run.pipeline
        if self.pipeline.enabled and layout is None:
            raise ValueError(
                "pipeline.enabled (--pipeline) needs the run's stage layout: set run.pipeline (e.g. "
                "PRIME_NODE_RUN__PIPELINE='{\"boundaries\": [0, 2, 4]}'), as the run announces it"
            )
        if layout is not None and any(not 0 <= k < layout.stages for k in self.pipeline.stages):
            raise ValueError(
                f"pipeline.stages {self.pipeline.stages}: the run's layout has stages 0 to {layout.stages - 1}"
            )
        for network in self.peer_weights_networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(
                    f"peer_weights_networks: {network[:80]!r} is not an IP network such as 10.0.0.0/8"
                ) from None
        return self

    def key_path(self) -> Path:
        return (self.key_file or self.resolved_data_dir() / KEY_FILE_NAME).expanduser()

    def swarm_config(self) -> SwarmConfig:
        """The swarm section with the run id and the pinned operator key filled in from the top level."""
        keys = list(
            dict.fromkeys([*([self.operator_key] if self.operator_key else []), *self.swarm.operator_keys])
        )
        return SwarmConfig.model_validate(
            {**self.swarm.model_dump(), "run_id": self.run.run_id, "operator_keys": keys}
        )
