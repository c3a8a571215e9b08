"""Sampling proofs (TOPLOC v2 style): were the output tokens drawn by seeded Gumbel-max sampling?

With the claimed model's prefill logits at the positions that produced each output token, a verifier
replays the noise g from the sample seed (proofs/gumbel.py) and checks that every token is the argmax of
logits / T + g. Three checks, all from one prefill:

- Gumbel argmax. The gap (best score - chosen token's score) must be 0, or at most `margin` where the
  generator's and the verifier's logits differ by floating-point noise (batching, kernels, bf16 on a
  GPU). Such tolerated near-ties are counted and bounded: honest runs need them only where the top-2
  perturbed scores are within numeric noise of each other, which is rare; an attacker who swaps tokens
  freely needs many.
- Termination. "eos": the last token is EOS, no earlier token is, and log p(EOS) there under
  softmax(logits / T) is at least `min_eos_logprob` (default -20, p ~ 2e-9: an honest sample ends on so
  unlikely an EOS with probability below 1e-6 even over 512 positions). "length": exactly
  max_new_tokens tokens and no EOS among them.
- Distribution. Under honest sampling the chosen tokens' log-probabilities have expectation -H_t
  (entropy) and variance Var_t per position; the z-score of their sum over many tokens is ~N(0, 1).
  Greedy decoding or a colder sampler scores far above, another model or a hotter sampler far below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from .gumbel import gumbel_noise

Z_UNDEFINED = 0.0  # z-score reported when too few tokens carry information


class SamplingThresholds(BaseModel):
    """Tolerances of the sampling, termination and distribution checks (see docs/proofs.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    margin: float = Field(0.05, ge=0, description="Largest tolerated score gap at a near-tie (logits/T units).")
    max_near_tie_fraction: float = Field(0.02, ge=0, le=1, description="Tolerated near-ties per output token.")
    near_tie_slack: int = Field(2, ge=0, description="Near-ties always tolerated per sample, on top of the fraction.")
    min_eos_logprob: float = Field(-20.0, le=0, description="Lowest log p(EOS) accepted where a sample ends on EOS.")
    max_abs_z: float = Field(6.0, gt=0, description="Largest |z| of the chosen tokens' log-probability sum.")
    min_z_tokens: int = Field(64, ge=1, description="Tokens needed before the distribution check applies.")

    @classmethod
    def for_precision(cls, precision: Literal["float32", "bfloat16"]) -> SamplingThresholds:
        """The calibrated tolerances for contributors computing in `precision` (the validator: float32)."""
        # bf16 logits of a trained model are off by up to ~0.26 at the largest honest near-tie measured
        # (docs/proofs.md); float32 contributors reproduce the validator's argmax exactly.
        return cls(margin=1.0) if precision == "bfloat16" else cls()


@dataclass(frozen=True)
class SamplingStats:
    """What one sample's replay found; sums are kept so a file's samples can be pooled."""

    tokens: int
    near_ties: int  # tokens that are not the exact argmax but within the margin
    mismatches: int  # tokens beyond the margin: each one alone rejects
    first_mismatch: int  # output position of the first mismatch, -1 when none
    max_gap: float  # largest gap seen among mismatches and near-ties (0 when all exact)
    logprob_sum: float  # sum of log p(chosen) under softmax(logits / T)
    expected_logprob_sum: float  # sum of -H_t: what honest sampling gives on average
    logprob_variance: float  # sum of Var_t of log p(sampled) under honest sampling


def replay_sampling(
    logits: torch.Tensor, output_ids: Sequence[int], temperature: float, seed: int, margin: float
) -> SamplingStats:
    """Replay the Gumbel noise over `logits` (n_out, vocab): row t produced output token t."""
    tokens = torch.as_tensor(list(output_ids), dtype=torch.int64)
    n = int(tokens.numel())
    if logits.dim() != 2 or logits.shape[0] != n:
        raise ValueError(f"need one logits row per output token: {tuple(logits.shape)} for {n} tokens")
    logits = logits.to(torch.float32)
    scaled = logits / temperature
    noise = gumbel_noise(torch.full((n,), seed, dtype=torch.int64), torch.arange(n), logits.shape[1])
    scores = scaled + noise
    chosen = scores.gather(1, tokens[:, None])[:, 0]
    gaps = scores.max(dim=1).values - chosen
    off = gaps > 0
    beyond = gaps > margin
    logp = torch.log_softmax(scaled.to(torch.float64), dim=1)
    probs = logp.exp()
    entropy_terms = -(probs * logp).sum(dim=1)
    second_moment = (probs * logp * logp).sum(dim=1)
    return SamplingStats(
        tokens=n,
        near_ties=int((off & ~beyond).sum()),
        mismatches=int(beyond.sum()),
        first_mismatch=int(beyond.nonzero()[0, 0]) if bool(beyond.any()) else -1,
        max_gap=float(gaps.max()) if n else 0.0,
        logprob_sum=float(logp.gather(1, tokens[:, None]).sum()),
        expected_logprob_sum=float(-entropy_terms.sum()),
        logprob_variance=float((second_moment - entropy_terms**2).clamp(min=0).sum()),
    )


def sampling_failure(stats: SamplingStats, thresholds: SamplingThresholds) -> str | None:
    """Why the tokens are not the seeded Gumbel-max samples, or None."""
    if stats.mismatches:
        return (
            f"{stats.mismatches} token(s) are not the Gumbel argmax (first at output position "
            f"{stats.first_mismatch}, gap up to {stats.max_gap:.3g} > margin {thresholds.margin})"
        )
    allowed = math.floor(thresholds.max_near_tie_fraction * stats.tokens) + thresholds.near_tie_slack
    if stats.near_ties > allowed:
        return f"{stats.near_ties} near-tie tokens, more than the {allowed} tolerated for {stats.tokens} tokens"
    return None


def distribution_z(stats: Sequence[SamplingStats]) -> tuple[float, int]:
    """Pooled z-score of the chosen tokens' log-probabilities, and the token count behind it."""
    tokens = sum(s.tokens for s in stats)
    variance = sum(s.logprob_variance for s in stats)
    if variance <= 1e-12:  # deterministic distributions: nothing to learn from the choices
        return Z_UNDEFINED, tokens
    deviation = sum(s.logprob_sum - s.expected_logprob_sum for s in stats)
    return deviation / math.sqrt(variance), tokens


def distribution_failure(stats: Sequence[SamplingStats], thresholds: SamplingThresholds) -> str | None:
    z, tokens = distribution_z(stats)
    if tokens >= thresholds.min_z_tokens and abs(z) > thresholds.max_abs_z:
        direction = "too likely (greedy or colder sampling?)" if z > 0 else "too unlikely (another model or sampler?)"
        return f"chosen tokens are {direction}: log-probability z-score {z:.1f}, bound {thresholds.max_abs_z}"
    return None


def termination_failure(output_ids: Sequence[int], finish_reason: str, max_new_tokens: int, eos_token_id: int) -> str | None:
    """Why the sample did not end the way its finish reason claims (structure only), or None."""
    ids = list(output_ids)
    if not ids:
        return "empty output: a sample has at least one token"
    if len(ids) > max_new_tokens:
        return f"{len(ids)} output tokens exceed max_new_tokens {max_new_tokens}"
    early = [i for i, token in enumerate(ids[:-1]) if token == eos_token_id]
    if early:
        return f"EOS at output position {early[0]} is followed by more tokens"
    if finish_reason == "length":
        if ids[-1] == eos_token_id:
            return "finish reason 'length' but the last token is EOS"
        if len(ids) != max_new_tokens:
            return f"finish reason 'length' with {len(ids)} tokens, expected exactly {max_new_tokens}"
        return None
    if finish_reason != "eos":
        return f"unknown finish reason {finish_reason!r}"
    if ids[-1] != eos_token_id:
        return f"finish reason 'eos' but the last token is {ids[-1]}, not EOS ({eos_token_id})"
    return None


def eos_logprob(last_logits: torch.Tensor, eos_token_id: int, temperature: float) -> float:
    """log p(EOS) under softmax(logits / T) at the position that produced the final token."""
    return float(torch.log_softmax(last_logits.to(torch.float64) / temperature, dim=-1)[eos_token_id])


def eos_probability_failure(
    last_logits: torch.Tensor, eos_token_id: int, temperature: float, thresholds: SamplingThresholds
) -> str | None:
    """Why an EOS ending is implausible (its probability was negligible there), or None."""
    logp = eos_logprob(last_logits, eos_token_id, temperature)
    if logp < thresholds.min_eos_logprob:
        return f"EOS is improbable where the sample ends: log p = {logp:.1f} < {thresholds.min_eos_logprob}"
    return None
