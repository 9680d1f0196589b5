"""Triton kernels for layer norm and RMSNorm, forward and backward.

Launched only by :mod:`layernorm.backends.triton_`, which loads this file once per mode
(compiled for CUDA tensors, interpreted for CPU tensors under ``TRITON_INTERPRET=1``).

Layout: ``x``, ``residual``, ``dy``, ``dresidual_out`` are ``(M, N)`` with contiguous rows
read through their row stride (no copy); outputs are contiguous. Every row index is cast to
int64 before it is multiplied by a stride, so tensors past 2^31 elements address correctly.

Forward numerics (docs/contract.md §3): every output element of a float32, float16 or
bfloat16 input is the exact result rounded once, the numba and torch backends' bits, by
their three stages:

1. float64 arithmetic (the inputs widened exactly) with the contract's bound per element
   and Ziv's test: ``yh - E`` and ``yh + E`` must round to the same value. Sums run
   over a ``ROWS x COLS`` tile (:func:`_sum2d`), so whatever order ``tl.sum`` takes
   within a level, a term passes at most ``(ROWS - 1) + (COLS - 1)`` roundings, plus
   one per chunk on the wide path: the ``depth`` each kernel receives. The bound's
   factors are rounded up to float32-representable values (:data:`_C1_01`, ...).
2. For a row stage 1 leaves open, the statistics again by accurate sums: one error-free
   extraction (Rump, Ogita and Oishi's ExtractVector) makes the high parts' sum exact
   and leaves low parts of at most ``u·sigma``, so the error of a sum is at most
   ``u|S| + γ·N·u·sigma`` (:func:`_accurate`); then the output and the test again. This
   runs on the device: in the same program (fused), or in a kernel launched for every
   row that returns at once for a settled row (wide). No host work.
3. A row still open gets ``FLAGS[row] = 1``; the host rewrites it with the exact
   fallback (``triton_._settle``). ``FLAGS`` is 0 where stage 1 settled the row, 2 where
   stage 2 did.

The halves are rounded from float64 through float32 rounded to odd (:func:`_round_once`),
never twice to nearest; bfloat16 by hand, since the interpreter's cast truncates. A
float argument reaches a kernel as float32, so ``eps`` comes as its float64 bit
pattern. Layer norm centres by the corrected two-pass ``m1 = mean(z)``, ``d = z - m1``,
``delta = mean(d)``, ``c = d - delta``; the output is ``((z - m1) - delta)·rstd·gamma
+ beta`` in that order, with gamma and beta rounded to float32 first.

Two forward paths, chosen by the host from N only:

- fused: one program holds a whole row (``ROWS·COLS >= N``, at most
  ``triton_.FUSED_FORWARD_N``).
- wide: grid (rows, chunks): per-chunk float64 partial sums of z, then (layer norm) of
  ``d`` and ``d²``, then each chunk's output from the row's totals (every program of a
  row adds the same partials in the same order), then stage 2 per row. A row of any
  width (tested past 1M elements) is spread over many programs; x is read three times.

The backward is correctly rounded too (docs/contract.md §3, "Correct rounding of the
backward"): the numba and torch backends' algorithm in float64 (five row sums, the row
constants and bound, Ziv's test), over the same tiles and depth as the forward; a row
the test leaves open gets stage 2: the sums again by extraction, as the forward's
stage 2, in the same program (fused) or in :func:`backward_precise_kernel` (chunked);
a row still open is flagged 1 for the host's exact fallback
(``triton_._settle_backward``). Each program owns a
fixed block of rows (a multiple of ``_weight_terms.ROWS``; and one chunk of columns when
chunked), loops over them in order and adds the terms of ``_weight_terms`` (``dy·u`` and
``dy``; a row's scalars ``r``, ``t`` that stages 1 and 2 leave open are settled in
double-double on the device, :func:`_dd_scalars_tile` / :func:`_dd_scalars_chunked`,
and only a row on a midpoint, or within about 2^-60 of one, goes to the host) in float64 registers, one block of rows at a time, into a ``(blocks, N)``
float64 buffer, whose blocks the host adds by halving (``torch_.block_totals``): the
numba and torch backends' sums, bit for bit. No atomics anywhere, so every result is bitwise
reproducible, and a row's output never depends on the other rows.
"""

# Triton kernels keep explicit if/else on constexpr flags (one branch is compiled):
# ruff: noqa: SIM102, SIM108, SIM300
from __future__ import annotations

import os

import triton
import triton.language as tl

from . import _weight_terms

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


# ---------------------------------------------------------------------------------------
# The correctly rounded forward (docs/contract.md §3): float64, a bound per element,
# Ziv's test; a row the test leaves open is recomputed in the kernel with accurate sums
# (stage 2), and what is still open is flagged for the host's exact fallback.

_U = tl.constexpr(2.0**-53)  # float64's unit roundoff
# The bound's factors of docs/contract.md §3, each rounded up (down for the threshold) to
# a value float32 holds: Triton types a float literal as float32, so 1.01 would be
# 1.00999999. A larger factor only loosens the bound.
_C1_01 = tl.constexpr(1.015625)  # >= 1.01
_C0_51 = tl.constexpr(0.515625)  # >= 0.51
_C2_01 = tl.constexpr(2.015625)  # >= 2.01
_C1_02 = tl.constexpr(1.03125)  # >= 1.02
_C1_001 = tl.constexpr(1.001953125)  # >= 1.001
_C2_1 = tl.constexpr(2.125)  # >= 2.1
_LOOSE = tl.constexpr(0.0078125)  # <= 0.01: a row with e_s >= s/128 is flagged
_SLACK = tl.constexpr(1.0 + 2.0**-22)  # >= 1 + 2**-30: the bound's own roundings
_EXPONENT = tl.constexpr(0x7FF0000000000000)  # float64's exponent bits


@triton.jit
def _sum2d(t):
    # A tile's sum: its rows (K terms), then the row totals (R terms). Whatever order
    # tl.sum takes within a level, a term passes at most (K - 1) + (R - 1) roundings.
    return tl.sum(tl.sum(t, 1), 0)


@triton.jit
def _max2d(t):
    return tl.max(tl.max(t, 1), 0)


@triton.jit
def _gamma(depth):
    # γ for sums whose terms pass at most ``depth`` roundings, plus one (a rounded square)
    h = (depth + 1).to(tl.float64) * _U
    return h / (1.0 - h)


@triton.jit
def _pow2_above(t):
    # A power of two above the finite t >= 0 (0 for t = 0): twice t's leading power.
    return (t.to(tl.int64, bitcast=True) & _EXPONENT).to(tl.float64, bitcast=True) * 2.0


@triton.jit
def _split(x, sigma):
    # Rump, Ogita and Oishi's ExtractScalar (2008, Lemma 3.3): with sigma a power of two
    # and |x| <= sigma, x = q + r exactly, q a multiple of u·sigma, |r| <= u·sigma. With
    # sigma >= 4·N·max|x| (ExtractVector, Theorem 3.4), any sum of the q is exact.
    q = (sigma + x) - sigma
    return q, x - q


@triton.jit
def _accurate(q_total, r_total, sigma, n, g):
    # (S, bound on |S - Σx|) of a sum split by _split: Σq is exact, Σr has an error of
    # at most γ·Σ|r| <= γ·N·u·sigma, and S = fl(Σq + Σr) one more rounding.
    total = q_total + r_total
    return total, _C1_01 * (_U * tl.abs(total) + g * n * _U * sigma)


@triton.jit
def _neg(x):
    # IEEE negation (-0.0 from +0.0): Triton 3.6 and older compile ``-x`` as ``0 - x``,
    # which is +0.0 at x = +0.0; every float negation in the kernels goes through here
    return x * -1.0


@triton.jit
def _two_sum(a, b):
    # Knuth's TwoSum: t + e == a + b exactly
    t = a + b
    bb = t - a
    return t, (a - (t - bb)) + (b - bb)


@triton.jit
def _two_prod(a, b):
    # p + e == a·b exactly (no underflow): the error by an explicit fma
    p = a * b
    return p, tl.fma(a, b, _neg(p))


@triton.jit
def _row_constants(var, e_var, eps):
    # rstd = 1/sqrt(var + eps) and the bound's per-row factors (docs/contract.md §3)
    s = var + eps
    e_s = e_var + _C1_01 * _U * s
    loose = (e_s >= _LOOSE * s).to(tl.int32)  # 0 for a NaN row: it stays NaN
    e_r = _C0_51 * (e_s / (s - e_s)) + _C2_01 * _U
    rstd = 1.0 / tl.sqrt(s)
    k_p = (_C2_01 * _U + _C1_02 * e_r) * _SLACK
    k_w = rstd * (1.0 + _C1_02 * e_r) * _SLACK
    return rstd, k_p, k_w, loose


