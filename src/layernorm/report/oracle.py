"""An exact oracle for the correctly rounded norms, sharing no code with the library.

Exact statistics from Python integers (every float is an integer times a power of two),
the square root from mpmath at 320 bits, and the rounding decided by distances: a
candidate value of the format and its two neighbours, the nearest wins; where two are
within 2**-250 of equally near (a tie, or a value closer than that to a midpoint, which
these inputs never produce by chance), squares of rationals decide exactly.

Formats are handled through their bit patterns: float32 (uint32), float16 and bfloat16
(uint16), so neighbours are found by stepping the integer pattern, never by rounding.
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np

_BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


def value_of(bits: int, fmt: str) -> float:
    """The float64 value of a bit pattern of ``fmt``."""
    if fmt == "float32":
        return float(np.array([bits], np.uint32).view(np.float32)[0])
    if fmt == "float16":
        return float(np.array([bits], np.uint16).view(np.float16)[0])
    return float(np.array([bits << 16], np.uint32).view(np.float32)[0])


def _sign_bit(fmt: str) -> int:
    return 1 << 31 if fmt == "float32" else 1 << 15


def _step(bits: int, fmt: str, up: bool) -> int:
    """The pattern of the next value above (``up``) or below ``bits``'s value."""
    sign = _sign_bit(fmt)
    negative = bool(bits & sign)
    magnitude = bits & (sign - 1)
    if magnitude == 0:  # a zero: the smallest subnormal of the wanted sign
        return 1 if up else sign | 1
    grow = up != negative
    return (bits & sign) | (magnitude + 1 if grow else magnitude - 1)


def _pattern_near(value: float, fmt: str) -> int:
    """Some pattern within a couple of places of ``value`` (float64), by truncation."""
    if fmt == "float32":
        return int(np.array([value], np.float64).astype(np.float32).view(np.uint32)[0])
    if fmt == "float16":
        return int(np.array([value], np.float64).astype(np.float16).view(np.uint16)[0])
    single = np.array([value], np.float64).astype(np.float32).view(np.uint32)[0]
    return (int(single) + 0x8000) >> 16 & 0xFFFF


def _exact_fraction(bits: int, fmt: str) -> Fraction:
    return Fraction(value_of(bits, fmt))


def _even(bits: int) -> bool:
    return bits % 2 == 0


def _compare(t: Fraction, w: Fraction, s: Fraction) -> int:
    """sign(w / sqrt(s) - t), exactly."""
    if w >= 0 and t <= 0:
        return 0 if (w == 0 and t == 0) else 1
    if w <= 0 and t >= 0:
        return -1
    lhs, rhs = w * w, t * t * s
    if w > 0:
        return (lhs > rhs) - (lhs < rhs)
    return (rhs > lhs) - (rhs < lhs)


class Row:
    """Exact statistics of one row (float64 values), for the forward and backward."""

    def __init__(self, z: np.ndarray, eps: float, rms: bool):
        # every float32 is an integer times 2**-149, and that integer is a float64
        scaled = z * 2.0**149
        assert (z.astype(np.float32) == z).all() and (np.floor(scaled) == scaled).all()
        ints = list(map(int, scaled.tolist()))
        den = 1 << 149
        self.ints, self.den = ints, den
        n = len(ints)
        total, squares = sum(ints), sum(k * k for k in ints)
        self.n = n
        if rms:
            self.mean = Fraction(0)
            q = Fraction(squares, n * den * den)
        else:
            self.mean = Fraction(total, n * den)
            q = Fraction(n * squares - total * total, n * n * den * den)
        self.s = q + Fraction(eps)
        mpmath.mp.prec = 320
        self.rsqrt = 1 / mpmath.sqrt(mpmath.mpf(self.s.numerator) / self.s.denominator)


