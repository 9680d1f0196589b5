"""The numba kernels' explicit-vector code, bit for bit.

``layernorm.backends._numba_vectors`` promises one summation order, whatever the
function the sum is compiled into; these tests replay that order in NumPy (elementwise
IEEE adds of the same dtype) and compare bits. The elementwise passes (the output, the
residual add, dx) must give the bits of their formula computed element by element in
NumPy (float32/float64 operations are IEEE, with no fused multiply-add), and 16-bit rows
torch's own conversions.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("numba")
from numba import njit

from layernorm.backends import _numba_kernels, _numba_vectors
from layernorm.backends._numba_vectors import (
    SUM_BLOCK,
    UNROLL,
    add_rows,
    dx_row,
    dx_row_touching,
    normalize_row,
    normalize_row_fast,
    row_sum,
    row_sum_sq,
    row_sums_backward,
    row_sums_centered,
)

LENGTHS = [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 1000]
#: whole blocks, a ragged last block, a last block that has no whole vector
WIDE = [SUM_BLOCK, SUM_BLOCK + 1, 2 * SUM_BLOCK + 100, 3 * SUM_BLOCK + 5]


def _documented_sum(terms: np.ndarray) -> np.generic:
    """The module docstring's order: blocks of SUM_BLOCK elements, each summed by
    :func:`_block_sum`, their totals added in float64 in block order, rounded once."""
    total = np.float64(0)
    for start in range(0, max(len(terms), 1), SUM_BLOCK):
        total = np.float64(total + np.float64(_block_sum(terms[start : start + SUM_BLOCK])))
    return terms.dtype.type(total)


def _block_sum(terms: np.ndarray) -> np.generic:
    """One block's sum, steps 1-4 of the module docstring, in ``terms``' dtype."""
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
@pytest.mark.parametrize("n", [0, *LENGTHS, *WIDE])
def test_row_sum_adds_in_the_documented_order(n, dtype):
    z = _row(n, dtype)
    expected = _documented_sum(z)
    assert _bits(_sum(z, dtype(0)), dtype) == _bits(expected, dtype)
    other = _sum_among_other_work(z, dtype(0), np.empty_like(z))
    assert _bits(other, dtype) == _bits(expected, dtype)


def test_block_totals_add_in_float64():
    # 2**30 + 1 is 2**30 in float32: a float32 total would lose the middle block's 1.
    z = np.zeros(3 * SUM_BLOCK, np.float32)
    z[[0, SUM_BLOCK, 2 * SUM_BLOCK]] = 2.0**30, 1.0, -(2.0**30)
    assert _sum(z, np.float32(0)) == 1.0
    assert _documented_sum(z) == 1.0


@pytest.mark.parametrize("n", [*LENGTHS, *WIDE])
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
def _passes(z, r, w, b, dro, pw, pb, m1, delta, rstd, c1, c2):
    y, h, dx = np.empty_like(z), np.empty_like(z), np.empty_like(z)
    normalize_row(z, y, m1, delta, rstd, w, b)
    add_rows(z, r, h)
    dx_row(r, z, dro, dx, w, pw, pb, m1, delta, rstd, c1, c2)
    return y, h, dx


@njit(cache=False)
def _dx_touching(dy, x, dro, w, pw, pb, dy_next, x_next, mean, delta, rstd, c1, c2):
    dx = np.empty_like(x)
    touched = dx_row_touching(dy, x, dro, dx, w, pw, pb, dy_next, x_next, mean, delta, rstd, c1, c2)
    return dx, touched


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", LENGTHS)
def test_the_elementwise_passes_give_their_formulas_bits(n, dtype):
    z, r, w, b, dro = (_row(n, dtype, seed) for seed in range(5))
    pw, pb = _row(n, dtype, 5), _row(n, dtype, 6)
    m1, delta, rstd, c1, c2 = (dtype(v) for v in (z.mean(), 1e-3, 0.37, -0.21, 0.05))
    pw_out, pb_out = pw.copy(), pb.copy()
    y, h, dx = _passes(z, r, w, b, dro, pw_out, pb_out, m1, delta, rstd, c1, c2)
    u = ((z - m1) - delta) * rstd
    assert _same(y, u * w + b)
    assert _same(h, z + r)
    g = r  # dy
    assert _same(dx, rstd * ((g * w - c2) - u * c1) + dro)
    assert _same(pw_out, pw + g * u) and _same(pb_out, pb + g)
    # the streaming variant: the same dx, and it really loads the next row
    pw2, pb2 = pw.copy(), pb.copy()
    dx2, touched = _dx_touching(r, z, dro, w, pw2, pb2, b, w, m1, delta, rstd, c1, c2)
    assert _same(dx2, dx) and _same(pw2, pw_out) and _same(pb2, pb_out)
    whole = n - n % (64 // np.dtype(dtype).itemsize)  # the vector part: its loads are summed
    assert touched == pytest.approx(
        float((b[:whole] + w[:whole]).astype(np.float64).sum()), rel=1e-4, abs=1e-3
    )


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_16_bit_rows_convert_as_torch_does(storage):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, storage)
    n = 100
    z32, r32, w, b = (_row(n, np.float32, seed) for seed in range(4))
    z32[[3, 40]] = np.nan, np.inf  # NaN and Inf stay what they are
    z, r = (torch.from_numpy(v).to(dtype) for v in (z32, r32))
    bits = torch.int16 if storage == "float16" else torch.uint16
    m1, delta, rstd = np.float32(0.5), np.float32(1e-3), np.float32(0.37)
    y, h, _ = _passes(
        z.view(bits).numpy(),
        r.view(bits).numpy(),
        w,
        b,
        np.zeros(n, np.float32).view(np.int16 if storage == "float16" else np.uint16),
        np.zeros(n, np.float32),
        np.zeros(n, np.float32),
        m1,
        delta,
        rstd,
        np.float32(0),
        np.float32(0),
    )
    widened = z.float().numpy()
    expected_y = torch.from_numpy(((widened - m1) - delta) * rstd * w + b).to(dtype)
    expected_h = torch.from_numpy(widened + r.float().numpy()).to(dtype)
    for ours, expected in ((y, expected_y), (h, expected_h)):
        ours = torch.from_numpy(ours).view(dtype)
        nan = expected.isnan()  # NaN's bits differ between torch's own conversion paths
        assert torch.equal(ours.isnan(), nan) and nan.any()
        assert torch.equal(ours[~nan].view(bits), expected[~nan].view(bits))


def test_the_kernels_record_the_vector_code_they_are_compiled_with():
    # numba's cache sees only _numba_kernels.py: see VECTORS_SHA256 there
    digest = hashlib.sha256(Path(_numba_vectors.__file__).read_bytes()).hexdigest()[:16]
    assert digest == _numba_kernels.VECTORS_SHA256, (
        f"_numba_vectors.py changed: set VECTORS_SHA256 in _numba_kernels.py to {digest!r}"
    )


# ---------------------------------------------------------------------------------------
# The forward's cheap pass (docs/contract.md §3): what it decides, it decides soundly

#: (significand bits, smallest normal exponent, largest exponent) of each output format
_FORMATS = {"float32": (24, -126, 127), "bfloat16": (8, -126, 127), "float16": (11, -14, 15)}
_STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.int16}


def _round_exactly(q: Fraction, fmt: str) -> Fraction | float:
    """``q`` rounded to nearest-even in ``fmt``, exactly (``inf`` past the overflow
    threshold): the test's own oracle, sharing nothing with the kernels."""
    digits, emin, emax = _FORMATS[fmt]
    if q == 0:
        return Fraction(0)
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - digits + 1)
    k = a / quantum
    whole = k.numerator // k.denominator
    rest = k - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
        whole += 1
    value = whole * quantum
    if value >= Fraction(2) ** (emax + 1):
        return math.copysign(math.inf, q)
    return value if q > 0 else -value


