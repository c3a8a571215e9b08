"""TOPLOC commitments to last hidden states, byte-compatible with the public `toploc` 0.1.6 format.

A proof commits to the hidden states that produced a sample's output tokens (see `committed_rows`),
cut into chunks of 32 rows. Per chunk: flatten the bf16 states, take the top-k (k = 128) entries by
magnitude; x = flat index mod the largest m <= 65497 under which the k indices stay distinct; y = the
entry's bf16 bit pattern; interpolate the degree < k polynomial through the points over GF(65497);
serialise big-endian u16 m followed by the k u16 coefficients (ascending): 258 bytes per chunk. This is
exactly what `toploc.build_proofs_bytes(rows, decode_batching_size=32, topk=128, skip_prefill=True)`
emits for the same rows.

A verifier recomputes the states by prefill, takes its own top-k per chunk, evaluates the committed
polynomial at those indices and compares bit fields: the number of exponent mismatches, and the mean and
median absolute mantissa difference where exponents agree (the median is the upper one, element n // 2
of the sorted errors, as toploc's C++ verifier computes it). Honest recomputation differs only by
rounding, so mismatches are rare and mantissa errors tiny; different weights, inputs or precision move
many top-k entries and their bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import gf
from .bounds import CHUNK_ROWS, TOPK, ToplocThresholds, chunk_count
from .errors import ProofError

MAX_MODULUS = gf.PRIME
NO_MATCH_ERROR = float(2**64)  # toploc's mantissa statistic when every exponent mismatches
_EXP_MASK, _EXP_SHIFT, _MANT_MASK = 0x7F80, 7, 0x007F  # bf16 bit fields
_MODULUS_BLOCK = 64  # candidate moduli tested per vectorised step
_NOT_FINITE = "hidden states contain NaN or infinite values (after rounding to bf16)"


@dataclass(frozen=True)
class ChunkStats:
    """How far a committed chunk is from the verifier's recomputation (all are errors: lower is better)."""

    exp_mismatches: int  # committed and recomputed exponent differ, out of the verifier's top-k
    mant_err_mean: float  # mean |mantissa difference| where exponents agree (2^64 if none agree)
    mant_err_median: float  # upper median of the same

    def failure(self, thresholds: ToplocThresholds) -> str | None:
        """Why this chunk fails the thresholds, or None when it passes."""
        if self.exp_mismatches > thresholds.max_exp_mismatches:
            return f"{self.exp_mismatches} exponent mismatches > {thresholds.max_exp_mismatches}"
        if not self.mant_err_mean <= thresholds.max_mant_err_mean:
            return f"mean mantissa error {self.mant_err_mean:.3g} > {thresholds.max_mant_err_mean}"
        if not self.mant_err_median <= thresholds.max_mant_err_median:
            return f"median mantissa error {self.mant_err_median:.3g} > {thresholds.max_mant_err_median}"
        return None


def committed_rows(prompt_len: int, output_len: int) -> slice:
    """Rows of prompt+output hidden states that a proof covers: those that produced the output tokens.

    Row i is the state at input position i, so output token t came from row prompt_len - 1 + t. The
    first covered row already depends on the whole prompt, so prompt tampering is covered as well.
    """
    return slice(prompt_len - 1, prompt_len - 1 + output_len)


def _as_bf16(hidden: torch.Tensor, topk: int, chunk_rows: int) -> torch.Tensor:
    if hidden.dim() != 2 or hidden.shape[0] == 0:
        raise ProofError(
            f"hidden states must be a non-empty (rows, hidden) matrix, got shape {tuple(hidden.shape)}"
        )
    if hidden.shape[1] < topk:
        raise ProofError(f"hidden size {hidden.shape[1]} is smaller than top-k {topk}; use a wider model")
    if chunk_rows * hidden.shape[1] >= 2**31:
        raise ProofError("a chunk has 2^31 or more entries: the format's indices are 32-bit")
    return hidden.detach().to("cpu", torch.bfloat16).contiguous()  # finiteness: checked per chunk


