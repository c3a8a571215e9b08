"""Batched polynomial arithmetic over GF(65497), the field of TOPLOC commitments.

Every function works on a batch of independent problems at once (leading axes). Field elements are
< 65497 < 2^16, so a product is < 2^32 and sums of up to 2^20 products are exact integers in float64.
Python loops run only over log2(k) levels, exponent bits or a few coefficients, never over elements,
so interpolating thousands of 128-point chunks costs a handful of array passes.

Interpolation uses the Lagrange form P(X) = sum_i a_i M(X) / (X - x_i), with M(X) = prod_j (X - x_j)
and a_i = y_i / M'(x_i). Dividing M by (X - x_i) has the closed form q_ij = sum_{l>j} m_l x_i^(l-1-j),
so the coefficients collapse to c_j = sum_{r>=0} m_{j+1+r} s_r with power sums s_r = sum_i a_i x_i^r:
gathers from a cached power table and batched matrix products instead of k synthetic divisions. The
products run in float64 BLAS, exact because every partial sum stays below 2^53. The interpolating
polynomial of degree < k through k distinct points is unique, so any correct method gives the very
coefficients the reference implementation (`toploc`, Newton divided differences) produces.

Products of polynomials (M's product tree, and the sums c_j, which are the upper half of the product of
m and the reversed s) run coefficient-major, shape (coefficients, batch): short factors by schoolbook
multiplication, long ones by evaluation at fixed points 0, 1, ..., pointwise products and interpolation
with a fixed Lagrange basis, i.e. plain matrix products with the whole batch as one operand.
"""

from __future__ import annotations

import functools

import numpy as np

PRIME = 65497  # the prime modulus fixed by the public TOPLOC format
_EXACT_TERMS = 1 << 20  # float64 sums of up to this many products < p^2 stay exact (< 2^53)
_SCHOOLBOOK_MAX = 12  # factors up to this many coefficients multiply term by term (fewer array passes)


def reduce(a: np.ndarray) -> np.ndarray:
    """a mod p for an int64 array, as `a % p` gives it. numpy divides int64 by a scalar with a multiply
    and shift (libdivide) but computes `%` with a hardware division per element, 2-4x slower; and almost
    every pass over the data here ends in a reduction."""
    return a - a // PRIME * PRIME


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
        table = np.concatenate([table, reduce(table * base[:, None])], axis=1)
        base = reduce(base * base)
    table = table[:, :count].astype(np.uint16)
    table.setflags(write=False)
    return table


def power_table(x: np.ndarray, count: int) -> np.ndarray:
    """x^t mod p for t in [0, count) as float64 (exact integers): shape (*x.shape, count)."""
    return _power_rows(count)[reduce(np.asarray(x, dtype=np.int64))].astype(np.float64)


def _matmul_mod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a @ b) mod p for float64 arrays of field elements: BLAS speed, exact because every partial sum
    of products below p^2 stays under 2^53 (the inner dimension is bounded by _EXACT_TERMS)."""
    if a.shape[-1] > _EXACT_TERMS:
        raise ValueError(f"inner dimension {a.shape[-1]} too large for exact float64 accumulation")
    return reduce((a @ b).astype(np.int64))  # exact integers: the cast truncates nothing


def pow_mod(a: np.ndarray, exponent: int) -> np.ndarray:
    """a^exponent mod p element-wise (square-and-multiply over the exponent's bits)."""
    result = np.ones_like(a, dtype=np.int64)
    base = reduce(a.astype(np.int64))
    while exponent:
        if exponent & 1:
            result = reduce(result * base)
        base = reduce(base * base)
        exponent >>= 1
    return result


@functools.lru_cache(maxsize=1)
def _inverse_table() -> np.ndarray:
    """v^(p-2) mod p for every field element v (Fermat, once, 512 KiB): v^-1, and 0 for v = 0."""
    table = pow_mod(np.arange(PRIME, dtype=np.int64), PRIME - 2)
    table.setflags(write=False)
    return table


def inverse(a: np.ndarray) -> np.ndarray:
    """Multiplicative inverse mod p, int64, by a gather from a cached table (a square-and-multiply per
    call cost as much as the rest of an interpolation). The caller guarantees a != 0 mod p; 0 maps to 0,
    as a^(p-2) does."""
    return _inverse_table()[reduce(np.asarray(a, dtype=np.int64))]


@functools.lru_cache(maxsize=32)
def _vandermonde(points: int, count: int) -> np.ndarray:
    """t^j mod p for t in [0, points), j in [0, count), float64: evaluates polynomials at 0, 1, ..."""
    table = np.ones((points, count), dtype=np.int64)
    for j in range(1, count):
        table[:, j] = reduce(table[:, j - 1] * np.arange(points))
    table = table.astype(np.float64)
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=32)
def _lagrange_basis(points: int) -> np.ndarray:
    """(points, points) float64 B with B @ values = the coefficients (ascending) of the polynomial of
    degree < points taking those values at 0, 1, ..., points - 1. Column i holds the coefficients of
    L_i(X) = N(X) / (X - i) / N'(i) with N(X) = prod_j (X - j): the quotients by synthetic division,
    for all i at once, and N'(i) = prod_{j != i} (i - j) = i! (points - 1 - i)! (-1)^(points - 1 - i)."""
    nodes = np.arange(points, dtype=np.int64)
    whole = np.zeros(points + 1, dtype=np.int64)  # N, ascending
    whole[0] = 1
    for j in range(points):  # times (X - j)
        whole = reduce(np.concatenate([[0], whole[:-1]]) - j * whole)
    quotients = np.empty((points, points), dtype=np.int64)  # [t, i]: coefficient t of N / (X - i)
    carry = np.full(points, whole[points], dtype=np.int64)
    for t in range(points - 1, -1, -1):
        quotients[t] = carry
        carry = reduce(whole[t] + nodes * carry)
    factorials = [1]
    for v in range(1, points):
        factorials.append(factorials[-1] * v % PRIME)
    derivative = np.array(
        [
            factorials[i] * factorials[points - 1 - i] * (-1) ** (points - 1 - i) % PRIME
            for i in range(points)
        ],
        dtype=np.int64,
    )
    basis = reduce(quotients * inverse(derivative)[None, :]).astype(np.float64)
    basis.setflags(write=False)
    return basis


