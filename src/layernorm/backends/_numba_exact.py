"""The exact fallback's row loops (:mod:`layernorm.backends._exact`) compiled: ``Σx`` and
``Σa·b`` of float64 rows as exact rationals, by integer arithmetic only, and the float64
estimates with their bounds that decide most of a fixed row's elements
(:func:`forward_estimate`, :func:`backward_estimate`: ``_exact`` states their bounds).

Every finite float64 is ``M · 2^E`` with an integer ``|M| < 2^53`` and ``E >= −1074``
(read from its bits), so a product is ``M_a · M_b · 2^(E_a + E_b)``. It enters as the
two float64 of TwoProd, ``fl(a·b)`` and the exact ``fma(a, b, −fl(a·b))``, where both
are exact (``fl(a·b)`` finite, ``E_a + E_b >= −1074``), else as ``M_a · M_b``'s four
partial products of 26- and 27-bit halves, each below ``2^54``. Each value (or partial
product) is added, as an integer shifted to its bit
position ``E + BIAS``, into a superaccumulator: :data:`CHUNKS` signed 64-bit words of
32 bits each (word ``k`` weighs ``2^(32k − BIAS)``). One addition changes a word by less
than ``2^33``, so ``2^29`` additions fit in a word's 63 bits; the carries are moved up
every :data:`NORMALIZE` additions and at the end. The words then give the rational
exactly (:func:`exact_sum`, :func:`exact_dot`): no rounding anywhere, for any finite
values (subnormals and ``2^±1023`` included), so no range condition either.

A sum of N values costs N additions, a dot product of N pairs 2N (4N past TwoProd's
range), where NumPy's extraction (``_exact._sum``) made 20–40 passes over the row.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from numba import njit

from . import _numba_cache, _numba_vectors
from ._numba_vectors import fma, pattern

__all__ = [
    "BIAS",
    "CHUNKS",
    "DEPENDS_SHA256",
    "backward_estimate",
    "compile_all",
    "depends_digest",
    "exact_dot",
    "exact_sum",
    "forward_estimate",
]

#: the lowest bit position of a product's ``2·(−1074)`` exponent, moved to 0
BIAS = 2148
#: 32-bit words: the highest product ``(2^1024)²`` has its top bit near position
#: ``2·971 + 106 + BIAS = 4196``, so 132 words hold it, with room for the carries
CHUNKS = 136
#: additions between two carry propagations (each changes a word by less than 2^33)
NORMALIZE = 1 << 28

_MASK = np.int64(0xFFFFFFFF)

#: numba caches these functions keyed on this file alone: the start of the SHA-256 of the
#: ``_numba_vectors`` code they compile in (:func:`depends_digest`), so that a change
#: there changes this file (``tests/test_exact_sums.py`` fails until this is updated)
DEPENDS_SHA256 = "20e884a7e952a773"


def depends_digest() -> str:
    """sha256 (16 hex digits) of the ``_numba_vectors`` intrinsics these functions use."""
    return _numba_cache.source_digest(
        _numba_vectors.pattern, _numba_vectors.fma, _numba_vectors._fma
    )


def _jit(func):
    dispatcher = njit(nogil=True, cache=False, error_model="numpy")(func)
    _numba_cache.enable(dispatcher)
    return dispatcher


@_jit
def _decompose(x):  # pragma: no cover - compiled
    """``(M, E)`` with ``x = M · 2^E`` exactly, ``|M| < 2^53``, ``E >= -1074`` (``x``
    finite), from its bits: a normal's significand with its implicit bit and exponent
    ``e - 1075``, a subnormal's (or zero's) significand and ``-1074``."""
    bits = pattern(x)
    field = (bits >> 52) & 0x7FF
    m = bits & 0xFFFFFFFFFFFFF
    e = np.int64(-1074)
    if field != 0:
        m |= np.int64(1) << 52
        e = field - 1075
    if bits < 0:
        m = -m
    return m, e


@_jit
def _add(words, value, position):  # pragma: no cover - compiled
    """Adds the integer ``value`` (``|value| < 2^54``) times ``2^position`` (``>= 0``)."""
    if value == 0:
        return
    sign = np.int64(1)
    if value < 0:
        sign = np.int64(-1)
        value = -value
    k = position >> 5
    r = position & 31
    low = (value & _MASK) << r  # below 2^63
    high = (value >> 32) << r  # below 2^53
    words[k] += sign * (low & _MASK)
    words[k + 1] += sign * ((low >> 32) + (high & _MASK))
    words[k + 2] += sign * (high >> 32)


@_jit
def _carry(words):  # pragma: no cover - compiled
    """Moves each word's bits above 32 into the next word (the value is unchanged)."""
    for k in range(words.size - 1):
        up = words[k] >> 32  # (arithmetic: the floor, for negative words too)
        words[k] -= up << 32
        words[k + 1] += up


@_jit
def _sum_words(x, words):  # pragma: no cover - compiled
    count = 0
    for i in range(x.size):
        m, e = _decompose(x[i])
        _add(words, m, e + BIAS)
        count += 1
        if count == NORMALIZE:
            _carry(words)
            count = 0
    _carry(words)


@_jit
def _split_product(words, ma, ea, mb, eb):  # pragma: no cover - compiled
    """Adds ``ma·2^ea · mb·2^eb`` (nonzero integers below ``2^53``) as four partial
    products of 26- and 27-bit halves; returns how many additions that was."""
    sign = np.int64(1)
    if ma < 0:
        sign = -sign
        ma = -ma
    if mb < 0:
        sign = -sign
        mb = -mb
    a1, a0 = ma >> 26, ma & 0x3FFFFFF  # below 2^27 and 2^26
    b1, b0 = mb >> 26, mb & 0x3FFFFFF
    position = ea + eb + BIAS
    _add(words, sign * (a0 * b0), position)
    _add(words, sign * (a1 * b0), position + 26)
    _add(words, sign * (a0 * b1), position + 26)
    _add(words, sign * (a1 * b1), position + 52)
    return 4


