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

import torch

from .bounds import SamplingThresholds
from .gumbel import gumbel_noise

Z_UNDEFINED = 0.0  # z-score reported when too few tokens carry information
REPLAY_BLOCK_ELEMENTS = 1 << 22  # logits replayed per pass (float64 temporaries of 32 MiB each)


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
    return replay_samplings([logits], [output_ids], [seed], temperature, margin)[0]


def replay_samplings(
    logits: Sequence[torch.Tensor],
    output_ids: Sequence[Sequence[int]],
    seeds: Sequence[int],
    temperature: float,
    margin: float,
) -> list[SamplingStats]:
    """replay_sampling for many samples of one temperature at once: the noise, scores and log-softmax of
    a group of samples' tokens in one pass each, then per-sample sums (the rows of a file share T by the
    bounds check). Element-wise work is the same as one sample at a time, so the gaps are bit-identical.
    Groups hold at most REPLAY_BLOCK_ELEMENTS logits (or one sample), which bounds the float64 temporaries
    for large vocabularies."""
    counts = [len(ids) for ids in output_ids]
    if not (len(logits) == len(counts) == len(seeds)):
        raise ValueError(f"{len(logits)} logits matrices, {len(counts)} outputs and {len(seeds)} seeds")
    for rows, n in zip(logits, counts, strict=True):
        if rows.dim() != 2 or rows.shape[0] != n:
            raise ValueError(f"need one logits row per output token: {tuple(rows.shape)} for {n} tokens")
    samples = list(zip(logits, output_ids, seeds, strict=True))
    sizes = [n * rows.shape[1] for rows, n in zip(logits, counts, strict=True)]
    stats: list[SamplingStats] = []
    start = 0
    while start < len(samples):
        end, elements = start + 1, sizes[start]
        while end < len(samples) and elements + sizes[end] <= REPLAY_BLOCK_ELEMENTS:
            elements += sizes[end]
            end += 1
        stats += _replay_group(samples[start:end], temperature, margin)
        start = end
    return stats


def _replay_group(
    samples: Sequence[tuple[torch.Tensor, Sequence[int], int]], temperature: float, margin: float
) -> list[SamplingStats]:
    """The replay of samples (logits, output ids, seed) whose logits fit in one pass."""
    logits, output_ids, seeds = zip(*samples, strict=True)
    counts = [len(ids) for ids in output_ids]
    total = sum(counts)
    sample = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
    # Output position t of every token: its index minus where its sample starts.
    starts = torch.tensor([0, *counts[:-1]], dtype=torch.int64).cumsum(0)
    positions = torch.arange(total) - starts[sample]
    tokens = torch.tensor([t for ids in output_ids for t in ids], dtype=torch.int64)
    flat = torch.cat([rows.to(torch.float32) for rows in logits])
    scaled = flat / temperature
    noise = gumbel_noise(torch.tensor(list(seeds), dtype=torch.int64)[sample], positions, flat.shape[1])
    scores = scaled + noise
    gaps = scores.max(dim=1).values - scores.gather(1, tokens[:, None])[:, 0]
    off = gaps > 0
    beyond = gaps > margin
    # Per position in float32 (the distribution check needs ~1e-4 of a z-score, float32 gives ~1e-6; float64
    # over the whole vocabulary cost as much as the noise), summed over positions in float64.
    logp = torch.log_softmax(scaled, dim=1)
    probs = logp.exp()
    entropy_terms = -(probs * logp).sum(dim=1)
    # Var_t = E[(log p + H_t)^2], centred, so float32 does not cancel E[log^2 p] against H_t^2.
    variance_terms = (probs * (logp + entropy_terms[:, None]).square()).sum(dim=1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    n = len(counts)

    def per_sample(values: torch.Tensor) -> list[float]:
        wide = values.to(torch.float64) if values.is_floating_point() else values
        return torch.zeros(n, dtype=wide.dtype).index_add_(0, sample, wide).tolist()

    near_ties = per_sample((off & ~beyond).to(torch.int64))
    mismatches = per_sample(beyond.to(torch.int64))
    # Tokens within the margin stand at position `total`, past every real one: amin finds the first mismatch.
    first = torch.where(beyond, positions, torch.full_like(positions, total))
    earliest = torch.full((n,), total, dtype=torch.int64).scatter_reduce_(0, sample, first, "amin").tolist()
    largest_gap = torch.zeros(n, dtype=gaps.dtype).scatter_reduce_(
        0, sample, gaps, "amax", include_self=False
    )
    max_gap = largest_gap.tolist()
    return [
        SamplingStats(
            tokens=counts[i],
            near_ties=int(near_ties[i]),
            mismatches=int(mismatches[i]),
            first_mismatch=int(earliest[i]) if earliest[i] < total else -1,
            max_gap=float(max_gap[i]) if counts[i] else 0.0,
            logprob_sum=sums[0],
            expected_logprob_sum=-sums[1],
            logprob_variance=sums[2],
        )
        for i, sums in enumerate(
            zip(per_sample(chosen), per_sample(entropy_terms), per_sample(variance_terms), strict=True)
        )
    ]


def sampling_failure(stats: SamplingStats, thresholds: SamplingThresholds) -> str | None:
    """Why the tokens are not the seeded Gumbel-max samples, or None."""
    if stats.mismatches:
        return (
            f"{stats.mismatches} token(s) are not the Gumbel argmax (first at output position "
            f"{stats.first_mismatch}, gap up to {stats.max_gap:.3g} > margin {thresholds.margin})"
        )
    allowed = math.floor(thresholds.max_near_tie_fraction * stats.tokens) + thresholds.near_tie_slack
    if stats.near_ties > allowed:
        return (
            f"{stats.near_ties} near-tie tokens, more than the {allowed} tolerated for {stats.tokens} tokens"
        )
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
        direction = (
            "too likely (greedy or colder sampling?)" if z > 0 else "too unlikely (another model or sampler?)"
        )
        return f"chosen tokens are {direction}: log-probability z-score {z:.1f}, bound {thresholds.max_abs_z}"
    return None


def termination_failure(
    output_ids: Sequence[int], finish_reason: str, max_new_tokens: int, eos_token_id: int
) -> str | None:
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
    return eos_logprob_failure(eos_logprob(last_logits, eos_token_id, temperature), thresholds)


def eos_logprob_failure(logp: float, thresholds: SamplingThresholds) -> str | None:
    """eos_probability_failure for an already computed log p(EOS)."""
    if logp < thresholds.min_eos_logprob:
        return f"EOS is improbable where the sample ends: log p = {logp:.1f} < {thresholds.min_eos_logprob}"
    return None
