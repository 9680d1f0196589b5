"""Numba CPU kernels for layer norm and RMSNorm: fused, multithreaded, deterministic.

Imported only on the numba backend's first call (``import layernorm`` compiles nothing).
There are four kernels (``forward_serial``/``forward_parallel``,
``backward_serial``/``backward_parallel``) on tensor addresses; the serial ones run a
whole call, the parallel ones one span of its rows (``numba_`` runs the spans over
threads: :mod:`layernorm.backends._threads`; no numba threading layer), and both run the
same compiled row functions. :func:`entry` compiles one of them for one
dtype as a function of C-typed arguments only (:mod:`layernorm.backends._kernel_abi`),
which Python calls (``numba_``) and compiled code calls by its address (:func:`address`):
one compiled body, the same bits either way. Everything is compiled with the on-disk cache of
:mod:`layernorm.backends._numba_cache`: the first call of each dtype's entry compiles,
later processes load it (``NUMBA_CACHE_DIR`` if set, else layernorm's cache directory).

Data layout. Each (M, N) tensor arrives as a flat 1-D array over its storage plus a row
stride, so row ``i`` is ``a[i * stride : i * stride + N]``: strided rows are read in place
(no copy). Every pass over a row (the sums, the residual add, the output, dx) is an
intrinsic of :mod:`layernorm.backends._numba_vectors` that emits its loop inline, on
explicit 64-byte vectors. float16 and bfloat16 arrive as their raw 16-bit patterns (int16
and uint16 arrays; numba has no half types) and are converted in registers, with
round-to-nearest-even on output. Weight and bias arrive in the accumulation dtype; a
missing weight is ones and a missing bias is ``-0.0`` (``v * 1 + -0.0 == v`` bitwise, so
no inner-loop branches).

Numerics (docs/contract.md §3). The forward computes in float64 for every dtype and
rounds each output once. Its output pass runs over segments of :data:`SEGMENT` elements,
first with a cheap rounding test (``_numba_vectors.normalize_row_fast``); a segment that
test leaves open is computed again with Ziv's test against a bound per element
(``normalize_row_checked``). A bfloat16 or float16 row runs its output pass in float32
lanes instead (``normalize_row_fast_single``, :func:`_single_bounds`), a vector they
leave open computed again by the float64 pass with the bound per element; a row whose rounding that leaves open is computed again with
compensated statistics (:func:`_precise_statistics`), and if still open, flagged
(``flags``) for the host's exact fallback (:mod:`layernorm.backends._exact`). A float64
row whose statistics would leave float64's range is scaled by a power of two first
(:func:`_scaled_row`). The backward's dx is correctly rounded the
same way, from five float64 row sums (:func:`_backward_sums`), the statistics of ``z``
recomputed with ``eps``, Ziv's test per element (:func:`_dx_row_checked`) and flags for
``_exact.fix_backward_rows``. Row sums add blocks of ``_numba_vectors.SUM_BLOCK``
elements in the accumulation dtype and the block totals in float64, so their error does
not grow with N. The forward's statistics are
shifted: ``m1`` is the row's first element, ``d = z - m1``, ``delta = mean(d)``,
``mean = m1 + delta``, ``var = mean(d²) - delta²`` from one pass for ``sum(d)`` and
``sum(d²)``, the cancellation in that difference inside the bound (docs/contract.md §3);
a row whose bound that leaves too loose goes to the compensated two-pass statistics. A
row is read once from memory; the output pass re-reads it from cache. Rows are
software-pipelined (:func:`_forward_rows`): row ``i + 1``'s statistics before row
``i``'s output; short rows (:data:`BATCHED_N`) go in batches of 8 instead
(:func:`_forward_batches`), their scalar constants computed together across the rows in
one vectorized loop. The backward's dx pass takes two rows at a time
(:func:`_dx_rows_checked`), which load the weight and the dweight/dbias partial sums
once. Either way each row's arithmetic is the same: the same bits.

Determinism. Every row sum goes through :mod:`layernorm.backends._numba_vectors`,
whose summation order is written out in LLVM IR and depends on N alone: not on M, the
row's position, the thread count, the entry (serial or parallel), streaming, or the code
the sum is compiled into (``tests/test_numba_vectors.py`` replays the order in NumPy
bit for bit; ``tests/test_numba_backend.py`` compares the entries and paths). The element
arithmetic carries no fast-math flags, so ``(z - m1) - delta`` is never rewritten, and
no function that computes a statistic is compiled with ``fastmath``. So outputs are
bitwise batch- and thread-invariant, and the same from build to build.
dweight/dbias are the sums of :mod:`layernorm.backends._weight_terms` (the same bits as
every backend's): a fixed partition of the rows into blocks of :data:`ROW_BLOCK` rows
(independent of the thread count), summed row by row within a block in float64, then
the blocks' totals by halving (:func:`column_sum_kernel`).

Inlining. Code that numba inlines itself (``inline="always"``) is lowered with the
caller's fast-math flags; none of these kernels has any, and the forward's row function
is inlined (a call per row would pass a dozen array structs: 7–27 % slower at 64 to 1024
elements a row). The row passes are intrinsics: inline by construction. numba inlines
by copying the callee's IR, its own inlined callees included, at every call site, and
types each copy again: most of a forward's compile time. So a function called once per
call, such as :func:`_forward_batches`, is a plain call (numba compiles it once per
argument types), not a nested inline: the float32 forward compiles in about half the
time, the same code per row (benchmarks/RESULTS.md, "Compiling the kernels").

Reference counts. numba increments and decrements an array's reference count at every
copy of it (a slice, an inlined function's argument), an atomic operation where the array
owns its memory (``np.empty``, the widened parameters, the scratch): some 20 ns a row of
the backward at N = 64. The per-row code therefore works on borrowed views
(:func:`_borrowed`, :func:`_scratch_row`), whose counts are null pointers, of arrays that
the caller keeps alive (a parameter, or :func:`_alive` after the last use).
"""

from __future__ import annotations

import inspect
import math
import platform
from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import _kernel_abi, _numba_cache, _weight_terms
from ._numba_vectors import (
    FAST_MARGIN,
    SUM_BLOCK,
    Row,
    _as_bits,
    _constant,
    _elementwise,
    _fabs,
    _reduce,
    _shaped,
    _splat_all,
    add_rows,
    element_f64,
    fma,
    narrow,
    narrow_once,
    normalize_row_checked,
    normalize_row_fast,
    normalize_row_fast_centered,
    normalize_row_fast_single,
    normalize_row_fast_single_streaming,
    normalize_row_fast_streaming,
    row_sum,
    row_sum_sq,
    row_sum_sq_kept,
    row_sums_centered,
    row_sums_centered_kept,
    two_prod,
    two_sum,
    widen,
)
from ._numba_vectors import lanes as vector_lanes
from ._numba_vectors import pattern as _pattern
from ._numba_vectors import view as _view

_FLAG_TAG = np.empty(0, np.uint8)  # the dtype of the forward's fallback flags
_F64_TAG = np.empty(0, np.float64)  # the dtype of the backward's dweight/dbias partials
ROW_BLOCK = _weight_terms.ROWS  # rows per dweight/dbias partial sum (never the threads')
#: Elements per segment of the forward's output pass (``_forward_row``): a segment that
#: the cheap pass leaves open is rewritten by the checked pass, so this bounds that cost.
SEGMENT = 1024
#: The start of the SHA-256 of ``_numba_vectors.py``, whose intrinsics are compiled into
#: these kernels. numba keys its on-disk cache on this file alone, so a change to that one
#: must change this line, or a stale cached kernel would keep running the old code;
#: ``tests/test_numba_vectors.py`` fails until it does.
VECTORS_SHA256 = "293dbc83a6af965e"
#: The same for ``_weight_terms.py``, whose constants the backward compiles in
WEIGHT_TERMS_SHA256 = "24c25c5ad03281b4"


def _jit(*signature, **options):
    """``numba.njit`` with the on-disk cache of :mod:`layernorm.backends._numba_cache`
    (its folder, its lock), compiled in memory where no folder is writable (then every
    process compiles again). Division by zero follows IEEE (``1 / 0 = inf``), not Python's
    ZeroDivisionError. With a ``signature``, compiles (or loads from the cache) now."""
    options.setdefault("error_model", "numpy")

    def decorate(func):
        dispatcher = njit(cache=False, **options)(func)
        _numba_cache.enable(dispatcher)
        if signature:
            (sig,) = signature
            dispatcher.compile(sig)
            dispatcher.disable_compile()
        return dispatcher

    return decorate


# ---------------------------------------------------------------------------------------
# Streaming (non-temporal) stores for large outputs: vectors whose stores bypass the cache
# (no read-for-ownership of the output, which a plain store costs; same bits). Used only
# when the output is larger than the caches, where it would be evicted before anyone read
# it anyway: the forward's output pass (``_numba_vectors.normalize_row_fast_streaming``,
# ``normalize_row_fast_single_streaming``). The backward's dx rows are stored plainly.

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")  # sfence


