"""The numba kernels' explicit-vector code, bit for bit.

``layernorm.backends._numba_vectors`` promises one summation order, whatever the
function the sum is compiled into; these tests replay that order in NumPy (elementwise
IEEE adds of the same dtype) and compare bits. The output pass on explicit vectors
(``_numba_kernels.normalize_row``) must give the bits of the plain loop it replaces.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
from numba import njit

from layernorm.backends._numba_kernels import _normalize_row, normalize_row
from layernorm.backends._numba_vectors import (
    UNROLL,
    row_sum,
    row_sum_sq,
    row_sums_backward,
    row_sums_centered,
)

LENGTHS = [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 1000]


def _documented_sum(terms: np.ndarray) -> np.generic:
    """The module docstring's order, step by step, in ``terms``' dtype."""
    dtype = terms.dtype.type
    lanes = 64 // terms.dtype.itemsize  # an accumulator: 64 bytes
    n, block = len(terms), lanes * UNROLL
    acc = np.zeros((UNROLL, lanes), terms.dtype)
    blocks = n // block
    for b in range(blocks):
        for u in range(UNROLL):
            acc[u] += terms[b * block + u * lanes : b * block + (u + 1) * lanes]
    start = blocks * block
    vectors = (n - start) // lanes
    for v in range(vectors):
        acc[0] += terms[start + v * lanes : start + (v + 1) * lanes]
    tail = dtype(0)
    for j in range(start + vectors * lanes, n):
        tail = dtype(tail + terms[j])
    partials = list(acc)
    while len(partials) > 1:  # pairwise: (a0 + a1) + (a2 + a3) + ...
        partials = [partials[i] + partials[i + 1] for i in range(0, len(partials), 2)]
    vector = partials[0]
    while len(vector) > 1:
        half = len(vector) // 2
        vector = vector[:half] + vector[half:]
    return dtype(vector[0] + tail)


@njit(cache=False)
def _sum(z, zero):
    return row_sum(z, zero)


@njit(cache=False)
def _sum_among_other_work(z, zero, out):
    # another context: a loop before and after, results stored, a different caller
    for j in range(z.shape[0]):
        out[j] = z[j] * zero
    s = row_sum(z, zero)
    for j in range(z.shape[0]):
        out[j] += s
    return s


@njit(cache=False)
def _sums(z, dy, w, m1, zero):
    return (
        row_sum_sq(z, zero),
        row_sums_centered(z, m1, zero),
        row_sums_backward(dy, z, w, m1, zero),
    )


def _row(n: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + n)
    # a wide range of magnitudes, so that a different order would change the bits
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)


def _bits(value, dtype=np.float32) -> int:
    """The bit pattern of ``value`` as a ``dtype`` (numba returns float32 sums as Python
    floats, which hold them exactly)."""
    return int(np.asarray(value, dtype).view(np.uint64 if dtype == np.float64 else np.uint32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", LENGTHS)
def test_row_sum_adds_in_the_documented_order(n, dtype):
    z = _row(n, dtype)
    expected = _documented_sum(z)
    assert _bits(_sum(z, dtype(0)), dtype) == _bits(expected, dtype)
    other = _sum_among_other_work(z, dtype(0), np.empty_like(z))
    assert _bits(other, dtype) == _bits(expected, dtype)


@pytest.mark.parametrize("n", LENGTHS)
def test_every_reduction_uses_the_same_order(n):
    z, dy, w = _row(n, np.float32), _row(n, np.float32, 1), _row(n, np.float32, 2)
    m1 = np.float32(z.mean())
    sq, (s1, s2), (t0, t1, t2) = _sums(z, dy, w, m1, np.float32(0))
    d = z - m1
    gh = dy * w
    assert _bits(sq) == _bits(_documented_sum(z * z))
    assert (_bits(s1), _bits(s2)) == (_bits(_documented_sum(d)), _bits(_documented_sum(d * d)))
    assert _bits(t0) == _bits(_documented_sum(d))
    assert _bits(t1) == _bits(_documented_sum(gh * d))
    assert _bits(t2) == _bits(_documented_sum(gh))


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_half_rows_are_widened_to_float32_exactly(storage):
    torch = pytest.importorskip("torch")
    n = 100
    values = torch.from_numpy(_row(n, np.float32)).to(getattr(torch, storage))
    bits = values.view(torch.int16 if storage == "float16" else torch.uint16).numpy()
    widened = values.float().numpy()
    assert _bits(_sum(bits, np.float32(0))) == _bits(_documented_sum(widened))


@njit(cache=False)
def _outputs(z, w, b, m1, delta, rstd):
    vectors, plain = np.empty_like(z), np.empty_like(z)
    normalize_row(z, vectors, m1, delta, rstd, w, b)
    _normalize_row(z, plain, m1, delta, rstd, w, b)
    return vectors, plain


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", LENGTHS)
def test_the_vector_output_pass_gives_the_plain_loops_bits(n, dtype):
    z, w, b = _row(n, dtype), _row(n, dtype, 1), _row(n, dtype, 2)
    vectors, plain = _outputs(z, w, b, dtype(z.mean()), dtype(1e-3), dtype(0.37))
    assert np.array_equal(vectors.view(np.uint8), plain.view(np.uint8))
