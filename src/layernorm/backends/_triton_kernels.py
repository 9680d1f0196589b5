"""Triton kernels for layer norm and RMSNorm, forward and backward.

Launched only by :mod:`layernorm.backends.triton_`, which loads this file once per mode
(compiled for CUDA tensors, interpreted for CPU tensors under ``TRITON_INTERPRET=1``).

Layout: ``x``, ``residual``, ``dy``, ``dresidual_out`` are ``(M, N)`` with contiguous rows
read through their row stride (no copy); outputs are contiguous. Every row index is cast to
int64 before it is multiplied by a stride, so tensors past 2^31 elements address correctly.

Numerics (docs/contract.md §3): float32 arithmetic whatever the storage dtype; means and the reciprocal
square root use IEEE-rounded ``div_rn`` / ``sqrt_rn`` so the compiled and the interpreted
kernels agree and a constant row gives a core of exactly 0. Layer norm uses the corrected
two-pass ``m1 = mean(z)``, ``d = z - m1``, ``delta = mean(d)``, ``c = d - delta``.

Three forward paths, chosen by the host from N and the dtype only:

- fused: one program holds a whole row in registers (``BLOCK_N >= N``).
- looped: one program per row loops over chunks of ``CHUNK`` columns twice (statistics,
  then normalization); the second read of the row mostly hits L2.
- wide: grid (rows, chunks); a first kernel writes each chunk's statistics, a second
  combines them and normalizes its chunk. Cost: x is read twice from memory, but a row
  of any width (tested past 1M elements) is spread over many programs.

The looped and wide paths keep per-chunk statistics of ``d = z - z[0]`` (shifting by the
row's first element keeps the chunk means small, so float32 loses nothing, and makes a
constant row exactly 0) and combine them in a fixed order with the parallel-variance
formula ``M2 = Σ M2_c + Σ n_c (mean_c - mean)²`` (mean by the corrected two-pass). Sums
within a chunk are float32 trees (``tl.sum``); sums over a row's chunk partials, forward
and backward, add in float64 (:func:`_total`), so the error does not grow with the number
of chunks (rows of 16M elements are tested on a GPU).

Backward: each program owns a fixed block of rows (and one chunk of columns on the wide
path), loops over them in order and accumulates ``dweight``/``dbias`` in float32
registers; the per-program partials go to a ``(programs, N)`` buffer that
:func:`column_sum_kernel` reduces in a fixed order. No atomics anywhere, so every result is
bitwise reproducible, and a row's forward output never depends on the other rows.
"""

# Triton kernels keep explicit if/else on constexpr flags (one branch is compiled):
# ruff: noqa: SIM102, SIM108, SIM300
from __future__ import annotations

import os

import triton
import triton.language as tl

_knobs = getattr(triton, "knobs", None)
#: whether this copy of the module runs in Triton's interpreter (fixed when it is loaded)
INTERPRETED = tl.constexpr(
    bool(_knobs.runtime.interpret)
    if _knobs is not None
    else os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"}
)


