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
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from . import gf
from .errors import ProofError

TOPK = 128
CHUNK_ROWS = 32
MAX_MODULUS = gf.PRIME
BYTES_PER_CHUNK = 2 + 2 * TOPK  # 258
NO_MATCH_ERROR = float(2**64)  # toploc's mantissa statistic when every exponent mismatches
_EXP_MASK, _EXP_SHIFT, _MANT_MASK = 0x7F80, 7, 0x007F  # bf16 bit fields
_MODULUS_BLOCK = 64  # candidate moduli tested per vectorised step


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

    max_exp_mismatches: int = Field(40, ge=0, le=TOPK, description="Per chunk: top-k entries whose exponent differs.")
    max_mant_err_mean: float = Field(16.0, ge=0, description="Per chunk: mean |mantissa diff| where exponents agree.")
    max_mant_err_median: float = Field(8.0, ge=0, description="Per chunk: median |mantissa diff| where exponents agree.")
    max_typical_mant_err_mean: float = Field(
        1.1, ge=0, description="Per file: lower median over checked chunks of the chunk mean mantissa error."
    )
    min_typical_chunks: int = Field(
        8, ge=1, description="Fewest checked chunks the per-file bound applies to (fewer: per-chunk caps only)."
    )

    @classmethod
    def for_precision(cls, precision: Precision) -> ToplocThresholds:
        """The calibrated bounds for contributors that compute in `precision` (the validator: float32)."""
        return CALIBRATED[precision]


# Measured on the warm-started embedded model (docs/proofs.md, "Calibration"): float32 contributors
# reproduce a float32 validator almost exactly, so their bounds are tight; bfloat16 ones differ by
# rounding in every layer and need the loose set.
CALIBRATED: dict[str, ToplocThresholds] = {
    "float32": ToplocThresholds(max_exp_mismatches=8, max_mant_err_mean=1.0, max_mant_err_median=1.0,
                                max_typical_mant_err_mean=0.04, min_typical_chunks=1),
    "bfloat16": ToplocThresholds(),
}


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