@intrinsic
def _store_fence(typingctx):
    """sfence: the row's streaming stores are globally visible before anything after."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@_jit(inline="always")
def _vector_head(a):
    """How many leading elements of ``a`` precede a multiple of 8 elements' bytes: where
    its 8-lane vectors may be streamed (``normalize_row_fast_streaming``)."""
    size = 8 * a.itemsize
    return min(a.shape[0], ((size - a.ctypes.data % size) % size) // a.itemsize)


@_jit(inline="always")
def _single_head(a):
    """How many leading elements of the 16-bit row ``a`` precede a multiple of 16
    elements' bytes: where ``normalize_row_fast_single_streaming`` may start."""
    size = 16 * a.itemsize
    return min(a.shape[0], ((size - a.ctypes.data % size) % size) // a.itemsize)


# ---------------------------------------------------------------------------------------
# Kernels


_U = 2.0**-53  # float64's unit roundoff
_SLACK = 1.0 + 2.0**-30  # covers the rounding errors of computing the bound itself
_K_Y = 2.1 * _U * _SLACK  # the forward bound's |yh| factor (docs/contract.md §3)


#: ``_weight_terms``' constants as the kernels use them
_RSTD_LOW_MASK = (1 << _weight_terms.RSTD_LOW) - 1
_GRID = 1.0 / _weight_terms.SHIFT_QUANTUM


@_jit(inline="always")
def _round_rstd(r):
    """``r`` rounded to nearest-even to ``_weight_terms.RSTD_BITS`` bits, on its pattern."""
    bits = _pattern(r)
    bits = (bits + (_RSTD_LOW_MASK >> 1) + ((bits >> _weight_terms.RSTD_LOW) & 1)) & ~_RSTD_LOW_MASK
    return _pattern(bits)


@_jit(inline="always")
def _on_grid(v):
    """``v`` (``|v| < 2^19``) rounded to nearest-even to a multiple of ``2^-32``."""
    return ((v * _GRID + _weight_terms.MAGIC) - _weight_terms.MAGIC) * _weight_terms.SHIFT_QUANTUM


@_jit(inline="always")
def _weight_scalars(m1, z0, delta, e_mean, rstd, e_r, loose, rms):
    """A row's ``(r, t, open)`` of :mod:`._weight_terms` from its float64 statistics:
    ``mean = m1 + delta`` within ``e_mean``, ``rstd`` within ``e_r`` of itself (unless
    ``loose`` is nonzero); ``open`` is 1.0 where Ziv's test on either scalar leaves its
    rounding open (the torch backend's ``_weight_scalars``, the same tests). Without a
    branch, so that :func:`_batch_rows`' loop over rows vectorizes."""
    spread = rstd * (1.01 * e_r + 4.0 * _U)
    r_t = _round_rstd(rstd)
    open_r = (loose != 0.0) | (rstd - rstd != 0.0)  # (NaN unless rstd is finite)
    open_r |= _round_rstd(rstd - spread) != _round_rstd(rstd + spread)
    head = m1 - z0
    w = head + delta
    v = w * rstd
    e_v = 1.02 * (
        (e_mean + _U * (abs(head) + abs(w))) * (rstd + spread)
        + abs(v) * (1.01 * e_r + 3.0 * _U)
    )  # fmt: skip
    open_t = (abs(v) + e_v >= _weight_terms.SHIFT_LIMIT) | (v - v != 0.0)
    open_t |= _on_grid(v - e_v) != _on_grid(v + e_v)
    t = 0.0 if rms else _on_grid(v)
    return r_t, t, 1.0 if open_r | (open_t & (not rms)) else 0.0


@_jit(inline="always")
def _depth(n):
    """An upper bound on the roundings on any path of a float64 row sum of ``n`` terms
    in ``_numba_vectors``' order (docs/contract.md §3): a lane adds at most
    ``B / 16 + 1`` terms of a block of ``B <= SUM_BLOCK`` elements (8 lanes, 2
    accumulators, one more vector), combining the accumulators and the lanes takes 4,
    the tail 7 and 1 more; then one per block total."""
    return min(n, min(n, SUM_BLOCK) // 16 + 14 + n // SUM_BLOCK)


@_jit(inline="always")
def _row_statistics(
    i, x, x_stride, residual, residual_stride, has_residual, residual_out,
    mean, rstd, n, eps, rms, store_stats,
):  # fmt: skip
    """:func:`_kept_statistics` without keeping ``d``."""
    return _kept_statistics(
        i, x, x_stride, residual, residual_stride, has_residual, residual_out,
        mean, rstd, n, eps, rms, store_stats, False, np.empty(0, np.float64),
    )  # fmt: skip


@_jit(inline="always")
def _kept_statistics(
    i, x, x_stride, residual, residual_stride, has_residual, residual_out,
    mean, rstd, n, eps, rms, store_stats, keep, kept,
):  # fmt: skip
    """Row ``i``'s input ``z`` (``residual_out = x + residual``, written first, when
    ``has_residual``), its statistics in float64 and the constants of its error bound
    (docs/contract.md §3): ``(z, m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y,
    flag)`` with ``k_w = fl(rstd_i·w_rel)``,
    the forward's first three passes. ``flag`` is 1 when the bound on ``rstd`` is too
    loose to use (the row goes to the exact fallback).

    ``x``, ``residual``: flat storage with row strides ``x_stride``, ``residual_stride``;
    ``residual_out``: contiguous (M*N,) output in x's dtype; ``mean`` (unused for RMSNorm)
    and ``rstd``: (M,) in the accumulation dtype, written only when ``store_stats``.
    ``eps`` is a float64. ``keep``, ``kept``: as :func:`_row_sums` takes them.
    """
    z, m1, s1, s2 = _row_sums(
        i, x, x_stride, residual, residual_stride, has_residual, residual_out, n, rms, keep,
        kept,
    )  # fmt: skip
    delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag = _statistics(m1, s1, s2, n, eps, rms)
    if store_stats:
        if not rms:
            mean[i] = m1 + delta
        rstd[i] = rstd_i
    return z, m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag


@_jit(inline="always")
def _row_sums(
    i, x, x_stride, residual, residual_stride, has_residual, residual_out, n, rms, keep, kept
):  # fmt: skip
    """Row ``i``'s pass over memory for :func:`_row_statistics`: ``(z, m1, s1, s2)``, the
    row ``z`` (``residual_out = x + residual`` written first, when ``has_residual``), its
    shift ``m1`` (the first element; 0 for RMSNorm) and the sums ``s1 = Σd``, ``s2 = Σd²``
    of ``d = z - m1`` in float64 (RMSNorm: ``s1 = 0``, ``s2 = Σz²``). When ``keep`` (see
    :func:`_keeps`), each ``d`` (RMSNorm: ``z`` widened) is also stored into ``kept``, a
    float64 row of N elements, for the float32 output's cheap pass
    (``normalize_row_fast_centered``): the same sums, bit for bit."""
    zero = 0.0
    z = x[i * x_stride : i * x_stride + n]
    if has_residual:
        z = residual_out[i * n : (i + 1) * n]
        residual_i = residual[i * residual_stride : i * residual_stride + n]
        add_rows(x[i * x_stride : i * x_stride + n], residual_i, z)
    if rms:
        if keep:
            return z, zero, zero, row_sum_sq_kept(z, zero, kept)
        return z, zero, zero, row_sum_sq(z, zero)
    # The shift: the row's first element (the bound holds for any m1, and this one
    # depends on the row alone). One pass for Σd and Σd², d = z − m1, and
    # Σ(d − delta)² = Σd² − N·delta²: the cancellation is in e_var.
    m1 = element_f64(z, 0) if n > 0 else zero
    if keep:
        s1, s2 = row_sums_centered_kept(z, m1, zero, kept)
    else:
        s1, s2 = row_sums_centered(z, m1, zero)
    return z, m1, s1, s2


@_jit(inline="always")
def _statistics(m1, s1, s2, n, eps, rms):
    """The scalar part of :func:`_row_statistics`: from a row's shift and sums
    (:func:`_row_sums`), ``(delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag)``.
    Straight-line code (selects, no branches but ``rms``, a constant of the loop), so
    that :func:`_batch_statistics` vectorizes across rows: the same IEEE operations on
    every lane, the same bits."""
    zero = 0.0
    inv_n = 1.0 / np.float64(n)  # depends on n alone: computed once per call
    h = np.float64(_depth(n) + 1) * _U
    gamma = h / (1.0 - h)  # bounds the relative error of a sum of squares, or of |terms|
    if rms:
        delta = zero
        var = s2 * inv_n
        e_mean = zero
        k_c = zero  # c = d = z, exactly
        e_var = 1.01 * ((gamma + 4.0 * _U) * var)
    else:
        delta = s1 * inv_n
        s2_n = s2 * inv_n
        d_n = 1.001 * np.sqrt(s2_n)  # Σ|d| / N <= sqrt(Σd² / N)
        e_mean = 1.01 * ((gamma + 2.0 * _U) * d_n + 3.0 * _U * abs(delta))
        var = max(s2_n - delta * delta, zero)
        k_c = 1.01 * _U
        e_var = 1.01 * (
            (gamma + 4.0 * _U) * s2_n
            + e_mean * (2.0 * abs(delta) + e_mean)
            + _U * (delta * delta + var)
        )
    s = var + eps
    e_s = e_var + 1.01 * _U * s
    flag = 1 if e_s >= 0.01 * s else 0  # (False for a NaN row: it stays NaN)
    rstd_i = 1.0 / np.sqrt(s)
    # relative error of rstd: 0.51·e_s/(s − e_s) <= 0.52·e_s·rstd² when e_s < s/100
    e_r = 0.52 * (e_s * (rstd_i * rstd_i)) + 2.01 * _U
    k_p = (2.01 * _U + 1.02 * e_r) * _SLACK
    w_rel = (1.0 + 1.02 * e_r) * _SLACK
    k_w = rstd_i * w_rel
    k_y = _K_Y
    return delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag


_LANES = 8  # independent Sum2 chains of _precise_statistics (their latencies overlap)


@_jit(inline="always")
def _lane_total(total, compensation):
    """``(s, c)``: the lanes' Sum2 totals added by TwoSum in lane order, every error
    (the lanes' and these) summed into ``c``; ``s + c`` is then Sum2 of all the terms in
    this tree, with the bound of Sum2 over ``n + 2 * _LANES`` terms."""
    s = 0.0
    c = 0.0
    for j in range(_LANES):
        s, e = two_sum(s, total[j])
        c += e + compensation[j]
    return s, c


@_jit()
def _precise_statistics(z, n, eps, rms):
    """Row statistics again, for a row the fast pass flagged, by compensated sums
    (Ogita, Rump and Oishi's Sum2: error at most ``u·|sum| + γ_{n}²·Σ|terms|`` for any
    tree of TwoSums whose errors are all summed, here ``_LANES`` interleaved chains then
    :func:`_lane_total`, so ``γ`` of ``n + 2·_LANES`` terms), and the constants of
    :func:`_row_statistics`' bound with the smaller errors they leave
    (docs/contract.md §3): ``(m1, delta, rstd, e_mean, k_c, k_p, k_w, w_rel, k_y, flag)``
    with a shift of their own, ``m1 = fl(Σz/N)`` (0 for RMSNorm): the bound holds for
    any shift, but stage 1's (the row's first element) would leave ``delta`` of the
    order of the spread, whose ``4u|delta|`` would loosen ``e_mean`` here. Scalar code
    in ``_LANES`` independent chains: it runs for few rows."""
    n_float = np.float64(n)
    m1 = 0.0 if rms else row_sum(z, 0.0) / n_float
    terms = n_float + 2.0 * _LANES
    g = terms * _U / (1.0 - terms * _U)
    g2 = g * g
    total = np.zeros(_LANES)
    compensation = np.zeros(_LANES)
    if rms:
        for start in range(0, n, _LANES):
            for j in range(min(_LANES, n - start)):
                v = element_f64(z, start + j)
                total[j], e = two_sum(total[j], v * v)  # exact v * v: v has <= 24 bits
                compensation[j] += e
        sum_, error = _lane_total(total, compensation)
        s2 = sum_ + error
        var = s2 / n_float
        delta = 0.0
        e_mean = 0.0
        k_c = 0.0
        e_var = 1.01 * ((2.0 * _U + g2) * var)
    else:
        rounding = np.zeros(_LANES)  # Σ of the exact rounding errors of d = z - m1
        absolute = np.zeros(_LANES)
        for start in range(0, n, _LANES):
            for j in range(min(_LANES, n - start)):
                d, r = two_sum(element_f64(z, start + j), -m1)
                total[j], e = two_sum(total[j], d)
                compensation[j] += e
                rounding[j] += r
                absolute[j] += abs(d)
        sum_, error = _lane_total(total, compensation)
        s1 = (sum_ + error) + rounding.sum()
        delta = s1 / n_float
        # Sum2's bound, the plain sum of the roundings, two additions and the division
        e_mean = 1.01 * (4.0 * _U * abs(delta) + (g2 + g * _U) * absolute.sum() / n_float)
        total[:] = 0.0
        compensation[:] = 0.0
        spread = np.zeros(_LANES)  # Σ 2|c| e_c + e_c² + u c², e_c = u(|c| + |d|) + e_mean
        for start in range(0, n, _LANES):
            for j in range(min(_LANES, n - start)):
                d = element_f64(z, start + j) - m1
                c = d - delta
                e_c = 1.01 * _U * (abs(c) + abs(d)) + e_mean
                spread[j] += 2.0 * abs(c) * e_c + e_c * e_c + _U * c * c
                total[j], e = two_sum(total[j], c * c)
                compensation[j] += e
        sum_, error = _lane_total(total, compensation)
        s2 = sum_ + error
        var = s2 / n_float
        k_c = 1.01 * _U
        e_var = 1.01 * ((_U + g2) * var + spread.sum() / n_float + _U * var)
    s = var + eps
    e_s = e_var + 1.01 * _U * s
    flag = 1 if e_s >= 0.01 * s else 0
    e_r = 0.51 * (e_s / (s - e_s)) + 2.01 * _U
    rstd_i = 1.0 / np.sqrt(s)
    k_p = (2.01 * _U + 1.02 * e_r) * _SLACK
    w_rel = (1.0 + 1.02 * e_r) * _SLACK
    k_w = rstd_i * w_rel
    k_y = _K_Y
    return m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag


@_jit(inline="always")
def _row_constants(
    i, x, x_stride, residual, residual_stride, has_residual, residual_out,
    mean, rstd, n, eps, rms, store_stats, weight_max, bias_max, single, out32,
):  # fmt: skip
    """:func:`_kept_constants` without keeping ``d``."""
    return _kept_constants(
        i, x, x_stride, residual, residual_stride, has_residual, residual_out,
        mean, rstd, n, eps, rms, store_stats, weight_max, bias_max, single, out32,
        False, np.empty(0, np.float64),
    )  # fmt: skip


@_jit(inline="always")
def _kept_constants(
    i, x, x_stride, residual, residual_stride, has_residual, residual_out,
    mean, rstd, n, eps, rms, store_stats, weight_max, bias_max, single, out32, keep, kept,
):  # fmt: skip
    """Row ``i``'s statistics and the constants of the output passes' bounds:
    ``(z, m1, delta, rstd_i, a, b, k_y, shift, bound_a, bound_b, tiny, flag, lanes32)``
    (:func:`_row_statistics`, :func:`_folded`, :func:`_bound_constants`; the bounds are
    meaningless when ``weight_max`` is infinite, and then unused), ``lanes32`` the
    float32 lanes' constants (:func:`_single_bounds`) when ``single`` (a constant of the
    compiled code: a 16-bit output row), else unused zeros; ``out32``: a float32
    output row (a constant too); ``keep``, ``kept``: as :func:`_row_sums` takes them."""
    z, m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag = _kept_statistics(
        i, x, x_stride, residual, residual_stride, has_residual, residual_out,
        mean, rstd, n, eps, rms, store_stats, keep, kept,
    )  # fmt: skip
    a, b, shift, bound_a, bound_b, tiny, lanes32 = _bound_constants(
        m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, weight_max, bias_max, single, out32
    )  # fmt: skip
    return z, m1, delta, rstd_i, a, b, k_y, shift, bound_a, bound_b, tiny, flag, lanes32


@_jit(inline="always")
def _bound_constants(m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, weight_max, bias_max, single, out32):  # fmt: skip
    """The output passes' constants from a row's statistics (:func:`_statistics`):
    ``(a, b, shift, bound_a, bound_b, tiny, lanes32)`` as :func:`_row_constants`
    describes them: the cheap pass's from :func:`_float32_bounds` for a float32 output
    (``out32``), else from :func:`_fast_bounds` (``shift`` unused). Straight-line code,
    as :func:`_statistics`."""
    a, b = _folded(delta, e_mean, k_c, k_p, k_w, w_rel)
    shift = 0.0
    if single:
        lanes32 = _single_bounds(m1, delta, rstd_i, e_mean, w_rel, weight_max, bias_max)
        bound_a = bound_b = tiny = 0.0  # unused: the float64 cheap pass does not run
    else:
        lanes32 = (np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0), False)
        if out32:
            shift, bound_a, bound_b, tiny = _float32_bounds(
                delta, rstd_i, e_mean, k_p, weight_max, bias_max
            )  # fmt: skip
        else:
            bound_a, bound_b, tiny = _fast_bounds(a, b, k_y, weight_max, bias_max)
    return a, b, shift, bound_a, bound_b, tiny, lanes32


_U32 = 2.0**-24  # float32's unit roundoff
#: the float32 lanes run for rows whose rstd has a relative error of at most _U32
#: (``w_rel = (1 + 1.02 e_r)·slack``) and lies well inside float32's normal range
_SINGLE_W_REL = 1.0 + _U32
_SINGLE_RSTD_LOW, _SINGLE_RSTD_HIGH = 2.0**-120, 2.0**120


@_jit(inline="always")
def _single_bounds(m1, delta, rstd_i, e_mean, w_rel, weight_max, bias_max):
    """The float32 lanes' row constants (``_numba_vectors.normalize_row_fast_single``;
    docs/contract.md §3, "float32 lanes"): ``(m1f, r, neg_t, a32, usable)`` with
    ``m1f = RN32(m1 + delta)`` (the mean in float32), ``r = RN32(rstd)``,
    ``neg_t = RN32(-τ)`` for ``τ = fl(fl(m1 - m1f) + delta)·rstd`` (the rest of the
    mean, in units of the deviation) and ``a32`` the absolute part of the bound
    ``E <= A + |yh|·SINGLE_RELATIVE``:

        A = w_max·λ + 4.001u·b_max + 2^-120,
        λ = rstd·(e_mean(1 + 8u) + 7v(|m1 - m1f| + |delta|)) + 5.01u|τ| + 2^-148

    (``u = 2^-24``, ``v = 2^-53``), times ``1 + 2^-20`` for its float64 roundings and
    those of ``a32`` and of the fma of ``E``. ``usable`` is False (the checked pass runs
    instead) unless ``e_r <= u`` and ``2^-120 < rstd < 2^120``."""
    usable = w_rel <= _SINGLE_W_REL and _SINGLE_RSTD_LOW < rstd_i < _SINGLE_RSTD_HIGH
    m1f = np.float32(m1 + delta)
    rest = np.float64(m1) - np.float64(m1f)
    tau = (rest + delta) * rstd_i
    lam = rstd_i * (e_mean * (1.0 + 8.0 * _U32) + 7.0 * _U * (abs(rest) + abs(delta)))
    lam += 5.01 * _U32 * abs(tau) + 2.0**-148
    a = (weight_max * lam + 4.001 * _U32 * bias_max + 2.0**-120) * (1.0 + 2.0**-20)
    return m1f, np.float32(rstd_i), np.float32(-tau), np.float32(a), usable


def _is_float32(y):
    """Whether ``y`` is a float32 row (a constant of the compiled code)."""


@overload(_is_float32, inline="always")
def _is_float32_impl(y):
    single = y.dtype == types.float32
    return lambda y: single


#: Widening weight and bias to float64 costs two allocations and a pass over each; the
#: float32 cheap pass gains about 70 ps an element from it (benchmarks/RESULTS.md)
_WIDE_M, _WIDE_NUMEL = 4, 2048


@_jit(inline="always")
def _widens(m, n, stream):
    """Whether a float32 output's cheap pass gets float64 copies of weight and bias
    (:func:`_float64_for`): for at least ``_WIDE_M`` rows and ``_WIDE_NUMEL`` elements
    (the copies' allocation then costs less than the conversions they save), without
    streaming stores (with them the copies measured slower)."""
    return m >= _WIDE_M and m * n >= _WIDE_NUMEL and not stream


#: Rows of at most this many elements keep their ``d = z - m1`` (two float64 rows of
#: scratch, 16 KiB: with the row, weight and bias they stay in the L1 cache; wider rows
#: measured slower) for a float32 output's cheap pass: software-pipelined rows without
#: streaming stores only (benchmarks/RESULTS.md, "the output pass reads d from the
#: statistics pass"). At most :data:`SEGMENT`: a kept row is one segment.
KEPT_N = 1024


@intrinsic
def _scratch_row(typingctx, rows, j):
    """Row ``j`` of the 2-D C array ``rows``, as a 1-D array that borrows its memory (no
    reference count: a slice ``rows[j]`` costs an atomic increment and decrement per
    row, some 15 ns, which short rows felt). The caller keeps ``rows`` alive while it
    uses the row (numba frees an array only after its last use)."""
    row_type = types.Array(rows.dtype, 1, "C")

    def codegen(context, builder, sig, args):
        parent = context.make_array(sig.args[0])(context, builder, args[0])
        n = builder.extract_value(parent.shape, 1)
        index = context.cast(builder, args[1], sig.args[1], types.intp)
        data = builder.gep(parent.data, [builder.mul(index, n)])
        row = context.make_array(row_type)(context, builder)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(data.type.pointee))
        context.populate_array(
            row, data=data, shape=[n], strides=[itemsize], itemsize=itemsize, meminfo=None
        )
        return row._getvalue()

    return row_type(rows, j), codegen


@intrinsic
def _borrowed(typingctx, array):
    """``array`` as a view that borrows its memory: the same data, shape and strides, no
    reference count. Every copy numba makes of an array variable (an inlined function's
    argument, a slice) increments and decrements its count, an atomic operation each
    where the array owns its memory (``np.empty``); borrowed, they test a null pointer.
    Only of a function's parameters (its caller keeps them alive for the call) or of a
    local that :func:`_alive` keeps alive past the view's last use."""

    def codegen(context, builder, sig, args):
        view = context.make_array(sig.args[0])(context, builder, value=args[0])
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        view.parent = cgutils.get_null_value(view.parent.type)
        return view._getvalue()

    return array(array), codegen


@intrinsic
def _alive(typingctx, value):
    """Nothing: a use of ``value`` that keeps it alive up to here, for the
    :func:`_borrowed` views of it used before."""

    def codegen(context, builder, sig, args):
        return context.get_dummy_value()

    return types.none(value), codegen


@_jit(inline="always")
def _keeps(out32, n, stream):
    """Whether a float32 output's software-pipelined rows keep ``d`` from their
    statistics pass for the cheap pass (:func:`_row_sums`,
    ``normalize_row_fast_centered``): rows of at most :data:`KEPT_N` elements, whose
    scratch stays in the L1 cache, without streaming stores (which measured no faster
    with it). ``out32`` is a constant of the compiled code: no code for it elsewhere.
    The batched short rows (:func:`_forward_batches`) keep none: a batch's eight
    scratch rows measured no faster."""
    return out32 and n <= KEPT_N and not stream


