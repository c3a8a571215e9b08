"""Batched polynomial arithmetic over GF(65497), the field of TOPLOC commitments.

Every function works on a batch of independent problems at once (leading axes). Field elements are
< 65497 < 2^16, so a product is < 2^32 and sums of up to 2^20 products are exact integers in float64.
Python loops run only over log2(k) levels or exponent bits, never over elements, so interpolating
thousands of 128-point chunks costs a handful of array passes.

Interpolation uses the Lagrange form P(X) = sum_i a_i M(X) / (X - x_i), with M(X) = prod_j (X - x_j)
and a_i = y_i / M'(x_i). Dividing M by (X - x_i) has the closed form q_ij = sum_{l>j} m_l x_i^(l-1-j),
so the coefficients collapse to c_j = sum_{r>=0} m_{j+1+r} s_r with power sums s_r = sum_i a_i x_i^r:
gathers from a cached power table and batched matrix products instead of k synthetic divisions. The
products run in float64 BLAS, exact because every partial sum stays below 2^53. The interpolating
polynomial of degree < k through k distinct points is unique, so any correct method gives the very
coefficients the reference implementation (`toploc`, Newton divided differences) produces.
"""

from __future__ import annotations

import functools

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

PRIME = 65497  # the prime modulus fixed by the public TOPLOC format
_EXACT_TERMS = 1 << 20  # float64 sums of up to this many products < p^2 stay exact (< 2^53)


@functools.lru_cache(maxsize=2)
def _power_rows(count: int) -> np.ndarray:
    """v^t mod p for every field element v and t in [0, count), uint16 (16 MiB for count = 128).

    Built once by repeated doubling; afterwards every power table is a gather, which is what makes
    building and checking commitments cheap enough to run beside generation.
    """
    values = np.arange(PRIME, dtype=np.int64)
    table = np.ones((PRIME, 1), dtype=np.int64)
    base = values.copy()  # v^(current table width)
    while table.shape[1] < count:
        table = np.concatenate([table, table * base[:, None] % PRIME], axis=1)
        base = base * base % PRIME
    table = table[:, :count].astype(np.uint16)
    table.setflags(write=False)
    return table


def power_table(x: np.ndarray, count: int) -> np.ndarray:
    """x^t mod p for t in [0, count) as float64 (exact integers): shape (*x.shape, count)."""
    return _power_rows(count)[np.asarray(x, dtype=np.int64) % PRIME].astype(np.float64)


def _matmul_mod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a @ b) mod p for float64 arrays of field elements: BLAS speed, exact because every partial sum
    of products below p^2 stays under 2^53 (the inner dimension is bounded by _EXACT_TERMS)."""
    if a.shape[-1] > _EXACT_TERMS:
        raise ValueError(f"inner dimension {a.shape[-1]} too large for exact float64 accumulation")
    return np.rint(a @ b).astype(np.int64) % PRIME


def pow_mod(a: np.ndarray, exponent: int) -> np.ndarray:
    """a^exponent mod p element-wise (square-and-multiply over the exponent's bits)."""
    result = np.ones_like(a, dtype=np.int64)
    base = a.astype(np.int64) % PRIME
    while exponent:
        if exponent & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        exponent >>= 1
    return result


def inverse(a: np.ndarray) -> np.ndarray:
    """Multiplicative inverse mod p (Fermat); the caller guarantees a != 0 mod p."""
    return pow_mod(a, PRIME - 2)


def poly_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Products of batched polynomials (ascending coefficients, same leading shape) mod p."""
    n, m = a.shape[-1], b.shape[-1]
    zeros = np.zeros((*b.shape[:-1], n - 1), np.float64)
    padded = np.concatenate([zeros, b.astype(np.float64), zeros], axis=-1)
    # out[t] = sum_v a[n-1-v] * padded[t+v]: sliding windows of b against a reversed, one batched product.
    windows = sliding_window_view(padded, n, axis=-1)  # (..., n + m - 1, n), a view
    return _matmul_mod(windows, a[..., ::-1].astype(np.float64)[..., None])[..., 0]


def root_product(x: np.ndarray) -> np.ndarray:
    """Coefficients (ascending, length k + 1) of prod_j (X - x_j) for x of shape (..., k)."""
    k = x.shape[-1]
    width = 1 << max(k - 1, 0).bit_length()
    level = np.zeros((*x.shape[:-1], width, 2), dtype=np.int64)
    level[..., :k, 0] = (-x) % PRIME
    level[..., :k, 1] = 1
    level[..., k:, 0] = 1  # padding leaves are the constant polynomial 1
    while level.shape[-2] > 1:  # a product tree: log2(k) levels of pairwise products
        level = poly_mul(level[..., 0::2, :], level[..., 1::2, :])
    return level[..., 0, : k + 1]


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients (ascending, length k) of the polynomial of degree < k through (x_i, y_i) mod p.

    x, y: int arrays of shape (..., k); the x_i of each problem must be distinct mod p.
    """
    x = x.astype(np.int64) % PRIME
    y = y.astype(np.int64) % PRIME
    k = x.shape[-1]
    roots = root_product(x)  # m_0 .. m_k
    powers = power_table(x, k)  # (..., k, k): x_i^t
    derivative = roots[..., 1:] * np.arange(1, k + 1) % PRIME  # coefficients of M'
    slopes = _matmul_mod(powers, derivative.astype(np.float64)[..., None])[..., 0]  # M'(x_i) != 0
    weights = y * inverse(slopes) % PRIME  # a_i = y_i / M'(x_i)
    power_sums = _matmul_mod(weights.astype(np.float64)[..., None, :], powers)[..., 0, :]  # s_r
    extended = np.concatenate([roots[..., 1:], np.zeros((*roots.shape[:-1], k - 1), np.int64)], axis=-1)
    hankel = sliding_window_view(extended.astype(np.float64), k, axis=-1)  # [j, r] = m_{j+1+r}, a view
    return _matmul_mod(hankel, power_sums.astype(np.float64)[..., None])[..., 0]


def evaluate(coefficients: np.ndarray, x: np.ndarray) -> np.ndarray:
    """P(x) mod p for batched coefficients (..., k) at batched points (..., n)."""
    k = coefficients.shape[-1]
    return _matmul_mod(power_table(x, k), coefficients.astype(np.float64)[..., None])[..., 0]
