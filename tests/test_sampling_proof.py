"""Sampling proofs: Gumbel-argmax replay, termination and distribution checks on seeded logits."""

from __future__ import annotations

import math

import pytest
import torch

from prime_node.proofs import sampling
from prime_node.proofs.gumbel import gumbel_argmax
from prime_node.proofs.sampling import (
    SamplingThresholds,
    distribution_failure,
    distribution_z,
    eos_probability_failure,
    replay_sampling,
    replay_samplings,
    sampling_failure,
    termination_failure,
)

VOCAB = 64
EOS = 1
T = SamplingThresholds()


def _logits(n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _sample(logits: torch.Tensor, temperature: float, seed: int) -> list[int]:
    n = logits.shape[0]
    return gumbel_argmax(logits, temperature, torch.full((n,), seed), torch.arange(n)).tolist()


def test_honest_samples_replay_exactly():
    for seed in range(5):
        logits = _logits(200, seed)
        tokens = _sample(logits, 0.8, seed)
        stats = replay_sampling(logits, tokens, 0.8, seed, T.margin)
        assert (stats.mismatches, stats.near_ties, stats.max_gap) == (0, 0, 0.0)
        assert sampling_failure(stats, T) is None
        # numeric noise of the verifier's recomputation is absorbed by the margin
        noisy = logits + 1e-4 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(99))
        assert sampling_failure(replay_sampling(noisy, tokens, 0.8, seed, T.margin), T) is None


def test_changed_token_wrong_seed_greedy_and_other_temperature_fail():
    logits = _logits(200, 0)
    tokens = _sample(logits, 1.0, 7)
    changed = tokens.copy()
    changed[50] = (changed[50] + 1) % VOCAB
    stats = replay_sampling(logits, changed, 1.0, 7, T.margin)
    assert stats.mismatches == 1 and stats.first_mismatch == 50
    assert "output position 50" in sampling_failure(stats, T)
    for bad_tokens, claimed_seed in (
        (tokens, 8),  # another seed
        (logits.argmax(dim=1).tolist(), 7),  # greedy decoding
        (_sample(logits, 0.5, 7), 7),  # another temperature, same noise
    ):
        stats = replay_sampling(logits, bad_tokens, 1.0, claimed_seed, T.margin)
        assert stats.mismatches > 10
        assert sampling_failure(stats, T) is not None


def test_near_ties_are_counted_and_bounded():
    logits = torch.zeros(100, VOCAB)
    tokens = _sample(logits, 1.0, 3)
    assert replay_sampling(logits, tokens, 1.0, 3, T.margin).near_ties == 0
    # Push the chosen token just below the runner-up at a few positions: tolerated near-ties.
    nudged = logits.clone()
    for position in range(0, 100, 10):
        nudged[position, tokens[position]] -= 10.0  # far beyond the margin: a mismatch
    stats = replay_sampling(nudged, tokens, 1.0, 3, T.margin)
    assert stats.mismatches == 10
    wide = SamplingThresholds(margin=100.0, max_near_tie_fraction=0.05, near_tie_slack=0)
    stats = replay_sampling(nudged, tokens, 1.0, 3, wide.margin)
    assert (stats.mismatches, stats.near_ties) == (0, 10)
    assert "10 near-tie tokens" in sampling_failure(stats, wide)
    assert sampling_failure(stats, wide.model_copy(update={"max_near_tie_fraction": 0.1})) is None


def test_length_termination():
    assert termination_failure([5] * 8, "length", 8, EOS) is None
    assert "expected exactly 8" in termination_failure([5] * 7, "length", 8, EOS)
    assert "exceed max_new_tokens" in termination_failure([5] * 9, "length", 8, EOS)
    assert "last token is EOS" in termination_failure([5] * 7 + [EOS], "length", 8, EOS)
    assert "followed by more tokens" in termination_failure([5, EOS, 5, 5], "length", 4, EOS)
    assert "empty output" in termination_failure([], "length", 4, EOS)
    assert "unknown finish reason" in termination_failure([5, EOS], "stop", 4, EOS)