@triton.jit
def _folded(delta, rstd, e_mean, k_c, k_p, k_w):
    # the per-element terms (k_c(|c| + |d|) + e_mean)·|w|·k_w + |p|·k_p as |w|·a + |p|·b
    a = (e_mean + k_c * tl.abs(delta)) * k_w
    b = k_p + k_c * (2.0 + _C1_01 * _U) * (1.0 + _C2_01 * _U) * (k_w / rstd) * _SLACK
    return a, b


@triton.jit
def _stage_one_rms(s2, n, g):
    # (delta, var, e_mean, e_var, k_c) of RMSNorm from s2 = Σz² (each z² exact)
    var = s2 / n
    zero = tl.full([], 0.0, tl.float64)
    e_var = _C1_01 * ((g + 2.0 * _U) * var + _U * var)
    return zero, var, zero, e_var, zero


@triton.jit
def _stage_one(s1, s2, n, g):
    # (delta, var, e_mean, e_var, k_c) of layer norm from s1 = Σd, s2 = Σd², d = z - m1
    delta = s1 / n
    absolute = _C1_001 * tl.sqrt(n * s2)  # >= Σ|d|
    e_mean = _C1_01 * ((g + 2.0 * _U) * absolute / n + _U * tl.abs(delta))
    var = tl.maximum(s2 / n - delta * delta, 0.0)
    e_var = _C1_01 * (
        (g + 3.0 * _U) * (s2 / n) + e_mean * (2.0 * tl.abs(delta) + e_mean)
        + _U * (delta * delta + var)
    )  # fmt: skip
    return delta, var, e_mean, e_var, _C1_01 * _U


@triton.jit
def _round_to_odd_single(v):
    # float64 -> float32, rounded to odd: truncate, set the last bit when inexact
    single = v.to(tl.float32)
    back = single.to(tl.float64)
    bits = single.to(tl.int32, bitcast=True)
    bits = tl.where(tl.abs(back) > tl.abs(v), bits - 1, bits)
    bits = bits | ((back != v) & (v == v)).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_once(v, DTYPE: tl.constexpr):
    # float64 -> DTYPE rounded once to nearest-even: float32 directly, the halves through
    # float32 rounded to odd (as torch_.round_once and _exact.round_once)
    if DTYPE == tl.float32:
        out = v.to(tl.float32)
    else:
        odd = _round_to_odd_single(v)
        if DTYPE == tl.bfloat16:
            out = _bfloat16_rne(odd)
        else:
            out = odd.to(tl.float16)
    return out


@triton.jit
def _bits(v, DTYPE: tl.constexpr):
    if DTYPE == tl.float32:
        out = v.to(tl.int32, bitcast=True)
    else:
        out = v.to(tl.int16, bitcast=True)
    return out