def _stored_value(bits: np.ndarray, fmt: str) -> list[Fraction | float]:
    as_float = torch.from_numpy(bits.copy()).view(getattr(torch, fmt)).double().numpy()
    return [Fraction(v) if math.isfinite(v) else v for v in as_float]


@njit(cache=False)
def _cheap_pass(z, y, m1, delta, rstd, w, b, bound_a, bound_b, tiny):
    return normalize_row_fast(z, y, m1, delta, rstd, -0.0, w, b, bound_a, bound_b, tiny)


def _cheap_rows(fmt: str, rng: np.random.Generator) -> list[tuple[np.ndarray, ...]]:
    """Rows (z, w, b) with ``m1 = delta = 0``, ``rstd = 1``: ``yh = z*w + b``. Random
    ones, and ones whose ``yh`` lies on, or within 2^-40 (relative) of, a rounding
    boundary of ``fmt``, near 0, in float16's subnormal range and past its largest value."""
    digits, _, _ = _FORMATS[fmt]
    n = 257
    rows = [
        (
            rng.standard_normal(n).astype(np.float32),
            rng.uniform(0.5, 1.5, n).astype(np.float32),
            rng.standard_normal(n).astype(np.float32),
        )
    ]
    # yh = z + b on a boundary M (a midpoint: an odd multiple of half an ulp) or off it by
    # small offsets: z = M rounded to float32, b = the rest plus the offset (exact sums)
    significands = rng.integers(2 ** (digits - 1), 2**digits, n)
    exponents = rng.integers(-6, 6, n)
    midpoints = (2.0 * significands + 1) * 2.0 ** (exponents - digits) * rng.choice([-1, 1], n)
    z = midpoints.astype(np.float32)
    for scale in (0.0, 2.0**-40, 2.0**-30, 2.0**-20):
        offsets = np.abs(midpoints) * scale * rng.uniform(-1, 1, n)
        b = (midpoints - z + offsets).astype(np.float32)
        rows.append((z, np.ones(n, np.float32), b))
    # float16's subnormal midpoints (odd multiples of 2^-25) and values near them
    halves = [3 * 2.0**-25, -5 * 2.0**-25, 1023 * 2.0**-25, 3 * 2.0**-25 * (1 + 2.0**-20)]
    special = [0.0, -0.0, 1e-6, -3e-7, 6.2e-5, 1e-30, 7e4, 65519.0, 65520.0, 3e38, *halves]
    ones = np.ones(len(special), np.float32)
    rows.append((np.array(special, np.float32), ones, np.zeros(len(special), np.float32)))
    return rows