@_jit
def _dot_words(a, b, words):  # pragma: no cover - compiled
    """Adds ``Σa·b``. Each product by TwoProd, ``a·b = p + e`` exactly with ``p =
    fl(a·b)`` and ``e = fma(a, b, -p)``, where that is exact: ``p`` finite and
    ``ea + eb >= -1074`` (``e`` is a multiple of ``2^(ea + eb)`` of at most 53 bits, so
    a float64 then); two additions. Otherwise the four partial products."""
    count = 0
    for i in range(a.size):
        ma, ea = _decompose(a[i])
        mb, eb = _decompose(b[i])
        if ma == 0 or mb == 0:
            continue
        p = a[i] * b[i]
        if ea + eb >= -1074 and abs(p) <= 1.7976931348623157e308:
            mp, ep = _decompose(p)
            me, ee = _decompose(fma(a[i], b[i], -p))
            _add(words, mp, ep + BIAS)
            _add(words, me, ee + BIAS)
            count += 2
        else:
            count += _split_product(words, ma, ea, mb, eb)
        if count >= NORMALIZE:
            _carry(words)
            count = 0
    _carry(words)


def _rational(words: np.ndarray) -> Fraction:
    total = 0
    for k, word in enumerate(words.tolist()):
        if word:
            total += word << (32 * k)
    return Fraction(total, 1 << BIAS)


def exact_sum(x: np.ndarray) -> Fraction:
    """``Σx`` exactly, for finite float64 ``x`` (1-D)."""
    words = np.zeros(CHUNKS, np.int64)
    _sum_words(np.ascontiguousarray(x, np.float64), words)
    return _rational(words)


def exact_dot(a: np.ndarray, b: np.ndarray) -> Fraction:
    """``Σa·b`` exactly, for finite float64 ``a`` and ``b`` of one length (1-D)."""
    words = np.zeros(CHUNKS, np.int64)
    _dot_words(np.ascontiguousarray(a, np.float64), np.ascontiguousarray(b, np.float64), words)
    return _rational(words)


# ---------------------------------------------------------------------------------------
# The float64 estimates of a fixed row (``_exact.fix_forward_row``, ``fix_backward_row``,
# which state the bounds): one pass, no temporaries, the operations in ``_exact``'s
# order (no fast-math: no contraction into fused multiply-adds)

_U = 2.0**-53


@_jit
def _forward_estimate(z, gamma, beta, mean_high, mean_low, rstd, y, bound):  # pragma: no cover
    for i in range(z.size):
        d = z[i] - mean_high
        c = d - mean_low
        p = c * rstd * gamma[i]
        y[i] = p + beta[i]
        e_c = 1.01 * _U * (abs(d) + abs(c)) + 1.01 * _U * _U * abs(mean_high)
        bound[i] = (abs(p) * 6 * _U + abs(gamma[i]) * rstd * 1.01 * e_c + abs(y[i]) * 3 * _U) * 1.01


@_jit
def _backward_estimate(z, gh, rho, mean_high, mean_low, rstd, c2, k, y, bound):  # pragma: no cover
    for i in range(z.size):
        d = z[i] - mean_high
        c = d - mean_low
        t1 = gh[i] - c2
        t2 = rstd * t1
        t3 = k * c
        y[i] = (t2 - t3) + rho[i] + 0.0
        e_c = 1.01 * _U * (abs(d) + abs(c)) + 1.01 * _U * _U * abs(mean_high)
        bound[i] = (
            rstd * _U * (abs(t1) + abs(c2)) * 1.01
            + abs(t2) * 4 * _U
            + abs(k) * e_c * 1.01
            + abs(t3) * 14 * _U
            + abs(y[i]) * 3 * _U
            + abs(t2 - t3) * 2 * _U
        ) * 1.01


def _rows(*rows: np.ndarray) -> list[np.ndarray]:
    return [np.ascontiguousarray(row, np.float64) for row in rows]


def forward_estimate(
    z: np.ndarray, gamma: np.ndarray, beta: np.ndarray, mean_high: float, mean_low: float,
    rstd: float,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(y, bound)`` of ``_exact.fix_forward_row``: ``y = ((z - mean_high) - mean_low)
    · rstd · gamma + beta`` in float64 and its error bound, per element."""
    y, bound = np.empty(len(z)), np.empty(len(z))
    _forward_estimate(*_rows(z, gamma, beta), mean_high, mean_low, rstd, y, bound)
    return y, bound


def backward_estimate(
    z: np.ndarray, gh: np.ndarray, rho: np.ndarray, mean_high: float, mean_low: float,
    rstd: float, c2: float, k: float,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(y, bound)`` of ``_exact.fix_backward_row``: ``y = rstd·(gh - c2) - k·((z -
    mean_high) - mean_low) + rho`` in float64 and its error bound, per element."""
    y, bound = np.empty(len(z)), np.empty(len(z))
    _backward_estimate(*_rows(z, gh, rho), mean_high, mean_low, rstd, c2, k, y, bound)
    return y, bound


def compile_all() -> None:
    """Compiles (or loads from the cache) every function here."""
    one = np.ones(1)
    exact_dot(one, one)
    exact_sum(one)
    forward_estimate(one, one, one, 0.0, 0.0, 1.0)
    backward_estimate(one, one, one, 0.0, 0.0, 1.0, 0.0, 0.0)
