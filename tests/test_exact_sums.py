"""The exact fallback's sums (``_exact._sum``, ``_exact._products``): NumPy's error-free
extraction and Dekker's products give the rationals that Python's integers give, on rows
within ``2**±_SPAN``; rows beyond it take the integers. Checked against ``Fraction``
arithmetic on the same floats, with hypothesis and with constructed cancellations."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layernorm.backends import _exact

SPAN = _exact._SPAN


@st.composite
def _rows(draw, low: int = -SPAN + 60, high: int = SPAN - 60) -> np.ndarray:
    """float64 rows of 1..300 values, significands of up to 53 bits, exponents in a drawn
    window within ``[low, high]``, some zeros and repeated values with opposite signs."""
    n = draw(st.integers(1, 300))
    top = draw(st.integers(low, high))
    width = draw(st.integers(0, min(top - low, 120)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bits = draw(st.sampled_from([24, 53]))
    significands = rng.integers(-(2**bits) + 1, 2**bits, n).astype(np.float64)
    exponents = rng.integers(top - width, top + 1, n)
    row = np.ldexp(significands, exponents - bits)
    row[rng.random(n) < 0.1] = 0.0
    if n > 2:  # cancellations: a value and its negation
        row[n // 2] = -row[0]
    return row


def _fraction_sum(values: np.ndarray) -> Fraction:
    return sum((Fraction(float(v)) for v in values), Fraction(0))


@settings(max_examples=300, deadline=None)
@given(_rows())
def test_the_sum_is_exact(row):
    assert _exact._sum(row) == _fraction_sum(row)


@settings(max_examples=300, deadline=None)
@given(_rows(), st.integers(0, 2**32 - 1))
def test_the_products_are_exact(row, seed):
    other = np.random.default_rng(seed).permutation(row)
    p, e = _exact._products(row, other)
    for a, b, high, low in zip(row, other, p, e, strict=True):
        assert Fraction(float(high)) + Fraction(float(low)) == Fraction(float(a)) * Fraction(
            float(b)
        )


def test_cancellations_far_apart_are_exact():
    big = 2.0 ** (SPAN - 1)
    row = np.array([big, 1.0, -big, 2.0**-SPAN, 3.0 * 2.0**-60, -(2.0**-SPAN)])
    assert _exact._sum(row) == Fraction(1) + Fraction(3, 2**60)
    # a sum whose parts cancel in every pass but the last
    row = np.array([2.0**100, -(2.0**100) + 2.0**47, -(2.0**47), 2.0**-300])
    assert _exact._sum(row) == Fraction(2) ** -300


def _integer_sums(z: np.ndarray, gh: np.ndarray) -> tuple[Fraction, ...]:
    """The sums of the integer path, for comparison."""
    z_ints, z_exp = _exact._integers(z)
    g_ints, g_exp = _exact._integers(gh)
    zu, gu = Fraction(2) ** z_exp, Fraction(2) ** g_exp
    return (
        sum(z_ints) * zu,
        sum(k * k for k in z_ints) * zu * zu,
        sum(g_ints) * gu,
        _exact._dot(g_ints, z_ints) * zu * gu,
    )


@pytest.mark.parametrize("offset", [0.0, 1e2, 1e6])
@pytest.mark.parametrize("n", [1, 7, 1024, 4096])
def test_float32_rows_give_the_integers_sums(offset, n):
    g = torch.Generator().manual_seed(n)
    z = (torch.randn(n, generator=g) * 3 + offset).double().numpy()
    gh = (torch.randn(n, generator=g) * torch.randn(n, generator=g)).double().numpy()
    assert _exact._spanned(z, gh)
    sums = _exact._row_sums(z)
    assert (sums.total, sums.squares, *_exact._gradient_sums(gh, z)) == _integer_sums(z, gh)


@pytest.mark.parametrize("scale", [2.0**-600, 2.0**600])
def test_rows_beyond_the_span_take_the_integers(scale):
    z = np.array([1.0, 3.0, -5.5, 0.0]) * scale
    gh = np.array([0.25, -1.0, 7.0, 2.0])
    assert not _exact._spanned(z)
    sums = _exact._row_sums(z)
    assert (sums.total, sums.squares, *_exact._gradient_sums(gh, z)) == _integer_sums(z, gh)
    stats = _exact.row_statistics(z, 1e-5, False)
    assert stats.mean == Fraction(-3, 8) * Fraction(scale)
