"""The verifier's settings: what a validator checks a rollout file against. Torch-free (the thresholds come from
bounds.py), so that every command's settings model, and the command line built from it, load fast."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from .bounds import Precision, SamplingThresholds, ToplocThresholds
from .rollout_schema import RolloutLimits


class VerifierSettings(BaseModel):
    """What a validator checks a rollout file against (the run's parameters and the thresholds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str | None = Field(
        None, description="The run's name; files of another run are rejected. None: any."
    )
    run_seed: int = Field(0, ge=0, lt=2**64, description="The run's seed for work assignment.")
    samples_per_prompt: int | None = Field(
        None, ge=1, description="Completions per prompt; None: from the file."
    )
    prompts_per_batch: int | None = Field(None, ge=1, description="Prompts per file; None: any prefix.")
    temperature: float | None = Field(
        None,
        gt=0,
        le=10,
        description="The run's sampling temperature every row must carry; None: any (checked as "
        "declared). Set from run.temperature by the commands that load a run.",
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        le=8192,
        description="The run's max_new_tokens every row must carry; None: any. Set from "
        "run.max_new_tokens by the commands that load a run.",
    )
    sample_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of rows the expensive checks (prefill, sampling) cover, drawn after each file arrives.",
    )
    prefill_batch_size: int = Field(16, ge=1, description="Most sequences per prefill call.")
    prefill_max_logits_mib: int = Field(
        1024,
        ge=1,
        description="Most float32 logits one prefill call may return (MiB); calls are cut to fit, "
        "one sequence at least. Bounds the validator's memory whatever the number of rows.",
    )
    limits: RolloutLimits = Field(default_factory=RolloutLimits, description="Size and value bounds.")
    node_precision: Precision = Field(
        "float32",
        description="Compute dtype the run's contributors generate in (run policy: files do not carry it); "
        "picks the calibrated TOPLOC and sampling bounds. bfloat16 tolerates GPU nodes, catches only coarser cheats.",
    )
    toploc: ToplocThresholds | None = Field(
        None, description="TOPLOC bounds; the fields set here replace node_precision's calibrated ones."
    )
    sampling: SamplingThresholds | None = Field(
        None, description="Sampling bounds; the fields set here replace node_precision's calibrated ones."
    )

    def file_limits(self) -> RolloutLimits:
        """What a file of this run may hold before it is decoded: `limits`, with the run's max_new_tokens as the
        longest output and, when both the group size and the prompts per file are pinned, their product as
        the most rows (proofs/rollout_layout.py holds a file to them before decoding it)."""
        update: dict[str, int] = {}
        if self.max_new_tokens is not None:
            update["max_new_tokens"] = min(self.limits.max_new_tokens, self.max_new_tokens)
        if self.samples_per_prompt is not None and self.prompts_per_batch is not None:
            update["max_rows"] = min(self.limits.max_rows, self.samples_per_prompt * self.prompts_per_batch)
        return self.limits.model_copy(update=update)

    def toploc_thresholds(self) -> ToplocThresholds:
        """The bounds the TOPLOC check applies: those calibrated for node_precision, with the explicitly set
        fields of `toploc` on top (a partial override must not fall back to another precision's defaults)."""
        return _override(ToplocThresholds.for_precision(self.node_precision), self.toploc)

    def sampling_thresholds(self) -> SamplingThresholds:
        """The sampling tolerances: calibrated for node_precision, explicitly set fields of `sampling` on top."""
        return _override(SamplingThresholds.for_precision(self.node_precision), self.sampling)


Bounds = TypeVar("Bounds", ToplocThresholds, SamplingThresholds)


def _override(calibrated: Bounds, explicit: Bounds | None) -> Bounds:
    if explicit is None:
        return calibrated
    # Only the fields the operator wrote: the class defaults of the rest are one precision's set, not this one's.
    return calibrated.model_copy(update={name: getattr(explicit, name) for name in explicit.model_fields_set})
