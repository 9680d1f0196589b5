"""The exact fallback's row sums (:mod:`layernorm.backends._exact`) compiled: ``Σx`` and
``Σa·b`` of float64 rows as exact rationals, by integer arithmetic only.

Every finite float64 is ``M · 2^E`` with an integer ``|M| < 2^53`` (``math.frexp``:
``M = m · 2^53``, ``E = e − 53 ≥ −1074``), so a product is ``M_a · M_b · 2^(E_a + E_b)``,
and ``M_a · M_b`` is four partial products of 26- and 27-bit halves, each below
``2^54``. Each value (or partial product) is added, as an integer shifted to its bit
position ``E + BIAS``, into a superaccumulator: :data:`CHUNKS` signed 64-bit words of
32 bits each (word ``k`` weighs ``2^(32k − BIAS)``). One addition changes a word by less
than ``2^33``, so ``2^29`` additions fit in a word's 63 bits; the carries are moved up
every :data:`NORMALIZE` additions and at the end. The words then give the rational
exactly (:func:`exact_sum`, :func:`exact_dot`): no rounding anywhere, for any finite
values (subnormals and ``2^±1023`` included), so no range condition either.

About 2–3 ns an addition: a dot product of N pairs costs 4N of them, a sum N, where
NumPy's extraction (``_exact._sum``) made 20–40 passes over the row.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from numba import njit

from . import _numba_cache

__all__ = ["BIAS", "CHUNKS", "exact_dot", "exact_sum"]

#: the lowest bit position of a product's ``2·(−1074)`` exponent, moved to 0
BIAS = 2148
#: 32-bit words: the highest product ``(2^1024)²`` has its top bit near position
#: ``2·971 + 106 + BIAS = 4196``, so 132 words hold it, with room for the carries
CHUNKS = 136
#: additions between two carry propagations (each changes a word by less than 2^33)
NORMALIZE = 1 << 28

_MASK = np.int64(0xFFFFFFFF)


def _jit(func):
    dispatcher = njit(nogil=True, cache=False, error_model="numpy")(func)
    _numba_cache.enable(dispatcher)
    return dispatcher


@_jit
def _decompose(x):  # pragma: no cover - compiled
    """``(M, E)`` with ``x = M · 2^E`` exactly, ``|M| < 2^53`` (``x`` finite)."""
    m, e = math.frexp(x)
    return np.int64(m * 9007199254740992.0), np.int64(e) - 53


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
def _dot_words(a, b, words):  # pragma: no cover - compiled
    count = 0
    for i in range(a.size):
        ma, ea = _decompose(a[i])
        mb, eb = _decompose(b[i])
        if ma == 0 or mb == 0:
            continue
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
        count += 4
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