def round_value(beta: Fraction, w: Fraction, s: Fraction, rsqrt, fmt: str) -> tuple[int, bool]:
    """The pattern of ``beta + w / sqrt(s)`` rounded to nearest-even in ``fmt``, and
    whether the exact value is zero (then the sign of the zero is a convention)."""
    mpmath.mp.prec = 320
    exact = (
        mpmath.mpf(beta.numerator) / beta.denominator
        + (mpmath.mpf(w.numerator) / w.denominator) * rsqrt
    )
    is_zero = (w == 0 and beta == 0) or (w != 0 and _compare(-beta, w, s) == 0)
    if is_zero:
        return 0, True
    guess = _pattern_near(float(exact), fmt)
    candidates = [_step(guess, fmt, False), guess, _step(guess, fmt, True)]
    candidates += [_step(candidates[0], fmt, False), _step(candidates[-1], fmt, True)]
    finite = [b for b in candidates if np.isfinite(value_of(b, fmt))]
    distance = {b: abs(mpmath.mpf(value_of(b, fmt)) - exact) for b in finite}
    best = sorted(finite, key=lambda b: distance[b])
    first, second = best[0], best[1]
    if value_of(first, fmt) == value_of(second, fmt):  # two zeros: the value's sign
        first = min(first, second) if exact > 0 else max(first, second)
    elif abs(distance[first] - distance[second]) < mpmath.mpf(2) ** -250 * abs(exact):
        midpoint = (_exact_fraction(first, fmt) + _exact_fraction(second, fmt)) / 2
        side = _compare(midpoint - beta, w, s)
        lower, upper = sorted((first, second), key=lambda b: value_of(b, fmt))
        tie = first if _even(first) else second
        first = tie if side == 0 else (upper if side > 0 else lower)
    top = _largest_pattern(fmt)
    if value_of(first, fmt) == value_of(top, fmt) or value_of(first, fmt) == -value_of(top, fmt):
        threshold = (
            Fraction(value_of(top, fmt))
            + (Fraction(value_of(top, fmt)) - _exact_fraction(top - 1, fmt)) / 2
        )
        if exact > 0 and _compare(threshold - beta, w, s) >= 0:
            return _inf_pattern(fmt), False
        if exact < 0 and _compare(-threshold - beta, w, s) <= 0:
            return _inf_pattern(fmt) | _sign_bit(fmt), False
    return first, False


def _largest_pattern(fmt: str) -> int:
    return {"float32": 0x7F7FFFFF, "float16": 0x7BFF, "bfloat16": 0x7F7F}[fmt]


def _inf_pattern(fmt: str) -> int:
    return {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}[fmt]


