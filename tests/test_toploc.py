"""TOPLOC commitments: field arithmetic against a scalar reference, format, honest and tampered checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from prime_node.proofs import gf
from prime_node.proofs.bounds import BYTES_PER_CHUNK, proof_size
from prime_node.proofs.errors import ProofError
from prime_node.proofs.sampling import SamplingThresholds
from prime_node.proofs.toploc import (
    ChunkStats,
    ToplocThresholds,
    build_proof,
    build_proofs,
    check_proof,
    check_proofs,
    committed_rows,
    injective_moduli,
    parse_proof,
    worst_failure,
)
from prime_node.proofs.verifier import VerifierSettings

P = gf.PRIME


def _newton_reference(x: list[int], y: list[int]) -> list[int]:
    """Newton divided differences expanded to ascending coefficients, scalar Python (as toploc does)."""
    n = len(x)
    dd = [v % P for v in y]
    for k in range(1, n):
        for i in range(n - 1, k - 1, -1):
            dd[i] = (dd[i] - dd[i - 1]) * pow((x[i] - x[i - k]) % P, P - 2, P) % P
    coeffs, factor = [0] * n, [1] + [0] * (n - 1)
    for i in range(n):
        coeffs = [(c + dd[i] * f) % P for c, f in zip(coeffs, factor)]
        factor = [((factor[j - 1] if j else 0) - x[i] * factor[j]) % P for j in range(n)]
    return coeffs


@pytest.mark.parametrize("k", [1, 2, 3, 7, 64, 128])
def test_interpolation_matches_scalar_newton(k: int):
    rng = np.random.default_rng(k)
    x = np.stack([rng.choice(P, k, replace=False) for _ in range(3)])
    y = rng.integers(0, 0xFF80, (3, k))
    coefficients = gf.interpolate(x, y)
    for row in range(3):
        assert coefficients[row].tolist() == _newton_reference(x[row].tolist(), y[row].tolist())
    assert np.array_equal(gf.evaluate(coefficients, x), y % P)
    assert gf.interpolate(x[:0], y[:0]).shape == (0, k)  # an empty batch is an empty answer, not an error


def _largest_injective(row: np.ndarray) -> int:
    return next(c for c in range(P, len(row) - 1, -1) if len(set((row % c).tolist())) == len(row))


def test_modulus_is_the_largest_injective_one():
    rng = np.random.default_rng(0)
    # Indices up to 2^20 collide modulo 65497 often, so several chunks need a smaller modulus; indices of a
    # wide model's chunk (32 x 4096 entries) exceed 65497 and mostly settle at the first candidate; a
    # 128-wide model's (< 4096) always do.
    bounds = [1 << 20] * 30 + [1 << 17] * 10 + [4096] * 4
    x = np.stack([rng.choice(bound, 128, replace=False) for bound in bounds])
    moduli = injective_moduli(x)
    assert moduli.tolist() == [_largest_injective(row) for row in x]
    assert (moduli < P).any() and (moduli[30:40] == P).any()  # both the search and the first candidate ran
    assert (moduli[40:] == P).all()
    with pytest.raises(ProofError, match="no modulus"):
        injective_moduli(np.r_[np.arange(127), 5][None, :])  # a repeated value collides under every modulus


def test_inverse_table_covers_the_field():
    values = np.arange(1, P)
    assert (values * gf.inverse(values) % P == 1).all()
    assert gf.inverse(np.array([P, 0]))[1] == 0  # documented: 0 (no inverse) maps to 0, as a^(p-2) does
    assert np.array_equal(gf.inverse(np.array([3, P + 3])), gf.pow_mod(np.array([3, 3]), P - 2))


def _hidden(rows: int, width: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("rows", [1, 31, 32, 33, 100])
def test_proof_size_is_258_bytes_per_started_chunk(rows: int):
    proof = build_proof(_hidden(rows))
    assert len(proof) == proof_size(rows) == BYTES_PER_CHUNK * (-(-rows // 32))
    moduli, _ = parse_proof(proof, -(-rows // 32))
    assert (moduli == P).all()  # 32 x 128 < 65497: every index is its own residue


def test_honest_recomputation_has_zero_error_and_same_bytes():
    hidden = _hidden(70)
    proof = build_proof(hidden)
    assert build_proof(hidden.clone()) == proof
    stats = check_proof(proof, hidden)
    assert len(stats) == 3
    assert all(s.exp_mismatches == 0 and s.mant_err_mean == 0 and s.mant_err_median == 0 for s in stats)
    assert worst_failure(stats, ToplocThresholds()) is None


def test_float_rounding_noise_passes_but_other_states_fail():
    hidden = _hidden(64)
    proof = build_proof(hidden)
    jitter = hidden * (1 + 1e-4 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)))
    assert worst_failure(check_proof(proof, jitter), ToplocThresholds()) is None
    for other in (_hidden(64, seed=5), hidden.flip(0)):
        stats = check_proof(proof, other)
        assert worst_failure(stats, ToplocThresholds()) is not None
        assert all(s.exp_mismatches > 32 for s in stats)
    # A 5% rescale keeps most exponents but moves every mantissa.
    scaled = check_proof(proof, hidden * 1.05)
    assert all(s.mant_err_median >= 4 for s in scaled)
    reason = worst_failure(
        scaled,
        ToplocThresholds(
            max_exp_mismatches=128, max_mant_err_mean=128, max_mant_err_median=128, min_typical_chunks=1
        ),
    )
    assert reason is not None and reason.startswith("typical chunk mean mantissa error")


def test_one_outlier_chunk_is_tolerated_a_systematic_shift_is_not():
    bf16 = ToplocThresholds.for_precision("bfloat16")
    ok = ChunkStats(1, 0.6, 1.0)  # a typical honest bf16-vs-fp32 chunk
    outlier = ChunkStats(19, 8.3, 3.0)  # the worst honest bf16-vs-fp32 chunk seen in calibration
    shifted = ChunkStats(6, 2.8, 2.0)  # a 5e-2 perturbation of one layer of the untrained model
    assert worst_failure([ok, outlier], bf16) is None
    assert bf16.min_typical_chunks == 8
    assert worst_failure([shifted] * 7, bf16) is None  # too few chunks for the per-file bound
    assert "typical" in worst_failure([shifted] * 8, bf16)  # enough of them: caught
    assert worst_failure([ok] * 30 + [outlier] * 2, bf16) is None
    assert "typical" in worst_failure([shifted] * 8 + [ok] * 7, bf16)
    assert "exponent mismatches" in worst_failure(
        [ok, ChunkStats(41, 0.5, 0.0)], bf16
    )  # another model: >= 42
    assert worst_failure([], bf16) is None


def test_float32_bounds_reject_what_bfloat16_bounds_tolerate():
    fp32 = ToplocThresholds.for_precision("float32")
    honest = ChunkStats(0, 0.01, 0.0)  # the worst honest float32 chunk: one rounding flip in 128
    perturbed = ChunkStats(0, 0.09, 0.0)  # a 5e-3 perturbation of one layer of the warm-started model
    assert worst_failure([honest] * 16, fp32) is None
    assert worst_failure([honest], fp32) is None
    assert "typical" in worst_failure([perturbed] * 3, fp32)
    assert worst_failure([perturbed] * 16, ToplocThresholds.for_precision("bfloat16")) is None
    assert "mean mantissa error" in worst_failure([honest] * 15 + [ChunkStats(2, 1.2, 1.0)], fp32)


def test_shuffled_or_foreign_chunks_fail():
    hidden = _hidden(64)
    proof = build_proof(hidden)
    swapped = proof[BYTES_PER_CHUNK:] + proof[:BYTES_PER_CHUNK]
    assert all(s.exp_mismatches > 32 for s in check_proof(swapped, hidden))
    foreign = build_proof(_hidden(64, seed=9))
    assert worst_failure(check_proof(foreign, hidden), ToplocThresholds()) is not None


def test_malformed_proofs_are_refused():
    hidden = _hidden(40)
    proof = build_proof(hidden)
    with pytest.raises(ProofError, match="expected 516"):
        check_proof(proof[:-1], hidden)
    with pytest.raises(ProofError, match="modulus 0"):
        check_proof(b"\x00\x00" + proof[2:], hidden)
    with pytest.raises(ProofError, match="not a field element"):
        check_proof(proof[:2] + b"\xff\xff" + proof[4:], hidden)


def test_bad_hidden_states_are_refused():
    with pytest.raises(ProofError, match="NaN or infinite"):
        build_proof(torch.full((4, 128), float("nan")))
    with pytest.raises(ProofError, match="smaller than top-k"):
        build_proof(torch.ones(4, 64))
    with pytest.raises(ProofError, match="non-empty"):
        build_proof(torch.ones(0, 128))


def test_committed_rows_are_the_states_that_produced_the_output():
    rows = committed_rows(prompt_len=5, output_len=3)
    assert (rows.start, rows.stop) == (4, 7)


def test_verifier_settings_pick_bounds_by_declared_precision():
    assert VerifierSettings().toploc_thresholds() == ToplocThresholds.for_precision("float32")
    assert VerifierSettings().sampling_thresholds() == SamplingThresholds()
    bf16 = VerifierSettings(node_precision="bfloat16")
    assert bf16.toploc_thresholds() == ToplocThresholds() and bf16.sampling_thresholds().margin == 1.0
    explicit = ToplocThresholds(max_typical_mant_err_mean=0.5)
    assert VerifierSettings(node_precision="bfloat16", toploc=explicit).toploc_thresholds() == explicit
    with pytest.raises(ValidationError):
        VerifierSettings(node_precision="float16")


def test_batched_proofs_equal_one_at_a_time() -> None:
    # Sequences of 1, 32, 33 and 70 rows: one chunk, exactly one, a full and a short one, several.
    hiddens = [_hidden(rows) for rows in (1, 32, 33, 70)]
    assert build_proofs(hiddens) == [build_proof(h) for h in hiddens]
    assert [len(p) for p in build_proofs(hiddens)] == [258, 258, 516, 774]
    assert build_proofs([]) == []


def test_batched_checks_equal_one_at_a_time_and_name_the_malformed_one() -> None:
    hiddens = [_hidden(rows, seed=rows) for rows in (3, 40, 70)]
    proofs = build_proofs(hiddens)
    noisy = [h + 0.05 * _hidden(h.shape[0], seed=99) for h in hiddens]  # another "model": stats differ
    batched = check_proofs([proofs[0], proofs[1][:-2], proofs[2]], noisy)
    assert batched[0] == check_proof(proofs[0], noisy[0]) and batched[2] == check_proof(proofs[2], noisy[2])
    assert isinstance(batched[1], ProofError) and "bytes" in str(batched[1])
    assert any(s.exp_mismatches or s.mant_err_mean for s in batched[2])


def _chunk_points(chunk: torch.Tensor) -> tuple[list[int], list[int]]:
    """toploc's own selection: one torch.topk call on one flattened bf16 chunk."""
    flat = chunk.reshape(-1)
    indices = flat.abs().topk(128).indices
    return indices.tolist(), [v & 0xFFFF for v in flat.view(torch.int16)[indices].tolist()]