@triton.jit
def _bfloat16_rne(y):
    # float32 -> bfloat16, rounding to nearest even (NaN stays a quiet NaN).
    bits = y.to(tl.uint32, bitcast=True)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    rounded = tl.where(y != y, bits | 0x400000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast(y, DTYPE: tl.constexpr):
    # The compiled cast rounds to nearest even; the interpreter's float32 -> bfloat16
    # cast truncates, so there we round by hand to get the compiled kernel's bits.
    out = y.to(DTYPE)
    if INTERPRETED:
        if DTYPE == tl.bfloat16:
            out = _bfloat16_rne(y)
    return out


@triton.jit
def _mean(total, count):
    return tl.div_rn(total, count)


@triton.jit
def _total(partials):
    # The sum of a row's chunk partials, added in float64 and rounded once to float32
    # (docs/contract.md §3): the error of a row sum does not grow with the chunk count.
    return tl.sum(partials.to(tl.float64), 0).to(tl.float32)


@triton.jit
def _rstd(var, eps):
    return tl.div_rn(1.0, tl.sqrt_rn(var + eps))


@triton.jit
def _load_z(
    X,
    R,
    RES_OUT,
    row,
    stride_x,
    stride_r,
    stride_res_out,
    cols,
    mask,
    HAS_RESIDUAL: tl.constexpr,
):
    # z = x, or the rounded residual_out = x + residual (stored; each element by one program).
    z = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = _cast(z + r, RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_res_out + cols, h, mask=mask)
        z = h.to(tl.float32)
    return z


@triton.jit
def _load_shift(X, R, RES_OUT, row, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr):
    # The row's first element of z, computed exactly as _load_z computes it.
    shift = tl.load(X + row * stride_x).to(tl.float32)
    if HAS_RESIDUAL:
        shift = shift + tl.load(R + row * stride_r).to(tl.float32)
        shift = _cast(shift, RES_OUT.dtype.element_ty).to(tl.float32)
    return shift


@triton.jit
def _affine(u, W, B, cols, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    y = u
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def forward_fused_kernel(
    X, R, W, B, Y, RES_OUT, MEAN, RSTD,
    stride_x, stride_r, stride_y, stride_res_out,
    N, n_f, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program per row; the whole row lives in registers (BLOCK_N >= N)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    z = _load_z(X, R, RES_OUT, row, stride_x, stride_r, stride_res_out, cols, mask,
                HAS_RESIDUAL)  # fmt: skip
    if RMS:
        rstd = _rstd(_mean(tl.sum(z * z, 0), n_f), eps)
        u = z * rstd
    else:
        m1 = _mean(tl.sum(z, 0), n_f)
        d = tl.where(mask, z - m1, 0.0)
        delta = _mean(tl.sum(d, 0), n_f)
        c = tl.where(mask, d - delta, 0.0)
        rstd = _rstd(_mean(tl.sum(c * c, 0), n_f), eps)
        u = c * rstd
        tl.store(MEAN + row, m1 + delta)
    tl.store(RSTD + row, rstd)
    y = _affine(u, W, B, cols, mask, HAS_WEIGHT, HAS_BIAS)
    tl.store(Y + row * stride_y + cols, _cast(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_stats(d, mask):
    # (mean_c, M2_c) of one chunk of d = z - shift, by the corrected two-pass.
    count = tl.sum(mask.to(tl.float32), 0)
    m1 = _mean(tl.sum(d, 0), count)
    e = tl.where(mask, d - m1, 0.0)
    delta = _mean(tl.sum(e, 0), count)
    c = tl.where(mask, e - delta, 0.0)
    return m1 + delta, tl.sum(c * c, 0)


@triton.jit
def _combine(mean_c, m2_c, N, n_f, num_chunks, CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr):
    # (mean, variance) of the row of d from its chunks' (mean_c, M2_c), in a fixed order:
    # M2 = Σ M2_c + Σ n_c (mean_c - mean)², the mean itself by the corrected two-pass.
    index = tl.arange(0, CHUNKS_P2)
    valid = index < num_chunks
    count_c = tl.where(valid, tl.minimum(N - index * CHUNK, CHUNK), 0).to(tl.float32)
    m1 = _mean(_total(count_c * mean_c), n_f)
    e_c = tl.where(valid, mean_c - m1, 0.0)
    delta = _mean(_total(count_c * e_c), n_f)
    f_c = tl.where(valid, e_c - delta, 0.0)
    var = _mean(_total(m2_c) + _total(count_c * f_c * f_c), n_f)
    return m1 + delta, var


@triton.jit
def forward_looped_kernel(
    X, R, W, B, Y, RES_OUT, MEAN, RSTD,
    stride_x, stride_r, stride_y, stride_res_out,
    N, n_f, eps, num_chunks,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr,
):  # fmt: skip
    """One program per row, looping over chunks of the row twice: statistics, then
    normalization (the second read mostly hits L2). Same math as the wide path."""
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, CHUNKS_P2)
    part_a = tl.zeros([CHUNKS_P2], dtype=tl.float32)
    part_b = tl.zeros([CHUNKS_P2], dtype=tl.float32)
    shift = _load_shift(X, R, RES_OUT, row, stride_x, stride_r, HAS_RESIDUAL)
    for chunk in range(0, num_chunks):
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = cols < N
        z = _load_z(X, R, RES_OUT, row, stride_x, stride_r, stride_res_out, cols, mask,
                    HAS_RESIDUAL)  # fmt: skip
        if RMS:
            part_a = tl.where(index == chunk, tl.sum(z * z, 0), part_a)
        else:
            mean_c, m2_c = _chunk_stats(tl.where(mask, z - shift, 0.0), mask)
            part_a = tl.where(index == chunk, mean_c, part_a)
            part_b = tl.where(index == chunk, m2_c, part_b)
    if RMS:
        rstd = _rstd(_mean(_total(part_a), n_f), eps)
    else:
        mean_d, var = _combine(part_a, part_b, N, n_f, num_chunks, CHUNK, CHUNKS_P2)
        rstd = _rstd(var, eps)
        tl.store(MEAN + row, shift + mean_d)
    tl.store(RSTD + row, rstd)
    if HAS_RESIDUAL:
        tl.debug_barrier()  # residual_out, written above, is read back below
    for chunk in range(0, num_chunks):
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = cols < N
        if HAS_RESIDUAL:
            z = tl.load(RES_OUT + row * stride_res_out + cols, mask=mask, other=0.0)
        else:
            z = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        z = z.to(tl.float32)
        if RMS:
            u = z * rstd
        else:
            u = tl.where(mask, (z - shift) - mean_d, 0.0) * rstd
        y = _affine(u, W, B, cols, mask, HAS_WEIGHT, HAS_BIAS)
        tl.store(Y + row * stride_y + cols, _cast(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def forward_partial_kernel(
    X, R, RES_OUT, PART_A, PART_B,
    stride_x, stride_r, stride_res_out,
    N, num_chunks,
    HAS_RESIDUAL: tl.constexpr, RMS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Wide rows, stage 1: per-chunk statistics, grid (M, num_chunks).

    RMS: PART_A = Σ z². Layer norm: with d = z - z[0], PART_A = mean_c(d) (corrected
    two-pass within the chunk) and PART_B = M2_c = Σ (d - mean_c)².
    """
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    z = _load_z(X, R, RES_OUT, row, stride_x, stride_r, stride_res_out, cols, mask,
                HAS_RESIDUAL)  # fmt: skip
    slot = row * num_chunks + chunk
    if RMS:
        tl.store(PART_A + slot, tl.sum(z * z, 0))
    else:
        shift = _load_shift(X, R, RES_OUT, row, stride_x, stride_r, HAS_RESIDUAL)
        mean_c, m2_c = _chunk_stats(tl.where(mask, z - shift, 0.0), mask)
        tl.store(PART_A + slot, mean_c)
        tl.store(PART_B + slot, m2_c)


@triton.jit
def forward_wide_kernel(
    Z, W, B, Y, MEAN, RSTD, PART_A, PART_B,
    stride_z, stride_y,
    N, n_f, eps, num_chunks,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr,
):  # fmt: skip
    """Wide rows, stage 2: combine the row's chunk statistics in a fixed order, normalize
    this program's chunk; grid (M, num_chunks). Z is x, or residual_out (already rounded)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    index = tl.arange(0, CHUNKS_P2)
    valid = index < num_chunks
    slots = row * num_chunks + index
    if RMS:
        rstd = _rstd(_mean(_total(tl.load(PART_A + slots, mask=valid, other=0.0)), n_f), eps)
        u = z * rstd
    else:
        shift = tl.load(Z + row * stride_z).to(tl.float32)
        mean_c = tl.load(PART_A + slots, mask=valid, other=0.0)
        m2_c = tl.load(PART_B + slots, mask=valid, other=0.0)
        mean_d, var = _combine(mean_c, m2_c, N, n_f, num_chunks, CHUNK, CHUNKS_P2)
        rstd = _rstd(var, eps)
        u = tl.where(mask, (z - shift) - mean_d, 0.0) * rstd
        tl.store(MEAN + row, shift + mean_d, mask=chunk == 0)
    tl.store(RSTD + row, rstd, mask=chunk == 0)
    y = _affine(u, W, B, cols, mask, HAS_WEIGHT, HAS_BIAS)
    tl.store(Y + row * stride_y + cols, _cast(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def backward_partial_kernel(
    DY, Z, W, MEAN, RSTD, PART_C1, PART_C2, PART_D,
    stride_dy, stride_z,
    N, num_chunks,
    HAS_WEIGHT: tl.constexpr, RMS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Wide rows, stage 1 of the backward: per-chunk Σ gh·d, Σ gh and Σ d with d = z − mean
    (RMS: Σ gh·u); grid (M, num_chunks)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    if RMS:
        u = z * rstd
    else:
        u = tl.where(mask, z - tl.load(MEAN + row), 0.0)  # d: re-centered in stage 2
    gh = g
    if HAS_WEIGHT:
        gh = g * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    slot = row * num_chunks + chunk
    tl.store(PART_C1 + slot, tl.sum(gh * u, 0))
    if not RMS:
        tl.store(PART_C2 + slot, tl.sum(gh, 0))
        tl.store(PART_D + slot, tl.sum(u, 0))


@triton.jit
def backward_kernel(
    DY, Z, W, MEAN, RSTD, DRES, DX, DW_PART, DB_PART, PART_C1, PART_C2, PART_D,
    stride_dy, stride_z, stride_dres, stride_dx,
    M, N, n_f, rows_per_program, num_chunks,
    HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr, NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr, RMS: tl.constexpr, FUSED: tl.constexpr,
    CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr,
):  # fmt: skip
    """dx = rstd·(gh − c2 − u·c1) (+ dresidual_out) for a fixed block of rows and one chunk
    of columns; grid (programs, num_chunks). FUSED: one chunk spans the row and c1, c2
    are reduced here; else they come from backward_partial_kernel. The saved mean is
    rounded to float32, so u is re-centered: with d = z − mean, u = (d − mean(d))·rstd
    (the corrected two-pass of docs/contract.md §3), which keeps the gradient's error independent of the row
    offset. This program's Σ g·u and Σ g over its rows go to row ``program_id(0)`` of
    DW_PART / DB_PART."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    w = tl.full([CHUNK], 1.0, tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    index = tl.arange(0, CHUNKS_P2)
    valid = index < num_chunks
    dw = tl.zeros([CHUNK], dtype=tl.float32)
    db = tl.zeros([CHUNK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    row = start.to(tl.int64)  # a loop-carried int64 row index (the loop variable is int32)
    for _ in range(start, end):
        slots = row * num_chunks + index
        z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        gh = g * w
        if RMS:
            u = z * rstd
            if FUSED:
                c1 = _mean(tl.sum(gh * u, 0), n_f)
            else:
                c1 = _mean(_total(tl.load(PART_C1 + slots, mask=valid, other=0.0)), n_f)
            dx = rstd * (gh - u * c1)
        else:
            d = tl.where(mask, z - tl.load(MEAN + row), 0.0)
            if FUSED:
                delta = _mean(tl.sum(d, 0), n_f)
                u = tl.where(mask, d - delta, 0.0) * rstd
                c1 = _mean(tl.sum(gh * u, 0), n_f)
                c2 = _mean(tl.sum(gh, 0), n_f)
            else:
                delta = _mean(_total(tl.load(PART_D + slots, mask=valid, other=0.0)), n_f)
                u = tl.where(mask, d - delta, 0.0) * rstd
                c2 = _mean(_total(tl.load(PART_C2 + slots, mask=valid, other=0.0)), n_f)
                ghd = _mean(_total(tl.load(PART_C1 + slots, mask=valid, other=0.0)), n_f)
                c1 = rstd * (ghd - delta * c2)
            dx = rstd * (gh - c2 - u * c1)
        if HAS_DRES:
            dx += tl.load(DRES + row * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, _cast(dx, DX.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw += g * u
        if NEED_DB:
            db += g
        row += 1
    out = pid.to(tl.int64) * N + cols
    if NEED_DW:
        tl.store(DW_PART + out, dw, mask=mask)
    if NEED_DB:
        tl.store(DB_PART + out, db, mask=mask)


@triton.jit
def column_sum_kernel(
    PART, OUT, P, N,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """OUT = Σ_p PART[p] for a (P, N) float32 buffer, in a fixed order; grid cdiv(N, BLOCK_N)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        acc += tl.load(PART + offsets, mask=(rows < P)[:, None] & col_mask[None, :], other=0.0)
    tl.store(OUT + cols, tl.sum(acc, 0), mask=col_mask)