def _float64_for(y, values, wide):
    """The cheap pass's copy of ``values`` (a weight or bias row): for a float32 row
    ``y`` and float32 ``values``, widened to float64 once (a fresh row, exact) when
    ``wide``, else an empty float64 row (unused); otherwise ``values`` itself. The float32
    output pass then loads them without a conversion per row."""


@overload(_float64_for)
def _float64_for_impl(y, values, wide):
    if y.dtype == types.float32 and values.dtype == types.float32:

        def widened(y, values, wide):
            if wide:
                return values.astype(np.float64)
            return np.empty(0, np.float64)

        return widened
    return lambda y, values, wide: values


def _is_copy(cheap, values):
    """Whether ``cheap`` can be a float64 copy of ``values`` (their dtypes differ: a
    constant of the compiled code, so that a row function given the parameters
    themselves, as :func:`_forward_batches` is, holds no code for copies)."""


@overload(_is_copy, inline="always")
def _is_copy_impl(cheap, values):
    differ = cheap.dtype != values.dtype
    return lambda cheap, values: differ


def _is_half(y, weight, bias):
    """Whether ``y`` is a 16-bit row and ``weight``, ``bias`` are not float64 (a constant
    of the compiled code): the float32 lanes apply."""


@overload(_is_half, inline="always")
def _is_half_impl(y, weight, bias):
    half = y.dtype in (types.uint16, types.int16) and types.float64 not in (
        weight.dtype,
        bias.dtype,
    )
    return lambda y, weight, bias: half


@_jit(inline="always")
def _forward_rows(
    x, x_stride, residual, residual_stride, has_residual, residual_out, weight, bias, y,
    mean, rstd, m, n, eps, rms, stream, store_stats, flags,
):  # fmt: skip
    """Every row's output and fallback flag (:func:`_forward_row`), software-pipelined:
    row ``i + 1``'s statistics come before row ``i``'s output pass in program order, so
    the CPU overlaps the one's dependent chain (the sums, the square root, the bound's
    constants) with the other's independent vector work. Each row's values depend on
    that row alone: the same bits in any order. For a float32 ``y``, the cheap pass gets
    weight and bias widened to float64 here, once per call (:func:`_float64_for`), but
    with streaming stores, where the widened rows measured slower (benchmarks/RESULTS.md,
    "the cheaper float32 forward pass"). The pipelined rows of a float32 output keep their
    ``d = z - m1`` from the statistics pass (:func:`_keeps`) in two scratch rows, row
    ``i``'s in row ``i % 2``, for their cheap pass."""
    if m == 0:
        return
    weight_max, bias_max = _largest_parameters(weight, bias)
    single = _is_half(y, weight, bias)
    out32 = _is_float32(y)
    wide = _widens(m, n, stream)
    owners = (_float64_for(y, weight, wide), _float64_for(y, bias, wide))
    cheap = (_borrowed(owners[0]), _borrowed(owners[1]))
    if n <= BATCHED_N or (n <= 4 * BATCHED_N and m * n <= BATCHED_NUMEL):
        if _is_copy(cheap[0], weight) and wide:  # (a constant False but for float32 y)
            _forward_batches(
                x, x_stride, residual, residual_stride, has_residual, residual_out, weight,
                bias, cheap, y, mean, rstd, m, n, eps, rms, stream, store_stats, flags,
                weight_max, bias_max, single, out32,
            )  # fmt: skip
        else:  # short rows: no copies, and no code for them (see _is_copy)
            _forward_batches(
                x, x_stride, residual, residual_stride, has_residual, residual_out, weight,
                bias, (weight, bias), y, mean, rstd, m, n, eps, rms, stream, store_stats,
                flags, weight_max, bias_max, single, out32,
            )  # fmt: skip
        _alive(owners)
        return
    keep = _keeps(out32, n, stream)
    kept = np.empty((2, n if keep else 0), np.float64)  # rows i % 2: row i's d
    row = _kept_constants(
        0, x, x_stride, residual, residual_stride, has_residual, residual_out,
        mean, rstd, n, eps, rms, store_stats, weight_max, bias_max, single, out32, keep,
        _scratch_row(kept, 0),
    )  # fmt: skip
    for i in range(m):
        following = row
        if i + 1 < m:
            following = _kept_constants(
                i + 1, x, x_stride, residual, residual_stride, has_residual, residual_out,
                mean, rstd, n, eps, rms, store_stats, weight_max, bias_max, single, out32,
                keep, _scratch_row(kept, (i + 1) % 2),
            )  # fmt: skip
        flags[i] = _forward_row(
            i, row, weight, bias, cheap, y, mean, rstd, n, eps, rms, store_stats, weight_max,
            stream, keep, _scratch_row(kept, i % 2),
        )  # fmt: skip
        row = following
    _alive(owners)  # (cheap borrows them)


#: Rows of at most this many elements take the forward in batches (:func:`_forward_batches`),
#: and rows of up to 4 times as many where the span has at most :data:`BATCHED_NUMEL`
#: elements (it stays in the L2 cache: a batch's rows are read again 8 rows later)
BATCHED_N = 256
BATCHED_NUMEL = 1 << 18
#: Rows per batch of :func:`_forward_batches` (one vector of doubles per constant)
_FORWARD_BATCH = 8
#: The rows of :func:`_forward_batches`' scratch: the inputs of :func:`_statistics`
#: (``m1``, ``s1``, ``s2``), then the row constants of :func:`_forward_row`
_M1, _S1, _S2, _DELTA, _RSTD, _A, _B, _BOUND_A, _BOUND_B, _TINY, _FLAG = range(11)
_M1F, _R, _NEG_T, _A32, _USABLE, _SCRATCH = range(11, 17)


@_jit()
def _batch_statistics(scratch, count, n, eps, rms, weight_max, bias_max, single, out32):
    """:func:`_statistics` and :func:`_bound_constants` of the ``count`` rows of a batch,
    from their shifts and sums in ``scratch[_M1:_S2 + 1, :count]`` into the rows after
    (flags and ``usable`` as 0.0 or 1.0, float32 constants widened exactly): one loop,
    which LLVM vectorizes across the rows (the same IEEE operations on each lane: the
    same bits as one row at a time)."""
    m1_, s1_, s2_ = scratch[_M1], scratch[_S1], scratch[_S2]
    delta_, rstd_, a_, b_ = scratch[_DELTA], scratch[_RSTD], scratch[_A], scratch[_B]
    bound_a_, bound_b_, tiny_, flag_ = (
        scratch[_BOUND_A],
        scratch[_BOUND_B],
        scratch[_TINY],
        scratch[_FLAG],
    )
    m1f_, r_, neg_t_, a32_, usable_ = (
        scratch[_M1F],
        scratch[_R],
        scratch[_NEG_T],
        scratch[_A32],
        scratch[_USABLE],
    )
    for j in range(count):
        m1 = m1_[j]
        delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag = _statistics(
            m1, s1_[j], s2_[j], n, eps, rms
        )  # fmt: skip
        a, b, _, bound_a, bound_b, tiny, lanes32 = _bound_constants(
            m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, weight_max, bias_max, single,
            out32,
        )  # fmt: skip
        m1f, r, neg_t, a32, usable = lanes32
        delta_[j], rstd_[j], a_[j], b_[j] = delta, rstd_i, a, b
        bound_a_[j], bound_b_[j], tiny_[j] = bound_a, bound_b, tiny
        flag_[j] = np.float64(flag)
        m1f_[j], r_[j], neg_t_[j], a32_[j] = m1f, r, neg_t, a32
        usable_[j] = 1.0 if usable else 0.0


@_jit()
def _forward_batches(
    x, x_stride, residual, residual_stride, has_residual, residual_out, weight, bias, cheap, y,
    mean, rstd, m, n, eps, rms, stream, store_stats, flags, weight_max, bias_max, single, out32,
):  # fmt: skip
    """:func:`_forward_rows` for short rows (``n <= BATCHED_N``, or up to ``4 *
    BATCHED_N`` in a span of at most ``BATCHED_NUMEL`` elements), whose per-row
    constants cost much beside their elements: in batches of :data:`_FORWARD_BATCH` rows, each
    row's pass over memory (:func:`_row_sums`), the batch's constants together
    (:func:`_batch_statistics`), then each row's output (:func:`_forward_row`). Every
    row's arithmetic is :func:`_row_constants`' (the same bits); only the scalar work is
    shared. ``cheap``: the cheap pass's weight and bias, as :func:`_forward_row` takes
    them. The rows keep no ``d`` (:func:`_keeps`). A plain call, not inlined: its one
    call per kernel call costs nothing, and inlining it (with its inlined
    :func:`_forward_row`) into both call sites of :func:`_forward_rows` doubled the
    forward's compile time (module docstring, "Inlining")."""
    weight, bias, cheap = (
        _borrowed(weight),
        _borrowed(bias),
        (_borrowed(cheap[0]), _borrowed(cheap[1])),
    )
    scratch = np.empty((_SCRATCH, _FORWARD_BATCH), np.float64)
    unkept = np.empty((1, 0), np.float64)
    k_y = _K_Y
    for first in range(0, m, _FORWARD_BATCH):
        count = min(_FORWARD_BATCH, m - first)
        for j in range(count):
            _, scratch[_M1, j], scratch[_S1, j], scratch[_S2, j] = _row_sums(
                first + j, x, x_stride, residual, residual_stride, has_residual,
                residual_out, n, rms, False, _scratch_row(unkept, 0),
            )  # fmt: skip
        _batch_statistics(scratch, count, n, eps, rms, weight_max, bias_max, single, out32)
        for j in range(count):
            i = first + j
            z = (
                residual_out[i * n : (i + 1) * n]
                if has_residual
                else x[i * x_stride : i * x_stride + n]
            )
            m1, delta, rstd_i = scratch[_M1, j], scratch[_DELTA, j], scratch[_RSTD, j]
            if store_stats:
                if not rms:
                    mean[i] = m1 + delta
                rstd[i] = rstd_i
            lanes32 = (
                np.float32(scratch[_M1F, j]), np.float32(scratch[_R, j]),
                np.float32(scratch[_NEG_T, j]), np.float32(scratch[_A32, j]),
                scratch[_USABLE, j] != 0.0,
            )  # fmt: skip
            row = (
                z, m1, delta, rstd_i, scratch[_A, j], scratch[_B, j], k_y, _shift(delta, rstd_i),
                scratch[_BOUND_A, j], scratch[_BOUND_B, j], scratch[_TINY, j],
                1 if scratch[_FLAG, j] != 0.0 else 0, lanes32,
            )  # fmt: skip
            flags[i] = _forward_row(
                i, row, weight, bias, cheap, y, mean, rstd, n, eps, rms, store_stats,
                weight_max, stream, False, _scratch_row(unkept, 0),
            )  # fmt: skip


@_jit(inline="always")
def _forward_row(
    i, row, weight, bias, cheap, y, mean, rstd, n, eps, rms, store_stats, weight_max, stream,
    keep, kept,
):  # fmt: skip
    """Row ``i``'s output from its constants ``row`` (:func:`_row_constants`), each
    element rounded once.
    The output pass runs over segments of at most :data:`SEGMENT` elements: first the
    cheap pass (``_numba_vectors.normalize_row_fast``, with :func:`_float32_bounds` for a
    float32 output, else :func:`_fast_bounds`, from the largest ``|weight|`` and
    ``|bias|``; skipped when one is not finite, ``weight_max = inf``, or where the
    constants leave it no use, ``tiny = inf``; weight and bias from ``cheap``, the
    float64 copies of :func:`_float64_for`, when they are not empty), with streaming
    stores when ``stream`` (on x86: the row's unaligned head is a segment of its own):
    :func:`_cheap_segments`. A 16-bit row (``_is_half``) runs in float32
    lanes instead (``normalize_row_fast_single``, whose result is the checked pass's;
    streamed from the first 32-byte boundary when ``stream``), or, where
    :func:`_single_bounds` finds it unusable, the checked pass directly. ``keep``: the
    cheap pass loads ``d = z - m1`` from ``kept``, where :func:`_row_sums` stored it.
    Returns the row's fallback flag."""
    z, m1, delta, rstd_i, a, b, k_y, shift, bound_a, bound_b, tiny, flag, lanes32 = row
    m1f, r, neg_t, a32, single = lanes32
    y_i = y[i * n : (i + 1) * n]
    in_range = _RANGE_LOW < rstd_i < _RANGE_HIGH and abs(m1) < np.inf
    if _is_float64(y_i) and not in_range:
        # rare: a float64 row whose statistics leave float64's range
        scaled, mean_i, rstd_scaled = _scaled_row(z, y_i, weight, bias, n, eps, rms)
        if scaled:
            if store_stats:
                if not rms:
                    mean[i] = mean_i
                rstd[i] = rstd_scaled
            return np.uint8(0)
    checked = np.int32(0)
    if flag == 0 and weight_max < np.inf and tiny < np.inf:
        streaming = stream and _X86
        if _is_half(y_i, weight, bias) and not single:  # rare: rstd too loose or extreme
            checked = normalize_row_checked(z, y_i, m1, delta, rstd_i, weight, bias, a, b, k_y)
        elif single:
            # 16-bit output: float32 lanes, a vector they leave open checked in float64
            if streaming:  # the unaligned head plainly, the rest streamed
                head = _single_head(y_i)
                checked = normalize_row_fast_single_streaming(
                    z[head:], y_i[head:], m1, delta, rstd_i, weight[head:], bias[head:],
                    a, b, k_y, m1f, r, neg_t, a32,
                )  # fmt: skip
                _store_fence()
                checked |= normalize_row_fast_single(
                    z[:head], y_i[:head], m1, delta, rstd_i, weight[:head], bias[:head],
                    a, b, k_y, m1f, r, neg_t, a32,
                )  # fmt: skip
            else:  # the row itself, unsliced
                checked = normalize_row_fast_single(
                    z, y_i, m1, delta, rstd_i, weight, bias, a, b, k_y, m1f, r, neg_t, a32
                )  # fmt: skip
        elif _is_copy(cheap[0], weight) and not streaming and cheap[0].shape[0] == n:
            checked = _cheap_segments(  # their float64 copies
                z, y_i, m1, delta, rstd_i, shift, weight, bias, cheap[0], cheap[1], a, b, k_y,
                bound_a, bound_b, tiny, n, False, keep, kept,
            )  # fmt: skip
        else:  # the parameters as they are
            checked = _cheap_segments(
                z, y_i, m1, delta, rstd_i, shift, weight, bias, weight, bias, a, b, k_y,
                bound_a, bound_b, tiny, n, streaming, keep, kept,
            )  # fmt: skip
    else:
        checked = normalize_row_checked(z, y_i, m1, delta, rstd_i, weight, bias, a, b, k_y)
    if (flag | checked) != 0:
        # rare: once more with compensated statistics, whose bound is some 50 times
        # tighter; what is still open goes to the exact fallback
        m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag = _precise_statistics(
            z, n, eps, rms
        )
        a, b = _folded(delta, e_mean, k_c, k_p, k_w, w_rel)
        checked = normalize_row_checked(z, y_i, m1, delta, rstd_i, weight, bias, a, b, k_y)
    return np.uint8(flag | checked)