def _chunks_topk(
    matrices: Sequence[torch.Tensor], topk: int, chunk_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per chunk of every bf16 matrix (matrix by matrix, chunk by chunk): the top-k flat indices by
    magnitude and the bf16 bits there, both (chunks, k) int64, and whether all its entries are finite.

    Chunks of equal shape, from all matrices, share one torch.topk call: the full 32-row ones, and the
    shorter last chunks grouped by row count. Each chunk is one row of the call on the same flattened
    bf16 layout toploc uses, and torch's CPU top-k selects every row on its own (a fresh selection per
    row, its algorithm picked by k and the row length alone), so ties between equal magnitudes break as
    in toploc's own one-chunk-at-a-time calls; batching only removes the per-call overhead.
    """
    groups: dict[tuple[int, int], tuple[list[torch.Tensor], list[np.ndarray]]] = {}
    total = 0
    for matrix in matrices:
        rows, width = matrix.shape
        full = rows // chunk_rows
        if full:
            blocks, slots = groups.setdefault((chunk_rows, width), ([], []))
            blocks.append(matrix[: full * chunk_rows])
            slots.append(np.arange(total, total + full))
        if rows > full * chunk_rows:
            blocks, slots = groups.setdefault((rows - full * chunk_rows, width), ([], []))
            blocks.append(matrix[full * chunk_rows :])
            slots.append(np.array([total + full]))
        total += chunk_count(rows, chunk_rows)
    indices = np.empty((total, topk), dtype=np.int64)
    bits = np.empty((total, topk), dtype=np.int64)
    finite = np.empty(total, dtype=bool)
    for (rows, width), (blocks, slots) in groups.items():
        flat = (torch.cat(blocks) if len(blocks) > 1 else blocks[0]).reshape(-1, rows * width)
        magnitudes = flat.abs()
        slot = np.concatenate(slots)
        finite[slot] = (magnitudes.amax(dim=1) < float("inf")).numpy()  # amax propagates NaN; inf is no < inf
        idx = magnitudes.topk(topk, dim=1).indices
        indices[slot] = idx.numpy()
        bits[slot] = flat.view(torch.int16).gather(1, idx).numpy()
    bits &= 0xFFFF  # the int16 view sign-extended; the format's y is the unsigned bit pattern
    return indices, bits, finite


def injective_moduli(x: np.ndarray) -> np.ndarray:
    """Per row of x (chunks, k): the largest m <= 65497 with the k values x mod m pairwise distinct.

    The top candidate settles every row whose values are distinct mod 65497, which is every chunk of a
    model with 32 x hidden <= 65497 (the flat indices are then their own residues): one (chunks, k) sort.
    Only the rows it leaves go through the search below, 64 candidates per vectorised step.
    """
    chunks, k = x.shape
    result = np.zeros(chunks, dtype=np.int64)
    first = np.sort(x % MAX_MODULUS, axis=1)
    settled = (np.diff(first, axis=1) != 0).all(axis=1)
    result[settled] = MAX_MODULUS
    pending = np.flatnonzero(~settled)
    top = MAX_MODULUS - 1
    while pending.size:
        if top < k:
            raise ProofError(f"no modulus >= {k} keeps the top-k indices distinct")
        candidates = np.arange(top, max(top - _MODULUS_BLOCK, k - 1), -1)
        residues = np.sort(x[pending, None, :] % candidates[None, :, None], axis=-1)
        distinct = (np.diff(residues, axis=-1) != 0).all(axis=-1)  # (pending, candidates)
        found = distinct.any(axis=1)
        result[pending[found]] = candidates[distinct[found].argmax(axis=1)]
        pending = pending[~found]
        top = int(candidates[-1]) - 1
    return result


def build_proof(hidden: torch.Tensor, *, topk: int = TOPK, chunk_rows: int = CHUNK_ROWS) -> bytes:
    """Commit to `hidden` (rows, hidden): one 258-byte polynomial per 32-row chunk, concatenated."""
    return build_proofs([hidden], topk=topk, chunk_rows=chunk_rows)[0]


def build_proofs(
    hiddens: Sequence[torch.Tensor], *, topk: int = TOPK, chunk_rows: int = CHUNK_ROWS
) -> list[bytes]:
    """build_proof for many sequences at once: the chunks of all of them share one batched interpolation.

    Short completions (a few tokens: one chunk each) made the per-call overhead of interpolating one chunk
    at a time cost about as much as generating them; batched, it is a handful of array passes per batch.
    """
    if not hiddens:
        return []
    matrices = [_as_bf16(h, topk, chunk_rows) for h in hiddens]
    indices, bits, finite = _chunks_topk(matrices, topk, chunk_rows)
    if not finite.all():
        raise ProofError(_NOT_FINITE)
    moduli = injective_moduli(indices)
    words = np.empty((len(moduli), 1 + topk), dtype=">u2")
    words[:, 0] = moduli
    words[:, 1:] = gf.interpolate(indices % moduli[:, None], bits)
    bounds = np.cumsum([0] + [chunk_count(m.shape[0], chunk_rows) for m in matrices])
    return [words[start:end].tobytes() for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def parse_proof(proof: bytes, chunks: int, topk: int = TOPK) -> tuple[np.ndarray, np.ndarray]:
    """Moduli (chunks,) and coefficients (chunks, k) of a proof, refusing any malformed encoding."""
    expected = chunks * (2 + 2 * topk)
    if len(proof) != expected:
        raise ProofError(
            f"proof is {len(proof)} bytes, expected {expected} ({chunks} chunks x {2 + 2 * topk})"
        )
    words = np.frombuffer(proof, dtype=">u2").reshape(chunks, 1 + topk).astype(np.int64)
    moduli, coefficients = words[:, 0], words[:, 1:]
    if not chunks or (moduli.min() >= topk and moduli.max() <= MAX_MODULUS and coefficients.max() < gf.PRIME):
        return moduli, coefficients  # the common case: three reductions, no index searches
    bad = np.flatnonzero((moduli < topk) | (moduli > MAX_MODULUS))
    if bad.size:
        raise ProofError(f"chunk {bad[0]}: modulus {moduli[bad[0]]} outside [{topk}, {MAX_MODULUS}]")
    bad_rows = np.flatnonzero((coefficients >= gf.PRIME).any(axis=1))
    raise ProofError(f"chunk {bad_rows[0]}: a coefficient is not a field element (>= {gf.PRIME})")


def check_proof(
    proof: bytes, hidden: torch.Tensor, *, topk: int = TOPK, chunk_rows: int = CHUNK_ROWS
) -> list[ChunkStats]:
    """Compare a committed proof with the verifier's recomputed hidden states, chunk by chunk."""
    result = check_proofs([proof], [hidden], topk=topk, chunk_rows=chunk_rows)[0]
    if isinstance(result, ProofError):
        raise result
    return result