def _reference_proof(hidden: torch.Tensor) -> bytes:
    """One chunk at a time and scalar: the chunk's own top-k, brute-force modulus, Newton interpolation."""
    bf16, out = hidden.to(torch.bfloat16), b""
    for start in range(0, bf16.shape[0], 32):
        x, y = _chunk_points(bf16[start : start + 32])
        m = _largest_injective(np.array(x))
        out += np.array([m, *_newton_reference([v % m for v in x], y)], dtype=">u2").tobytes()
    return out


def _reference_stats(proof: bytes, hidden: torch.Tensor) -> list[tuple[int, float, float]]:
    bf16, out = hidden.to(torch.bfloat16), []
    for n, start in enumerate(range(0, bf16.shape[0], 32)):
        m, *coefficients = np.frombuffer(proof, ">u2").reshape(-1, 129)[n].tolist()
        errors, mismatches = [], 0
        for x, y in zip(*_chunk_points(bf16[start : start + 32])):
            committed = sum(c * pow(x % m, t, P) for t, c in enumerate(coefficients)) % P
            if (committed >> 7) & 0xFF != (y >> 7) & 0xFF:
                mismatches += 1
            else:
                errors.append(abs((committed & 0x7F) - (y & 0x7F)))
        errors.sort()
        no_match = float(2**64)
        out.append(
            (
                mismatches,
                sum(errors) / len(errors) if errors else no_match,
                float(errors[len(errors) // 2]) if errors else no_match,
            )
        )
    return out


@pytest.mark.parametrize("kind", ["randn", "rounded", "equal magnitudes"])
def test_batched_build_and_check_equal_a_chunk_at_a_time_scalar_reference(kind: str) -> None:
    # Batching puts chunks of different sequences (full ones, and short last ones of equal length) into one
    # torch.topk call; ties between equal magnitudes must still break as in a call on the chunk alone.
    generator = torch.Generator().manual_seed(len(kind))
    shapes = ((1, 128), (31, 128), (33, 128), (70, 128), (86, 128), (38, 128), (40, 160))
    hiddens = [torch.randn(rows, width, generator=generator) * 3 for rows, width in shapes]
    if kind == "rounded":  # magnitudes repeat (integers up to ~15): ties across the top-k boundary
        hiddens = [h.round() for h in hiddens]
    elif kind == "equal magnitudes":  # every entry ties: the selection is torch's tie-breaking alone
        hiddens = [torch.sign(h) + (h == 0) for h in hiddens]
    proofs = build_proofs(hiddens)
    assert proofs == [_reference_proof(h) for h in hiddens]
    other = [h * (1 + 0.02 * torch.randn(h.shape, generator=generator)) for h in hiddens]
    checked = check_proofs(proofs, other)
    assert [[(s.exp_mismatches, s.mant_err_mean, s.mant_err_median) for s in stats] for stats in checked] == [
        _reference_stats(p, h) for p, h in zip(proofs, other)
    ]
    assert any(s.exp_mismatches or s.mant_err_mean for stats in checked for s in stats)


def test_one_non_finite_entry_anywhere_is_refused() -> None:
    hiddens = [_hidden(rows, seed=rows) for rows in (40, 70, 3)]
    proofs = build_proofs(hiddens)
    for row, column, value in ((69, 127, float("inf")), (0, 0, float("nan")), (33, 5, float("-inf"))):
        bad = [h.clone() for h in hiddens]
        bad[1][row, column] = value
        with pytest.raises(ProofError, match="NaN or infinite"):
            build_proofs(bad)
        results = check_proofs(proofs, bad)
        assert isinstance(results[1], ProofError) and "NaN or infinite" in str(results[1])
        assert results[0] == check_proof(proofs[0], hiddens[0])
        assert results[2] == check_proof(proofs[2], hiddens[2])
