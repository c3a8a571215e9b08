"""The settings of a fetch: timeouts, parallelism, deadlines, hedging and retry bounds (a typed config section).

A module of its own so that every part of a fetch (fetch.py, shardrun.py, attempts.py) can read them without
importing the Fetcher.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .sources import SelectionSettings


class FetchSettings(BaseModel):
    """Timeouts, parallelism, deadlines, hedging and retry bounds of a fetch."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(
        8,
        ge=1,
        le=256,
        description="Shard transfers at once from proven sources (and as many probes of others, "
        "besides each source's first).",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Time allowed to open a connection to a source.")
    stall_timeout_s: float = Field(
        15.0, gt=0, description="A source that sends no byte for this long has stalled: another is used."
    )
    manifest_timeout_s: float = Field(
        15.0,
        gt=0,
        description="Wall-clock deadline of one manifest request, however the source paces its bytes.",
    )
    manifest_grace_s: float = Field(
        0.5,
        ge=0,
        le=60,
        description="After the first valid manifest, wait this long for others' before choosing.",
    )
    min_rate_bytes_s: int = Field(
        32 << 10,
        ge=1,
        description="Throughput floor of a shard transfer: fewer bytes/s over a window cuts it.",
    )
    rate_window_s: float = Field(
        10.0, gt=0, le=600, description="Window over which the throughput floor is measured."
    )
    hedge_ratio: float = Field(
        4.0,
        ge=1,
        le=1000,
        description="A transfer projected to take this many times longer than the shard "
        "would from the best other source is hedged (the shard is asked of that source too).",
    )
    hedge_after_s: float = Field(
        0.5,
        ge=0,
        le=600,
        description="With no other source measured yet, a transfer under the floor rate is "
        "hedged after this long.",
    )
    max_attempts_per_shard: int = Field(
        8,
        ge=1,
        le=1000,
        description="Failures of one shard each source may have before it is not asked for it again; the "
        "shard is given up once every source that could serve it has had as many.",
    )
    max_not_ready: int = Field(
        1000,
        ge=0,
        description="503 answers (not verified yet, every upload slot busy) tolerated per source and shard "
        "before they count as failures.",
    )
    availability_interval_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="How often each source is asked which shards it holds (a long poll: the answer comes when "
        "it holds more), and a source without the version is asked for the manifest again (0: never).",
    )
    availability_wait_s: float = Field(
        0.5,
        ge=0,
        le=60,
        description="While no source is known to hold a waiting shard, wait this long for availability "
        "answers before asking a source that has not answered yet.",
    )
    chunk_bytes: int = Field(
        1 << 20, ge=4096, description="Bytes hashed and written at once; also the resume granularity."
    )
    save_interval_s: float = Field(1.0, gt=0, description="How often resume progress is journaled to disk.")
    durable: bool = Field(True, description="fsync the checkpoint before moving it into place.")
    keep: int = Field(0, ge=0, description="After success keep only this many versions (0: keep all).")
    selection: SelectionSettings = Field(default_factory=SelectionSettings, description="Source scoring.")
