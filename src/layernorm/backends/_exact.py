"""The exact fallback and the one rounding: correctly rounded layer norm, written once.

Every backend computes its output in float64 with an error bound per element and rounds
it once to the output dtype; where the bound cannot decide the rounding (Ziv's test,
docs/contract.md §3), the backend flags the row and this module recomputes it exactly,
with rationals and integer square roots. Everything here is plain Python and NumPy, run
on the host (the row's exact sums in a compiled superaccumulator,
:mod:`layernorm.backends._numba_exact`), and shared by every backend, so a flagged row
gets the same bits whichever backend flagged it.

The value of one output element has the form ``beta + w / sqrt(s)`` with rationals ``w``,
``s > 0`` and ``beta``: the forward's ``y_i = beta_i + gamma_i * v_i / sqrt(q + eps)``
(``v_i = z_i - mean`` exactly, or ``z_i`` for RMSNorm). :func:`round_sqrt_form` rounds
such a value to nearest-even in a :class:`Format`, exactly: an interval from an integer
square root, and, when a rounding boundary lies inside it, the sign of the value minus
that boundary, decided by comparing squares of rationals.

:func:`round_once` is the NumPy rounding from float64 to each dtype (float16 and
bfloat16 through float32 rounded to odd, never twice to nearest), and
:func:`fix_forward_rows` recomputes flagged rows.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np
import torch

from . import _weight_terms

__all__ = [
    "FORMATS",
    "STORAGE",
    "Format",
    "fix_backward_rows",
    "fix_forward_rows",
    "round_fraction",
    "round_once",
    "weight_scalars",
]


class Format(NamedTuple):
    """A binary floating-point format: ``precision`` bits (with the implicit one),
    normal exponents ``emin`` to ``emax`` (the largest finite value is
    ``(2 - 2**(1 - precision)) * 2**emax``), subnormals below ``2**emin``."""

    precision: int
    emin: int
    emax: int


#: the torch dtype of :func:`fix_forward_rows`' outputs (16-bit patterns as int16)
STORAGE = {torch.float32: torch.float32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

FORMATS = {
    torch.float32: Format(24, -126, 127),
    torch.bfloat16: Format(8, -126, 127),
    torch.float16: Format(11, -14, 15),
}


def round_fraction(x: Fraction, fmt: Format) -> float:
    """The rational ``x`` rounded to nearest-even in ``fmt``, as a Python float (exact:
    every value of these formats is a float64); overflow gives ``±inf``, a nonzero ``x``
    that rounds to zero gives a zero of its sign, and ``x == 0`` gives ``+0.0``."""
    if x == 0:
        return 0.0
    negative = x < 0
    a = -x if negative else x
    num, den = a.numerator, a.denominator
    k = num.bit_length() - den.bit_length()  # 2**k <= a < 2**(k+2)
    if (num << max(0, -k)) < (den << max(0, k)):
        k -= 1  # now 2**k <= a < 2**(k+1)
    e = max(k, fmt.emin) - fmt.precision + 1  # the exponent of the last place
    # n + rest = a / 2**e
    scaled_num, scaled_den = (num, den << e) if e >= 0 else (num << -e, den)
    n, rest = divmod(scaled_num, scaled_den)
    twice = 2 * rest
    if twice > scaled_den or (twice == scaled_den and n % 2 == 1):
        n += 1
    largest = ((1 << fmt.precision) - 1) << (fmt.emax - fmt.precision + 1)
    value = math.inf if Fraction(n) * Fraction(2) ** e > largest else math.ldexp(n, e)
    return -value if negative else value


def _neighbours(value: float, fmt: Format) -> tuple[Fraction, Fraction]:
    """The rounding boundaries around ``value`` (a value of ``fmt``, finite): the
    midpoints to its neighbours below and above (at the largest value, the overflow
    threshold)."""
    if value == 0:
        tiny = Fraction(2) ** (fmt.emin - fmt.precision + 1)
        return -tiny / 2, tiny / 2
    a = Fraction(abs(value))
    _, exponent = math.frexp(abs(value))  # 2**(exponent-1) <= a < 2**exponent
    k = exponent - 1
    e = max(k, fmt.emin) - fmt.precision + 1
    ulp_above = Fraction(2) ** e
    ulp_below = Fraction(2) ** (e - 1) if (k > fmt.emin and a == Fraction(2) ** k) else ulp_above
    low, high = a - ulp_below / 2, a + ulp_above / 2
    return (low, high) if value > 0 else (-high, -low)


def _sign_of_difference(w: Fraction, s: Fraction, b: Fraction) -> int:
    """The sign of ``w / sqrt(s) - b`` for ``s > 0``, exactly (by comparing squares)."""
    if w >= 0 >= b:
        return 0 if w == 0 and b == 0 else 1
    if w <= 0 <= b:
        return -1
    # both positive, or both negative
    difference = w * w - b * b * s if w > 0 else b * b * s - w * w
    return (difference > 0) - (difference < 0)


def round_sqrt_form(beta: Fraction, w: Fraction, s: Fraction, zero: float, fmt: Format) -> float:
    """``beta + w / sqrt(s)`` (``s > 0``) rounded to nearest-even in ``fmt``, exactly.
    ``zero`` is the result when ``w == 0 == beta``: the signed zero that IEEE arithmetic
    gives for the formula, so that such a zero has the same sign whichever path computed
    it (a nonzero ``w`` cancelling ``beta`` exactly gives ``+0.0``, as IEEE sums do)."""
    if w == 0:
        return zero if beta == 0 else round_fraction(beta, fmt)
    num, den = s.denominator, s.numerator  # 1/s = num/den
    bits = 200
    while True:
        # sqrt(1/s) in [r, r + 1) / 2**k with r >= 2**bits: an interval around the value
        k = max(0, (2 * bits - (num.bit_length() - den.bit_length())) // 2 + 2)
        r = math.isqrt((num << (2 * k)) // den)
        scale = Fraction(1, 1 << k)
        ends = sorted((beta + w * r * scale, beta + w * (r + 1) * scale))
        low, high = (round_fraction(v, fmt) for v in ends)
        if low == high and math.copysign(1, low) == math.copysign(1, high):
            return low
        boundary = _boundary_between(low, high, fmt)
        if boundary is not None:
            break
        bits *= 2  # the interval holds several boundaries: narrow it
    sign = _sign_of_difference(w, s, boundary - beta)
    if sign == 0:
        return 0.0 if boundary == 0 else (low if _even(low, fmt) else high)
    return high if sign > 0 else low


def _boundary_between(low: float, high: float, fmt: Format) -> Fraction | None:
    """The one rounding boundary between ``low < high``, values of ``fmt`` (or the two
    zeros, between which the boundary is 0): the midpoint of two neighbours or the
    overflow threshold; ``None`` when they are not neighbours."""
    if low == 0 and high == 0:
        return Fraction(0)
    tiny = Fraction(2) ** (fmt.emin - fmt.precision + 1)  # the smallest subnormal
    if low == 0:  # +0.0 and the smallest subnormal are neighbours (-0.0 lies below 0)
        return tiny / 2 if math.copysign(1, low) > 0 and high == float(tiny) else None
    if high == 0:
        return -tiny / 2 if math.copysign(1, high) < 0 and low == -float(tiny) else None
    if not math.isfinite(low):
        return None
    upper = _neighbours(low, fmt)[1]
    if not math.isfinite(high):
        return upper if low == _largest(fmt) else None
    return upper if _neighbours(high, fmt)[0] == upper else None


def _largest(fmt: Format) -> float:
    return math.ldexp((1 << fmt.precision) - 1, fmt.emax - fmt.precision + 1)


def _even(value: float, fmt: Format) -> bool:
    """Whether ``value`` (of ``fmt``) has an even last digit; infinities count as even."""
    if not math.isfinite(value) or value == 0:
        return True
    a = abs(value)
    _, exponent = math.frexp(a)
    e = max(exponent - 1, fmt.emin) - fmt.precision + 1
    return (Fraction(a) / Fraction(2) ** e).numerator % 2 == 0


# ---------------------------------------------------------------------------------------
# Rounding from float64 in NumPy


def _round_to_odd_float32(values: np.ndarray) -> np.ndarray:
    """float64 ``values`` rounded to float32 by round-to-odd (truncate, set the last bit
    when inexact)."""
    single = values.astype(np.float32)
    back = single.astype(np.float64)
    bits = single.view(np.uint32).copy()
    with np.errstate(invalid="ignore"):
        away = np.abs(back) > np.abs(values)
        inexact = (back != values) & ~np.isnan(values)
    bits[away] -= 1
    bits |= inexact.astype(np.uint32)
    return bits.view(np.float32)


def round_once(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float64 ``values`` rounded once to nearest-even in ``dtype`` (float32, float16 or
    bfloat16), returned as the storage the kernels use: float32 values, or the 16-bit
    patterns (int16 for float16, uint16 for bfloat16)."""
    values = np.asarray(values, np.float64)
    if dtype == torch.float32:
        return values.astype(np.float32)
    odd = _round_to_odd_float32(values)
    if dtype == torch.float16:
        return odd.astype(np.float16).view(np.int16)
    bits = odd.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(odd)] = 0x7FC0
    return rounded