def chunk_count(rows: int, chunk_rows: int = CHUNK_ROWS) -> int:
    return -(-rows // chunk_rows)


def proof_size(rows: int, chunk_rows: int = CHUNK_ROWS, topk: int = TOPK) -> int:
    """Bytes of the proof of `rows` committed rows: 258 per 32-row chunk by default."""
    return chunk_count(rows, chunk_rows) * (2 + 2 * topk)


def _as_bf16(hidden: torch.Tensor, topk: int, chunk_rows: int) -> torch.Tensor:
    if hidden.dim() != 2 or hidden.shape[0] == 0:
        raise ProofError(f"hidden states must be a non-empty (rows, hidden) matrix, got shape {tuple(hidden.shape)}")
    if hidden.shape[1] < topk:
        raise ProofError(f"hidden size {hidden.shape[1]} is smaller than top-k {topk}; use a wider model")
    if chunk_rows * hidden.shape[1] >= 2**31:
        raise ProofError("a chunk has 2^31 or more entries: the format's indices are 32-bit")
    hidden = hidden.detach().to("cpu", torch.bfloat16).contiguous()
    if not bool(torch.isfinite(hidden).all()):
        raise ProofError("hidden states contain NaN or infinite values (after rounding to bf16)")
    return hidden


def _chunk_topk(hidden: torch.Tensor, topk: int, chunk_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk: the top-k flat indices by magnitude and the bf16 bits there, shapes (chunks, k).

    Full chunks go through one batched torch.topk; the shorter last chunk through its own call, both on
    the same flattened bf16 layout toploc uses, so ties between equal magnitudes break the same way.
    """
    rows, width = hidden.shape
    full = rows // chunk_rows
    bits = hidden.view(torch.int16)
    indices, values = [], []
    if full:
        flat = hidden[: full * chunk_rows].reshape(full, chunk_rows * width)
        idx = flat.abs().topk(topk, dim=1).indices
        indices.append(idx)
        values.append(bits[: full * chunk_rows].reshape(full, -1).gather(1, idx))
    if rows > full * chunk_rows:
        flat = hidden[full * chunk_rows :].reshape(1, -1)
        idx = flat.abs().topk(topk, dim=1).indices
        indices.append(idx)
        values.append(bits[full * chunk_rows :].reshape(1, -1).gather(1, idx))
    index_array = torch.cat(indices).numpy().astype(np.int64)
    bit_array = torch.cat(values).numpy().astype(np.int64) & 0xFFFF
    return index_array, bit_array


def injective_moduli(x: np.ndarray) -> np.ndarray:
    """Per row of x (chunks, k): the largest m <= 65497 with the k values x mod m pairwise distinct."""
    chunks, k = x.shape
    result = np.zeros(chunks, dtype=np.int64)
    pending = np.arange(chunks)
    top = MAX_MODULUS
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
    parts = [_chunk_topk(_as_bf16(h, topk, chunk_rows), topk, chunk_rows) for h in hiddens]
    indices = np.concatenate([p[0] for p in parts])
    bits = np.concatenate([p[1] for p in parts])
    moduli = injective_moduli(indices)
    words = np.empty((len(moduli), 1 + topk), dtype=">u2")
    words[:, 0] = moduli
    words[:, 1:] = gf.interpolate(indices % moduli[:, None], bits)
    ends = np.cumsum([len(p[0]) for p in parts])
    return [words[end - len(p[0]) : end].tobytes() for p, end in zip(parts, ends, strict=True)]


def parse_proof(proof: bytes, chunks: int, topk: int = TOPK) -> tuple[np.ndarray, np.ndarray]:
    """Moduli (chunks,) and coefficients (chunks, k) of a proof, refusing any malformed encoding."""
    expected = chunks * (2 + 2 * topk)
    if len(proof) != expected:
        raise ProofError(f"proof is {len(proof)} bytes, expected {expected} ({chunks} chunks x {2 + 2 * topk})")
    words = np.frombuffer(proof, dtype=">u2").reshape(chunks, 1 + topk).astype(np.int64)
    moduli, coefficients = words[:, 0], words[:, 1:]
    bad = np.flatnonzero((moduli < topk) | (moduli > MAX_MODULUS))
    if bad.size:
        raise ProofError(f"chunk {bad[0]}: modulus {moduli[bad[0]]} outside [{topk}, {MAX_MODULUS}]")
    bad_rows = np.flatnonzero((coefficients >= gf.PRIME).any(axis=1))
    if bad_rows.size:
        raise ProofError(f"chunk {bad_rows[0]}: a coefficient is not a field element (>= {gf.PRIME})")
    return moduli, coefficients


def check_proof(
    proof: bytes, hidden: torch.Tensor, *, topk: int = TOPK, chunk_rows: int = CHUNK_ROWS
) -> list[ChunkStats]:
    """Compare a committed proof with the verifier's recomputed hidden states, chunk by chunk."""
    result = check_proofs([proof], [hidden], topk=topk, chunk_rows=chunk_rows)[0]
    if isinstance(result, ProofError):
        raise result
    return result


def check_proofs(
    proofs: Sequence[bytes], hiddens: Sequence[torch.Tensor], *, topk: int = TOPK, chunk_rows: int = CHUNK_ROWS
) -> list[list[ChunkStats] | ProofError]:
    """check_proof for many sequences, with one batched polynomial evaluation over all their chunks.

    Per sequence: its chunk statistics, or the ProofError that makes it malformed (so the caller can name
    the row); one malformed proof does not stop the others from being checked.
    """
    if len(proofs) != len(hiddens):
        raise ProofError(f"{len(proofs)} proofs for {len(hiddens)} hidden-state matrices")
    parsed: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | ProofError] = []
    for proof, hidden in zip(proofs, hiddens, strict=True):
        try:
            bf16 = _as_bf16(hidden, topk, chunk_rows)
            moduli, coefficients = parse_proof(proof, chunk_count(bf16.shape[0], chunk_rows), topk)
            parsed.append((moduli, coefficients, *_chunk_topk(bf16, topk, chunk_rows)))
        except ProofError as exc:
            parsed.append(exc)
    good = [p for p in parsed if not isinstance(p, ProofError)]
    if not good:
        return list(parsed)  # type: ignore[arg-type]  (every entry is a ProofError)
    moduli, coefficients, indices, bits = (np.concatenate([p[n] for p in good]) for n in range(4))
    stats = _chunk_stats(gf.evaluate(coefficients, indices % moduli[:, None]), bits)
    out: list[list[ChunkStats] | ProofError] = []
    start = 0
    for p in parsed:
        if isinstance(p, ProofError):
            out.append(p)
            continue
        out.append(stats[start : start + len(p[0])])
        start += len(p[0])
    return out


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
        return (f"typical chunk mean mantissa error {typical:.3g} > {thresholds.max_typical_mant_err_mean} "
                f"over {len(stats)} chunks (systematically different weights or precision)")
    return None