@_jit(inline="always")
def _cheap_segments(
    z, y_i, m1, delta, rstd_i, shift, weight, bias, cheap_weight, cheap_bias, a, b, k_y,
    bound_a, bound_b, tiny, n, streaming, keep, kept,
):  # fmt: skip
    """:func:`_forward_row`'s output pass over segments of at most :data:`SEGMENT`
    elements: the cheap pass (``normalize_row_fast``, on ``cheap_weight`` and
    ``cheap_bias``, the same values as ``weight`` and ``bias``, in their dtype or
    float64), and the checked pass, which rewrites a segment it leaves open (the passes
    have no reductions: segments change no bits). Returns the checked passes' flag.
    ``streaming``: non-temporal stores after the unaligned head. ``keep`` (a row of one
    segment, no streaming: :func:`_keeps`): the cheap pass reads ``d = z - m1`` from
    ``kept`` (``normalize_row_fast_centered``; the checked pass reads ``z``)."""
    checked = np.int32(0)
    if n <= SEGMENT and not streaming:  # one segment: the row itself, no slicing
        if keep:  # (only here: see _keeps)
            open_ = normalize_row_fast_centered(
                kept, y_i, m1, delta, rstd_i, shift, cheap_weight, cheap_bias, bound_a,
                bound_b, tiny,
            )  # fmt: skip
        else:
            open_ = normalize_row_fast(
                z, y_i, m1, delta, rstd_i, shift, cheap_weight, cheap_bias, bound_a, bound_b,
                tiny,
            )  # fmt: skip
        if open_ != 0:
            checked = normalize_row_checked(z, y_i, m1, delta, rstd_i, weight, bias, a, b, k_y)
        return checked
    start = 0
    stop = _vector_head(y_i) if streaming else min(n, SEGMENT)
    while start < n:
        z_s, y_s = z[start:stop], y_i[start:stop]
        w_s, b_s = cheap_weight[start:stop], cheap_bias[start:stop]
        if streaming and start > 0:  # after the head: aligned
            open_ = normalize_row_fast_streaming(
                z_s, y_s, m1, delta, rstd_i, shift, w_s, b_s, bound_a, bound_b, tiny
            )  # fmt: skip
            if open_ != 0:
                _store_fence()  # the streamed stores land before their rewrite
        else:
            open_ = normalize_row_fast(
                z_s, y_s, m1, delta, rstd_i, shift, w_s, b_s, bound_a, bound_b, tiny
            )  # fmt: skip
        if open_ != 0:
            checked |= normalize_row_checked(
                z_s, y_s, m1, delta, rstd_i, weight[start:stop], bias[start:stop], a, b, k_y
            )  # fmt: skip
        start, stop = stop, min(n, stop + SEGMENT)
    if streaming:
        _store_fence()
    return checked


#: float64 rows whose ``rstd`` falls outside these (``var + eps`` outside 2^-880..2^880),
#: or whose first sum is not finite, go to :func:`_scaled_row`
_RANGE_LOW, _RANGE_HIGH = 2.0**-440, 2.0**440


def _is_float64(a):
    """Whether ``a`` is a float64 array (a constant of the compiled code)."""


@overload(_is_float64, inline="always")
def _is_float64_impl(a):
    wide = a.dtype == types.float64
    return lambda a: wide


@_jit()
def _scaled_row(z, y, weight, bias, n, eps, rms):
    """A float64 row over the whole range (docs/contract.md §3): ``z`` scaled by the
    power of two ``2^-k`` that brings ``max |z|`` into ``[1/2, 1)`` (exact, but for
    elements under ``2^-1022`` of it, which fall to subnormals), the corrected two-pass
    statistics and the output in those units, with ``eps`` scaled by ``2^-2k``; where
    that overflows (``eps·2^-2k > 2^1000``, the variance is negligible beside it), the
    output is ``ldexp(c / sqrt(eps), k)·w + b``. Scalar code: it runs for rows of
    magnitude past about 2^±440 only. Returns ``(handled, mean, rstd)``, ``handled``
    False for a row holding a NaN or an infinity, or only zeros (then the usual path's
    result stands: NaN, or ``beta``)."""
    largest = 0.0
    for j in range(n):
        v = abs(element_f64(z, j))
        if not v < np.inf:
            return False, 0.0, 0.0
        largest = max(largest, v)
    if largest == 0.0:
        return False, 0.0, 0.0
    k = math.frexp(largest)[1]
    n_float = np.float64(n)
    m1 = 0.0
    if not rms:
        for j in range(n):
            m1 += math.ldexp(element_f64(z, j), -k)
        m1 /= n_float
    s1 = 0.0
    s2 = 0.0
    for j in range(n):
        d = math.ldexp(element_f64(z, j), -k) - m1
        s1 += d
        s2 += d * d
    delta = 0.0 if rms else s1 / n_float
    var = max(s2 / n_float - delta * delta, 0.0)
    eps_scaled = math.ldexp(eps, -2 * k)
    huge = not eps_scaled <= 2.0**1000
    factor = 1.0 / np.sqrt(eps) if huge else 1.0 / np.sqrt(var + eps_scaled)
    for j in range(n):
        c = (math.ldexp(element_f64(z, j), -k) - m1) - delta
        if huge:
            y[j] = math.ldexp(c * factor, k) * weight[j] + bias[j]
        else:
            y[j] = c * factor * weight[j] + bias[j]
    rstd_i = factor if huge else math.ldexp(factor, -k)
    return True, math.ldexp(m1 + delta, k), rstd_i


@_jit(inline="always")
def _fast_bounds(a, b, k_y, weight_max, bias_max):
    """The row constants of ``normalize_row_fast`` (docs/contract.md §3) from those of
    ``normalize_row_checked``'s bound ``E = |w|·a + |p|·b + |yh|·k_y`` and the largest
    ``|w|``, ``|beta|`` of the call: ``(bound_a, bound_b, tiny)`` with

    - ``E <= bound_a + |p|·bound_b``, from ``|yh| <= |p|(1 + u) + |beta|``;
    - ``E <= |yh|·FAST_MARGIN`` wherever ``|yh| >= tiny``, from
      ``|p| <= |yh|(1 + 2u) + |beta|``: ``bound_a + |p|·bound_b <= A + |yh|·B`` with
      ``A = bound_a + beta_max·bound_b``, ``B = (1 + 2u)·bound_b``, so any
      ``tiny >= A / (FAST_MARGIN - B)`` will do; with ``g = B / FAST_MARGIN <= 1/2``
      (else ``tiny = inf``), ``1 / (1 - g) <= 1 + 2g`` gives
      ``tiny = A·(1 + 2g) / FAST_MARGIN``, without a division (FAST_MARGIN is a
      power of two).

    Each is rounded up by the slack (their own roundings are a few ``u``)."""
    bound_a = (weight_max * a + bias_max * k_y * (1.0 + 2.0 * _U)) * _SLACK
    bound_b = (b + k_y * (1.0 + 2.0 * _U)) * _SLACK
    growth = bound_b * (1.0 + 2.0 * _U) * (1.0 / FAST_MARGIN)
    tiny = np.inf
    if growth <= 0.5:
        tiny = (bound_a + bias_max * bound_b) * (1.0 / FAST_MARGIN) * (1.0 + 2.0 * growth)
        tiny *= _SLACK * _SLACK
    return bound_a, bound_b, tiny


@_jit(inline="always")
def _shift(delta, rstd_i):
    """The float32 cheap pass's ``shift = fl(-delta·rstd)`` (not kept in
    :func:`_batch_statistics`' scratch, whose one more row would stop LLVM vectorizing
    it: computed again where used, the same bits)."""
    return -(delta * rstd_i)


#: The float32 cheap pass's slack: covers ``1/(1 - α) <= 1 + 2^-26`` (``α <= 2^-27``
#: wherever the pass runs) and the few roundings of its constants and of ``E``'s fma
_SLACK32 = 1.0 + 2.0**-24
#: float32's smallest normal: below it its rounding boundaries are not at fixed low bits
_FLOAT32_NORMAL = 2.0**-126


@_jit(inline="always")
def _float32_bounds(delta, rstd_i, e_mean, k_p, weight_max, bias_max):
    """The row constants of ``normalize_row_fast`` for a float32 output
    (docs/contract.md §3, "float32 output"): ``(shift, bound_a, bound_b, tiny)`` with
    ``shift = fl(-delta·rstd)``, ``α = 1.01·k_p`` (at least ``e_r + 2.02u``) and
    ``λ = rstd·(1.01·e_mean + 2.01u|delta|) + 2^-1000``:

    - ``bound_a = (α·bias_max + λ·weight_max + 2^-1000)·slack`` (for underflow; at
      least 2^-1000, a normal double: a subnormal ``bound_a`` costs every fma of the pass
      a microcode assist on Intel, ten times the pass),
      ``bound_b = (α + u)·slack``, so ``|yh - y| <= bound_a + |yh|·bound_b``;
    - ``tiny >= bound_a / (FAST_MARGIN - bound_b)`` and ``>= 2^-126``: where
      ``|yh| >= tiny`` the bound is at most ``|yh|·FAST_MARGIN``, under a quarter of a
      float32 unit of ``yh``; with ``g = bound_b / FAST_MARGIN <= 1/2``,
      ``1 / (1 - g) <= 1 + 2g`` (no division). ``tiny = inf`` (the cheap pass does not
      run) unless ``g <= 1/2`` and the constants are finite."""
    shift = _shift(delta, rstd_i)
    alpha = 1.01 * k_p
    lam = rstd_i * (1.01 * e_mean + 2.01 * _U * abs(delta)) + 2.0**-1000
    bound_a = (alpha * bias_max + lam * weight_max + 2.0**-1000) * _SLACK32
    bound_b = (alpha + _U) * _SLACK32
    growth = bound_b * (1.0 / FAST_MARGIN)
    tiny = bound_a * (1.0 / FAST_MARGIN) * (1.0 + 2.0 * growth) * _SLACK32
    if tiny < _FLOAT32_NORMAL:
        tiny = _FLOAT32_NORMAL
    if not growth <= 0.5:  # (NaN constants too)
        tiny = np.inf
    if not tiny < np.inf:
        tiny = np.inf
    return shift, bound_a, bound_b, tiny


def _largest(values):
    """``max |values|`` (float32 or float64 values) as a float64, or ``inf`` when one is
    not finite (NaN included): the largest magnitude's bit pattern, by an integer
    maximum (which vectorizes without fast-math, unlike a float one), then its value."""


@overload(_largest)
def _largest_impl(values):
    wide = values.dtype == types.float64
    bits_type = np.uint64 if wide else np.uint32
    magnitude = (1 << 63) - 1 if wide else (1 << 31) - 1
    fraction_bits = 52 if wide else 23
    bias = 1075 if wide else 150  # exponent bias + fraction bits
    infinite = 0x7FF << 52 if wide else 0xFF << 23

    def impl(values):
        patterns = values.view(bits_type)
        top = bits_type(0)
        for k in range(patterns.shape[0]):
            top = max(top, patterns[k] & bits_type(magnitude))
        if top >= bits_type(infinite):
            return np.inf
        exponent = np.int64(top >> bits_type(fraction_bits))
        fraction = np.int64(top & bits_type((1 << fraction_bits) - 1))
        if exponent == 0:  # subnormal
            return math.ldexp(np.float64(fraction), 1 - bias)
        return math.ldexp(np.float64(fraction + (1 << fraction_bits)), exponent - bias)

    return impl


@_jit(inline="always")
def _largest_parameters(weight, bias):
    """``(max |weight|, max |bias|)`` for :func:`_fast_bounds`, the first ``inf`` when
    either holds a value that is not finite (the cheap pass is then skipped)."""
    weight_max = _largest(weight)
    bias_max = _largest(bias)
    if bias_max == np.inf:
        weight_max = np.inf
    return weight_max, bias_max


@_jit(inline="always")
def _folded(delta, e_mean, k_c, k_p, k_w, w_rel):
    """The bound's per-element terms ``(k_c(|c| + |d|) + e_mean)·|w|·k_w + |p|·k_p`` as
    ``|w|·a + |p|·b`` (docs/contract.md §3), from ``|d| <= |c|/(1 - u) + |delta|`` and
    ``|c|·|w|·rstd <= |p|/(1 - u)²``, with ``k_w = fl(rstd·w_rel) <= rstd·w_rel·(1 + u)``
    (``w_rel = (1 + 1.02 e_r)·slack``)."""
    a = (e_mean + k_c * abs(delta)) * k_w
    b = k_p + k_c * (2.0 + 1.01 * _U) * (1.0 + 3.01 * _U) * w_rel * _SLACK
    return a, b


@_jit()
def forward_kernel(
    x, x_stride, residual, residual_stride, has_residual, residual_out, weight, bias, y,
    mean, rstd, m, n, eps, rms, stream, store_stats, flags,
):  # fmt: skip
    """Every row's output ``y`` (contiguous (M*N,)) and fallback flag ``flags[i]``
    (:func:`_forward_row`), for a call's rows or for one span of rows of a call that
    ``numba_`` spreads over its threads; ``stream``: outputs far larger than the caches
    (streaming stores, the same bits). One compiled function for both entries: each
    compile of it costs half a minute (numba's inlining of the row functions), so the
    serial entry does not compile a copy of its own."""
    _forward_rows(
        x, x_stride, residual, residual_stride, has_residual, residual_out, weight, bias, y,
        mean, rstd, m, n, eps, rms, stream, store_stats, flags,
    )  # fmt: skip


@_jit()
def _any_flag(flags, m):
    """``flags[m] = 1`` when any of ``flags[:m]`` is set: one byte for the caller to read."""
    flagged = np.uint8(0)
    for i in range(m):
        flagged |= flags[i]
    flags[m] = flagged


# ---------------------------------------------------------------------------------------
# The backward, correctly rounded (docs/contract.md §3, "Correct rounding of the
# backward"): per row, one pass of five float64 sums, the row constants of the bound, one
# pass that writes dx and tests each element's rounding


@intrinsic
def _backward_sums(typingctx, dy, z, w, m1, zero):
    """``(Σd, Σd², Σgh, Σgh², Σgh·d)`` in float64 with ``d = z - m1``, ``gh = dy * w``
    (exact in float64 for float32 and 16-bit rows: 24-bit by 24-bit), in
    ``_numba_vectors``' summation order (``zero`` is a float64 0: the sums' dtype)."""

    def codegen(context, builder, sig, args):
        def terms(b, values, scalars):
            g, zv, wv = values
            gh = b.fmul(g, wv)
            d = b.fsub(zv, scalars[0])
            return [d, b.fmul(d, d), gh, b.fmul(gh, gh), b.fmul(gh, d)]

        dy, z, w, m1, zero = args
        arrays = [(sig.args[0], dy), (sig.args[1], z), (sig.args[2], w)]
        sums = _reduce(context, builder, arrays, [m1, zero], terms, 5)
        return context.make_tuple(builder, sig.return_type, sums)

    return types.UniTuple(types.float64, 5)(dy, z, w, m1, zero), codegen


def _on_boundary(builder: ir.IRBuilder, single: ir.Value, dtype: types.Type, lanes: int):
    """i1 (per lane) where the float32 ``single`` is a rounding boundary of the 16-bit
    ``dtype``: bfloat16, low 16 bits 0x8000 (its midpoints and overflow threshold);
    float16, the midpoint of ``RN16(single)`` and a neighbour (exact sums in float32), or
    at least 65504 in magnitude (the overflow threshold, 65520, and beyond)."""
    i32 = ir.IntType(32)
    bits = builder.bitcast(single, _shaped(i32, single))
    if dtype == types.uint16:
        low16 = builder.and_(bits, _constant(i32, 0xFFFF, single))
        return builder.icmp_unsigned("==", low16, _constant(i32, 0x8000, single))
    h = narrow(builder, single, dtype)
    one = _constant(ir.IntType(16), 1, single)
    (largest,) = _splat_all(builder, [ir.FloatType()(65504.0)], lanes)
    (halve,) = _splat_all(builder, [ir.FloatType()(0.5)], lanes)
    clear = _constant(i32, 0x7FFFFFFF, single)
    magnitude = builder.bitcast(builder.and_(bits, clear), single.type)
    on = builder.fcmp_ordered(">=", magnitude, largest)
    value = widen(builder, h, dtype)
    for step in (builder.sub(h, one), builder.add(h, one)):
        neighbour = widen(builder, step, dtype)
        midpoint = builder.fmul(builder.fadd(value, neighbour), halve)
        on = builder.or_(on, builder.fcmp_ordered("==", single, midpoint))
    return on


def _narrow_off_boundary(builder: ir.IRBuilder, single: ir.Value, dtype: types.Type):
    """The float32 ``single`` rounded to the 16-bit ``dtype``, right wherever it is not a
    rounding boundary (:func:`_on_boundary`): float16 by ``fptrunc``; bfloat16 by adding
    half a unit to the pattern, with no tie rule (a tie is a boundary), a NaN becoming
    ``narrow``'s 0x7FC0."""
    if dtype == types.int16:
        return narrow(builder, single, dtype)
    i32 = ir.IntType(32)
    bits = builder.bitcast(single, _shaped(i32, single))
    rounded = builder.lshr(
        builder.add(bits, _constant(i32, 0x8000, single)), _constant(i32, 16, single)
    )
    upper = builder.trunc(rounded, _shaped(ir.IntType(16), single))
    is_nan = builder.fcmp_unordered("uno", single, single)
    return builder.select(is_nan, _constant(ir.IntType(16), 0x7FC0, single), upper)


