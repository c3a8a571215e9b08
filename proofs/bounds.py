"""What a proof weighs and what a verifier accepts, without torch: the TOPLOC format's sizes, the compute
precisions a run may declare, and the calibrated acceptance bounds of the TOPLOC and sampling checks.

Kept apart from toploc.py and sampling.py (which compute with torch) so that the verifier's settings
(verifier_settings.py), the settings of every command and the command line built from them load without it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TOPK = 128
CHUNK_ROWS = 32
BYTES_PER_CHUNK = 2 + 2 * TOPK  # 258


def chunk_count(rows: int, chunk_rows: int = CHUNK_ROWS) -> int:
    return -(-rows // chunk_rows)


def proof_size(rows: int, chunk_rows: int = CHUNK_ROWS, topk: int = TOPK) -> int:
    """Bytes of the proof of `rows` committed rows: 258 per 32-row chunk by default."""
    return chunk_count(rows, chunk_rows) * (2 + 2 * topk)


Precision = Literal["float32", "bfloat16"]


class ToplocThresholds(BaseModel):
    """Acceptance bounds. Every chunk must stay within the per-chunk caps, which catch gross deviations
    (another model, int4 weights, another input, shuffled or copied chunks); and the typical chunk (the
    lower median, over all chunks checked in one file, of the chunk's mean mantissa error) must stay
    within `max_typical_mant_err_mean`, which catches small systematic deviations (a slightly perturbed
    layer) that move every chunk a little, while tolerating the rare chunk where honest compute drifts.

    The defaults are the bounds for bfloat16 contributors (the loosest honest case); `for_precision`
    gives the calibrated set for each declared compute precision. Both come from
    benchmarks/calibrate_proofs.py on the warm-started model (docs/proofs.md has the measured gap).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_exp_mismatches: int = Field(
        40, ge=0, le=TOPK, description="Per chunk: top-k entries whose exponent differs."
    )
    max_mant_err_mean: float = Field(
        16.0, ge=0, description="Per chunk: mean |mantissa diff| where exponents agree."
    )
    max_mant_err_median: float = Field(
        8.0, ge=0, description="Per chunk: median |mantissa diff| where exponents agree."
    )
    max_typical_mant_err_mean: float = Field(
        1.1, ge=0, description="Per file: lower median over checked chunks of the chunk mean mantissa error."
    )
    min_typical_chunks: int = Field(
        8,
        ge=1,
        description="Fewest checked chunks the per-file bound applies to (fewer: per-chunk caps only).",
    )

    @classmethod
    def for_precision(cls, precision: Precision) -> ToplocThresholds:
        """The calibrated bounds for contributors that compute in `precision` (the validator: float32)."""
        return CALIBRATED[precision]


# Measured on the warm-started embedded model (docs/proofs.md, "Calibration"): float32 contributors
# reproduce a float32 validator almost exactly, so their bounds are tight; bfloat16 ones differ by
# rounding in every layer and need the loose set.
CALIBRATED: dict[str, ToplocThresholds] = {
    "float32": ToplocThresholds(
        max_exp_mismatches=8,
        max_mant_err_mean=1.0,
        max_mant_err_median=1.0,
        max_typical_mant_err_mean=0.04,
        min_typical_chunks=1,
    ),
    "bfloat16": ToplocThresholds(),
}


class SamplingThresholds(BaseModel):
    """Tolerances of the sampling, termination and distribution checks (see docs/proofs.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    margin: float = Field(
        0.05, ge=0, description="Largest tolerated score gap at a near-tie (logits/T units)."
    )
    max_near_tie_fraction: float = Field(
        0.02, ge=0, le=1, description="Tolerated near-ties per output token."
    )
    near_tie_slack: int = Field(
        2, ge=0, description="Near-ties always tolerated per sample, on top of the fraction."
    )
    min_eos_logprob: float = Field(
        -20.0, le=0, description="Lowest log p(EOS) accepted where a sample ends on EOS."
    )
    max_abs_z: float = Field(6.0, gt=0, description="Largest |z| of the chosen tokens' log-probability sum.")
    min_z_tokens: int = Field(64, ge=1, description="Tokens needed before the distribution check applies.")

    @classmethod
    def for_precision(cls, precision: Precision) -> SamplingThresholds:
        """The calibrated tolerances for contributors computing in `precision` (the validator: float32)."""
        # bf16 logits of a trained model are off by up to ~0.26 at the largest honest near-tie measured
        # (docs/proofs.md); float32 contributors reproduce the validator's argmax exactly.
        return cls(margin=1.0) if precision == "bfloat16" else cls()
