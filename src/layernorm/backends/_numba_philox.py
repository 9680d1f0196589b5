"""The dropout generator of :mod:`layernorm.backends._philox` as numba functions, for the
numba kernels: the same bits as the torch implementation and the Triton helpers
(docs/contract.md §7; the rules and constants are written once, in ``_philox``).

Per element, from the key ``(k0, k1) = _philox.seed_key(seed)`` and the int64 offset
``row · N + col``: :func:`random_bits`, :func:`uniform` and :func:`keep` (the keep rule
on ``p32 = _philox.threshold(p)``) of mask stream 0, :func:`random_bits_of` of either
stream; per span of consecutive offsets, :func:`keep_span` (the kernels' masks: one
Philox call per four elements, vectorized, 0.8 ns an element on one AVX2 core against
2.3 for a call per element); per row, :func:`keep_row` and :func:`uniform_row`; over rows,
:func:`keep_rows` (numba's threads, each row's bits independent of the others). All are
``@njit(nogil=True)`` with the on-disk cache; the per-element ones are inlined by numba
into their caller (``inline="always"``), where LLVM vectorizes the rounds (a call per
element costs 8x).
Inlined code takes the caller's fast-math flags, and under fast-math LLVM may rewrite
``float32(y) * scale > p32``: a caller must not be compiled with ``fastmath`` (the numba
kernels never are).

The state is held in uint64 (32-bit words, the products of two words fit exactly), so
``hi`` is ``product >> 32`` and ``lo`` is ``product & 0xFFFFFFFF``. A kernel that calls these
functions is cached by numba on its own file only: a change here must change that
file too (as ``_numba_kernels.VECTORS_SHA256`` does for ``_numba_vectors``), or a stale
cached kernel keeps the old bits. Imported only by numba code (``import layernorm`` does
not import numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _philox

_MASK = np.uint64(0xFFFFFFFF)
_SIGN = np.uint64(0x80000000)
_SHIFT = np.uint64(32)
_ZERO = np.uint64(0)
_M0 = np.uint64(_philox.PHILOX_M0)
_M1 = np.uint64(_philox.PHILOX_M1)
_W0 = np.uint64(_philox.PHILOX_W0)
_W1 = np.uint64(_philox.PHILOX_W1)
_ROUNDS = _philox.ROUNDS
_SCALE = np.float32(_philox.UNIFORM_SCALE)


def _jit(**options):
    """``numba.njit(nogil=True)`` with the on-disk cache, without it when numba finds no
    writable cache directory (as ``_numba_kernels._jit``)."""

    def decorate(func):
        try:
            return njit(nogil=True, cache=True, **options)(func)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(nogil=True, cache=False, **options)(func)

    return decorate


@_jit(inline="always")
def philox4x32(c0, c1, c2, c3, k0, k1):  # pragma: no cover - compiled
    """Philox4x32-10 of the counter ``(c0, c1, c2, c3)`` under the key ``(k0, k1)``
    (integers holding 32-bit words): four uint64 holding 32-bit words."""
    c0, c1, c2, c3 = np.uint64(c0), np.uint64(c1), np.uint64(c2), np.uint64(c3)
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(_ROUNDS):
        p0 = c0 * _M0
        p1 = c2 * _M1
        c0, c1, c2, c3 = (p1 >> _SHIFT) ^ c1 ^ k0, p1 & _MASK, (p0 >> _SHIFT) ^ c3 ^ k1, p0 & _MASK
        k0 = (k0 + _W0) & _MASK
        k1 = (k1 + _W1) & _MASK
    return c0, c1, c2, c3


@_jit(inline="always")
def words(k0, k1, q, stream):  # pragma: no cover - compiled
    """The four words of offsets ``4q .. 4q + 3`` in mask stream ``stream``: Philox of the
    counter ``(q mod 2^32, q >> 32, stream, 0)``. ``q``: int64, >= 0."""
    o = np.uint64(q)
    return philox4x32(o & _MASK, o >> _SHIFT, np.uint64(stream), _ZERO, k0, k1)


@_jit(inline="always")
def random_bits_of(k0, k1, offset, stream):  # pragma: no cover - compiled
    """The word of ``offset`` in mask stream ``stream``: word ``offset mod 4`` of
    :func:`words` of ``offset >> 2``, as a uint64 in ``[0, 2^32)``. ``offset``: int64,
    >= 0."""
    w0, w1, w2, w3 = words(k0, k1, offset >> 2, stream)
    j = offset & 3
    return w0 if j == 0 else (w1 if j == 1 else (w2 if j == 2 else w3))


@_jit(inline="always")
def random_bits(k0, k1, offset):  # pragma: no cover - compiled
    """:func:`random_bits_of` mask stream 0 (a dropout's mask)."""
    return random_bits_of(k0, k1, offset, 0)


@_jit()
def keep_span(k0, k1, stream, base, p32, out):  # pragma: no cover - compiled
    """``out[c]`` = the keep rule of offset ``base + c`` in mask stream ``stream``, for
    every ``c`` of the 1-D bool array ``out``: the offsets up to a multiple of 4 one at a
    time, then four elements per Philox call (a loop LLVM vectorizes: its stores are
    indexed from the start of a slice), then the rest one at a time. ``base``: int64,
    >= 0; ``p32`` a float32. Called, not inlined: inlined into both of a dropout-add
    kernel's streams it doubled the kernel's compile time (6 -> 13.5 s a forward), for
    a call per row."""
    n = out.shape[0]
    c = 0
    while c < n and (base + c) & 3 != 0:
        out[c] = keep_from_bits(random_bits_of(k0, k1, base + c, stream), p32)
        c += 1
    q = (base + c) >> 2
    groups = (n - c) >> 2
    body = out[c : c + 4 * groups]
    for g in range(groups):
        w0, w1, w2, w3 = words(k0, k1, q + g, stream)
        body[4 * g] = keep_from_bits(w0, p32)
        body[4 * g + 1] = keep_from_bits(w1, p32)
        body[4 * g + 2] = keep_from_bits(w2, p32)
        body[4 * g + 3] = keep_from_bits(w3, p32)
    c += 4 * groups
    while c < n:
        out[c] = keep_from_bits(random_bits_of(k0, k1, base + c, stream), p32)
        c += 1


@_jit(inline="always")
def keep_from_bits(word, p32):  # pragma: no cover - compiled
    """The keep rule on a word: ``p32 == 0`` or its uniform ``> p32``."""
    return p32 == 0 or uniform_from_bits(word) > p32


@_jit(inline="always")
def uniform_from_bits(word):  # pragma: no cover - compiled
    """``tl.rand``'s float32 of a 32-bit word: ``float32(y) · scale``, ``y`` the word as an
    int32, complemented when negative. ``y < 2^31`` is converted as an int32, the same
    value (both conversions round to nearest): AVX2 has no uint64 → float32 instruction,
    and LLVM's emulation of one cost 0.7 ns an element of a 3 ns mask."""
    y = (word ^ _MASK) if word & _SIGN else word
    return np.float32(np.int32(y)) * _SCALE


@_jit(inline="always")
def uniform(k0, k1, offset):  # pragma: no cover - compiled
    """The uniform of ``offset`` in mask stream 0: a float32 in ``[0, 1)``."""
    return uniform_from_bits(random_bits(k0, k1, offset))


@_jit(inline="always")
def keep(k0, k1, offset, p32):  # pragma: no cover - compiled
    """The keep rule: ``p32 == 0`` or ``uniform > p32`` (``p32`` a float32)."""
    return p32 == 0 or uniform(k0, k1, offset) > p32


@_jit()
def uniform_row(k0, k1, row, n_cols, out):  # pragma: no cover - compiled
    """Writes the uniforms of row ``row`` (global index) of ``n_cols`` columns to
    ``out[:n_cols]`` (float32)."""
    base = np.int64(row) * np.int64(n_cols)
    for c in range(n_cols):
        out[c] = uniform(k0, k1, base + c)


@_jit()
def keep_row(k0, k1, row, n_cols, p32, out):  # pragma: no cover - compiled
    """Writes the keep-mask of row ``row`` (global index) to ``out[:n_cols]`` (bool), mask
    stream 0."""
    p = np.float32(p32)
    base = np.int64(row) * np.int64(n_cols)
    keep_span(k0, k1, 0, base, p, out[:n_cols])


@_jit(parallel=True)
def keep_rows(k0, k1, row_start, p32, out):  # pragma: no cover - compiled
    """Writes the keep-mask of rows ``row_start .. row_start + M - 1`` to the ``(M, N)``
    bool array ``out``, rows over numba's threads."""
    n_rows, n_cols = out.shape
    for i in prange(n_rows):
        keep_row(k0, k1, np.int64(row_start) + i, n_cols, p32, out[i])