def _any_lane(builder: ir.IRBuilder, mask: ir.Value) -> ir.Value:
    """i1: whether any lane of the i1 ``mask`` (a vector or a scalar) is set."""
    if not isinstance(mask.type, ir.VectorType):
        return mask
    packed = builder.bitcast(mask, ir.IntType(mask.type.count))
    return builder.icmp_unsigned("!=", packed, ir.IntType(mask.type.count)(0))


def _mul_add(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` (doubles, scalars or vectors): one rounding where the CPU fuses
    them (``llvm.fmuladd``), else two: the bits may differ by CPU, so only for bounds,
    values exact either way, and values whose bound covers both."""
    suffix = f"v{a.type.count}f64" if isinstance(a.type, ir.VectorType) else "f64"
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(a.type, [a.type] * 3), "llvm.fmuladd." + suffix
    )
    return builder.call(function, [a, b, c])


#: ``tiny = a_0 · factor`` for the half types' row test: for ``|y| >= tiny``, ``E <= a_0 +
#: 3.2u|y| <= |y|·2^-25(1 - 2^-23) < |RN32(y)|·2^-25`` (``1 + 2^-20`` covers the product's
#: rounding; docs/contract.md §3)
_TINY_FACTOR = (1.0 + 2.0**-20) / (2.0**-25 * (1.0 - 2.0**-23) - 3.2 * _U)
#: Below float32's normal range the row test decides nothing (there RN32's relative
#: error is not bounded by 2^-24)
_SINGLE_NORMAL = 2.0**-126


@intrinsic
def _dx_row_checked(
    typingctx, dy, z, dresidual_out, dx, weight, dweight_partial, dbias_partial,
    m1, delta, rstd, c2, k, k_t1, k_c, k_0, a_0, a, r_t, t,
):  # fmt: skip
    """One row's dx, each element rounded once to dx's dtype, Ziv's test on each, and the
    row's terms added to the dweight/dbias partial sums (docs/contract.md §3)::

        gh = dy * weight;  d = z - m1;  c = d - delta
        t1 = gh - c2;  t2 = rstd * t1;  t3 = k * c;  t4 = t2 - t3   (fused: below)
        y = t4 + dresidual_out      (+ 0.0 for float64: an exact zero is +0.0)
        E = k_t1 |t1| + (k_c |c| + (k_y |y| + k_0)),  k_y = 3.1u(1 + 2^-30)
        dweight_partial += dy * u;  dbias_partial += dy,  u = ((z - a) * r_t) - t

    in float64 (the scalars are doubles; rows are widened exactly; ``E``'s three steps are
    fused multiply-adds where the CPU has them, and the caller's ``k_t1``, ``k_c``, ``k_0``
    carry the slack ``1 + 2^-30``, which covers ``E``'s own roundings; for float32 and
    narrower ``dx``, so are ``t1 = gh - c2``, exact ``gh`` and all, and ``t4 = rstd·t1
    - t3``, one rounding fewer, which ``E`` covers as well). With
    ``dresidual_out`` None: ``y = t4``, the same bits as a row of ``-0.0``, and
    ``E`` without its ``k_y`` term, which the caller folds into ``k_t1`` and ``k_c``
    (:func:`_backward_constants`' ``plain``). bfloat16 and float16 ``dx`` are stored as
    ``RN16(RN32(y))`` where ``RN32(y)`` is not a rounding boundary, and a vector with
    one is stored again, each element rounded once (:func:`narrow_once`).

    Ziv's test: for float32 on each element; for the half types in two steps. The row
    test, with no per-element bound: ``a_0`` bounds ``E`` at ``y = 0`` (every element's
    ``E <= a_0 + k_y|y|``), so ``E < |RN32(y)|·2^-25`` wherever ``|y| >= tiny =
    a_0·``:data:`_TINY_FACTOR` (:func:`_below_tiny`), and there the rounding is decided
    unless ``RN32(y)`` is a boundary; an exact zero is decided when ``a_0 == 0``. Only a
    vector with an element the row test leaves open runs the test with ``E`` per
    element (the same answer where the row test decides). Returns 1 when ``y - E`` and
    ``y + E`` round to different values of dx's dtype for some element (the row needs
    the exact fallback), else 0; for a float64 ``dx``, no test (0). ``u`` is
    :mod:`._weight_terms`' (the row's ``a``, ``r_t``, ``t``), each operation rounded once.
    """
    sig = types.int32(
        dy, z, dresidual_out, dx, weight, dweight_partial, dbias_partial,
        m1, delta, rstd, c2, k, k_t1, k_c, k_0, a_0, a, r_t, t,
    )  # fmt: skip

    def codegen(context, builder, sig, args):
        # (the shared arguments first, then the row's: as _dx_rows_checked takes them)
        order = [4, 5, 6, 0, 1, 2, 3, *range(7, 19)]
        return _dx_codegen(
            context, builder, [sig.args[i] for i in order], [args[i] for i in order], 1
        )

    return sig, codegen


@intrinsic
def _dx_rows_checked(
    typingctx, weight, dweight_partial, dbias_partial,
    dy, z, dresidual_out, dx, m1, delta, rstd, c2, k, k_t1, k_c, k_0, a_0, a, r_t, t,
    dy_b, z_b, dresidual_out_b, dx_b, m1_b, delta_b, rstd_b, c2_b, k_b, k_t1_b, k_c_b, k_0_b,
    a_0_b, a_b, r_t_b, t_b,
):  # fmt: skip
    """:func:`_dx_row_checked` of two rows in one pass: the second row's arguments
    follow the first's (the weight and the partial sums are shared). Each element of
    the partial sums takes the first row's term, then the second's, as two passes would
    add them (the same bits), with one load and one store instead of two. Returns bit 0
    set when the first row is left open, bit 1 when the second is."""
    sig = types.int32(
        weight, dweight_partial, dbias_partial,
        dy, z, dresidual_out, dx, m1, delta, rstd, c2, k, k_t1, k_c, k_0, a_0, a, r_t, t,
        dy_b, z_b, dresidual_out_b, dx_b, m1_b, delta_b, rstd_b, c2_b, k_b, k_t1_b, k_c_b, k_0_b,
        a_0_b, a_b, r_t_b, t_b,
    )  # fmt: skip

    def codegen(context, builder, sig, args):
        return _dx_codegen(context, builder, list(sig.args), list(args), 2)

    return sig, codegen


#: Per row, :func:`_dx_codegen` takes four arrays and this many scalars
_ROW_SCALARS = 12


def _below_tiny(builder: ir.IRBuilder, y: ir.Value, a_0: ir.Value) -> ir.Value:
    """i1 (per lane) where the half types' row test leaves ``y`` open for its size:
    ``|y| < tiny``, ``tiny = max(a_0·``:data:`_TINY_FACTOR```, 2^-126)`` (every finite
    ``y`` when ``a_0`` is NaN or infinite), except an exact zero where ``a_0 == 0``
    (``E = 0`` there). On the patterns, unsigned: ``bits(|y|) - z0 < bits(tiny) - z0``
    with ``z0 = 1`` where ``a_0 == 0``, which wraps a zero's 0 to the top."""
    i64 = ir.IntType(64)
    lanes = y.type.count if isinstance(y.type, ir.VectorType) else 1
    factor, normal = _splat_all(
        builder, [ir.DoubleType()(_TINY_FACTOR), ir.DoubleType()(_SINGLE_NORMAL)], lanes
    )
    tiny = builder.fmul(a_0, factor)
    tiny = builder.select(builder.fcmp_ordered("<", tiny, normal), normal, tiny)
    zero = ir.Constant(a_0.type, None)
    z0 = builder.zext(builder.fcmp_ordered("==", a_0, zero), _shaped(i64, y))
    magnitude = builder.bitcast(_fabs(builder, y), _shaped(i64, y))
    limit = builder.bitcast(tiny, _shaped(i64, y))
    return builder.icmp_unsigned("<", builder.sub(magnitude, z0), builder.sub(limit, z0))


def _dx_codegen(context, builder: ir.IRBuilder, arg_types, args, count: int) -> ir.Value:
    """The code of :func:`_dx_row_checked` (``count`` 1) and :func:`_dx_rows_checked`
    (2): ``(weight, dweight_partial, dbias_partial)``, then per row ``(dy, z,
    dresidual_out, dx)`` and its :data:`_ROW_SCALARS` scalars. Returns the rows' open
    bits (bit ``r`` for row ``r``)."""

    def row(i):
        return None if arg_types[i] == types.none else Row(context, builder, arg_types[i], args[i])

    w, dwp, dbp = row(0), row(1), row(2)
    stride = 4 + _ROW_SCALARS
    per_row = [(3 + stride * r, [row(3 + stride * r + j) for j in range(4)]) for r in range(count)]
    double = ir.DoubleType()
    width = vector_lanes(double)
    dtype = per_row[0][1][3].dtype  # dx's (every row's)
    check = dtype != types.float64
    half = check and dtype in (types.uint16, types.int16)
    i32 = ir.IntType(32)
    flags = [
        cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(i32, width), [0] * width))
        for _ in range(count)
    ]

    def rounded(partial, value):
        """``value`` as ``partial``'s dtype holds it (a float32 partial between rows)."""
        if partial.dtype != types.float32:
            return value
        return builder.fpext(builder.fptrunc(value, _shaped(ir.FloatType(), value)), value.type)

    def one_row(first, arrays, flag, wv, index, lanes):
        """Row's dx stored and tested; returns its ``(dy, u)`` for the partials."""
        dy, z, dres, dx = arrays
        m1, delta, rstd, c2, k, k_t1, k_c, k_0, a_0, a, r_t, t = _splat_all(
            builder, args[first + 4 : first + 4 + _ROW_SCALARS], lanes
        )
        g, zv = (a.load(index, lanes, double) for a in (dy, z))
        d = builder.fsub(zv, m1)
        c = builder.fsub(d, delta)
        t3 = builder.fmul(k, c)
        if check:
            # gh = dy·weight is exact (24 by 24 bits), so gh - c2 fused is t1's bits;
            # t4 = rstd·t1 - t3 fused (where the CPU fuses) saves t2's rounding, within
            # the same bound (docs/contract.md §3)
            t1 = _mul_add(builder, g, wv, builder.fneg(c2))
            t4 = _mul_add(builder, rstd, t1, builder.fneg(t3))
        else:  # float64: dx's bits are these operations'
            t1 = builder.fsub(builder.fmul(g, wv), c2)
            t4 = builder.fsub(builder.fmul(rstd, t1), t3)
        # (no "+ 0.0" but for float64: with c2 never +0.0, t4 is never -0.0, and neither
        # is y, for rows of float32 and narrower: docs/contract.md §3)
        y = t4 if dres is None else builder.fadd(t4, dres.load(index, lanes, double))
        if check:  # _weight_terms' u (no fast-math flags: each operation rounded once)
            u = builder.fsub(builder.fmul(builder.fsub(zv, a), r_t), t)
        else:  # float64: float64's accuracy, each backend's own bits
            u = builder.fmul(c, rstd)
        if not check:
            y = builder.fadd(y, ir.Constant(y.type, None))
            dx.store_raw(narrow_once(builder, y, dx.dtype), index, lanes)
            return g, u

        def open_where(differ):
            """ORs ``differ`` (an i1 or i32 per lane, nonzero where open) into the flags."""
            if differ.type == _shaped(ir.IntType(1), differ):
                differ = builder.zext(differ, _shaped(i32, differ))
            if lanes == 1:
                differ = builder.insert_element(
                    ir.Constant(ir.VectorType(i32, width), [0] * width), differ, i32(0)
                )
            builder.store(builder.or_(builder.load(flag), differ), flag)

        def bound():
            """``E`` per element (Ziv's test's)."""
            e = k_0
            if dres is not None:  # (else the caller folded 3.1u|y| into k_t1, k_c)
                (k_y,) = _splat_all(builder, [double(3.1 * _U * _SLACK)], lanes)
                e = _mul_add(builder, k_y, _fabs(builder, y), k_0)
            e = _mul_add(builder, k_c, _fabs(builder, c), e)
            return _mul_add(builder, k_t1, _fabs(builder, t1), e)

        if half:
            single = builder.fptrunc(y, _shaped(ir.FloatType(), y))
            on = _on_boundary(builder, single, dx.dtype, lanes)
            # RN16(RN32(y)) is RN16(y) unless RN32(y) is a boundary (none lies
            # strictly between y and its nearest float32): rounded twice, cheaply,
            # and the rare vector with a boundary rounded once, through round-to-odd
            dx.store_raw(_narrow_off_boundary(builder, single, dx.dtype), index, lanes)
            # the row test: |y| >= tiny makes E < |r| 2^-25, r = RN32(y)
            maybe = builder.or_(_below_tiny(builder, y, a_0), on)
            with builder.if_then(_any_lane(builder, maybe), likely=False):
                # When E < |r| 2^-25 (below half of r's gaps to its float32
                # neighbours), [y - E, y + E] holds no float32 but r, and every rounding
                # boundary of the half types is a float32: the rounding is decided
                # unless r is one and |y - r| <= E (tested in the rare vector with one).
                e = bound()
                r = builder.fpext(single, y.type)
                (tiny,) = _splat_all(builder, [double(2.0**-25)], lanes)
                open_where(builder.fcmp_ordered(">", e, builder.fmul(_fabs(builder, r), tiny)))
                with builder.if_then(_any_lane(builder, on), likely=False):
                    dx.store_raw(narrow_once(builder, y, dx.dtype), index, lanes)
                    inside = builder.fcmp_ordered("<=", _fabs(builder, builder.fsub(y, r)), e)
                    open_where(builder.and_(on, inside))
        else:
            dx.store_raw(narrow_once(builder, y, dx.dtype), index, lanes)
            # float32: the ends' patterns' xor, nonzero where they round apart
            e = bound()
            low, high = builder.fsub(y, e), builder.fadd(y, e)
            low = _as_bits(builder, narrow_once(builder, low, dx.dtype))
            high = _as_bits(builder, narrow_once(builder, high, dx.dtype))
            open_where(builder.xor(low, high))
        return g, u

    def element(index, lanes):
        wv = w.load(index, lanes, double)
        terms = [
            one_row(first, arrays, flags[r], wv, index, lanes)
            for r, (first, arrays) in enumerate(per_row)
        ]
        dweight = dwp.load(index, lanes, double)
        dbias = dbp.load(index, lanes, double)
        for r, (g, u) in enumerate(terms):
            if r > 0:
                dweight, dbias = rounded(dwp, dweight), rounded(dbp, dbias)
            dweight = builder.fadd(dweight, builder.fmul(g, u))
            dbias = builder.fadd(dbias, g)
        for partial, value in ((dwp, dweight), (dbp, dbias)):
            if partial.dtype == types.float32:
                value = builder.fptrunc(value, _shaped(ir.FloatType(), value))
            partial.store_raw(value, index, lanes)

    _elementwise(builder, per_row[0][1][3].length, width, element)
    result = i32(0)
    for r in range(count):
        packed = builder.bitcast(builder.load(flags[r]), ir.IntType(32 * width))
        open_ = builder.zext(builder.icmp_unsigned("!=", packed, packed.type(0)), i32)
        result = builder.or_(result, builder.shl(open_, i32(r)))
    return result


@_jit()
def _precise_backward_sums(dy, z, w, m1, n):
    """:func:`_backward_sums` again, for a row the fast pass flagged, by Ogita, Rump and
    Oishi's Sum2 (each sum within ``u|sum| + γ_n²·Σ|terms|`` of the sum of its rounded
    terms), and that factor ``u + γ_n²``, :func:`_backward_constants`' ``gamma``.
    Scalar code: it runs for few rows."""
    n_float = np.float64(n)
    g = n_float * _U / (1.0 - n_float * _U)
    s0 = s1 = s2 = s3 = s4 = 0.0  # the running sums
    c0 = c1 = c2 = c3 = c4 = 0.0  # and their compensations: five independent chains
    for k in range(n):
        gh = element_f64(dy, k) * element_f64(w, k)
        d = element_f64(z, k) - m1
        s0, e = two_sum(s0, d)
        c0 += e
        s1, e = two_sum(s1, d * d)
        c1 += e
        s2, e = two_sum(s2, gh)
        c2 += e
        s3, e = two_sum(s3, gh * gh)
        c3 += e
        s4, e = two_sum(s4, gh * d)
        c4 += e
    return s0 + c0, s1 + c1, s2 + c2, s3 + c3, s4 + c4, 1.01 * (_U + g * g)


_CHUNK = 256  # elements per chunk of the backward's row sums
_GROUP = 16 * _CHUNK  # chunks per group


@_jit(inline="always")
def _chunked_backward_sums(dy, z, w, m1, n):
    """:func:`_backward_sums` of the row, in chunks of :data:`_CHUNK` elements (each one
    block of ``_numba_vectors``' order), the chunk totals added in order into groups of
    16, the group totals in order into the row's: fewer roundings on any path than one
    sum over the row (:func:`_fast_gamma`), so a bound some 6 times tighter at N = 4096.
    A row of one chunk is that chunk's sums as they are (``0 + s`` is ``s``: no sum of
    ``_numba_vectors`` is ``-0.0``, its accumulators start at ``+0.0``)."""
    zero = 0.0
    if 0 < n <= _CHUNK:
        return _backward_sums(dy, z, w, m1, zero)
    t0 = t1 = t2 = t3 = t4 = zero
    for g in range(0, n, _GROUP):
        u0 = u1 = u2 = u3 = u4 = zero
        for c in range(g, min(n, g + _GROUP), _CHUNK):
            e = min(n, c + _CHUNK)
            a0, a1, a2, a3, a4 = _backward_sums(dy[c:e], z[c:e], w[c:e], m1, zero)
            u0 += a0
            u1 += a1
            u2 += a2
            u3 += a3
            u4 += a4
        t0 += u0
        t1 += u1
        t2 += u2
        t3 += u3
        t4 += u4
    return t0, t1, t2, t3, t4


@_jit(inline="always")
def _fast_gamma(n):
    """:func:`_backward_constants`' ``gamma`` for :func:`_chunked_backward_sums`: a sum's
    error relative to the sum of its |terms|, from the roundings on any path: those of
    a chunk (:func:`_depth`), at most 16 into its group, one per group into the row's."""
    groups = (n + _GROUP - 1) // _GROUP
    h = np.float64(_depth(min(n, _CHUNK)) + 16 + groups + 1) * _U
    return h / (1.0 - h)


@_jit(inline="always")
def _backward_factors(n, gamma):
    """The per-call factors of :func:`_backward_constants` for rows of ``n`` elements
    whose sums err by at most ``gamma`` times the sums of their |terms|:
    ``(f_mean, f_c2, f_a, f_var)``, with which a row's bound terms need no division
    (docs/contract.md §3): ``γD/N``-type terms become ``f·sqrt(S)``, since
    ``D/N = 1.001·sqrt(S_dd)/sqrt(N)``. Each factor carries the 1.01 of the term it
    stands for, which covers the roundings of evaluating it (fewer than 20, 10^-14)."""
    n_float = np.float64(n)
    inv_n = 1.0 / n_float
    rn = 1.0 / np.sqrt(n_float)
    f_mean = 1.01 * 1.001 * (gamma + 2.0 * _U) * rn  # e_mean = f_mean·sqrt(S_dd) + ...
    f_c2 = 1.01 * 1.001 * gamma * rn  # e_c2 = f_c2·sqrt(S_gg) + ...
    f_a = 1.01 * 1.001 * (gamma + 2.01 * _U) * inv_n  # e_a = f_a·sqrt(S_gg)·sqrt(S_dd) + ...
    f_var = 1.01 * (gamma + 3.0 * _U)  # e_var = f_var·S_dd/N + ...
    return f_mean, f_c2, f_a, f_var


@_jit(inline="always")
def _over_n(total, n_float, binary):
    """``total / N``: for ``N`` a power of two (``binary``), ``total · (1/N)``, the same
    value (both are the rounding of the exact ``total·2^-k``, subnormals included) for a
    multiplication instead of a division."""
    if binary:
        return total * (1.0 / n_float)
    return total / n_float


@_jit(inline="always")
def _backward_constants(s_d, s_dd, s_g, s_gg, s_gd, factors, n, eps, rms, plain, binary):
    """A row's constants for :func:`_dx_row_checked` from its five sums
    (:func:`_backward_sums`) and the call's :func:`_backward_factors`, and the row's flag
    (docs/contract.md §3): ``(delta, rstd, c2, k, k_t1, k_c, k_0, a_0, flag, e_mean,
    e_r)``, the
    three ``k_*`` times the slack ``1 + 2^-30``; ``c2`` as the dx pass takes it (-0.0
    for +0.0); ``a_0`` bounds the row's ``E`` at ``y = 0`` (every element's ``E <= a_0
    + k_y|y|``: the dx pass's row test); ``flag`` is 1 when the bound on ``rstd`` is too
    loose to use; ``e_mean`` and ``e_r`` bound the errors of the mean and of ``rstd``
    (relative), for :func:`_weight_scalars`. ``binary``: ``N`` is a power of two (:func:`_over_n`). ``plain`` (no
    residual gradient: ``y = t4``, and ``|y| <= (1 + u)²(rstd|t1| + |k||c|)``): ``E``'s
    ``3.1u|y|`` term is folded into ``k_t1`` and ``k_c`` (as ``3.11u·rstd`` and
    ``3.11u|k|``), and the dx pass leaves it out. The values that ``dx`` and ``dweight``
    use (``delta``, ``var``, ``rstd``, ``c2``, ``a1``) are computed as they always were
    (four divisions by N, or their equal multiplications, and ``1/sqrt``: float64 dx
    keeps its bits); the bound's terms multiply by the per-call
    factors instead, with two more square roots. Every name is the contract's quantity
    or a bound on it."""
    zero = 0.0
    n_float = np.float64(n)
    f_mean, f_c2, f_a, f_var = factors
    root_dd = np.sqrt(s_dd)  # Σ|d| <= D = 1.001·sqrt(N·S_dd) = 1.001·sqrt(N)·root_dd
    root_gg = np.sqrt(s_gg)  # Σ|gh| <= G likewise; Σ|gh·d| <= P = 1.001·root_gg·root_dd
    if rms:
        delta = zero
        e_mean = zero
        var = _over_n(s_dd, n_float, binary)
        e_var = f_var * var + 1.01 * _U * var
        c2 = zero
        e_c2 = zero
        a1 = _over_n(s_gd, n_float, binary)
        a2 = zero
        alpha = zero  # c = z, exactly
    else:
        delta = _over_n(s_d, n_float, binary)
        e_mean = f_mean * root_dd + 1.01 * _U * abs(delta)
        q = _over_n(s_dd, n_float, binary)
        var = max(q - delta * delta, zero)
        e_var = f_var * q + 1.01 * (
            e_mean * (2.0 * abs(delta) + e_mean) + _U * (delta * delta + var)
        )
        c2 = _over_n(s_g, n_float, binary)
        e_c2 = f_c2 * root_gg + 1.01 * _U * abs(c2)
        a1 = _over_n(s_gd, n_float, binary)
        a2 = delta * c2
        alpha = 2.04 * _U
    a = a1 - a2
    e_a = f_a * root_gg * root_dd + 1.01 * (
        _U * (abs(a) + abs(a1) + abs(a2)) + e_mean * abs(c2) + (abs(delta) + e_mean) * e_c2
    )
    s = var + eps
    e_s = e_var + 1.01 * _U * s
    flag = 1 if e_s >= 0.01 * s else 0  # (False for a NaN row: it stays NaN)
    rstd = 1.0 / np.sqrt(s)
    # the relative error of rstd: 0.51·e_s/(s − e_s) + 2.01u <= 0.52·e_s·rstd² + 2.01u
    # where e_s < s/100 (else the row is flagged, and these constants go unused)
    e_r = 0.52 * (e_s * (rstd * rstd)) + 2.01 * _U
    k = rstd * rstd * rstd * a
    r_hi = rstd * (1.0 + 1.01 * e_r)  # >= the exact rstd
    e_k = 3.02 * _U * abs(k) + r_hi * r_hi * r_hi * (3.03 * e_r * abs(a) + e_a)
    beta = 1.01 * _U * abs(delta) + e_mean  # e_c <= alpha |c| + beta
    # with the roundings of t2, t3 and t4 = t2 - t3: u(|t2| + |t3| + |t4|)
    # <= 2.01u(|t2| + |t3|), |t2| <= (1 + u) rstd |t1|, |t3| <= (1 + u) |k| |c|
    k_t1 = r_hi * (e_r + _U) + 2.02 * _U * rstd
    k_c = abs(k) * (alpha + 2.02 * _U) + e_k * (1.0 + alpha)
    k_0 = r_hi * e_c2 + beta * (abs(k) + e_k)
    if plain:
        k_t1 += 3.11 * _U * rstd
        k_c += 3.11 * _U * abs(k)
    k_t1, k_c, k_0 = k_t1 * _SLACK, k_c * _SLACK, k_0 * _SLACK
    # the row's bound at y = 0: max|t1| <= 1.002(root_gg + |c2|), max|c| <= 1.002(root_dd
    # + |delta|) (Cauchy-Schwarz on the sums; docs/contract.md §3, the row test)
    a_0 = 1.01 * (
        k_t1 * (1.002 * (root_gg + abs(c2))) + k_c * (1.002 * (root_dd + abs(delta))) + k_0
    )
    # -0.0 for a zero c2 (which is +0.0: no sum is -0.0): then t1 = gh - c2 is never
    # -0.0 (gh - (-0.0) = gh + 0.0), nor are t2 = rstd·t1, t4 = t2 - t3 and y = t4 +
    # dresidual_out, so the dx pass needs no "+ 0.0" (the same bits: only zeros' signs
    # move, and y's zeros were +0.0 already)
    c2_dx = c2 if c2 != zero else -zero
    return delta, rstd, c2_dx, k, k_t1, k_c, k_0, a_0, flag, e_mean, e_r


#: Rows whose constants :func:`_backward_block` computes together (one vector of doubles)
_BATCH = 8
#: What a batch's scratch holds per row (``_BATCH`` columns each), in this order
_SUMS, _CONSTANTS = 6, 9  # m1, the five sums; delta, rstd, c2, k, k_t1, k_c, k_0, a_0, flag
_SCALARS = 6  # then dweight's: a (the row's first element), r, t, open (_weight_scalars),
_W_A, _W_R, _W_T, _W_OPEN, _W_EMEAN, _W_ER = 15, 16, 17, 18, 19, 20  # and e_mean, e_r


@_jit()
def _batch_constants(scratch, b, factors, n, eps, rms, plain):
    """:func:`_backward_constants` of the ``b`` rows of a batch, from their sums in
    ``scratch[1:6, :b]`` (and ``m1``, ``a``) into ``scratch[6:15, :b]`` and
    ``scratch[16:19, :b]`` (the flags as 0.0 or 1.0): one loop,
    which LLVM vectorizes across the rows (the same IEEE operations on each lane: the
    same bits as one row at a time, and an eighth of the instructions)."""
    if n & (n - 1) == 0:  # a power of two: no division by N (_over_n)
        _batch_rows(scratch, b, factors, n, eps, rms, plain, True)
    else:
        _batch_rows(scratch, b, factors, n, eps, rms, plain, False)


@_jit(inline="always")
def _batch_rows(scratch, b, factors, n, eps, rms, plain, binary):
    """The loop of :func:`_batch_constants`, one for each ``binary``."""
    s_d, s_dd, s_g, s_gg, s_gd = scratch[1], scratch[2], scratch[3], scratch[4], scratch[5]
    delta, rstd, c2, k = scratch[6], scratch[7], scratch[8], scratch[9]
    k_t1, k_c, k_0, a_0 = scratch[10], scratch[11], scratch[12], scratch[13]
    flag, m1, a = scratch[14], scratch[0], scratch[_W_A]
    r_t, t, open_ = scratch[_W_R], scratch[_W_T], scratch[_W_OPEN]
    e_mean, e_r = scratch[_W_EMEAN], scratch[_W_ER]
    for j in range(b):
        row = _backward_constants(
            s_d[j], s_dd[j], s_g[j], s_gg[j], s_gd[j], factors, n, eps, rms, plain, binary
        )
        delta[j], rstd[j], c2[j], k[j], k_t1[j], k_c[j], k_0[j], a_0[j] = row[:8]
        flag[j] = np.float64(row[8])
        e_mean[j], e_r[j] = row[9], row[10]
    for j in range(b):  # (a loop of its own, which vectorizes too)
        r_t[j], t[j], open_[j] = _weight_scalars(
            m1[j], a[j], delta[j], e_mean[j], rstd[j], e_r[j], flag[j], rms
        )


@_jit()
def _no_residual(dresidual_out, stride, n):
    """Whether ``dresidual_out`` is the backward's "no residual gradient": one row of
    ``-0.0`` with a stride of 0 (``numba_.backward`` passes it; ``v + -0.0 == v``
    bitwise, so the dx pass may skip the addition)."""
    if stride != 0:
        return False
    # (every element tested, without an early exit: the loop vectorizes; it runs on
    # every call, and an early exit made it ~10 times slower, 0.65 us at N = 768)
    found = True
    for k in range(n):
        value = element_f64(dresidual_out, k)
        found &= (value == 0.0) & (math.copysign(1.0, value) < 0.0)
    return found


@_jit()
def _backward_row_again(
    i, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight, dx, m1, n,
    eps, rms,
):  # fmt: skip
    """Row ``i``'s dx once more, for a row whose constants or dx pass left it open (rare):
    with compensated sums, whose bound is some 100 times tighter (the partial sums
    already have the row's terms: a throwaway pair). Returns the row's fallback flag, 1
    where this leaves it open too (the exact fallback's). Not inlined: the common path
    passes it no arrays."""
    dy_i = dy[i * dy_stride : i * dy_stride + n]
    x_i = x[i * x_stride : i * x_stride + n]
    dresidual_out_i = dresidual_out[i * dresidual_out_stride : i * dresidual_out_stride + n]
    dx_i = dx[i * n : (i + 1) * n]
    s_d, s_dd, s_g, s_gg, s_gd, gamma = _precise_backward_sums(dy_i, x_i, weight, m1, n)
    constants = _backward_constants(
        s_d, s_dd, s_g, s_gg, s_gd, _backward_factors(n, gamma), n, eps, rms, False,
        n & (n - 1) == 0,
    )  # fmt: skip
    delta, rstd_i, c2, k, k_t1, k_c, k_0, a_0, flag = constants[:9]
    throwaway = np.zeros(n)
    checked = _dx_row_checked(
        dy_i, x_i, dresidual_out_i, dx_i, weight, throwaway, throwaway,
        m1, delta, rstd_i, c2, k, k_t1, k_c, k_0, a_0, 0.0, 0.0, 0.0,
    )  # fmt: skip
    return np.uint8(flag | checked)


@_jit(inline="always")
def _product_minus(x1, x2, y1, y2, z1, z2):
    """``(x1 + x2)·(y1 + y2) - (z1 + z2)`` in float64, and a bound on the rounding
    errors of evaluating it (not on the inputs' own errors): the product of the high
    parts by TwoProd, exactly; ``z1`` taken from its high part (exact where they are
    within a factor 2, Sterbenz); the rest, each term rounded at most three times."""
    c1, c2 = two_prod(x1, y1)
    head = c1 - z1
    p, q, w = x1 * y2, x2 * y1, x2 * y2
    tail = ((c2 - z2) + p) + (q + w)
    value = head + tail
    small = abs(c2) + abs(z2) + abs(p) + abs(q) + abs(w)
    return value, 1.01 * (_U * (abs(head) + abs(value)) + 3.01 * _U * small)


@_jit()
def _settled_weight_scalars(z, n, eps, rms, a):
    """A row's ``(r, t, open)`` of :mod:`._weight_terms` in double-double, for a row
    whose float64 test left them open (rare; docs/contract.md §3, "dweight and dbias"):
    ``open`` is 1.0 only where the exact value lies within about ``2^-60`` (relative) of
    a rounding midpoint, or on one (then ``_exact.weight_scalars``, on the host).

    With ``S = N·(q + eps)`` (``q`` the exact biased variance) and ``V = Σ(z - a) =
    N·(mean - a)``: ``rstd = sqrt(N/S)`` and ``v = (mean - a)·rstd = V/sqrt(N·S)``.
    ``V`` is Sum2 (Ogita, Rump and Oishi) of the exact differences ``z - a`` (TwoSum),
    kept as a pair: within ``e_V = γ_2N(γ_N + u)·Σ|z - a|``. ``S`` sums the squares of
    ``d = z - M'``, ``M' = a + V/N`` in double-double (``Σ(z - M')² = N·q + N·(M' -
    mean)²``: an inexact ``M'`` only adds a square), each ``d`` a pair within
    ``2.01u·τ`` of ``z - M'``, each square by TwoProd into Sum2; ``e_S`` bounds every
    rounding (the terms are written out below). Neither value is rounded: the scalars are
    decided against the midpoint ``m`` of the grid interval of a float64 estimate (an
    exact float64, and ``m²`` an exact pair): ``rstd > m`` iff ``m²·S < N``, and ``|v|
    > m`` iff ``m²·N·S < V²``. Each side is evaluated by :func:`_product_minus`, and the
    verdict is kept only where ``|difference|`` exceeds the evaluation's bound plus what
    ``e_V`` and ``e_S`` move it: IEEE operations with bounds, no rounding of the scalars
    themselves: the estimates need only lie within a quarter of a grid step (a bound
    on their error says so; ``|v| < 2^14``, ``e_S <= 2^-60·S``; else the row stays
    open)."""
    n_float = np.float64(n)
    gamma_n = n_float * _U / (1.0 - n_float * _U)
    gamma_2n = 2.0 * n_float * _U / (1.0 - 2.0 * n_float * _U)
    # V = Σ (z - a): the exact differences' high parts into TwoSum, everything else into c
    v_s = v_c = h_abs = 0.0
    if not rms:
        for k in range(n):
            h, l = two_sum(element_f64(z, k), -a)
            v_s, e = two_sum(v_s, h)
            v_c += e + l
            h_abs += abs(h)
    v_h, v_l = two_sum(v_s, v_c)  # (exactly v_s + v_c)
    e_v = 1.02 * gamma_2n * (gamma_n + _U) * h_abs
    # M' - a = (w_h + w_l): V/N in double-double; its distance to mean - a, mu, matters
    # only squared (N·mu²)
    w_h = v_h / n_float
    w_l = (fma(-w_h, n_float, v_h) + v_l) / n_float  # (the remainder is exact)
    mu = 1.02 * (e_v / n_float + 2.02 * _U * abs(w_l))
    # S' = Σ d², d = (z - a) - (w_h + w_l) = p1 + e1 + l - w_l as the pair (d_h, d_l)
    q_s = q_c = p_sum = tau_d = tau_sq = 0.0
    for k in range(n):
        x = element_f64(z, k)
        if rms:
            d_h, d_l = x, 0.0
        else:
            h, l = two_sum(x, -a)
            p1, e1 = two_sum(h, -w_h)
            d_h, d_l = two_sum(p1, e1 + (l - w_l))  # within 2.01u·tau of z - M'
            tau = abs(e1) + abs(l) + abs(w_l)
            tau_d += abs(d_h) * tau
            tau_sq += tau * tau
        p, p_e = two_prod(d_h, d_h)
        q_s, e = two_sum(q_s, p)
        q_c += e + (p_e + 2.0 * d_h * d_l)  # (d_l², at most u²·p, left out)
        p_sum += p
    # the Sum2 of the p's and of (e + p_e + 2·d_h·d_l) (at most (γ_N + 3u)·Σp), with
    # 2·d_h·d_l rounded and d_l² dropped; then the d's own errors: |d² - d'²| <=
    # 2.01u·tau·(2.01|d_h| + 2.01u·tau)
    e_sum = ((3.01 * _U + gamma_n) * (gamma_n + 3.01 * _U) + 3.01 * _U * _U) * p_sum
    e_d = 4.05 * _U * tau_d + 4.05 * _U * _U * tau_sq
    # S = S' - N·mu'² + N·eps, N·eps exactly by TwoProd, as the pair (s_h, s_l)
    ne_h, ne_l = two_prod(n_float, eps)
    s_h, s_2 = two_sum(q_s, ne_h)
    s_l = (s_2 + q_c) + ne_l
    e_s = (
        1.02 * (e_sum + e_d + n_float * mu * mu + 2.01 * _U * (abs(s_2) + abs(q_c) + abs(ne_l)))
        + 2.0**-1000
    )  # (an underflow in ne_l's TwoProd)
    if not (s_h > 0.0 and e_s <= 2.0**-60 * s_h and e_v < np.inf):  # NaN rows included
        return np.nan, np.nan, 1.0
    # rstd: the midpoint of the 32-bit grid interval holding its estimate r_a, which is
    # within a relative rel_r < 2^-35 of it (a step is more than 2^-32 of rstd): rstd
    # then lies within 3/4 of a step of the midpoint, between its neighbours
    r_a = 1.0 / np.sqrt(s_h / n_float)
    rel_r = 0.51 * (abs(s_l) + e_s) / s_h + 2.6 * _U
    if not rel_r < 2.0**-35:
        return np.nan, np.nan, 1.0
    step = math.ldexp(1.0, math.frexp(r_a)[1] - _weight_terms.RSTD_BITS)
    m_r = (math.floor(r_a / step) + 0.5) * step
    m2_h, m2_l = two_prod(m_r, m_r)  # exact: m_r has 33 bits
    below, error = _product_minus(m2_h, m2_l, s_h, s_l, n_float, 0.0)  # m²S - N
    if abs(below) <= 1.01 * (error + 1.01 * m2_h * e_s):
        return np.nan, np.nan, 1.0
    r = m_r + 0.5 * step if below < 0.0 else m_r - 0.5 * step
    if rms:
        return r, 0.0, 0.0
    # t: the midpoint of the 2^-32 grid interval holding |v|'s estimate v_a, which is
    # within a quarter step of |v|, likewise
    v_a = abs(w_h) * r_a
    quantum = _weight_terms.SHIFT_QUANTUM
    e_va = 1.02 * (v_a * (rel_r + 2.01 * _U) + r_a * (abs(v_l) + e_v) / n_float)
    if not (v_a < 2.0**14 and e_va < 0.25 * quantum):
        return np.nan, np.nan, 1.0
    m_t = (math.floor(v_a * _GRID) + 0.5) * quantum
    t2_h, t2_l = two_prod(m_t, m_t)  # exact: m_t < 2^14 has at most 47 bits
    x_h, x_e = two_prod(t2_h, n_float)
    x_p = t2_l * n_float
    x_l = x_e + x_p  # m²·N = x_h + x_l within e_x
    e_x = 2.01 * _U * (abs(x_e) + abs(x_p))
    y_h, y_e = two_prod(v_h, v_h)
    y_c = 2.0 * v_h * v_l
    y_l = y_e + y_c  # V² = y_h + y_l within e_y (V's own error included)
    e_y = 2.01 * _U * (abs(y_e) + abs(y_c)) + 1.01 * _U * _U * y_h + e_v * (2.01 * abs(v_h) + e_v)
    above, error = _product_minus(x_h, x_l, s_h, s_l, y_h, y_l)  # m²NS - V²
    moved = 1.01 * (abs(x_h) * e_s + e_x * abs(s_h)) + e_y
    if abs(above) <= 1.01 * (error + moved):
        return np.nan, np.nan, 1.0
    t = m_t + 0.5 * quantum if above < 0.0 else m_t - 0.5 * quantum
    if t == 0.0:
        return r, 0.0, 0.0
    if abs(v_h) <= 2.0 * e_v:  # V's sign unknown
        return np.nan, np.nan, 1.0
    return r, math.copysign(t, v_h), 0.0


@_jit()
def _backward_block(
    block, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight, mean,
    dx, dweight_partial, dbias_partial, flags, m, n, eps, rms, scratch, plain,
):  # fmt: skip
    """dx for the rows of block ``block`` (rows ``block*ROW_BLOCK`` to
    ``(block+1)*ROW_BLOCK - 1``; ``+ dresidual_out``: without a residual, one row of
    ``-0.0`` with a stride of 0), each row's fallback flag ``flags[i]``, and the block's
    partial sums ``dweight_partial[block*N:(block+1)*N] = sum(dy * u)``,
    ``dbias_partial[...] = sum(dy)``, in row order. ``scratch``: (15, ``_BATCH``) float64;
    ``plain``: there is no residual gradient (:func:`_no_residual`), and the dx pass
    skips it.

    In batches of :data:`_BATCH` rows: each row's ``m1`` (the forward's mean: any finite
    value will do, the bound covers it; 0 for RMSNorm, where ``d = z`` exactly) and
    :func:`_chunked_backward_sums`, the batch's constants together
    (:func:`_batch_constants`), then each row's :func:`_dx_row_checked`. The rows'
    arithmetic is unchanged (the same bits); only the constants' scalar work is shared.
    """
    weight, scratch = _borrowed(weight), _borrowed(scratch)
    dweight_partial, dbias_partial = _borrowed(dweight_partial), _borrowed(dbias_partial)
    dweight_block = dweight_partial[block * n : (block + 1) * n]
    dbias_block = dbias_partial[block * n : (block + 1) * n]
    for k in range(n):  # (indices from 0: contiguous stores; from block * n, LLVM's
        dweight_block[k] = 0.0  # vectorized loop scattered them, for negative indices)
        dbias_block[k] = 0.0
    factors = _backward_factors(n, _fast_gamma(n))
    last = min(m, (block + 1) * ROW_BLOCK)
    for first in range(block * ROW_BLOCK, last, _BATCH):
        b = min(_BATCH, last - first)
        for j in range(b):
            i = first + j
            m1 = 0.0
            if not rms:
                m1 = np.float64(mean[i])
                if not np.isfinite(m1):
                    m1 = 0.0
            dy_i = dy[i * dy_stride : i * dy_stride + n]
            x_i = x[i * x_stride : i * x_stride + n]
            scratch[0, j] = m1
            scratch[_W_A, j] = 0.0 if rms else element_f64(x_i, 0)
            (scratch[1, j], scratch[2, j], scratch[3, j], scratch[4, j], scratch[5, j]) = (
                _chunked_backward_sums(dy_i, x_i, weight, m1, n)
            )
        _batch_constants(scratch, b, factors, n, eps, rms, plain)
        for j in range(b):  # (rare) dweight's scalars are settled before the terms
            if scratch[_W_OPEN, j] != 0.0 and not _is_float64(dx):
                i = first + j
                scalars = _settled_weight_scalars(
                    x[i * x_stride : i * x_stride + n], n, eps, rms, scratch[_W_A, j]
                )
                if scalars[2] == 0.0:
                    scratch[_W_R, j], scratch[_W_T, j], scratch[_W_OPEN, j] = scalars
        for j in range(0, b, 2):  # two rows a pass (the partial sums loaded once)
            i = first + j
            pair = j + 1 < b
            dy_i = dy[i * dy_stride : i * dy_stride + n]
            x_i = x[i * x_stride : i * x_stride + n]
            dres_i = dresidual_out[i * dresidual_out_stride : i * dresidual_out_stride + n]
            dx_i = dx[i * n : (i + 1) * n]
            m1, delta, rstd_i, c2 = scratch[0, j], scratch[6, j], scratch[7, j], scratch[8, j]
            k, k_t1, k_c, k_0 = scratch[9, j], scratch[10, j], scratch[11, j], scratch[12, j]
            a_0 = scratch[13, j]
            a, r_t, t = scratch[_W_A, j], scratch[_W_R, j], scratch[_W_T, j]
            if not pair:
                if plain:
                    opened = _dx_row_checked(
                        dy_i, x_i, None, dx_i, weight, dweight_block, dbias_block,
                        m1, delta, rstd_i, c2, k, k_t1, k_c, k_0, a_0, a, r_t, t,
                    )  # fmt: skip
                else:
                    opened = _dx_row_checked(
                        dy_i, x_i, dres_i, dx_i, weight, dweight_block, dbias_block,
                        m1, delta, rstd_i, c2, k, k_t1, k_c, k_0, a_0, a, r_t, t,
                    )  # fmt: skip
            else:
                h = i + 1
                dy_h = dy[h * dy_stride : h * dy_stride + n]
                x_h = x[h * x_stride : h * x_stride + n]
                dres_h = dresidual_out[h * dresidual_out_stride : h * dresidual_out_stride + n]
                dx_h = dx[h * n : (h + 1) * n]
                if plain:
                    opened = _dx_rows_checked(
                        weight, dweight_block, dbias_block,
                        dy_i, x_i, None, dx_i, m1, delta, rstd_i, c2, k, k_t1, k_c, k_0, a_0,
                        a, r_t, t,
                        dy_h, x_h, None, dx_h, scratch[0, j + 1], scratch[6, j + 1],
                        scratch[7, j + 1], scratch[8, j + 1], scratch[9, j + 1],
                        scratch[10, j + 1], scratch[11, j + 1], scratch[12, j + 1],
                        scratch[13, j + 1], scratch[_W_A, j + 1], scratch[_W_R, j + 1],
                        scratch[_W_T, j + 1],
                    )  # fmt: skip
                else:
                    opened = _dx_rows_checked(
                        weight, dweight_block, dbias_block,
                        dy_i, x_i, dres_i, dx_i, m1, delta, rstd_i, c2, k, k_t1, k_c, k_0, a_0,
                        a, r_t, t,
                        dy_h, x_h, dres_h, dx_h, scratch[0, j + 1], scratch[6, j + 1],
                        scratch[7, j + 1], scratch[8, j + 1], scratch[9, j + 1],
                        scratch[10, j + 1], scratch[11, j + 1], scratch[12, j + 1],
                        scratch[13, j + 1], scratch[_W_A, j + 1], scratch[_W_R, j + 1],
                        scratch[_W_T, j + 1],
                    )  # fmt: skip
            for r in range(2 if pair else 1):
                flags[i + r] = np.uint8(0)
                if scratch[14, j + r] != 0.0 or (opened >> r) & 1 != 0:
                    flags[i + r] = _backward_row_again(
                        i + r, dy, dy_stride, x, x_stride, dresidual_out,
                        dresidual_out_stride, weight, dx, scratch[0, j + r], n, eps, rms,
                    )  # fmt: skip
                if scratch[_W_OPEN, j + r] != 0.0 and not _is_float64(dx):  # host: dweight
                    flags[i + r] |= np.uint8(2)


@_jit()
def backward_kernel(
    dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight, mean,
    dx, dweight_partial, dbias_partial, flags, m, n, eps, rms,
):  # fmt: skip
    """:func:`_backward_block` for every block of rows of one span of blocks of a call
    that ``numba_`` spreads over its threads."""
    scratch = np.empty((_SUMS + _CONSTANTS + _SCALARS, _BATCH), np.float64)
    plain = _no_residual(dresidual_out, dresidual_out_stride, n)
    for block in range((m + ROW_BLOCK - 1) // ROW_BLOCK):
        _backward_block(
            block, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight,
            mean, dx, dweight_partial, dbias_partial, flags, m, n, eps, rms, scratch, plain,
        )  # fmt: skip


@_jit()
def backward_kernel_serial(
    dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight, mean,
    dx, dweight_partial, dbias_partial, flags, m, n, eps, rms,
):  # fmt: skip
    """:func:`backward_kernel` in the calling thread."""
    scratch = np.empty((_SUMS + _CONSTANTS + _SCALARS, _BATCH), np.float64)
    plain = _no_residual(dresidual_out, dresidual_out_stride, n)
    for block in range((m + ROW_BLOCK - 1) // ROW_BLOCK):
        _backward_block(
            block, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight,
            mean, dx, dweight_partial, dbias_partial, flags, m, n, eps, rms, scratch, plain,
        )  # fmt: skip


@_jit()
def _add_into(total, part):
    for k in range(total.shape[0]):
        total[k] += part[k]


@_jit()
def column_sum_kernel(partial, blocks, n, out):
    """``out`` = the column sums of the ``blocks`` x N float64 partial sums, in the order
    of :mod:`._weight_terms`: by halving (while ``k > 1`` blocks are left, ``h =
    ceil(k/2)`` and block ``j < k - h`` takes ``block_j + block_{j+h}``), rounded once to
    ``out``'s dtype. Rewrites ``partial``.

    Serial on purpose: the partials are ``M / ROW_BLOCK`` rows of N, a few MB at most, and
    a parallel region costs more to launch than this costs to run.
    """
    if blocks == 0:
        for c in range(n):
            out[c] = 0.0
        return
    k = blocks
    while k > 1:
        h = (k + 1) // 2
        for j in range(k - h):
            _add_into(partial[j * n : (j + 1) * n], partial[(j + h) * n : (j + h + 1) * n])
        k = h
    for c in range(n):
        out[c] = partial[c]


# ---------------------------------------------------------------------------------------
# Entry points. Python hands over tensors as addresses (``Tensor.data_ptr()``) and sizes,
# which numba's dispatcher types far faster than arrays. ``storage_tag`` and ``acc_tag``
# are empty arrays whose dtypes say what the addresses hold: x's storage dtype
# (int16/uint16 for float16/bfloat16 bits) and the accumulation dtype.


def _cast(tag, value):
    """``value`` as a scalar of ``tag``'s dtype."""


@overload(_cast)
def _cast_impl(tag, value):
    if tag.dtype == types.float64:
        return lambda tag, value: np.float64(value)
    return lambda tag, value: np.float32(value)


@_jit()
def _param_row(address, n, storage_tag, acc_tag, params_x_dtype):
    """The (N,) parameter at ``address`` in the accumulation dtype: a view when it holds
    that dtype (or x's dtype is the accumulation dtype), else (``params_x_dtype`` with
    16-bit x) its values widened once into a fresh row, exactly."""
    if params_x_dtype and storage_tag.itemsize < acc_tag.itemsize:
        raw = _view(address, n, storage_tag)
        row = np.empty(n, acc_tag.dtype)
        for k in range(n):
            row[k] = _cast(acc_tag, element_f64(raw, k))
        return row
    return _view(address, n, acc_tag)


@_jit()
def _weight_f64(address, n, storage_tag, acc_tag, params_x_dtype):
    """The (N,) weight at ``address`` (x's dtype when ``params_x_dtype``, else the
    accumulation dtype) widened to float64 once per call, exactly."""
    if params_x_dtype:
        raw = _view(address, n, storage_tag)
        row = np.empty(n, np.float64)
        for k in range(n):
            row[k] = element_f64(raw, k)
        return row
    return _view(address, n, acc_tag).astype(np.float64)


@_jit()
def _forward_views(
    storage_tag, acc_tag, y_tag, x, x_stride, residual, residual_stride, has_residual, residual_out,
    weight, bias, params_x_dtype, y, mean, rstd, m, n, rms, store_stats, flags,
):  # fmt: skip
    return (
        _view(x, (m - 1) * x_stride + n, storage_tag),
        _view(residual, (m - 1) * residual_stride + n if has_residual else 1, storage_tag),
        _view(residual_out, m * n if has_residual else 1, storage_tag),
        _param_row(weight, n, storage_tag, acc_tag, params_x_dtype),
        _param_row(bias, n, storage_tag, acc_tag, params_x_dtype),
        _view(y, m * n, y_tag),
        _view(mean, 0 if rms or not store_stats else m, acc_tag),
        _view(rstd, m if store_stats else 0, acc_tag),
        _view(flags, m + 1, _FLAG_TAG),
    )


@_jit()
def forward_serial(
    storage_tag, acc_tag, y_tag, x, x_stride, residual, residual_stride, has_residual, residual_out,
    weight, bias, params_x_dtype, y, mean, rstd, m, n, eps, rms, stream, store_stats, flags,
):  # fmt: skip
    """The forward on addresses (the arguments of ``_kernel_abi.FORWARD``), in the
    calling thread (for small inputs). Without a residual, ``residual`` and
    ``residual_out`` may be any valid address (``has_residual`` False); ``mean`` and
    ``rstd`` too when not ``store_stats``. ``stream`` as :func:`forward_parallel`'s
    (callers pass False: outputs this small stay in the caches). ``flags``: m + 1
    bytes; ``flags[i]`` is 1 when row ``i`` needs the exact fallback, ``flags[m]`` when
    any row does.
    """
    views = _forward_views(
        storage_tag, acc_tag, y_tag, x, x_stride, residual, residual_stride, has_residual,
        residual_out, weight, bias, params_x_dtype, y, mean, rstd, m, n, rms, store_stats,
        flags,
    )  # fmt: skip
    x_, residual_, residual_out_, weight_, bias_, y_, mean_, rstd_, flags_ = views
    forward_kernel(
        x_, x_stride, residual_, residual_stride, has_residual, residual_out_, weight_,
        bias_, y_, mean_, rstd_, m, n, np.float64(eps), rms, stream, store_stats, flags_,
    )  # fmt: skip
    _any_flag(flags_, m)


@_jit()
def forward_parallel(
    storage_tag, acc_tag, y_tag, x, x_stride, residual, residual_stride, has_residual, residual_out,
    weight, bias, params_x_dtype, y, mean, rstd, m, n, eps, rms, stream, store_stats, flags,
):  # fmt: skip
    """One span of rows of a forward that ``numba_`` spreads over its threads:
    :func:`forward_serial`, with streaming stores for large float32 outputs."""
    views = _forward_views(
        storage_tag, acc_tag, y_tag, x, x_stride, residual, residual_stride, has_residual,
        residual_out, weight, bias, params_x_dtype, y, mean, rstd, m, n, rms, store_stats,
        flags,
    )  # fmt: skip
    x_, residual_, residual_out_, weight_, bias_, y_, mean_, rstd_, flags_ = views
    forward_kernel(
        x_, x_stride, residual_, residual_stride, has_residual, residual_out_, weight_,
        bias_, y_, mean_, rstd_, m, n, np.float64(eps), rms, stream, store_stats, flags_,
    )  # fmt: skip
    _any_flag(flags_, m)


@_jit()
def _backward_arrays(
    storage_tag, acc_tag, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride,
    weight, params_x_dtype, mean, dx, m, n, rms, flags,
):  # fmt: skip
    """The views over the addresses, the weight widened to float64 (exactly; the passes
    over a row then load it without a conversion) and the per-block partial sums (see
    :func:`backward_kernel`)."""
    blocks = (m + ROW_BLOCK - 1) // ROW_BLOCK
    return (
        _view(dy, (m - 1) * dy_stride + n, storage_tag),
        _view(x, (m - 1) * x_stride + n, storage_tag),
        _view(dresidual_out, (m - 1) * dresidual_out_stride + n, storage_tag),
        _weight_f64(weight, n, storage_tag, acc_tag, params_x_dtype),  # once, not per row
        _view(mean, 0 if rms else m, acc_tag),
        _view(dx, m * n, storage_tag),
        np.empty(blocks * n, np.float64),
        np.empty(blocks * n, np.float64),
        _view(flags, m + 1, _FLAG_TAG),
    )


@_jit()
def _column_sums(acc_tag, dweight_partial, dbias_partial, dweight, dbias, n):
    """dweight and dbias (addresses; 0 when not wanted) from the block partial sums."""
    blocks = dweight_partial.shape[0] // n
    if dweight != 0:
        column_sum_kernel(dweight_partial, blocks, n, _view(dweight, n, acc_tag))
    if dbias != 0:
        column_sum_kernel(dbias_partial, blocks, n, _view(dbias, n, acc_tag))


@_jit()
def backward_serial(
    storage_tag, acc_tag, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride,
    weight, params_x_dtype, mean, rstd, dx, dweight, dbias, m, n, rms, stream, eps, flags,
):  # fmt: skip
    """The backward on addresses (the arguments of ``_kernel_abi.BACKWARD``), in the
    calling thread (for small inputs). ``x`` is the normalized input ``z``; the row
    statistics are computed again from it with ``eps`` (``mean`` only shifts the sums;
    ``rstd`` and ``stream`` are not read). ``flags``: m + 1 bytes; ``flags[i]`` is 1 when
    row ``i`` of dx needs the exact fallback, ``flags[m]`` when any row does."""
    arrays = _backward_arrays(
        storage_tag, acc_tag, dy, dy_stride, x, x_stride, dresidual_out,
        dresidual_out_stride, weight, params_x_dtype, mean, dx, m, n, rms, flags,
    )  # fmt: skip
    dy_, x_, dresidual_out_, weight_, mean_, dx_, dw_part, db_part, flags_ = arrays
    backward_kernel_serial(
        dy_, dy_stride, x_, x_stride, dresidual_out_, dresidual_out_stride, weight_, mean_,
        dx_, dw_part, db_part, flags_, m, n, np.float64(eps), rms,
    )  # fmt: skip
    _column_sums(acc_tag, dw_part, db_part, dweight, dbias, n)
    _any_flag(flags_, m)


@_jit()
def backward_parallel(
    storage_tag, acc_tag, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride,
    weight, params_x_dtype, mean, rstd, dx, dweight, dbias, m, n, rms, stream, eps, flags,
):  # fmt: skip
    """One span of rows (a whole number of ``ROW_BLOCK`` blocks, but for the last) of a
    backward that ``numba_`` spreads over its threads: :func:`backward_serial`, except that
    ``dweight`` and ``dbias`` receive the span's per-block partial sums
    (``ceil(m / ROW_BLOCK) * n`` elements each, float64; both required),
    which the caller adds over all spans with :func:`column_sums`: the same additions in
    the same order as :func:`backward_serial`'s, so the same bits. ``flags``:
    the span's m + 1 fallback flags, as :func:`backward_serial` writes them."""
    arrays = _backward_arrays(
        storage_tag, acc_tag, dy, dy_stride, x, x_stride, dresidual_out,
        dresidual_out_stride, weight, params_x_dtype, mean, dx, m, n, rms, flags,
    )  # fmt: skip
    dy_, x_, dresidual_out_, weight_, mean_, dx_, _, _, flags_ = arrays
    blocks = (m + ROW_BLOCK - 1) // ROW_BLOCK
    backward_kernel(
        dy_, dy_stride, x_, x_stride, dresidual_out_, dresidual_out_stride, weight_, mean_,
        dx_, _view(dweight, blocks * n, _F64_TAG), _view(dbias, blocks * n, _F64_TAG), flags_,
        m, n, np.float64(eps), rms,
    )  # fmt: skip
    _any_flag(flags_, m)


@_jit()
def column_sums(acc_tag, partial, blocks, n, out):
    """``out`` (N,) = the column sums of the ``blocks`` x N partial sums at ``partial``
    (addresses; float64 partials, ``out`` in the accumulation dtype), by halving in
    float64 (:func:`column_sum_kernel`): how the spans of :func:`backward_parallel`
    become dweight and dbias."""
    partials = _view(partial, blocks * n, _F64_TAG)
    column_sum_kernel(partials, blocks, n, _view(out, n, acc_tag))


# ---------------------------------------------------------------------------------------
# Entries: the four kernels for one dtype, on C types only (addresses, sizes, flags), as
# _kernel_abi describes them

_NUMBA_TYPES = {"i64": types.int64, "f64": types.float64, "bool": types.boolean}


def entry_type(direction: str):
    """The numba signature of the ``direction`` entries (a key of
    ``_kernel_abi.KERNELS``), from :mod:`layernorm.backends._kernel_abi`."""
    return types.void(*(_NUMBA_TYPES[kind] for _, kind in _kernel_abi.KERNELS[direction]))


def _check_parameters(function, direction: str, tags: int = 0) -> None:
    """Raises unless ``function`` takes the ``direction`` entries' arguments, in order,
    after ``tags`` leading arguments."""
    parameters = tuple(inspect.signature(function).parameters)[tags:]
    if parameters != _kernel_abi.names(direction):
        raise TypeError(
            f"{function.__qualname__} takes {parameters}, the {direction} entry "
            f"{_kernel_abi.names(direction)} (layernorm.backends._kernel_abi)"
        )


#: The compiled function that each entry's compile compiles: the forward entries share
#: :func:`forward_kernel` (a caller serializes their compiles on this name, so that the
#: second loads what the first compiled), each other entry has its own.
COMPILES = {
    "forward_serial": "forward_kernel",
    "forward_parallel": "forward_kernel",
    "backward_serial": "backward_kernel_serial",
    "backward_parallel": "backward_kernel",
    "column_sums": "column_sum_kernel",
}


def entry(name: str, storage_tag: np.ndarray, acc_tag: np.ndarray, y_tag: np.ndarray | None = None):
    """Kernel ``name`` (``forward_serial``, ``forward_parallel``, ``backward_serial`` or
    ``backward_parallel``) for the storage and accumulation dtypes of the tags (and, for
    the forward, ``y_tag``'s storage dtype for ``y``: x's when None; each element of
    ``y`` is rounded once to it, as to x's, by the same row functions), compiled
    now (or loaded from the on-disk cache) for the arguments of that kernel without its
    two tags: all of them C types (:mod:`layernorm.backends._kernel_abi`), so the compiled
    function also has a C address (:func:`address`) that compiled code calls directly. The
    tags become constants of the compiled code (numba keys its cache on them too)."""
    # One function per kernel, each calling its kernel as a global: numba caches a
    # function by its code and the closure's values (the tags).
    if y_tag is None:
        y_tag = storage_tag
    elif not name.startswith("forward"):
        raise ValueError(f"kernel entry {name!r} has no output dtype of its own")
    run: Callable[..., None]
    if name == "forward_serial":

        def forward(x, x_stride, residual, residual_stride, has_residual, residual_out, weight, bias, params_x_dtype, y, mean, rstd, m, n, eps, rms, stream, store_stats, flags):  # fmt: skip
            forward_serial(storage_tag, acc_tag, y_tag, x, x_stride, residual, residual_stride, has_residual, residual_out, weight, bias, params_x_dtype, y, mean, rstd, m, n, eps, rms, stream, store_stats, flags)  # fmt: skip

        run = forward

    elif name == "forward_parallel":

        def forward(x, x_stride, residual, residual_stride, has_residual, residual_out, weight, bias, params_x_dtype, y, mean, rstd, m, n, eps, rms, stream, store_stats, flags):  # fmt: skip
            forward_parallel(storage_tag, acc_tag, y_tag, x, x_stride, residual, residual_stride, has_residual, residual_out, weight, bias, params_x_dtype, y, mean, rstd, m, n, eps, rms, stream, store_stats, flags)  # fmt: skip

        run = forward

    elif name == "backward_serial":

        def backward(dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight, params_x_dtype, mean, rstd, dx, dweight, dbias, m, n, rms, stream, eps, flags):  # fmt: skip
            backward_serial(storage_tag, acc_tag, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight, params_x_dtype, mean, rstd, dx, dweight, dbias, m, n, rms, stream, eps, flags)  # fmt: skip

        run = backward

    elif name == "backward_parallel":

        def backward(dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight, params_x_dtype, mean, rstd, dx, dweight, dbias, m, n, rms, stream, eps, flags):  # fmt: skip
            backward_parallel(storage_tag, acc_tag, dy, dy_stride, x, x_stride, dresidual_out, dresidual_out_stride, weight, params_x_dtype, mean, rstd, dx, dweight, dbias, m, n, rms, stream, eps, flags)  # fmt: skip

        run = backward

    elif name == "column_sums":

        def sums(partial, blocks, n, out):
            column_sums(acc_tag, partial, blocks, n, out)

        run = sums

    else:
        raise ValueError(f"unknown kernel entry {name!r}")
    if name == "column_sums":
        signature = types.void(types.int64, types.int64, types.int64, types.int64)
    else:
        direction = name.split("_")[0]
        _check_parameters(run, direction)
        tags = 3 if direction == "forward" else 2
        _check_parameters(globals()[name].py_func, direction, tags=tags)
        signature = entry_type(direction)
    # One name per entry and dtype: :func:`address` finds the compiled function by its
    # symbol, which numba derives from this name and a per-process counter. Closures of
    # one name loaded from the on-disk cache can share a symbol, and the lookup would then
    # return another dtype's kernel.
    label = f"{name}_{storage_tag.dtype.name}_{acc_tag.dtype.name}"
    if y_tag.dtype != storage_tag.dtype:
        label += f"_to_{y_tag.dtype.name}"
    run.__name__ = run.__qualname__ = label
    # nogil: numba_ runs the spans of one call from several Python threads at once
    return _jit(signature, nogil=True)(run)


def address(compiled) -> int:
    """The C address of an :func:`entry` (a ``void`` function of its C-typed arguments)."""
    (result,) = compiled.overloads.values()
    return result.library.get_pointer_to_function(result.fndesc.llvm_cfunc_wrapper_name)