def check_proofs(
    proofs: Sequence[bytes],
    hiddens: Sequence[torch.Tensor],
    *,
    topk: int = TOPK,
    chunk_rows: int = CHUNK_ROWS,
) -> list[list[ChunkStats] | ProofError]:
    """check_proof for many sequences, with one batched polynomial evaluation over all their chunks.

    Per sequence: its chunk statistics, or the ProofError that makes it malformed (so the caller can name
    the row); one malformed proof does not stop the others from being checked.
    """
    if len(proofs) != len(hiddens):
        raise ProofError(f"{len(proofs)} proofs for {len(hiddens)} hidden-state matrices")
    results: list[list[ChunkStats] | ProofError | None] = [None] * len(proofs)
    matrices: list[torch.Tensor] = []
    members: list[int] = []  # the sequence of each matrix
    for n, hidden in enumerate(hiddens):
        try:
            matrices.append(_as_bf16(hidden, topk, chunk_rows))
            members.append(n)
        except ProofError as exc:
            results[n] = exc
    indices, bits, finite = _chunks_topk(matrices, topk, chunk_rows)
    bounds = np.cumsum([0] + [chunk_count(m.shape[0], chunk_rows) for m in matrices])
    checked: list[
        tuple[int, np.ndarray, np.ndarray, np.ndarray]
    ] = []  # sequence, chunks, moduli, coefficients
    for n, start, end in zip(members, bounds[:-1], bounds[1:], strict=True):
        try:
            if not finite[start:end].all():
                raise ProofError(_NOT_FINITE)
            checked.append((n, np.arange(start, end), *parse_proof(proofs[n], end - start, topk)))
        except ProofError as exc:
            results[n] = exc
    if checked:
        chunks, moduli, coefficients = (np.concatenate([c[i] for c in checked]) for i in (1, 2, 3))
        stats = _chunk_stats(gf.evaluate(coefficients, indices[chunks] % moduli[:, None]), bits[chunks])
        position = 0
        for n, own, _, _ in checked:
            results[n] = stats[position : position + len(own)]
            position += len(own)
    # Each entry is now a list or a ProofError.
    return results  # type: ignore[return-value]


def _chunk_stats(committed: np.ndarray, bits: np.ndarray) -> list[ChunkStats]:
    """Per chunk (rows of both arrays): exponent mismatches and mantissa errors where exponents agree."""
    exp_mismatch = ((committed & _EXP_MASK) >> _EXP_SHIFT) != ((bits & _EXP_MASK) >> _EXP_SHIFT)
    mant_err = np.abs((committed & _MANT_MASK) - (bits & _MANT_MASK))
    agree = (~exp_mismatch).sum(axis=1)
    mean = np.where(exp_mismatch, 0, mant_err).sum(axis=1) / np.maximum(agree, 1)
    # Mismatched entries sort last (errors are < 128), so element agree // 2 is the upper median.
    ordered = np.sort(np.where(exp_mismatch, 1 << 16, mant_err), axis=1)
    median = np.take_along_axis(ordered, (agree // 2)[:, None], axis=1)[:, 0]
    return [
        ChunkStats(int(m), float(mu) if n else NO_MATCH_ERROR, float(md) if n else NO_MATCH_ERROR)
        for m, mu, md, n in zip(exp_mismatch.sum(axis=1), mean, median, agree, strict=True)
    ]


def typical_mant_err_mean(stats: list[ChunkStats]) -> float:
    """The lower median over chunks of their mean mantissa error (0 when there are none)."""
    means = sorted(s.mant_err_mean for s in stats)
    return means[(len(means) - 1) // 2] if means else 0.0


def worst_failure(stats: list[ChunkStats], thresholds: ToplocThresholds) -> str | None:
    """The first chunk over a per-chunk cap, or the typical error over its bound, or None."""
    for i, chunk in enumerate(stats):
        reason = chunk.failure(thresholds)
        if reason is not None:
            return f"chunk {i}: {reason}"
    typical = typical_mant_err_mean(stats)
    if len(stats) >= thresholds.min_typical_chunks and typical > thresholds.max_typical_mant_err_mean:
        return (
            f"typical chunk mean mantissa error {typical:.3g} > {thresholds.max_typical_mant_err_mean} "
            f"over {len(stats)} chunks (systematically different weights or precision)"
        )
    return None