@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_the_cheap_pass_decides_only_what_its_bound_leaves_no_doubt_about(fmt):
    """``normalize_row_fast`` returns 0 for an element only when every value within the
    bound its contract assumes (float32: ``bound_a + |yh| bound_b``, on its ``yh =
    fma(z, w, b)`` here; 16-bit: ``|yh| 2^-26``), and only where ``|yh| >= tiny``,
    rounds to the value it stored, ``RN(yh)``; a row is open when one of its elements is
    (vector and scalar code alike); most random elements are decided (the pass is not one
    that always says open); a NaN stays NaN, or (bfloat16, float32) is left open."""
    rng = np.random.default_rng(21)
    # float32's tiny makes bound_a + |yh| bound_b <= |yh| 2^-26 (its pass assumes it)
    bound_a, bound_b = 2.0**-60, 2.0**-44
    tiny = 2.0**-30 if fmt == "float32" else 2.0**-50
    for index, (z, w, b) in enumerate(_cheap_rows(fmt, rng)):
        n = len(z)
        if fmt == "float32":  # its own arithmetic: fma(fma(z - 0, 1, -0), w, b), one rounding
            yh = np.array([float(Fraction(float(zk)) * Fraction(float(wk)) + Fraction(float(bk)))
                           for zk, wk, bk in zip(z, w, b, strict=True)])  # fmt: skip
        else:
            yh = z.astype(np.float64) * w.astype(np.float64) + b.astype(np.float64)
        row = np.empty(n, _STORAGE[fmt])
        row_open = _cheap_pass(z, row, 0.0, 0.0, 1.0, w, b, bound_a, bound_b, tiny)
        single = np.empty(1, _STORAGE[fmt])
        opens = []
        for k in range(n):
            one = (z[k : k + 1], single, 0.0, 0.0, 1.0, w[k : k + 1], b[k : k + 1])
            opens.append(_cheap_pass(*one, bound_a, bound_b, tiny))
            assert single.view(np.uint8).tobytes() == row[k : k + 1].view(np.uint8).tobytes()
        assert row_open == int(any(opens))
        stored = _stored_value(row, fmt)
        for k in np.flatnonzero(np.array(opens) == 0):
            exact = Fraction(float(yh[k]))
            if fmt == "float32":
                assert abs(yh[k]) >= tiny
                bound = Fraction(bound_a) + abs(exact) * Fraction(bound_b)
            else:
                assert abs(yh[k]) >= tiny or yh[k] == 0
                bound = abs(exact) * Fraction(2) ** -26
            low, high = _round_exactly(exact - bound, fmt), _round_exactly(exact + bound, fmt)
            assert low == high == stored[k], (fmt, k, float(yh[k]))
        if index == 0:  # the random row
            assert np.mean(np.array(opens) == 0) >= 0.95
    # NaN stays NaN; in bfloat16 and float32 it is left open (the checked pass writes it)
    nan, out = np.array([np.nan], np.float32), np.empty(1, _STORAGE[fmt])
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    opened = _cheap_pass(nan, out, 0.0, 0.0, 1.0, one, zero, bound_a, bound_b, tiny)
    assert opened == (fmt in ("bfloat16", "float32"))
    assert opened or math.isnan(_stored_value(out, fmt)[0])


@njit(cache=False)
def _largest(values):
    return _numba_kernels._largest(values)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_largest_magnitude_is_exact_or_inf(dtype):
    """``_numba_kernels._largest`` (the cheap test's max |gamma|, max |beta|): exactly
    ``max |values|``, subnormals and the largest finite value included, and ``inf``
    when a value is not finite (then the cheap test is skipped)."""
    info = np.finfo(dtype)
    rows = [
        np.random.default_rng(3).standard_normal(1001),
        [info.smallest_subnormal, 0.0],
        [0.0, -0.0],
        [-3.5, 2.0],
        [info.max, -info.max],
        [-info.tiny * 0.75],
    ]
    for row in rows:
        values = np.array(row, dtype)
        assert _largest(values) == np.max(np.abs(values.astype(np.float64)))
    for bad in (np.nan, -np.inf, np.inf):
        assert _largest(np.array([1.0, bad, 2.0], dtype)) == np.inf
