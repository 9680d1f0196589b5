"""The dropout generator of :mod:`layernorm.backends._philox` as ``@triton.jit`` helpers:
Triton's own ``tl.rand`` with the offset, keep and key rules of docs/contract.md §7, so a
Triton kernel gets the bits the torch and numba implementations give.

In a kernel, for row ``row`` (global index) and a block of columns ``cols`` of a tensor of
``n_cols`` columns::

    keep = _triton_philox.keep(seed, _triton_philox.dropout_offsets(row, cols, n_cols), p)

with ``seed`` a Python int kernel argument in ``[-2^63, 2^64)`` (Triton types it int32,
int64 or uint64 by value and ``tl.randint`` takes it modulo 2^64, as
``_philox.seed_key`` does) and ``p`` a float kernel argument (float32: the keep rule's
``p32``). ``tl.rand`` keeps the first of Philox's four output words, so one Philox call
gives one element's uniform (the price of matching ``tl.rand(seed, offset)``);
:func:`keep_pair` takes two masks from one call (words 0 and 1, ``tl.rand4x``).

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
def uniform(seed, offsets):
    """``tl.rand(seed, offsets)``: float32 in ``[0, 1)``."""
    return tl.rand(seed, offsets)


@triton.jit
def keep(seed, offsets, p):
    """The keep rule: ``p == 0`` or ``tl.rand(seed, offsets) > p`` (``p`` float32)."""
    return (tl.rand(seed, offsets) > p) | (p == 0.0)


@triton.jit
def keep_pair(seed, offsets, p):
    """The keep rule on the first two words of one Philox call (``tl.rand4x``'s first two
    uniforms): ``x0``'s and ``x1``'s masks of a dropout-add. The first is :func:`keep`'s."""
    u0, u1, _, _ = tl.rand4x(seed, offsets)
    return (u0 > p) | (p == 0.0), (u1 > p) | (p == 0.0)


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