def _patterns_near(values: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "float32":
        return values.astype(np.float32).view(np.uint32).astype(np.int64)
    if fmt == "float16":
        return values.astype(np.float16).view(np.uint16).astype(np.int64)
    return ((values.astype(np.float32).view(np.uint32).astype(np.int64) + 0x8000) >> 16) & 0xFFFF


def _values_of(patterns: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "float32":
        return patterns.astype(np.uint32).view(np.float32).astype(np.float64)
    if fmt == "float16":
        return patterns.astype(np.uint16).view(np.float16).astype(np.float64)
    return (patterns.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _clear_of_midpoints(y: np.ndarray, size: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """The patterns nearest the float64 estimates ``y``, and where that is surely the
    answer: ``y`` farther than ``1e-12 * size`` (``size`` dwarfing the estimate's error of
    a few units of float64) from both midpoints to the neighbours, all finite."""
    guess = _patterns_near(y, fmt)
    sign = _sign_bit(fmt)
    value = _values_of(guess, fmt)
    magnitude = guess & (sign - 1)
    step = np.where((guess & sign) != 0, -1, 1)
    up = _values_of(np.where(magnitude == 0, guess, guess + step), fmt)
    down = _values_of(np.where(magnitude == 0, guess, guess - step), fmt)
    low_mid, high_mid = (value + np.minimum(up, down)) / 2, (value + np.maximum(up, down)) / 2
    with np.errstate(invalid="ignore", over="ignore"):
        clear = (
            np.isfinite(up) & np.isfinite(down) & np.isfinite(value) & (np.abs(y) > 2.0**-100)
            & (y > low_mid + 1e-12 * size) & (y < high_mid - 1e-12 * size)
        )  # fmt: skip
    return guess, clear


def forward(z, gamma, beta, eps, rms, fmt):
    """The correctly rounded forward of one row: (patterns, exact-zero mask).

    A float64 estimate from the exact statistics first, vectorized: where it is far
    (1e-12 relative) from every midpoint of the candidate and its neighbours, by a margin
    that dwarfs its error (a few units of float64), the nearest value is the answer.
    The rest go through :func:`round_value`."""
    z = np.asarray(z, np.float64)
    row = Row(z, eps, rms)
    gamma = np.asarray(gamma, np.float64)
    beta = np.asarray(beta, np.float64)
    mean_hi = float(row.mean)
    mean_lo = float(row.mean - Fraction(mean_hi))
    r64 = float(row.rsqrt)
    t = ((z - mean_hi) - mean_lo) * r64 * gamma
    y = beta + t
    size = np.abs(beta) + np.abs(t)
    guess, clear = _clear_of_midpoints(y, size, fmt)
    out = guess.copy()
    zeros = np.zeros(len(z), bool)
    for i in np.flatnonzero(~clear).tolist():
        zi = Fraction(row.ints[i], row.den)
        g, b = Fraction(float(gamma[i])), Fraction(float(beta[i]))
        v = zi if rms else zi - row.mean
        out[i], zeros[i] = round_value(b, g * v, row.s, row.rsqrt, fmt)
    return out, zeros


def _integers_149(values: np.ndarray) -> list[int]:
    """float32 values (as float64) as integers times 2**-149, exactly."""
    scaled = np.asarray(values, np.float64) * 2.0**149
    assert (np.floor(scaled) == scaled).all()
    return list(map(int, scaled.tolist()))


def backward(z, dy, gamma, rho, eps, rms, fmt):
    """The correctly rounded ``dx`` of one row (docs/contract.md §1's backward, plus
    ``dresidual_out`` ``rho``): (patterns, exact-zero mask).

    With ``gh = dy * gamma`` (exact rationals), the exact ``mean``, ``v = z - mean``
    (``z`` for RMSNorm), ``s = q + eps``, ``c2 = mean(gh)`` (0 for RMSNorm) and
    ``a = mean(gh * v)``, the value is ``rho + (gh - c2) / sqrt(s) - a v / s**1.5``, that
    is ``rho + w / sqrt(s)`` with ``w = gh - c2 - a v / s``. A float64 estimate first, as
    in :func:`forward`; :func:`round_value` for what it leaves open."""
    z = np.asarray(z, np.float64)
    row = Row(z, eps, rms)
    g_ints = _integers_149(dy)
    w_ints = _integers_149(gamma)
    gh_ints = [a * b for a, b in zip(g_ints, w_ints, strict=True)]  # gh * 2**298
    gh_den = 1 << 298
    n = row.n
    c2 = Fraction(0) if rms else Fraction(sum(gh_ints), n * gh_den)
    ghz = Fraction(sum(a * b for a, b in zip(gh_ints, row.ints, strict=True)), n * gh_den * row.den)
    a = ghz - row.mean * c2  # mean(gh * (z - mean))
    rho = np.asarray(rho, np.float64)
    gh = np.asarray(dy, np.float64) * np.asarray(gamma, np.float64)  # exact in float64
    r64 = float(row.rsqrt)
    mean_hi = float(row.mean)
    mean_lo = float(row.mean - Fraction(mean_hi))
    v = (z - mean_hi) - mean_lo
    t2 = (gh - float(c2)) * r64
    t3 = float(a) * r64**3 * v
    y = rho + (t2 - t3)
    size = np.abs(rho) + np.abs(t2) + np.abs(t3)
    guess, clear = _clear_of_midpoints(y, size, fmt)
    out = guess.copy()
    zeros = np.zeros(len(z), bool)
    for i in np.flatnonzero(~clear).tolist():
        zi = Fraction(row.ints[i], row.den)
        vi = zi if rms else zi - row.mean
        w = Fraction(gh_ints[i], gh_den) - c2 - a * vi / row.s
        out[i], zeros[i] = round_value(Fraction(float(rho[i])), w, row.s, row.rsqrt, fmt)
    return out, zeros
