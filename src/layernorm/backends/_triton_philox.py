"""The dropout generator of :mod:`layernorm.backends._philox` as ``@triton.jit`` helpers:
Triton's own ``tl.philox`` and ``tl.rand``'s uniform with the counter, offset, keep and key
rules of docs/contract.md §7, so a Triton kernel gets the bits the torch and numba
implementations give.

In a kernel, for row ``row`` (global index) and a block of columns ``cols`` of a tensor of
``n_cols`` columns::

    keep = _triton_philox.keep(seed, _triton_philox.dropout_offsets(row, cols, n_cols), p)

with ``seed`` a Python int kernel argument in ``[-2^63, 2^64)`` (Triton types it int32,
int64 or uint64 by value and ``tl.randint`` takes it modulo 2^64, as
``_philox.seed_key`` does) and ``p`` a float kernel argument (float32: the keep rule's
``p32``). An element takes word ``offset mod 4`` of the counter of ``offset >> 2``
(:func:`random_bits`): each element computes that call and keeps its word, as ``tl.rand``
keeps one word of its call, so a mask costs what ``tl.rand(seed, offset)`` costs, while
the CPU's kernels make one call per four elements. :func:`keep_pair` gives the masks of
streams 0 and 1 (a dropout-add's ``x0`` and ``x1``): two calls an element, where
``tl.rand4x``'s words 0 and 1 were one (the GPU's kernels are bound by memory, not by
these calls: not measured, no GPU has been lent).

Like ``_triton_kernels``, this module imports triton at import and its ``@triton.jit``
decorations see ``TRITON_INTERPRET`` as it is then: a kernel module that calls these
helpers must load a copy of this one in the same mode (compiled for CUDA tensors,
interpreted for CPU tensors). ``import layernorm`` does not import it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dropout_offsets(row, cols, n_cols):
    """``row · n_cols + cols`` in int64: the offsets of docs/contract.md §7."""
    return row.to(tl.int64) * n_cols + cols.to(tl.int64)


@triton.jit
def random_bits(seed, offsets, STREAM: tl.constexpr):
    """The words (uint32) of ``offsets`` (int32 or int64, >= 0) in mask stream
    ``STREAM``: word ``offsets mod 4`` of ``tl.philox(seed, q mod 2^32, q >> 32,
    STREAM, 0)``, ``q = offsets >> 2``."""
    q = offsets >> 2
    lo = q.to(tl.uint32)
    zero = lo * 0
    if tl.constexpr(offsets.dtype.primitive_bitwidth) > 32:  # noqa: SIM108 (as triton)
        hi = (q >> 32).to(tl.uint32)
    else:
        hi = zero
    w0, w1, w2, w3 = tl.philox(seed, lo, hi, zero + STREAM, zero)
    j = offsets & 3
    return tl.where(j == 0, w0, tl.where(j == 1, w1, tl.where(j == 2, w2, w3)))


@triton.jit
def uniform(seed, offsets):
    """The uniforms of ``offsets`` in mask stream 0 (``tl.rand``'s conversion of
    :func:`random_bits`): float32 in ``[0, 1)``."""
    return tl.random.uint_to_uniform_float(random_bits(seed, offsets, 0))


@triton.jit
def keep(seed, offsets, p):
    """The keep rule: ``p == 0`` or :func:`uniform` ``> p`` (``p`` float32)."""
    return (uniform(seed, offsets) > p) | (p == 0.0)


@triton.jit
def keep_pair(seed, offsets, p):
    """The keep rule in mask streams 0 and 1: ``x0``'s and ``x1``'s masks of a
    dropout-add. The first is :func:`keep`'s."""
    u1 = tl.random.uint_to_uniform_float(random_bits(seed, offsets, 1))
    return keep(seed, offsets, p), (u1 > p) | (p == 0.0)


@triton.jit
def mask_kernel(
    KEEP,
    U,
    seed,
    p,
    row_start,
    n_cols,
    BLOCK: tl.constexpr,
    INT32_OFFSETS: tl.constexpr,
):
    """Writes the keep-mask (bool) and the uniforms (float32) of rows ``row_start ..``
    to the contiguous ``(M, n_cols)`` ``KEEP`` and ``U``; grid ``(M, cdiv(n_cols, BLOCK))``.
    With ``INT32_OFFSETS`` the offsets are int32 (valid below 2^31, where the bits are
    the same)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    if INT32_OFFSETS:
        offsets = (row_start + i).to(tl.int32) * n_cols + cols
    else:
        offsets = dropout_offsets(row_start + i, cols, n_cols)
    where = i.to(tl.int64) * n_cols + cols
    tl.store(U + where, uniform(seed, offsets), mask=inside)
    tl.store(KEEP + where, keep(seed, offsets, p), mask=inside)
