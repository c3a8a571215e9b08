"""Counter-based Gumbel noise: the replayable randomness behind sampling proofs (TOPLOC v2 style).

A sampled token is argmax(logits / T + g) where g[v] is Gumbel noise for vocabulary entry v, keyed only
by (sample seed, output position, v). Because the noise is a pure function of those integers, a verifier
replays it exactly, whatever device, batch composition or thread count the sampler used.

The generator hashes the counter with the `lowbias32` integer mixer (C. Wellons) in int64 tensor
arithmetic. Multiplications are split into 16-bit halves so no intermediate exceeds 2^49: the result is
bit-identical on CPU and CUDA (no reliance on signed-overflow behaviour). The uniform draw uses 24 bits,
exactly representable in float32; the double log is computed in float64 and rounded to float32, so the
remaining device difference is at most one float32 ulp of g, far below the verifier's margin.

On CPU the same arithmetic runs in numpy uint32, where multiplication wraps modulo 2^32 by definition:
one multiply instead of the six operations of the split form, about ten times faster, and bit-identical
(tests/test_gumbel.py checks both paths against each other). Replaying the noise is most of a validator's
sampling check, so this is where verification time goes.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x846CA68B
# Distinct odd constants separate the roles of the counter words, so (seed, pos) never aliases (pos, seed).
_SEED_HI_SALT = 0x9E3779B9
_POSITION_SALT = 0x85EBCA6B
_VOCAB_SALT = 0xC2B2AE35
MAX_SEED = 2**63 - 1


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for 0 <= x < 2^32 held in int64, without any intermediate overflow."""
    low = (x & 0xFFFF) * constant
    high = ((x >> 16) * constant) & 0xFFFF
    return (low + (high << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MUL_2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position) pair; int64 tensors of equal shape, seeds in [0, 2^63)."""
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    key = _mix32(seed_hi ^ _SEED_HI_SALT)
    key = _mix32(key ^ seed_lo)
    return _mix32(key ^ ((positions & _MASK32) ^ _POSITION_SALT))


def _mix32_u32(x: np.ndarray) -> np.ndarray:
    """_mix32 on uint32 arrays (wrapping multiplication is exact modulo 2^32 here), in place: x is
    overwritten and returned (fresh temporaries per step cost more than the arithmetic at this size)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(_MIX_MUL_1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_MIX_MUL_2)
    x ^= x >> np.uint32(16)
    return x


def _uniform_noise_numpy(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    with np.errstate(over="ignore"):  # numpy scalars (0-d inputs) warn on the wrap-around that is intended
        return _uniform_noise_numpy_unchecked(seeds, positions, vocab_size)


def _uniform_noise_numpy_unchecked(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    s = seeds.to(torch.int64).numpy().astype(np.uint64)
    seed_lo = (s & np.uint64(_MASK32)).astype(np.uint32)
    seed_hi = ((s >> np.uint64(32)) & np.uint64(_MASK32)).astype(np.uint32)
    pos = (positions.to(torch.int64).numpy().astype(np.uint64) & np.uint64(_MASK32)).astype(np.uint32)
    key = _mix32_u32(seed_hi ^ np.uint32(_SEED_HI_SALT))
    key = _mix32_u32(key ^ seed_lo)
    key = _mix32_u32(key ^ (pos ^ np.uint32(_POSITION_SALT)))[..., None]
    vocab = np.arange(vocab_size, dtype=np.uint32)
    bits = _mix32_u32(key ^ (vocab * np.uint32(_VOCAB_SALT)))
    bits ^= vocab
    bits = _mix32_u32(bits) >> np.uint32(8)
    uniform = bits.astype(np.float64)
    uniform += 0.5
    uniform *= 2.0**-24
    return torch.from_numpy(uniform)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform draws in (0, 1), float64, shape (*seeds.shape, vocab_size), on the seeds' device."""
    if seeds.device.type == "cpu" and positions.device.type == "cpu":
        seeds, positions = torch.broadcast_tensors(seeds, positions)
        return _uniform_noise_numpy(seeds, positions, vocab_size)
    return _uniform_noise_torch(seeds, positions, vocab_size)


def _uniform_noise_torch(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    keys = row_keys(seeds, positions).unsqueeze(-1)
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    bits = _mix32(_mix32(keys ^ _mul32(vocab, _VOCAB_SALT)) ^ vocab)
    return ((bits >> 8).to(torch.float64) + 0.5) * (2.0**-24)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float32, shape (*seeds.shape, vocab_size): -log(-log(U))."""
    # In place on the fresh draws: the same operations as -log(-log(u)), without a new float64 buffer
    # (and its page faults) per step, which cost more than the logarithms.
    return uniform_noise(seeds, positions, vocab_size).log_().neg_().log_().neg_().to(torch.float32)


def perturbed_scores(logits: torch.Tensor, temperature: float, noise: torch.Tensor) -> torch.Tensor:
    """logits / T + g in float32: the quantity whose argmax is the sampled token."""
    if not temperature > 0:
        raise ValueError(f"Gumbel sampling needs a temperature > 0, got {temperature}")
    return logits.to(torch.float32) / temperature + noise.to(logits.device)


def gumbel_argmax(
    logits: torch.Tensor, temperature: float, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Sample one token per row of `logits` (shape (..., V)) with replayable Gumbel-max sampling."""
    noise = gumbel_noise(seeds.to(logits.device), positions.to(logits.device), logits.shape[-1])
    return perturbed_scores(logits, temperature, noise).argmax(dim=-1)