@triton.jit
def _output(
    z, gamma, beta, mask, m1, delta, rstd, a, b, k_y,
    DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The elements ``((z - m1) - delta)·rstd·gamma + beta`` in float64, each rounded once
    to DTYPE, and Ziv's test on each: whether ``yh - E`` and ``yh + E`` round apart.
    A missing weight is 1 and a missing bias -0.0 (``p + -0.0 == p`` bitwise)."""
    d = z - m1
    c = d - delta
    p = c * rstd
    mean_part = tl.zeros_like(z) + a
    if HAS_WEIGHT:
        p = p * gamma
        mean_part = tl.abs(gamma) * a
    yh = p
    if HAS_BIAS:
        yh = p + beta
    bound = (mean_part + tl.abs(p) * b) + tl.abs(yh) * k_y
    bound = tl.where((p == 0.0) & (mean_part == 0.0), 0.0, bound)
    low = _bits(_round_once(yh - bound, DTYPE), DTYPE)
    high = _bits(_round_once(yh + bound, DTYPE), DTYPE)
    # (a zero bound is an exact value: -0.0 + 0.0 = +0.0 would split a -0.0 in two)
    open_ = (low != high) & (bound != 0.0) & mask
    return _round_once(yh, DTYPE), _max2d(open_.to(tl.int32))


@triton.jit
def _load_params(W, B, cols, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    # gamma and beta as float64 values of the accumulation dtype (float32)
    gamma = tl.full(cols.shape, 1.0, tl.float64)
    beta = tl.full(cols.shape, -0.0, tl.float64)
    if HAS_WEIGHT:
        gamma = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32).to(tl.float64)
    if HAS_BIAS:
        beta = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32).to(tl.float64)
    return gamma, beta


@triton.jit
def _tile(ROWS: tl.constexpr, COLS: tl.constexpr):
    # the column offsets of a ROWS x COLS tile (row-major)
    return tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]


@triton.jit
def _eps(eps_bits):
    # eps at its float64 value, passed as its bit pattern (a float argument is float32)
    return eps_bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _precise_rms(z, mask, n, g):
    # stage 2 for RMSNorm: s2 = Σz² by one extraction (z² is exact)
    squares = tl.where(mask, z * z, 0.0)
    sigma = _pow2_above(4.0 * n * _max2d(squares))
    q, r = _split(squares, sigma)
    s2, e_s2 = _accurate(_sum2d(q), _sum2d(r), sigma, n, g)
    var = s2 / n
    zero = tl.full([], 0.0, tl.float64)
    return zero, var, zero, _C1_01 * (e_s2 / n + _U * var), zero


@triton.jit(do_not_specialize=["N", "eps_bits", "depth"])
def forward_fused_kernel(
    X, R, W, B, Y, RES_OUT, MEAN, RSTD, FLAGS,
    stride_x, stride_r, stride_y, stride_res_out,
    N, eps_bits, depth,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """One program per row, held whole as a ROWS x COLS tile (ROWS·COLS >= N): stage 1,
    and for a row it leaves open, stage 2 in the same program. ``FLAGS[row]``: 0 when
    stage 1 settled the row, 2 when stage 2 did, 1 when it is still open (the host's
    exact fallback)."""
    row = tl.program_id(0).to(tl.int64)
    cols = _tile(ROWS, COLS)
    mask = cols < N
    n = N.to(tl.float64)
    eps = _eps(eps_bits)
    g = _gamma(depth)
    z = _load_z(X, R, RES_OUT, row, stride_x, stride_r, stride_res_out, cols, mask,
                HAS_RESIDUAL).to(tl.float64)  # fmt: skip
    gamma, beta = _load_params(W, B, cols, mask, HAS_WEIGHT, HAS_BIAS)
    if RMS:
        m1 = tl.full([], 0.0, tl.float64)
        delta, var, e_mean, e_var, k_c = _stage_one_rms(_sum2d(z * z), n, g)
    else:
        m1 = _sum2d(z) / n
        d = tl.where(mask, z - m1, 0.0)
        delta, var, e_mean, e_var, k_c = _stage_one(_sum2d(d), _sum2d(d * d), n, g)
        tl.store(MEAN + row, (m1 + delta).to(tl.float32))
    rstd, k_p, k_w, loose = _row_constants(var, e_var, eps)
    tl.store(RSTD + row, rstd.to(tl.float32))
    a, b = _folded(delta, rstd, e_mean, k_c, k_p, k_w)
    k_y = _C2_1 * _U * _SLACK
    y, open_ = _output(z, gamma, beta, mask, m1, delta, rstd, a, b, k_y,
                       Y.dtype.element_ty, HAS_WEIGHT, HAS_BIAS)  # fmt: skip
    tl.store(Y + row * stride_y + cols, y, mask=mask)
    flag = open_ | loose
    if flag != 0:  # rare: stage 2, whose bound is far tighter; the row is read again
        if HAS_RESIDUAL:
            tl.debug_barrier()  # residual_out, written by other threads, is read back
            z = _load_row(RES_OUT, row, stride_res_out, cols, mask)
        else:
            z = _load_row(X, row, stride_x, cols, mask)
        if RMS:
            delta, var, e_mean, e_var, k_c = _precise_rms(z, mask, n, g)
        else:
            d, rounding = _two_sum(z, _neg(m1))
            d = tl.where(mask, d, 0.0)
            rounding = tl.where(mask, rounding, 0.0)
            big_d = _max2d(tl.abs(d))
            sigma = _pow2_above(4.0 * n * big_d)
            q, r = _split(d, sigma)
            absolute = _sum2d(tl.abs(d))
            delta, e_mean = _precise_mean(
                _sum2d(q), _sum2d(r), _sum2d(rounding), absolute, sigma, n, g
            )
            c = tl.where(mask, d - delta, 0.0)
            spread = _sum2d(tl.where(mask, _spread(c, d, e_mean), 0.0))
            sigma = _pow2_above(4.0 * n * _square_above(big_d, delta))
            q, r = _split(c * c, sigma)
            var, e_var = _precise_variance(_sum2d(q), _sum2d(r), spread, sigma, n, g)
            k_c = _C1_01 * _U
        rstd, k_p, k_w, loose = _row_constants(var, e_var, eps)
        a, b = _folded(delta, rstd, e_mean, k_c, k_p, k_w)
        gamma, beta = _load_params(W, B, cols, mask, HAS_WEIGHT, HAS_BIAS)
        y, open_ = _output(z, gamma, beta, mask, m1, delta, rstd, a, b, k_y,
                           Y.dtype.element_ty, HAS_WEIGHT, HAS_BIAS)  # fmt: skip
        tl.store(Y + row * stride_y + cols, y, mask=mask)
        flag = 2 - (open_ | loose)  # 2: settled by stage 2, 1: still open
    tl.store(FLAGS + row, flag)


@triton.jit
def _spread(c, d, e_mean):
    # per element 2|c|·e_c + e_c² + u·c², e_c = 1.01u(|c| + |d|) + e_mean: bounds
    # |fl(c²) - v²| (v the exact centred value; zero where c = d = 0 and e_mean = 0)
    e_c = _C1_01 * _U * (tl.abs(c) + tl.abs(d)) + e_mean
    return 2.0 * tl.abs(c) * e_c + e_c * e_c + _U * c * c


@triton.jit
def _square_above(big_d, delta):
    # >= every fl(c)², c = fl(d - delta), |d| <= big_d
    top = big_d + tl.abs(delta)
    return top * top * (1.0 + 2.0**-20)


@triton.jit
def _precise_mean(q_total, r_total, rounding, absolute, sigma, n, g):
    # (delta, e_mean) of stage 2: Σd by extraction plus the exact roundings of d = z - m1
    # (|rounding_i| <= u|d_i|, summed plainly: error <= γ·u·Σ|d|)
    sum_d, e_sum = _accurate(q_total, r_total, sigma, n, g)
    s1 = sum_d + rounding
    e_s1 = e_sum + _C1_01 * (g * _U * absolute * (1.0 + 2.0 * g) + _U * tl.abs(s1))
    delta = s1 / n
    return delta, _C1_01 * (e_s1 / n + _U * tl.abs(delta))


@triton.jit
def _precise_variance(q_total, r_total, spread, sigma, n, g):
    # (var, e_var) of stage 2: Σfl(c²) by extraction, the spread summed plainly
    s2, e_s2 = _accurate(q_total, r_total, sigma, n, g)
    var = s2 / n
    return var, _C1_01 * ((e_s2 + spread * (1.0 + 2.0 * g)) / n + _U * var)


# Wide rows: grid (rows, chunks) over passes that each read a chunk, with per-chunk
# partial sums in float64 added in a fixed order (_row_total), and stage 2 in one
# program per row launched for every row (it returns at once for a row none of whose
# chunks is open).


@triton.jit
def _row_total(PART, row, num_chunks, CHUNKS_P2: tl.constexpr):
    # the sum of a row's chunk partials (float64), in a fixed order
    index = tl.arange(0, CHUNKS_P2)
    return tl.sum(tl.load(PART + row * num_chunks + index, mask=index < num_chunks, other=0.0), 0)


@triton.jit
def _load_row(Z, row, stride_z, cols, mask):
    return tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float64)


@triton.jit(do_not_specialize=["N"])
def forward_sums_kernel(
    X, R, RES_OUT, PART_A,
    stride_x, stride_r, stride_res_out,
    N, num_chunks,
    HAS_RESIDUAL: tl.constexpr, RMS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Wide rows, pass 1, grid (M, chunks): a chunk's Σz (RMSNorm: Σz²) into PART_A, and
    its residual_out."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * (ROWS * COLS) + _tile(ROWS, COLS)
    mask = cols < N
    z = _load_z(X, R, RES_OUT, row, stride_x, stride_r, stride_res_out, cols, mask,
                HAS_RESIDUAL).to(tl.float64)  # fmt: skip
    if RMS:
        total = _sum2d(z * z)
    else:
        total = _sum2d(z)
    tl.store(PART_A + row * num_chunks + chunk, total)


@triton.jit(do_not_specialize=["N"])
def forward_centered_kernel(
    Z, PART_A, PART_B, PART_C,
    stride_z,
    N, num_chunks,
    CHUNKS_P2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Wide rows, pass 2 (layer norm), grid (M, chunks): with m1 = Σz/N, a chunk's Σd
    and Σd², d = z - m1, into PART_B and PART_C."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * (ROWS * COLS) + _tile(ROWS, COLS)
    mask = cols < N
    m1 = _row_total(PART_A, row, num_chunks, CHUNKS_P2) / N.to(tl.float64)
    d = tl.where(mask, _load_row(Z, row, stride_z, cols, mask) - m1, 0.0)
    slot = row * num_chunks + chunk
    tl.store(PART_B + slot, _sum2d(d))
    tl.store(PART_C + slot, _sum2d(d * d))


@triton.jit(do_not_specialize=["N", "eps_bits", "depth"])
def forward_output_kernel(
    Z, W, B, Y, MEAN, RSTD, PART_A, PART_B, PART_C, CHUNK_FLAGS,
    stride_z, stride_y,
    N, eps_bits, depth, num_chunks,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
    CHUNKS_P2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Wide rows, pass 3, grid (M, chunks): the row's statistics from its partials (every
    program of a row the same bits), then stage 1's output and test for one chunk;
    ``CHUNK_FLAGS[row, chunk]`` is 1 where the chunk or the row's bound is open."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * (ROWS * COLS) + _tile(ROWS, COLS)
    mask = cols < N
    n = N.to(tl.float64)
    g = _gamma(depth)
    if RMS:
        m1 = tl.full([], 0.0, tl.float64)
        delta, var, e_mean, e_var, k_c = _stage_one_rms(
            _row_total(PART_A, row, num_chunks, CHUNKS_P2), n, g
        )
    else:
        m1 = _row_total(PART_A, row, num_chunks, CHUNKS_P2) / n
        delta, var, e_mean, e_var, k_c = _stage_one(
            _row_total(PART_B, row, num_chunks, CHUNKS_P2),
            _row_total(PART_C, row, num_chunks, CHUNKS_P2),
            n,
            g,
        )
        tl.store(MEAN + row, (m1 + delta).to(tl.float32), mask=chunk == 0)
    rstd, k_p, k_w, loose = _row_constants(var, e_var, _eps(eps_bits))
    tl.store(RSTD + row, rstd.to(tl.float32), mask=chunk == 0)
    a, b = _folded(delta, rstd, e_mean, k_c, k_p, k_w)
    z = _load_row(Z, row, stride_z, cols, mask)
    gamma, beta = _load_params(W, B, cols, mask, HAS_WEIGHT, HAS_BIAS)
    y, open_ = _output(z, gamma, beta, mask, m1, delta, rstd, a, b, _C2_1 * _U * _SLACK,
                       Y.dtype.element_ty, HAS_WEIGHT, HAS_BIAS)  # fmt: skip
    tl.store(Y + row * stride_y + cols, y, mask=mask)
    tl.store(CHUNK_FLAGS + row * num_chunks + chunk, open_ | loose)


@triton.jit(do_not_specialize=["N", "eps_bits", "depth"])
def forward_precise_kernel(
    Z, W, B, Y, PART_A, CHUNK_FLAGS, FLAGS,
    stride_z, stride_y,
    N, eps_bits, depth, num_chunks,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
    CHUNKS_P2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Wide rows, stage 2, grid (M,): launched for every row, it returns at once for a
    row none of whose chunks is open; for an open row it computes the statistics again
    by accurate sums (four passes over the row) and rewrites the row's output.
    ``FLAGS[row]`` as in :func:`forward_fused_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, CHUNKS_P2)
    chunk_flags = tl.load(CHUNK_FLAGS + row * num_chunks + index, mask=index < num_chunks, other=0)
    flag = tl.max(chunk_flags, 0)
    if flag != 0:
        n = N.to(tl.float64)
        g = _gamma(depth)
        tile = _tile(ROWS, COLS)
        zero = tl.full([], 0.0, tl.float64)
        big = zero
        if RMS:
            m1 = zero
        else:
            m1 = _row_total(PART_A, row, num_chunks, CHUNKS_P2) / n
        for chunk in range(0, num_chunks):  # the largest |d| (RMSNorm: z²)
            cols = chunk * (ROWS * COLS) + tile
            mask = cols < N
            z = _load_row(Z, row, stride_z, cols, mask)
            if RMS:
                big = tl.maximum(big, _max2d(z * z))
            else:
                big = tl.maximum(big, _max2d(tl.where(mask, tl.abs(z - m1), 0.0)))
        sigma = _pow2_above(4.0 * n * big)
        q_total = zero
        r_total = zero
        rounding = zero
        absolute = zero
        for chunk in range(0, num_chunks):  # Σd (RMSNorm: Σz²) by extraction
            cols = chunk * (ROWS * COLS) + tile
            mask = cols < N
            z = _load_row(Z, row, stride_z, cols, mask)
            if RMS:
                q, r = _split(z * z, sigma)
            else:
                d, error = _two_sum(z, _neg(m1))
                d = tl.where(mask, d, 0.0)
                q, r = _split(d, sigma)
                rounding += _sum2d(tl.where(mask, error, 0.0))
                absolute += _sum2d(tl.abs(d))
            q_total += _sum2d(q)
            r_total += _sum2d(r)
        if RMS:
            s2, e_s2 = _accurate(q_total, r_total, sigma, n, g)
            var = s2 / n
            e_var = _C1_01 * (e_s2 / n + _U * var)
            delta = zero
            e_mean = zero
            k_c = zero
        else:
            delta, e_mean = _precise_mean(q_total, r_total, rounding, absolute, sigma, n, g)
            sigma = _pow2_above(4.0 * n * _square_above(big, delta))
            q_total = zero
            r_total = zero
            spread = zero
            for chunk in range(0, num_chunks):  # Σfl(c²) by extraction, and the spread
                cols = chunk * (ROWS * COLS) + tile
                mask = cols < N
                d = tl.where(mask, _load_row(Z, row, stride_z, cols, mask) - m1, 0.0)
                c = tl.where(mask, d - delta, 0.0)
                spread += _sum2d(tl.where(mask, _spread(c, d, e_mean), 0.0))
                q, r = _split(c * c, sigma)
                q_total += _sum2d(q)
                r_total += _sum2d(r)
            var, e_var = _precise_variance(q_total, r_total, spread, sigma, n, g)
            k_c = _C1_01 * _U
        rstd, k_p, k_w, loose = _row_constants(var, e_var, _eps(eps_bits))
        a, b = _folded(delta, rstd, e_mean, k_c, k_p, k_w)
        flag = loose
        for chunk in range(0, num_chunks):  # the output again, with stage 2's bound
            cols = chunk * (ROWS * COLS) + tile
            mask = cols < N
            z = _load_row(Z, row, stride_z, cols, mask)
            gamma, beta = _load_params(W, B, cols, mask, HAS_WEIGHT, HAS_BIAS)
            y, open_ = _output(z, gamma, beta, mask, m1, delta, rstd, a, b,
                               _C2_1 * _U * _SLACK, Y.dtype.element_ty, HAS_WEIGHT,
                               HAS_BIAS)  # fmt: skip
            tl.store(Y + row * stride_y + cols, y, mask=mask)
            flag = flag | open_
        flag = 2 - flag  # 2: settled by stage 2, 1: still open
    tl.store(FLAGS + row, flag)


# ---------------------------------------------------------------------------------------
# The correctly rounded backward (docs/contract.md §3, "Correct rounding of the
# backward"): the numba and torch backends' algorithm in float64, with this file's sums.
# A row whose bound is open gets stage 2 on the device, and is flagged for the host's
# exact fallback if it is still open.

# More factors of the backward's bound, rounded up to values float32 holds (as above).
_C2_02 = tl.constexpr(2.03125)  # >= 2.02
_C2_04 = tl.constexpr(2.046875)  # >= 2.04
_C3_03 = tl.constexpr(3.03125)  # >= 3.02 and >= 3.03
#: ``_weight_terms``' constants (each float one a power of two or exact in float32)
_RSTD_LOW = tl.constexpr(_weight_terms.RSTD_LOW)
_RSTD_HALF = tl.constexpr((1 << (_weight_terms.RSTD_LOW - 1)) - 1)
_RSTD_KEEP = tl.constexpr(-(1 << _weight_terms.RSTD_LOW))
_GRID = tl.constexpr(1.0 / _weight_terms.SHIFT_QUANTUM)
_QUANTUM = tl.constexpr(_weight_terms.SHIFT_QUANTUM)
_MAGIC = tl.constexpr(_weight_terms.MAGIC)
_SHIFT_LIMIT = tl.constexpr(_weight_terms.SHIFT_LIMIT)
_WEIGHT_ROWS = tl.constexpr(_weight_terms.ROWS)


@triton.jit
def _round_rstd(r):
    # r rounded to nearest-even to _weight_terms.RSTD_BITS bits, on its pattern
    bits = r.to(tl.int64, bitcast=True)
    bits = (bits + _RSTD_HALF + ((bits >> _RSTD_LOW) & 1)) & _RSTD_KEEP
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def _on_grid(v):
    # v (|v| < 2^19) rounded to nearest-even to a multiple of 2^-32
    return ((v * _GRID + _MAGIC) - _MAGIC) * _QUANTUM


@triton.jit
def _weight_scalars(m1, z0, delta, e_mean, rstd, e_r, loose, RMS: tl.constexpr):
    """A row's ``(r, t, open)`` of ``_weight_terms`` from its float64 statistics
    (``mean = m1 + delta`` within ``e_mean``, ``rstd`` within ``e_r`` of itself unless
    ``loose``): Ziv's test on each scalar, the torch backend's ``_weight_scalars``."""
    spread = rstd * (_C1_01 * e_r + 4.0 * _U)
    r_t = _round_rstd(rstd)
    open_ = (loose != 0) | (rstd - rstd != 0.0)  # (rstd - rstd: NaN unless finite)
    open_ = open_ | (_round_rstd(rstd - spread) != _round_rstd(rstd + spread))
    t = tl.full([], 0.0, tl.float64)
    if not RMS:
        head = m1 - z0
        w = head + delta
        v = w * rstd
        e_v = _C1_02 * (
            (e_mean + _U * (tl.abs(head) + tl.abs(w))) * (rstd + spread)
            + tl.abs(v) * (_C1_01 * e_r + 3.0 * _U)
        )  # fmt: skip
        t = _on_grid(v)
        open_ = open_ | ~(tl.abs(v) + e_v < _SHIFT_LIMIT)
        open_ = open_ | (_on_grid(v - e_v) != _on_grid(v + e_v))
    return r_t, t, open_.to(tl.int32)


@triton.jit
def _weight_shift(Z, row, stride_z, RMS: tl.constexpr):
    # the row's a of _weight_terms: its first element (0 for RMSNorm)
    z0 = tl.full([], 0.0, tl.float64)
    if not RMS:
        z0 = tl.load(Z + row * stride_z).to(tl.float32).to(tl.float64)
    return z0


# ---------------------------------------------------------------------------------------
# dweight's scalars in double-double, for a row that stages 1 and 2 leave open: the numba
# kernel's _settled_weight_scalars (docs/contract.md §3, "dweight and dbias"), the same
# quantities, bounds and verdicts, with the sums over tiles by extraction (each sum of
# high parts exact, as stage 2's) instead of Sum2 chains.


_TINY = tl.constexpr(0x0170000000000000)  # 2^-1000's float64 pattern


@triton.jit
def _dd_difference(z, mask, a):
    # (h, l), h = fl(z - a) and h + l == z - a exactly, 0 past the row
    h, l = _two_sum(z, _neg(a))
    return tl.where(mask, h, 0.0), tl.where(mask, l, 0.0)


@triton.jit
def _dd_mean_parts(z, mask, a, sigma):
    # a tile's part of V = Σ(z - a): (Σq, Σr, Σl) of the differences, h split at sigma
    h, l = _dd_difference(z, mask, a)
    q, r = _split(h, sigma)
    return _sum2d(q), _sum2d(r), _sum2d(l)


@triton.jit
def _dd_square_parts(z, mask, a, w_h, w_l, sigma, RMS: tl.constexpr):
    """A tile's part of ``S' = Σd²``, ``d = z - a - (w_h + w_l)`` as the pair ``(d_h,
    d_l)`` (within ``2.01u·tau`` of it), ``d_h² = p + p_e`` by TwoProd: ``(Σq, Σr)`` of
    the ``p`` split at ``sigma``, ``Σ(p_e + 2·d_h·d_l)``, ``Σp``, ``Σ|d_h|·tau`` and
    ``Σtau²`` (RMSNorm: ``d = z``, exactly)."""
    if RMS:
        d_h = tl.where(mask, z, 0.0)
        d_l = tl.zeros_like(z)
        tau = tl.zeros_like(z)
    else:
        h, l = _dd_difference(z, mask, a)
        p1, e1 = _two_sum(h, _neg(w_h))
        d_h, d_l = _two_sum(p1, e1 + (l - w_l))
        d_h = tl.where(mask, d_h, 0.0)
        d_l = tl.where(mask, d_l, 0.0)
        tau = tl.where(mask, tl.abs(e1) + tl.abs(l) + tl.abs(w_l), 0.0)
    p, p_e = _two_prod(d_h, d_h)
    q, r = _split(p, sigma)
    low = p_e + 2.0 * d_h * d_l
    return (
        _sum2d(q), _sum2d(r), _sum2d(low), _sum2d(p), _sum2d(tl.abs(d_h) * tau),
        _sum2d(tau * tau),
    )  # fmt: skip


@triton.jit
def _product_minus(x1, x2, y1, y2, z1, z2):
    # (x1 + x2)·(y1 + y2) - (z1 + z2) and a bound on its evaluation's roundings (the
    # numba kernel's _product_minus)
    c1, c2 = _two_prod(x1, y1)
    head = c1 - z1
    p = x1 * y2
    q = x2 * y1
    w = x2 * y2
    tail = ((c2 - z2) + p) + (q + w)
    value = head + tail
    small = tl.abs(c2) + tl.abs(z2) + tl.abs(p) + tl.abs(q) + tl.abs(w)
    return value, _C1_01 * (_U * (tl.abs(head) + tl.abs(value)) + 3.015625 * _U * small)


@triton.jit
def _dd_sigma_of_squares(big, w_h, n):
    # sigma >= 4·N·max d_h², from |d_h| <= (max|h| + |w_h|)(1 + 2^-40)
    top = (big + tl.abs(w_h)) * (1.0 + 2.0**-40)
    return _pow2_above(4.0 * n * top * top)


@triton.jit
def _dd_mean(q_v, r_v, l_v, sigma, big, n, g):
    """From V's parts (Σq exact; Σr within g·N·u·sigma; Σl within g·u·N·big): ``V`` as
    the pair ``(v_h, v_l)``, its bound ``e_v``, and ``mean - a = V/N`` as ``(w_h, w_l)``
    with ``mu`` bounding how far ``a + w_h + w_l`` is from the mean."""
    c = r_v + l_v
    v_h, v_l = _two_sum(q_v, c)
    e_v = _C1_02 * (g * n * _U * sigma + g * _U * n * big + _U * tl.abs(c))
    w_h = v_h / n
    w_l = (tl.fma(_neg(w_h), n, v_h) + v_l) / n  # (the remainder is exact)
    mu = _C1_02 * (e_v / n + _C2_01 * _U * tl.abs(w_l))
    return v_h, v_l, e_v, w_h, w_l, mu


@triton.jit
def _dd_spread(q_s, r_s, low, p_sum, tau_d, tau_sq, sigma, mu, n, eps, g):
    """``S = N·(q + eps)`` as the pair ``(s_h, s_l)`` within ``e_s``, from the parts of
    :func:`_dd_square_parts` (``N·q = S' - N·mu'²``, ``|mu'| <= mu``; ``N·eps`` exactly
    by TwoProd)."""
    e_sum = g * n * _U * sigma + ((g + _C2_01 * _U) * 3.015625 + 1.015625 * _U) * _U * p_sum
    e_d = 4.0625 * _U * tau_d + 4.0625 * _U * _U * tau_sq
    c = r_s + low
    ne_h, ne_l = _two_prod(n, eps)
    s_h, s_2 = _two_sum(q_s, ne_h)
    s_l = (s_2 + c) + ne_l
    e_s = _C1_02 * (
        e_sum + e_d + n * mu * mu + _U * tl.abs(c)
        + _C2_01 * _U * (tl.abs(s_2) + tl.abs(c) + tl.abs(ne_l))
    ) + tl.full([], _TINY, tl.int64).to(tl.float64, bitcast=True)  # fmt: skip
    return s_h, s_l, e_s


@triton.jit
def _dd_verdict(v_h, v_l, e_v, w_h, s_h, s_l, e_s, n, RMS: tl.constexpr):
    """``(r, t, open)`` decided at the midpoints of the estimates' grid intervals, as the
    numba kernel's :func:`_settled_weight_scalars` (its docstring has the argument):
    ``rstd > m`` iff ``m²·S < N``, ``|v| > m`` iff ``m²·N·S < V²``."""
    ok = (s_h > 0.0) & (e_s <= 2.0**-60 * s_h) & (e_v - e_v == 0.0)  # (NaN rows too)
    s_safe = tl.where(ok, s_h, 1.0)
    r_a = 1.0 / tl.sqrt(s_safe / n)
    rel_r = _C0_51 * (tl.abs(s_l) + e_s) / s_safe + 2.625 * _U
    ok = ok & (rel_r < 2.0**-35)
    power = (r_a.to(tl.int64, bitcast=True) & _EXPONENT).to(tl.float64, bitcast=True)
    step = power * 2.0**-31  # the 32-bit grid's spacing in r_a's binade
    m_r = (tl.floor(r_a / step) + 0.5) * step
    m2_h, m2_l = _two_prod(m_r, m_r)  # exact: m_r has 33 bits
    below, error = _product_minus(m2_h, m2_l, s_h, s_l, n, 0.0)  # m²S - N
    ok = ok & (tl.abs(below) > _C1_01 * (error + _C1_01 * m2_h * e_s))
    r = tl.where(below < 0.0, m_r + 0.5 * step, m_r - 0.5 * step)
    t = tl.full([], 0.0, tl.float64)
    if not RMS:
        v_a = tl.abs(w_h) * r_a
        e_va = _C1_02 * (v_a * (rel_r + _C2_01 * _U) + r_a * (tl.abs(v_l) + e_v) / n)
        ok = ok & (v_a < 2.0**14) & (e_va < 0.25 * _QUANTUM)
        m_t = (tl.floor(tl.minimum(v_a, 2.0**14) * _GRID) + 0.5) * _QUANTUM
        t2_h, t2_l = _two_prod(m_t, m_t)  # exact: m_t < 2^14 has at most 47 bits
        x_h, x_e = _two_prod(t2_h, n)
        x_p = t2_l * n
        x_l = x_e + x_p
        e_x = _C2_01 * _U * (tl.abs(x_e) + tl.abs(x_p))
        y_h, y_e = _two_prod(v_h, v_h)
        y_c = 2.0 * v_h * v_l
        y_l = y_e + y_c
        e_y = _C2_01 * _U * (tl.abs(y_e) + tl.abs(y_c)) + _C1_01 * _U * _U * y_h
        e_y = e_y + e_v * (_C2_01 * tl.abs(v_h) + e_v)
        above, error = _product_minus(x_h, x_l, s_h, s_l, y_h, y_l)  # m²NS - V²
        moved = _C1_01 * (tl.abs(x_h) * e_s + e_x * tl.abs(s_h)) + e_y
        ok = ok & (tl.abs(above) > _C1_01 * (error + moved))
        t = tl.where(above < 0.0, m_t + 0.5 * _QUANTUM, m_t - 0.5 * _QUANTUM)
        ok = ok & ((t == 0.0) | (tl.abs(v_h) > 2.0 * e_v))  # V's sign known
        t = tl.where(t == 0.0, 0.0, tl.where(v_h < 0.0, _neg(t), t))
    return r, t, 1 - ok.to(tl.int32)


@triton.jit
def _dd_scalars_tile(z, mask, a, n, eps, g, RMS: tl.constexpr):
    # (r, t, open) of a row held in one tile (fused)
    v_h = tl.full([], 0.0, tl.float64)
    v_l = v_h
    e_v = v_h
    w_h = v_h
    w_l = v_h
    mu = v_h
    big = v_h
    if not RMS:
        h, _ = _dd_difference(z, mask, a)
        big = _max2d(tl.abs(h))
        sigma = _pow2_above(4.0 * n * big)
        q_v, r_v, l_v = _dd_mean_parts(z, mask, a, sigma)
        v_h, v_l, e_v, w_h, w_l, mu = _dd_mean(q_v, r_v, l_v, sigma, big, n, g)
    else:
        big = _max2d(tl.abs(tl.where(mask, z, 0.0)))
    sigma = _dd_sigma_of_squares(big, w_h, n)
    q_s, r_s, low, p_sum, tau_d, tau_sq = _dd_square_parts(z, mask, a, w_h, w_l, sigma, RMS)
    s_h, s_l, e_s = _dd_spread(q_s, r_s, low, p_sum, tau_d, tau_sq, sigma, mu, n, eps, g)
    return _dd_verdict(v_h, v_l, e_v, w_h, s_h, s_l, e_s, n, RMS)


@triton.jit
def _chunk_of_row(Z, row, stride_z, N, chunk, ROWS: tl.constexpr, COLS: tl.constexpr):
    # (z, mask): chunk ``chunk`` of the row as float64 (0 past its end)
    cols = chunk * (ROWS * COLS) + _tile(ROWS, COLS)
    mask = cols < N
    return _load_row(Z, row, stride_z, cols, mask), mask


@triton.jit
def _dd_scalars_chunked(
    Z, row, stride_z, N, n, a, eps, g, num_chunks,
    RMS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    # (r, t, open) of a row read chunk by chunk: max|z - a|, then V, then S
    zero = tl.full([], 0.0, tl.float64)
    big = zero
    for chunk in range(0, num_chunks):
        z, mask = _chunk_of_row(Z, row, stride_z, N, chunk, ROWS, COLS)
        h, _ = _dd_difference(z, mask, a)
        big = tl.maximum(big, _max2d(tl.abs(h)))
    v_h = zero
    v_l = zero
    e_v = zero
    w_h = zero
    w_l = zero
    mu = zero
    if not RMS:
        sigma = _pow2_above(4.0 * n * big)
        q_v = zero
        r_v = zero
        l_v = zero
        for chunk in range(0, num_chunks):
            z, mask = _chunk_of_row(Z, row, stride_z, N, chunk, ROWS, COLS)
            q, r, l = _dd_mean_parts(z, mask, a, sigma)
            q_v += q
            r_v += r
            l_v += l
        v_h, v_l, e_v, w_h, w_l, mu = _dd_mean(q_v, r_v, l_v, sigma, big, n, g)
    sigma = _dd_sigma_of_squares(big, w_h, n)
    q_s = zero
    r_s = zero
    low = zero
    p_sum = zero
    tau_d = zero
    tau_sq = zero
    for chunk in range(0, num_chunks):
        z, mask = _chunk_of_row(Z, row, stride_z, N, chunk, ROWS, COLS)
        q, r, lo, p, td, ts = _dd_square_parts(z, mask, a, w_h, w_l, sigma, RMS)
        q_s += q
        r_s += r
        low += lo
        p_sum += p
        tau_d += td
        tau_sq += ts
    s_h, s_l, e_s = _dd_spread(q_s, r_s, low, p_sum, tau_d, tau_sq, sigma, mu, n, eps, g)
    return _dd_verdict(v_h, v_l, e_v, w_h, s_h, s_l, e_s, n, RMS)


_C3_1 = tl.constexpr(3.125)  # >= 3.1


@triton.jit
def _load_gradient_row(DY, Z, row, stride_dy, stride_z, cols, mask):
    # (z, g) of one row (or chunk) as float64, exactly
    z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    return z.to(tl.float64), g.to(tl.float64)


@triton.jit
def _shift(MEAN, row, RMS: tl.constexpr):
    # m1: the saved mean (any finite value will do; 0 for RMSNorm or a non-finite mean)
    m1 = tl.full([], 0.0, tl.float64)
    if not RMS:
        m1 = tl.load(MEAN + row).to(tl.float64)
        m1 = tl.where(m1 - m1 == 0.0, m1, 0.0)  # (NaN for an infinite or NaN m1)
    return m1


@triton.jit
def _backward_sums(z, gh, m1, mask, RMS: tl.constexpr):
    # the five sums of step 1: (Σd, Σd², Σgh, Σgh², Σgh·d), d = z - m1 (RMSNorm: no Σd, Σgh)
    d = tl.where(mask, z - m1, 0.0)
    s_d = tl.full([], 0.0, tl.float64)
    s_g = s_d
    if not RMS:
        s_d = _sum2d(d)
        s_g = _sum2d(gh)
    return s_d, _sum2d(d * d), s_g, _sum2d(gh * gh), _sum2d(gh * d)


@triton.jit
def _plain_errors(s_dd, s_gg, n, g):
    # step 1's bounds on the summation errors of Σd, Σd², Σgh, Σgh·d: γ times Σ|terms|
    # (D, Σd², G, P of docs/contract.md §3)
    root_dd = tl.sqrt(s_dd)
    root_gg = tl.sqrt(s_gg)
    root_n = tl.sqrt(n)
    e_d = g * (_C1_001 * root_n * root_dd)
    e_g = g * (_C1_001 * root_n * root_gg)
    return e_d, g * s_dd, e_g, g * (_C1_001 * root_gg * root_dd)


@triton.jit
def _accurate_sum(t, mask, n, g):
    # (Σt, bound on its error) by one extraction (stage 2's sums: _split, _accurate)
    t = tl.where(mask, t, 0.0)
    sigma = _pow2_above(4.0 * n * _max2d(tl.abs(t)))
    q, r = _split(t, sigma)
    return _accurate(_sum2d(q), _sum2d(r), sigma, n, g)


@triton.jit
def _backward_constants(
    s_d, s_dd, s_g, s_gg, s_gd, e_d, e_dd, e_g, e_gd, n, eps, RMS: tl.constexpr
):  # fmt: skip
    """Step 2: ``(delta, c2, rstd, k, k_t1, k_c, k_0, loose, e_mean, e_r)`` from the five
    sums and
    bounds ``e_*`` on the summation errors of four (docs/contract.md §3, the torch
    backend's formulas, with ``γ·D`` written ``e_d``, ``γ·Σd²`` ``e_dd``, ``γ·G``
    ``e_g`` and ``γ·P`` ``e_gd``: :func:`_plain_errors` in step 1, the extraction's
    bounds in stage 2)."""
    zero = tl.full([], 0.0, tl.float64)
    p_abs = _C1_001 * tl.sqrt(s_gg) * tl.sqrt(s_dd)  # >= Σ|gh·d|
    if RMS:
        delta = zero
        e_mean = zero
        c2 = zero
        e_c2 = zero
        a2 = zero
        var = s_dd / n
        e_var = _C1_01 * ((e_dd + 3.0 * _U * s_dd) / n + _U * var)
        alpha = zero
    else:
        delta = s_d / n
        d_abs = _C1_001 * tl.sqrt(n * s_dd)  # >= Σ|d|
        e_mean = _C1_01 * ((e_d + 2.0 * _U * d_abs) / n + _U * tl.abs(delta))
        var = tl.maximum(s_dd / n - delta * delta, 0.0)
        e_var = _C1_01 * (
            (e_dd + 3.0 * _U * s_dd) / n + e_mean * (2.0 * tl.abs(delta) + e_mean)
            + _U * (delta * delta + var)
        )  # fmt: skip
        c2 = s_g / n
        e_c2 = _C1_01 * (e_g / n + _U * tl.abs(c2))
        a2 = delta * c2
        alpha = _C2_04 * _U + zero
    a1 = s_gd / n
    a = a1 - a2
    e_a = _C1_01 * (
        _U * (tl.abs(a) + tl.abs(a1) + tl.abs(a2)) + (e_gd + _C2_01 * _U * p_abs) / n
        + e_mean * tl.abs(c2) + (tl.abs(delta) + e_mean) * e_c2
    )  # fmt: skip
    s = var + eps
    e_s = e_var + _C1_01 * _U * s
    loose = (e_s >= _LOOSE * s).to(tl.int32)
    e_r = _C0_51 * (e_s / (s - e_s)) + _C2_01 * _U
    rstd = 1.0 / tl.sqrt(s)
    k = rstd * rstd * rstd * a
    r_hi = rstd * (1.0 + _C1_01 * e_r)
    e_k = _C3_03 * _U * tl.abs(k) + r_hi * r_hi * r_hi * (_C3_03 * e_r * tl.abs(a) + e_a)
    beta = _C1_01 * _U * tl.abs(delta) + e_mean
    k_t1 = r_hi * (e_r + _U) + _C2_02 * _U * rstd
    k_c = tl.abs(k) * (alpha + _C2_02 * _U) + e_k * (1.0 + alpha)
    k_0 = r_hi * e_c2 + beta * (tl.abs(k) + e_k)
    return delta, c2, rstd, k, k_t1, k_c, k_0, loose, e_mean, e_r


@triton.jit
def _backward_output(
    z, gh, rho, mask, m1, delta, c2, rstd, k, k_t1, k_c, k_0, DTYPE: tl.constexpr
):  # fmt: skip
    """Step 3: ``dx = ((rstd·(gh - c2) - k·c) + rho) + 0.0`` in float64, ``c = (z - m1) -
    delta``, each element rounded once to DTYPE, Ziv's test on each, and ``c``."""
    c = (z - m1) - delta
    t1 = gh - c2
    y = ((rstd * t1 - k * c) + rho) + 0.0  # (+ 0.0: an exact zero is +0.0)
    bound = (k_t1 * tl.abs(t1) + k_c * tl.abs(c) + k_0) * _SLACK
    bound = bound + tl.abs(y) * (_C3_1 * _U * _SLACK)
    low = _bits(_round_once(y - bound, DTYPE), DTYPE)
    high = _bits(_round_once(y + bound, DTYPE), DTYPE)
    open_ = (low != high) & mask
    return _round_once(y, DTYPE), _max2d(open_.to(tl.int32)), c


@triton.jit(do_not_specialize=["M", "N"])
def backward_sums_kernel(
    DY, Z, W, MEAN, PART,
    stride_dy, stride_z,
    M, N, num_chunks,
    HAS_WEIGHT: tl.constexpr, RMS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Wide rows, grid (M, chunks): a chunk's five float64 sums of step 1 into
    ``PART[k, row, chunk]`` (k = 0..4: Σd, Σd², Σgh, Σgh², Σgh·d)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * (ROWS * COLS) + _tile(ROWS, COLS)
    mask = cols < N
    z, g = _load_gradient_row(DY, Z, row, stride_dy, stride_z, cols, mask)
    gamma, _ = _load_params(W, W, cols, mask, HAS_WEIGHT, False)
    sums = _backward_sums(z, g * gamma, _shift(MEAN, row, RMS), mask, RMS)
    slot = row * num_chunks + chunk
    plane = M.to(tl.int64) * num_chunks
    tl.store(PART + slot, sums[0])
    tl.store(PART + plane + slot, sums[1])
    tl.store(PART + 2 * plane + slot, sums[2])
    tl.store(PART + 3 * plane + slot, sums[3])
    tl.store(PART + 4 * plane + slot, sums[4])


@triton.jit(do_not_specialize=["M", "N", "eps_bits", "depth"])
def backward_kernel(
    DY, Z, W, MEAN, DRES, DX, DW_PART, DB_PART, PART, CHUNK_FLAGS, SCALARS, WEIGHT_FLAGS,
    stride_dy, stride_z, stride_dres, stride_dx,
    M, N, eps_bits, depth, rows_per_program, num_chunks,
    HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr, NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr, RMS: tl.constexpr, FUSED: tl.constexpr, WEIGHT_TERMS: tl.constexpr,
    CHUNKS_P2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """The correctly rounded ``dx`` (``+ dresidual_out``) for a fixed block of rows and
    one chunk of ``ROWS·COLS`` columns; grid (programs, num_chunks). FUSED: the chunk
    spans the row and its five sums are taken here; else they are the chunk partials of
    :func:`backward_sums_kernel`, added in a fixed order (every program of a row gets
    the same constants). ``CHUNK_FLAGS[row, chunk]`` is 0 where stage 1 settled the
    chunk, 1 where it is open; FUSED: an open row gets stage 2 (the sums again by
    extraction) here, and its flag is then 2 where that settles it (else 1: the host's
    exact fallback rewrites the row). Chunked rows get stage 2 from
    :func:`backward_precise_kernel`.

    ``dweight``/``dbias``: the terms of ``_weight_terms`` (``dy·u``, ``u = ((z - a)·r) -
    t``, and ``dy``), added row by row in float64 from ``0.0`` over each block of
    ``_weight_terms.ROWS`` rows (``rows_per_program`` is a multiple of it) into row
    ``block`` of DW_PART / DB_PART. The row's ``(r, t)``: FUSED, from its constants (and
    stage 2's when their test leaves them open, then :func:`_dd_scalars_tile`'s),
    ``WEIGHT_FLAGS[row]`` 1 where they are still open (the host's exact fallback); chunked, from ``SCALARS`` (2, M), which
    :func:`backward_scalars_kernel` wrote. Not WEIGHT_TERMS (float64 input): ``u =
    c·rstd``, float64's accuracy and this backend's own bits."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * (ROWS * COLS) + _tile(ROWS, COLS)
    mask = cols < N
    n = N.to(tl.float64)
    eps = _eps(eps_bits)
    g = _gamma(depth)
    gamma, _ = _load_params(W, W, cols, mask, HAS_WEIGHT, False)
    plane = M.to(tl.int64) * num_chunks
    dw = tl.zeros([ROWS, COLS], dtype=tl.float64)
    db = tl.zeros([ROWS, COLS], dtype=tl.float64)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    row = start.to(tl.int64)  # a loop-carried int64 row index (the loop variable is int32)
    for _ in range(start, end):
        z, dy = _load_gradient_row(DY, Z, row, stride_dy, stride_z, cols, mask)
        gh = dy * gamma  # exact: 24 by 24 bits
        m1 = _shift(MEAN, row, RMS)
        z0 = _weight_shift(Z, row, stride_z, RMS)
        if FUSED:
            s_d, s_dd, s_g, s_gg, s_gd = _backward_sums(z, gh, m1, mask, RMS)
        else:
            s_d = _row_total(PART, row, num_chunks, CHUNKS_P2)
            s_dd = _row_total(PART + plane, row, num_chunks, CHUNKS_P2)
            s_g = _row_total(PART + 2 * plane, row, num_chunks, CHUNKS_P2)
            s_gg = _row_total(PART + 3 * plane, row, num_chunks, CHUNKS_P2)
            s_gd = _row_total(PART + 4 * plane, row, num_chunks, CHUNKS_P2)
        e_d, e_dd, e_g, e_gd = _plain_errors(s_dd, s_gg, n, g)
        delta, c2, rstd, k, k_t1, k_c, k_0, loose, e_mean, e_r = _backward_constants(
            s_d, s_dd, s_g, s_gg, s_gd, e_d, e_dd, e_g, e_gd, n, eps, RMS
        )
        rho = tl.full([ROWS, COLS], -0.0, tl.float64)
        if HAS_DRES:
            rho = _load_row(DRES, row, stride_dres, cols, mask)
        dx, open_, c = _backward_output(
            z, gh, rho, mask, m1, delta, c2, rstd, k, k_t1, k_c, k_0, DX.dtype.element_ty
        )
        flag = open_ | loose
        if FUSED:
            r_t, t, w_open = _weight_scalars(m1, z0, delta, e_mean, rstd, e_r, loose, RMS)
            if not (NEED_DW and WEIGHT_TERMS):
                w_open = w_open * 0
            if (flag | w_open) != 0:  # rare: stage 2, the sums again by extraction
                d = tl.where(mask, z - m1, 0.0)
                s_dd, e_dd = _accurate_sum(d * d, mask, n, g)
                s_gd, e_gd = _accurate_sum(gh * d, mask, n, g)
                if not RMS:
                    s_d, e_d = _accurate_sum(d, mask, n, g)
                    s_g, e_g = _accurate_sum(gh, mask, n, g)
                delta, c2, rstd, k, k_t1, k_c, k_0, loose, e_mean, e_r = _backward_constants(
                    s_d, s_dd, s_g, s_gg, s_gd, e_d, e_dd, e_g, e_gd, n, eps, RMS
                )
                if flag != 0:
                    dx, open_, c = _backward_output(
                        z, gh, rho, mask, m1, delta, c2, rstd, k, k_t1, k_c, k_0,
                        DX.dtype.element_ty,
                    )  # fmt: skip
                    flag = 2 - (open_ | loose)  # 2: settled by stage 2, 1: still open
                if w_open != 0:
                    r_t, t, w_open = _weight_scalars(m1, z0, delta, e_mean, rstd, e_r, loose, RMS)
                if w_open != 0:  # rarer: double-double
                    r_dd, t_dd, w_open = _dd_scalars_tile(z, mask, z0, n, eps, g, RMS)
                    if w_open == 0:
                        r_t = r_dd
                        t = t_dd
            tl.store(WEIGHT_FLAGS + row, w_open)
        else:
            r_t = tl.full([], 0.0, tl.float64)
            t = r_t
            if NEED_DW and WEIGHT_TERMS:
                r_t = tl.load(SCALARS + row)
                t = tl.load(SCALARS + M + row)
        tl.store(DX + row * stride_dx + cols, dx, mask=mask)
        tl.store(CHUNK_FLAGS + row * num_chunks + chunk, flag)
        if NEED_DW and WEIGHT_TERMS:
            dw += tl.where(mask, dy * (((z - z0) * r_t) - t), 0.0)
        elif NEED_DW:
            dw += tl.where(mask, dy * (c * rstd), 0.0)
        if NEED_DB:
            db += dy
        if ((row + 1) % _WEIGHT_ROWS == 0) | (row + 1 == end):  # a block's last row
            out = (row // _WEIGHT_ROWS) * N + cols
            if NEED_DW:
                tl.store(DW_PART + out, dw, mask=mask)
                dw = tl.zeros([ROWS, COLS], dtype=tl.float64)
            if NEED_DB:
                tl.store(DB_PART + out, db, mask=mask)
                db = tl.zeros([ROWS, COLS], dtype=tl.float64)
        row += 1


@triton.jit
def _chunk_terms(
    DY, Z, W, row, m1, stride_dy, stride_z, N, chunk,
    HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    # one chunk of a row: (gh, d) = (dy·gamma, z - m1), 0 past the row's end
    cols = chunk * (ROWS * COLS) + _tile(ROWS, COLS)
    mask = cols < N
    z, dy = _load_gradient_row(DY, Z, row, stride_dy, stride_z, cols, mask)
    gamma, _ = _load_params(W, W, cols, mask, HAS_WEIGHT, False)
    return dy * gamma, tl.where(mask, z - m1, 0.0)


@triton.jit
def _precise_sums(
    DY, Z, W, row, m1, stride_dy, stride_z, N, n, g, num_chunks,
    HAS_WEIGHT: tl.constexpr, RMS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Stage 2's sums of a chunked row by extraction, with their bounds: two passes over
    the row (the largest terms, then the sums): ``(s_d, e_d, s_dd, e_dd, s_g, e_g,
    s_gd, e_gd)``."""
    zero = tl.full([], 0.0, tl.float64)
    big_d = zero
    big_dd = zero
    big_g = zero
    big_gd = zero
    for chunk in range(0, num_chunks):  # the largest terms of each sum
        gh, d = _chunk_terms(
            DY, Z, W, row, m1, stride_dy, stride_z, N, chunk, HAS_WEIGHT, ROWS, COLS
        )
        big_d = tl.maximum(big_d, _max2d(tl.abs(d)))
        big_dd = tl.maximum(big_dd, _max2d(d * d))
        big_g = tl.maximum(big_g, _max2d(tl.abs(gh)))
        big_gd = tl.maximum(big_gd, _max2d(tl.abs(gh * d)))
    sigma_d = _pow2_above(4.0 * n * big_d)
    sigma_dd = _pow2_above(4.0 * n * big_dd)
    sigma_g = _pow2_above(4.0 * n * big_g)
    sigma_gd = _pow2_above(4.0 * n * big_gd)
    q_d = zero
    r_d = zero
    q_dd = zero
    r_dd = zero
    q_g = zero
    r_g = zero
    q_gd = zero
    r_gd = zero
    for chunk in range(0, num_chunks):  # the sums by extraction (_accurate_sum's)
        gh, d = _chunk_terms(
            DY, Z, W, row, m1, stride_dy, stride_z, N, chunk, HAS_WEIGHT, ROWS, COLS
        )
        q, r = _split(d * d, sigma_dd)
        q_dd += _sum2d(q)
        r_dd += _sum2d(r)
        q, r = _split(gh * d, sigma_gd)
        q_gd += _sum2d(q)
        r_gd += _sum2d(r)
        if not RMS:
            q, r = _split(d, sigma_d)
            q_d += _sum2d(q)
            r_d += _sum2d(r)
            q, r = _split(gh, sigma_g)
            q_g += _sum2d(q)
            r_g += _sum2d(r)
    s_dd, e_dd = _accurate(q_dd, r_dd, sigma_dd, n, g)
    s_gd, e_gd = _accurate(q_gd, r_gd, sigma_gd, n, g)
    s_d, e_d = _accurate(q_d, r_d, sigma_d, n, g)
    s_g, e_g = _accurate(q_g, r_g, sigma_g, n, g)
    return s_d, e_d, s_dd, e_dd, s_g, e_g, s_gd, e_gd


@triton.jit(do_not_specialize=["M", "N", "eps_bits", "depth"])
def backward_scalars_kernel(
    DY, Z, W, MEAN, PART, SCALARS, WEIGHT_FLAGS,
    stride_dy, stride_z,
    M, N, eps_bits, depth, num_chunks,
    HAS_WEIGHT: tl.constexpr, RMS: tl.constexpr,
    CHUNKS_P2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Chunked rows, grid (M,): each row's ``(r, t)`` of ``_weight_terms`` into
    ``SCALARS`` (2, M), from the chunk partials of :func:`backward_sums_kernel` (the
    constants :func:`backward_kernel` computes), and where their test leaves them open
    (rare) from :func:`_precise_sums`, then (rarer) :func:`_dd_scalars_chunked`;
    ``WEIGHT_FLAGS[row]`` is 1 where they are still open (the host's exact fallback)."""
    row = tl.program_id(0).to(tl.int64)
    n = N.to(tl.float64)
    eps = _eps(eps_bits)
    g = _gamma(depth)
    plane = M.to(tl.int64) * num_chunks
    s_d = _row_total(PART, row, num_chunks, CHUNKS_P2)
    s_dd = _row_total(PART + plane, row, num_chunks, CHUNKS_P2)
    s_g = _row_total(PART + 2 * plane, row, num_chunks, CHUNKS_P2)
    s_gg = _row_total(PART + 3 * plane, row, num_chunks, CHUNKS_P2)
    s_gd = _row_total(PART + 4 * plane, row, num_chunks, CHUNKS_P2)
    m1 = _shift(MEAN, row, RMS)
    z0 = _weight_shift(Z, row, stride_z, RMS)
    e_d, e_dd, e_g, e_gd = _plain_errors(s_dd, s_gg, n, g)
    delta, _c2, rstd, _k, _k_t1, _k_c, _k_0, loose, e_mean, e_r = _backward_constants(
        s_d, s_dd, s_g, s_gg, s_gd, e_d, e_dd, e_g, e_gd, n, eps, RMS
    )
    r_t, t, w_open = _weight_scalars(m1, z0, delta, e_mean, rstd, e_r, loose, RMS)
    if w_open != 0:
        s_d, e_d, s_dd, e_dd, s_g, e_g, s_gd, e_gd = _precise_sums(
            DY, Z, W, row, m1, stride_dy, stride_z, N, n, g, num_chunks,
            HAS_WEIGHT, RMS, ROWS, COLS,
        )  # fmt: skip
        delta, _c2, rstd, _k, _k_t1, _k_c, _k_0, loose, e_mean, e_r = _backward_constants(
            s_d, s_dd, s_g, s_gg, s_gd, e_d, e_dd, e_g, e_gd, n, eps, RMS
        )
        r_t, t, w_open = _weight_scalars(m1, z0, delta, e_mean, rstd, e_r, loose, RMS)
    if w_open != 0:  # rarer: double-double
        r_dd, t_dd, w_open = _dd_scalars_chunked(
            Z, row, stride_z, N, n, z0, eps, g, num_chunks, RMS, ROWS, COLS
        )
        if w_open == 0:
            r_t = r_dd
            t = t_dd
    tl.store(SCALARS + row, r_t)
    tl.store(SCALARS + M + row, t)
    tl.store(WEIGHT_FLAGS + row, w_open)


@triton.jit(do_not_specialize=["M", "N", "eps_bits", "depth"])
def backward_precise_kernel(
    DY, Z, W, MEAN, DRES, DX, PART, CHUNK_FLAGS, FLAGS,
    stride_dy, stride_z, stride_dres, stride_dx,
    M, N, eps_bits, depth, num_chunks,
    HAS_WEIGHT: tl.constexpr, HAS_DRES: tl.constexpr, RMS: tl.constexpr,
    CHUNKS_P2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Chunked rows, stage 2, grid (M,): launched for every row, it returns at once for
    a row none of whose chunks is open; for an open row it takes the four sums again by
    extraction (:func:`_precise_sums`), then step 3 again, rewriting the row's ``dx``.
    ``FLAGS[row]``: 0 when stage 1 settled the row, 2 when stage 2 did, 1 when it is
    still open (the host's exact fallback)."""
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, CHUNKS_P2)
    chunk_flags = tl.load(CHUNK_FLAGS + row * num_chunks + index, mask=index < num_chunks, other=0)
    flag = tl.max(chunk_flags, 0)
    if flag != 0:
        n = N.to(tl.float64)
        g = _gamma(depth)
        tile = _tile(ROWS, COLS)
        plane = M.to(tl.int64) * num_chunks
        s_gg = _row_total(PART + 3 * plane, row, num_chunks, CHUNKS_P2)
        m1 = _shift(MEAN, row, RMS)
        s_d, e_d, s_dd, e_dd, s_g, e_g, s_gd, e_gd = _precise_sums(
            DY, Z, W, row, m1, stride_dy, stride_z, N, n, g, num_chunks,
            HAS_WEIGHT, RMS, ROWS, COLS,
        )  # fmt: skip
        delta, c2, rstd, k, k_t1, k_c, k_0, loose, _e_mean, _e_r = _backward_constants(
            s_d, s_dd, s_g, s_gg, s_gd, e_d, e_dd, e_g, e_gd, n, _eps(eps_bits), RMS
        )
        flag = loose
        for chunk in range(0, num_chunks):  # step 3 again, with stage 2's bound
            cols = chunk * (ROWS * COLS) + tile
            mask = cols < N
            z, dy = _load_gradient_row(DY, Z, row, stride_dy, stride_z, cols, mask)
            gamma, _ = _load_params(W, W, cols, mask, HAS_WEIGHT, False)
            rho = tl.full([ROWS, COLS], -0.0, tl.float64)
            if HAS_DRES:
                rho = _load_row(DRES, row, stride_dres, cols, mask)
            dx, open_, _ = _backward_output(
                z, dy * gamma, rho, mask, m1, delta, c2, rstd, k, k_t1, k_c, k_0,
                DX.dtype.element_ty,
            )  # fmt: skip
            tl.store(DX + row * stride_dx + cols, dx, mask=mask)
            flag = flag | open_
        flag = 2 - flag  # 2: settled by stage 2, 1: still open
    tl.store(FLAGS + row, flag)