def _from_storage(stored: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The float64 values of :func:`round_once`'s storage."""
    if dtype == torch.float32:
        return stored.astype(np.float64)
    if dtype == torch.float16:
        return stored.view(np.float16).astype(np.float64)
    return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------------------
# Exact rows


class _RowStatistics(NamedTuple):
    """A row's exact statistics: ``mean`` and ``s = q + eps``, rationals."""

    mean: Fraction
    s: Fraction


def _compiled():
    """:mod:`layernorm.backends._numba_exact` (imported on first use: numba compiles)."""
    from . import _numba_exact

    return _numba_exact


def _exact_sum(x: np.ndarray) -> Fraction:
    """``Σx`` exactly, for finite float64 ``x``: integer arithmetic in a compiled
    superaccumulator (:mod:`layernorm.backends._numba_exact`)."""
    return _compiled().exact_sum(x)


def _exact_dot(a: np.ndarray, b: np.ndarray) -> Fraction:
    """``Σa·b`` exactly, for finite float64 ``a`` and ``b``: as :func:`_exact_sum`."""
    return _compiled().exact_dot(a, b)


class _RowSums(NamedTuple):
    """A row's exact sums: ``n``, ``Σz`` and ``Σz²``, rationals."""

    n: int
    total: Fraction
    squares: Fraction


def _row_sums(z: np.ndarray) -> _RowSums:
    """:class:`_RowSums` of the row ``z`` (finite float64)."""
    return _RowSums(len(z), _exact_sum(z), _exact_dot(z, z))


def row_statistics(z: np.ndarray, eps: float, rms: bool) -> _RowStatistics:
    """The exact mean (0 for RMSNorm) and ``s = q + eps`` of the row ``z`` (docs/contract.md
    §1, eps at its float64 value)."""
    sums = _row_sums(z)
    n = sums.n
    if rms:
        return _RowStatistics(Fraction(0), sums.squares / n + Fraction(eps))
    mean = sums.total / n
    return _RowStatistics(mean, sums.squares / n - mean * mean + Fraction(eps))


def _gradient_sums(gh: np.ndarray, z: np.ndarray) -> tuple[Fraction, Fraction]:
    """``(Σgh, Σgh·z)`` exactly, for rows ``gh`` and ``z`` (finite float64)."""
    return _exact_sum(gh), _exact_dot(gh, z)


_U = 2.0**-53


def fix_forward_row(
    z: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    eps: float,
    rms: bool,
    dtype: torch.dtype,
) -> np.ndarray:
    """The correctly rounded forward output of one row ``z`` (float64 values of the
    normalized input, finite), with float64 ``gamma`` and ``beta`` (a missing weight is
    ones, a missing bias ``-0.0``), in :func:`round_once`'s storage of ``dtype``.

    Vectorized first: float64 from the exact statistics (the mean as two doubles), with a
    bound of a few units of float64 per element; only the elements whose rounding that
    bound leaves open go through :func:`round_sqrt_form`.

    An element whose ``gamma`` or ``beta`` is not finite gets IEEE's value of ``beta +
    gamma · v / sqrt(s)`` for the exact ``v`` (``±inf``, or NaN for an infinite ``gamma``
    where ``v = 0``, opposite infinities, or a NaN parameter), which no rounding changes."""
    fmt = FORMATS[dtype]
    stats = row_statistics(z, eps, rms)
    if stats.s == 0:  # a constant row with eps = 0: 0/0, as the formula says
        return round_once(np.full(z.shape, np.nan), dtype)
    special = ~(np.isfinite(gamma) & np.isfinite(beta))
    if special.any():
        y_special = _infinite_parameters(z[special], gamma[special], beta[special], stats, rms)
        gamma, beta = np.where(special, 0.0, gamma), np.where(special, 0.0, beta)
    mean_high = float(stats.mean)
    mean_low = float(stats.mean - Fraction(mean_high))
    rstd = 1.0 / math.sqrt(float(stats.s))  # within 2.6 units of float64 of 1/sqrt(s)
    # y = p + beta, p = ((z - mean_high) - mean_low)·rstd·gamma (compiled), within
    # bound = 1.01(6u|p| + 1.01|gamma|·rstd·e_c + 3u|y|),
    # e_c = 1.01u(|d| + |c|) + 1.01u²|mean_high| (d = z - mean_high, c = d - mean_low)
    y, bound = _compiled().forward_estimate(z, gamma, beta, mean_high, mean_low, rstd)
    if special.any():
        y[special], bound[special] = y_special, 0.0
    out = round_once(y, dtype)
    low, high = round_once(y - bound, dtype), round_once(y + bound, dtype)
    values = _from_storage(out, dtype)
    for i in np.flatnonzero((low != high) & (bound != 0)).tolist():  # 0: exact (±0.0)
        zi = Fraction(float(z[i]))
        v = zi if rms else zi - stats.mean
        zero_v = math.copysign(0.0, z[i]) if rms else 0.0
        zero = zero_v * float(gamma[i]) + float(beta[i])
        values[i] = round_sqrt_form(
            Fraction(float(beta[i])), Fraction(float(gamma[i])) * v, stats.s, zero, fmt
        )
    return round_once(values, dtype)


def _infinite_parameters(
    z: np.ndarray, gamma: np.ndarray, beta: np.ndarray, stats: _RowStatistics, rms: bool
) -> np.ndarray:
    """IEEE's ``beta + gamma · v / sqrt(s)`` where ``gamma`` or ``beta`` is not finite:
    only the sign of the exact ``v`` (``z``, or ``z - mean``) matters, as ``±1`` or 0."""
    if rms:
        sign = np.sign(z)
    else:
        v = [Fraction(float(zi)) - stats.mean for zi in z]
        sign = np.array([int(vi > 0) - int(vi < 0) for vi in v], dtype=np.float64)
    with np.errstate(invalid="ignore"):  # inf·0 and inf - inf: NaN, as IEEE says
        return np.where(np.isfinite(gamma), 0.0, gamma * sign) + beta


def fix_forward_rows(
    rows: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    eps: float,
    rms: bool,
    dtype: torch.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fix_forward_row` for the finite rows of ``rows`` (float64, (k, N)):
    returns which rows were fixed (a row holding a NaN or an infinity has a NaN output in
    every backend; the caller keeps its own) and their outputs, as :data:`STORAGE`."""
    finite = np.isfinite(rows).all(axis=1)
    out = np.stack(
        [fix_forward_row(z, gamma, beta, eps, rms, dtype) for z in rows[finite]]
        or [round_once(np.zeros(rows.shape[1]), dtype)]
    )[: int(finite.sum())]
    return finite, out.view(np.int16) if out.dtype == np.uint16 else out


# ---------------------------------------------------------------------------------------
# Exact rows of the backward


def fix_backward_row(
    z: np.ndarray,
    gh: np.ndarray,
    rho: np.ndarray,
    eps: float,
    rms: bool,
    dtype: torch.dtype,
) -> np.ndarray:
    """The correctly rounded ``dx`` of one row (docs/contract.md §1's backward, plus
    ``dresidual_out``), in :func:`round_once`'s storage of ``dtype``: ``z`` the row of
    the normalized input, ``gh = dy * gamma`` (exact products, float64), ``rho`` the row
    of ``dresidual_out`` (``-0.0`` without one), all finite.

    With the exact ``mean``, ``v = z - mean`` (``z`` for RMSNorm), ``s = q + eps``,
    ``c2 = mean(gh)`` (0 for RMSNorm) and ``a = mean(gh * v)``, each element is
    ``rho + (gh - c2) / sqrt(s) - a * v / s**1.5 = rho + w / sqrt(s)`` with the rational
    ``w = gh - c2 - a * v / s``: float64 first, with a bound of a few units of float64,
    and :func:`round_sqrt_form` for the elements that bound leaves open. An exact zero
    is ``+0.0``."""
    fmt = FORMATS[dtype]
    n = len(z)
    stats = row_statistics(z, eps, rms)
    if stats.s == 0:  # a constant row with eps = 0: 0/0, as the formula says
        return round_once(np.full(z.shape, np.nan), dtype)
    g_total, g_dot_z = _gradient_sums(gh, z)
    c2 = Fraction(0) if rms else g_total / n
    # mean(gh * v) = mean(gh * z) - mean * mean(gh)
    a = g_dot_z / n - stats.mean * c2
    # float64 from the exact statistics: every quantity within a few units of float64
    mean_high = float(stats.mean)
    mean_low = float(stats.mean - Fraction(mean_high))
    rstd = 1.0 / math.sqrt(float(stats.s))  # within 2.6 units of float64
    c2_f, a_f = float(c2), float(a)
    k = rstd * rstd * rstd * a_f  # within 12.1 units of float64 of a / s**1.5
    # compiled: d = z - mean_high, c = d - mean_low (v within e_c = 1.01u(|d| + |c|) +
    # 1.01u²|mean_high|), t1 = gh - c2 (within u(|t1| + |c2|)), t2 = rstd·t1, t3 = k·c,
    # y = (t2 - t3) + rho, within bound = 1.01(1.01u·rstd(|t1| + |c2|) + 4u|t2| +
    # 1.01|k|·e_c + 14u|t3| + 3u|y| + 2u|t2 - t3|)
    y, bound = _compiled().backward_estimate(z, gh, rho, mean_high, mean_low, rstd, c2_f, k)
    out = round_once(y, dtype)
    low, high = round_once(y - bound, dtype), round_once(y + bound, dtype)
    values = _from_storage(out, dtype)
    for i in np.flatnonzero(low != high).tolist():
        zi = Fraction(float(z[i]))
        v = zi if rms else zi - stats.mean
        w = Fraction(float(gh[i])) - c2 - a * v / stats.s
        values[i] = round_sqrt_form(Fraction(float(rho[i])), w, stats.s, 0.0, fmt)
    return round_once(values, dtype)


def fix_backward_rows(
    z: np.ndarray,
    gh: np.ndarray,
    rho: np.ndarray,
    eps: float,
    rms: bool,
    dtype: torch.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fix_backward_row` for the finite rows of ``z``, ``gh`` and ``rho``
    (float64, (k, N) each): returns which rows were fixed (a row holding a NaN or an
    infinity keeps the backend's own output) and their dx, as :data:`STORAGE`."""
    finite = np.isfinite(z).all(axis=1) & np.isfinite(gh).all(axis=1) & np.isfinite(rho).all(axis=1)
    out = np.stack(
        [
            fix_backward_row(z[i], gh[i], rho[i], eps, rms, dtype)
            for i in np.flatnonzero(finite).tolist()
        ]
        or [round_once(np.zeros(z.shape[1]), dtype)]
    )[: int(finite.sum())]
    return finite, out.view(np.int16) if out.dtype == np.uint16 else out


# ---------------------------------------------------------------------------------------
# The per-row scalars of dweight's terms (layernorm.backends._weight_terms)

#: ``r``'s format: :data:`_weight_terms.RSTD_BITS` bits, float64's exponents
_RSTD = Format(_weight_terms.RSTD_BITS, -1022, 1023)
#: ``t``'s grid: below ``2^19`` this format's subnormals, multiples of ``2^-32``
_SHIFT = Format(19 + 33, 19, 1023)


def weight_scalars(z: np.ndarray, eps: float, rms: bool) -> tuple[float, float, float]:
    """The row ``z``'s ``(a, r, t)`` of :mod:`layernorm.backends._weight_terms`, exactly:
    ``r = 1/sqrt(s)`` and ``t = (mean - a)/sqrt(s)`` rounded to nearest-even in their
    formats. A row holding a NaN or an infinity gets NaN for ``r`` and ``t`` (its terms
    are NaN on every backend); ``s = 0`` gives ``r = inf``, ``t = 0``."""
    a = 0.0 if rms else float(z[0])
    if not np.isfinite(z).all():
        return a, math.nan, math.nan
    stats = row_statistics(z, eps, rms)
    if stats.s == 0:
        return a, math.inf, 0.0
    r = round_sqrt_form(Fraction(0), Fraction(1), stats.s, 0.0, _RSTD)
    t = 0.0 if rms else round_sqrt_form(Fraction(0), stats.mean - Fraction(a), stats.s, 0.0, _SHIFT)
    return a, r, t + 0.0