def _product(a: np.ndarray, b: np.ndarray, keep: slice = slice(None)) -> np.ndarray:
    """Coefficients `keep` of the products of coefficient-major polynomials a (n, ...) and b (m, ...)
    (reduced int64, same trailing shape): (n + m - 1, ...) for all of them."""
    n, m = a.shape[0], b.shape[0]
    if a.size == 0 or b.size == 0:  # no problems in the batch: nothing to multiply (and nothing to reshape)
        return np.zeros((n + m - 1, *a.shape[1:]), dtype=np.int64)[keep]
    if min(n, m) <= _SCHOOLBOOK_MAX or n + m - 1 > PRIME:  # the latter: too few field elements as points
        # min(n, m) passes over the batch; each output sums at most that many products < p^2 (int64-exact).
        if n > m:
            a, b, n, m = b, a, m, n
        out = np.zeros((n + m - 1, *a.shape[1:]), dtype=np.int64)
        for v in range(n):
            out[v : v + m] += a[v] * b
        return reduce(out[keep])
    # Values at 0 .. n + m - 2 determine the product: two evaluations, n + m - 1 pointwise products and
    # one interpolation, each a matrix product over the whole batch.
    points = n + m - 1
    powers = _vandermonde(points, max(n, m))
    at_a = _matmul_mod(powers[:, :n], a.reshape(n, -1).astype(np.float64))
    at_b = _matmul_mod(powers[:, :m], b.reshape(m, -1).astype(np.float64))
    values = reduce(at_a * at_b).astype(np.float64)
    return _matmul_mod(_lagrange_basis(points)[keep], values).reshape(-1, *a.shape[1:])


def root_product(x: np.ndarray) -> np.ndarray:
    """Coefficients (ascending, length k + 1) of prod_j (X - x_j) for x of shape (..., k)."""
    k = x.shape[-1]
    width = 1 << max(k - 1, 0).bit_length()
    batch = reduce(np.asarray(x, dtype=np.int64)).reshape(-1, k).T  # (k, problems)
    level = np.zeros((2, width, batch.shape[1]), dtype=np.int64)  # [coefficient, factor, problem]
    level[0, :k] = reduce(-batch)
    level[1, :k] = 1
    level[0, k:] = 1  # padding leaves are the constant polynomial 1
    while level.shape[1] > 1:  # a product tree: log2(k) levels, each factor times the one half a level on
        half = level.shape[1] // 2
        level = _product(level[:, :half], level[:, half:])
    return np.ascontiguousarray(level[: k + 1, 0].T).reshape(*x.shape[:-1], k + 1)


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients (ascending, length k) of the polynomial of degree < k through (x_i, y_i) mod p.

    x, y: int arrays of shape (..., k); the x_i of each problem must be distinct mod p.
    """
    x = reduce(x.astype(np.int64))
    y = reduce(y.astype(np.int64))
    k = x.shape[-1]
    roots = root_product(x)  # m_0 .. m_k
    powers = power_table(x, k)  # (..., k, k): x_i^t
    derivative = reduce(roots[..., 1:] * np.arange(1, k + 1))  # coefficients of M'
    slopes = _matmul_mod(powers, derivative.astype(np.float64)[..., None])[..., 0]  # M'(x_i) != 0
    weights = reduce(y * inverse(slopes))  # a_i = y_i / M'(x_i)
    power_sums = _matmul_mod(weights.astype(np.float64)[..., None, :], powers)[..., 0, :]  # s_r
    # c_j = sum_r m_{j+1+r} s_r is coefficient k - 1 + j of (sum_t m_{t+1} X^t) (sum_r s_r X^(k-1-r)).
    upper = roots[..., 1:].reshape(-1, k).T
    reversed_sums = power_sums[..., ::-1].reshape(-1, k).T
    coefficients = _product(upper, reversed_sums, keep=slice(k - 1, None))  # (k, problems)
    return np.ascontiguousarray(coefficients.T).reshape(x.shape)


def evaluate(coefficients: np.ndarray, x: np.ndarray) -> np.ndarray:
    """P(x) mod p for batched coefficients (..., k) at batched points (..., n)."""
    k = coefficients.shape[-1]
    return _matmul_mod(power_table(x, k), coefficients.astype(np.float64)[..., None])[..., 0]
