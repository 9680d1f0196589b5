"""The exact fallback's sums (``_exact._exact_sum``, ``_exact._exact_dot``: the compiled
superaccumulator of ``backends._numba_exact``) give the rationals that ``Fraction``
arithmetic gives on the same floats: with hypothesis over the whole float64 range
(subnormals, the largest values, zeros of both signs), with constructed cancellations
and with words that carry many times."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layernorm.backends import _exact, _numba_exact

#: float64 values the accumulator's edges meet
EDGES = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, -2.2250738585072009e-308,
         1.7976931348623157e308, -1.7976931348623157e308, 1.0, -1.0, 2.0**-1022, 0.1]  # fmt: skip


@st.composite
def _rows(draw) -> np.ndarray:
    """float64 rows of 1..300 values: significands of up to 53 bits, exponents in a drawn
    window anywhere in float64's range (subnormals included), some zeros, edge values and
    a value beside its negation."""
    n = draw(st.integers(1, 300))
    top = draw(st.integers(-1074, 971))
    width = draw(st.integers(0, 2045))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bits = draw(st.sampled_from([1, 24, 53]))
    significands = rng.integers(-(2**bits) + 1, 2**bits, n).astype(np.float64)
    exponents = rng.integers(max(-1074, top - width), top + 1, n)
    row = np.ldexp(significands, exponents)
    row[~np.isfinite(row)] = 1.7976931348623157e308
    row[rng.random(n) < 0.1] = 0.0
    edges = rng.random(n) < 0.05
    row[edges] = rng.choice(EDGES, int(edges.sum()))
    if n > 2:  # cancellations: a value and its negation
        row[n // 2] = -row[0]
    return row


def _fraction_sum(values: np.ndarray) -> Fraction:
    return sum((Fraction(float(v)) for v in values), Fraction(0))


@settings(max_examples=300, deadline=None)
@given(_rows())
def test_the_sum_is_exact(row):
    assert _exact._exact_sum(row) == _fraction_sum(row)


@settings(max_examples=300, deadline=None)
@given(_rows(), st.integers(0, 2**32 - 1))
def test_the_dot_product_is_exact(row, seed):
    other = np.random.default_rng(seed).permutation(row)
    expected = sum(
        (Fraction(float(a)) * Fraction(float(b)) for a, b in zip(row, other, strict=True)),
        Fraction(0),
    )
    assert _exact._exact_dot(row, other) == expected


def test_cancellations_far_apart_are_exact():
    # 1e300 + 1e-300 - 1e300: the tiny part survives; products that cancel to it too
    row = np.array([1e300, 1e-300, -1e300, 5e-324, -5e-324, 2.0**-1074])
    assert _exact._exact_sum(row) == Fraction(1e-300) + Fraction(2.0**-1074)
    a = np.array([1e200, 3.0, -1e200, 2.0**-600])
    b = np.array([1e100, 2.0**-1074, 1e100, 2.0**-474])
    assert _exact._exact_dot(a, b) == Fraction(3.0) * Fraction(2.0**-1074) + Fraction(2) ** -1074


def test_products_on_both_sides_of_twoprods_range_are_exact():
    # TwoProd (fl(a·b) and its exact error) where exact: E_a + E_b >= -1074 and a finite
    # fl(a·b); the four partial products past it: products whose error would fall below
    # the smallest subnormal, that underflow whole, or that overflow. 53-bit
    # significands, so that the error term is never zero.
    odd = float(2**53 - 1)
    a = np.array([odd * 2.0**-560, odd * 2.0**-561, odd * 2.0**-600, 5e-324, odd * 2.0**480,
                  1.7976931348623157e308, 3.0, odd * 2.0**-52])  # fmt: skip
    b = np.array([odd * 2.0**-514, odd * 2.0**-514, odd * 2.0**-600, 0.5, odd * 2.0**500,
                  -2.0, 5e-324, odd * 2.0**-53])  # fmt: skip
    exponents = np.frexp(a)[1] - 53 + np.frexp(b)[1] - 53
    with np.errstate(over="ignore"):
        twoprod = (exponents >= -1074) & np.isfinite(a * b)
    assert twoprod.any() and not twoprod.all()  # both paths
    for i in range(len(a)):
        assert _exact._exact_dot(a[i : i + 1], b[i : i + 1]) == Fraction(a[i]) * Fraction(b[i])
    expected = sum(
        (Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a, b, strict=True)), Fraction(0)
    )
    assert _exact._exact_dot(a, b) == expected


def test_words_that_carry_many_times_stay_exact():
    # 2^17 copies of the largest significand at one position: each word overflows its
    # 32 bits many times before the carries move up
    row = np.full(1 << 17, float(2**53 - 1) * 2.0**-20)
    assert _exact._exact_sum(row) == Fraction(2**53 - 1, 2**20) * (1 << 17)
    assert _exact._exact_dot(row, -row) == -(Fraction(2**53 - 1, 2**20) ** 2) * (1 << 17)
    assert _numba_exact.CHUNKS * 32 > 2 * 971 + 106 + _numba_exact.BIAS


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("n", [1, 17, 4096])
def test_float32_rows_give_the_row_statistics_of_fractions(offset, n):
    z = (torch.randn(n, generator=torch.Generator().manual_seed(n)) + offset).numpy()
    z = z.astype(np.float64)
    stats = _exact.row_statistics(z, 1e-5, False)
    mean = _fraction_sum(z) / n
    squares = sum((Fraction(float(v)) ** 2 for v in z), Fraction(0))
    assert stats.mean == mean
    assert stats.s == squares / n - mean * mean + Fraction(1e-5)


def test_the_sums_record_the_code_they_compile_in():
    # numba's cache sees only _numba_exact.py: see DEPENDS_SHA256 there
    digest = _numba_exact.depends_digest()
    assert digest == _numba_exact.DEPENDS_SHA256, (
        f"_numba_vectors' intrinsics changed: set DEPENDS_SHA256 in _numba_exact.py to {digest!r}"
    )