def test_eos_termination_checks_structure_and_probability():
    assert termination_failure([5, 6, EOS], "eos", 8, EOS) is None
    assert "not EOS" in termination_failure([5, 6, 7], "eos", 8, EOS)
    assert "followed by more tokens" in termination_failure([5, EOS, 7, EOS], "eos", 8, EOS)
    likely = torch.zeros(VOCAB)
    likely[EOS] = 5.0
    assert eos_probability_failure(likely, EOS, 1.0, T) is None
    unlikely = torch.zeros(VOCAB)
    unlikely[EOS] = -40.0
    assert "improbable" in eos_probability_failure(unlikely, EOS, 1.0, T)
    assert eos_probability_failure(unlikely, EOS, 4.0, T) is None  # a hot sampler makes it plausible


def test_distribution_check_separates_samplers():
    honest, greedy, hot = [], [], []
    for seed in range(20):
        logits = _logits(50, seed, scale=2.0)
        honest.append(replay_sampling(logits, _sample(logits, 1.0, seed), 1.0, seed, T.margin))
        greedy.append(replay_sampling(logits, logits.argmax(1).tolist(), 1.0, seed, T.margin))
        hot.append(replay_sampling(logits, _sample(logits, 2.0, seed + 100), 1.0, seed, T.margin))
    z_honest, tokens = distribution_z(honest)
    assert tokens == 1000
    assert abs(z_honest) < 4
    assert distribution_failure(honest, T) is None
    assert distribution_z(greedy)[0] > 10 and "too likely" in distribution_failure(greedy, T)
    assert distribution_z(hot)[0] < -10 and "too unlikely" in distribution_failure(hot, T)


def test_distribution_z_is_standard_normal_over_honest_samples():
    zs = []
    for seed in range(120):
        logits = _logits(40, 1000 + seed, scale=1.5)
        zs.append(
            distribution_z([replay_sampling(logits, _sample(logits, 1.0, seed), 1.0, seed, T.margin)])[0]
        )
    mean = sum(zs) / len(zs)
    std = math.sqrt(sum((z - mean) ** 2 for z in zs) / len(zs))
    assert abs(mean) < 0.3 and 0.75 < std < 1.25


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one logits row per output token"):
        replay_sampling(_logits(3, 0), [1, 2], 1.0, 0, T.margin)


def test_replay_of_many_samples_matches_one_at_a_time(monkeypatch: pytest.MonkeyPatch):
    # The validator replays a whole file at once; each sample's verdict must be what it gets alone.
    logits, outputs, seeds = [], [], []
    for i in range(12):
        rows = _logits(5 + 7 * i, 50 + i, scale=0.5 + i)
        tokens = _sample(rows, 0.9, 900 + i)
        if i % 3 == 1:  # some samples with swapped tokens: mismatches at known positions
            tokens[i % 5] = (tokens[i % 5] + 1) % VOCAB
        logits.append(rows)
        outputs.append(tokens)
        seeds.append(900 + i)
    alone = [replay_sampling(r, o, 0.9, s, T.margin) for r, o, s in zip(logits, outputs, seeds)]
    assert sum(a.mismatches for a in alone) > 0 and any(a.mismatches == 0 for a in alone)
    for block in (sampling.REPLAY_BLOCK_ELEMENTS, 200 * VOCAB, 1):  # one pass, several groups, one per sample
        monkeypatch.setattr(sampling, "REPLAY_BLOCK_ELEMENTS", block)
        together = replay_samplings(logits, outputs, seeds, 0.9, T.margin)
        for a, b in zip(alone, together, strict=True):
            assert (a.tokens, a.near_ties, a.mismatches, a.first_mismatch, a.max_gap) == (
                b.tokens,
                b.near_ties,
                b.mismatches,
                b.first_mismatch,
                b.max_gap,
            )
            for field in ("logprob_sum", "expected_logprob_sum", "logprob_variance"):
                assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError):
        replay_samplings(logits, outputs[:-1], seeds, 0.9, T.margin)
