"""The fused dropout-add in numba: ``h = RN(k0·s·x0·rs + k1·s·x1 + residual)``, the exact
sum rounded once, and its backward, bit for bit the torch version's (the definition and
the interface, the checks and the definition's special values:
:mod:`layernorm.backends._dropout_add`; the masks: docs/contract.md §7).

For row ``r`` and column ``c`` of ``(M, N)`` rows::

    h[r, c] = RN_rdtype(k0[r,c]·s·x0[r,c]·rs[r] + k1[r,c]·s·x1[r,c] + residual[r,c])

``k0``/``k1``: the keep rule of §7 on mask streams 0 and 1 at offset ``r·N + c`` (one
Philox call per four elements of a stream: ``_numba_philox.keep_span``);
``s = _philox.dropout_scale(p)``.
An absent ``x1`` or ``residual`` is no term, an absent ``rowscale`` is 1.

**Exactness.** Every term is split into float64 pieces whose sum is the term exactly:
``TwoProd(a, b) = (a·b, fma(a, b, -a·b))`` (an explicit ``llvm.fma``) gives
``x0·rs = a0 + b0``, then ``a0·s`` and ``b0·s`` two pieces each, ``x1·s`` two more, and
the residual one: seven floats. Shewchuk's Grow-Expansion (TwoSum only) turns them into a
nonoverlapping expansion with the same exact sum, which is rounded once from the top
(:func:`_scan`): the first inexact TwoSum from the top decides the float64 neighbours the
sum lies between, and the sign of the rest decides a tie. float64 ``h`` is the sum
rounded to nearest-even; a narrower ``h`` is the sum rounded to odd in float64, then to
nearest-even in its dtype (``_numba_vectors.narrow_once``: correct because 53 >= p + 2,
Boldo and Melquiond), so every output element is the exact value rounded once.
The pieces are exact while no product underflows: for float32/16-bit inputs always (their
products stay above 2^-400); float64 inputs whose products fall below about 2^-969 lose
the bits of their error terms below float64's subnormal grid (the result is then the sum
of the rounded pieces, rounded once), and terms near float64's overflow threshold may
overflow in a TwoSum (Inf or NaN where the exact sum is finite). Not compiled with ``fastmath`` (it would reorder
the TwoSums); LLVM on the CPU contracts nothing without it.

**The fast sums.** Where every element is kept, ``s`` is 1 and there is no rowscale
(``dropout_p`` 0 with ``x1``), ``h = RN(x0 + x1 + residual)``: a row is first summed
as ``t = (x0 + x1) + r`` in float64 (float32 where every term is 16-bit), with both
additions' TwoSum errors. TwoSum is error-free (no overflow: an overflow or an Inf or
NaN term makes an error NaN), so both errors are zero iff both additions were exact,
and then ``t`` is the exact sum and ``RN_rdtype(t)`` (one rounding: ``_stored``, or
``narrow`` from float32) is the exact path's ``h``, bits and all: the rounding of an
exact value is unique, and ``t``'s zero sign is IEEE addition's, the rule below (``a +
b`` is ``-0.0`` iff both are). Any nonzero error in a row sends the whole row to the
exact path. For float32 terms (24 bits) the float64 sums are exact unless the terms'
exponents span more than about 27 binades; for bfloat16 (8 bits) the float32 sums
unless they span more than about 14; float16 terms span at most 40 binades, so their
float32 sums may miss more often (a row then pays both). The fast sum is an
optimization: the exact path below is the definition.

**The decided pass.** Without ``x1`` and with ``h`` narrower than float64, a row is
first rounded from ``t + lo`` (``TwoProd(x0·rs, s)``, then ``TwoSum`` with the
residual: ``t`` and a low part within a float64 rounding of the rest) with a midpoint
test per element (:func:`_settled`), in one vectorized loop; a row with an element that
test leaves open runs the exact pass. The same bits, by the test's argument there. A
row's rowscale takes this pass only where ``x0·rs`` is exact in float64
(:func:`_exact_product`: ``x0`` narrower than float64 and ``rs`` a float32 value, as
flash-attn's drop-path scales are); other rows run the exact pass.

**Special values.** A dropped term is +0.0 whatever ``x`` is (NaN, Inf). When a kept
term or the residual is Inf or NaN, ``h`` is the IEEE float64 sum
``(x0·rs·s + x1·s) + residual`` of the rounded terms, then rounded (Inf, -Inf or NaN).
An exact sum of zero is +0.0, unless every present term is a zero and all of them are
-0.0 (IEEE's rule for a sum), then -0.0.

**Backward.** ``dx0 = RN_x0dtype(dh·k0·s·rs)`` (four pieces, the same rounding; two,
``TwoProd(dh·rs, s)``, where ``dh·rs`` is exact as above),
``dx1 = RN_x1dtype(dh·k1·s)``, ``dresidual = RN_residualdtype(dh)`` (``dh``'s copy
when the dtypes agree, as the torch version: NaN payloads kept); rowscale gets no
gradient.

Layout: each ``(M, N)`` tensor reaches the kernels as a flat 1-D array over its storage
plus a row stride (as ``_numba_kernels``): strided rows are read in place; float16 and
bfloat16 as their int16 / uint16 patterns. Rows are split over ``_threads`` spans; a row's
bits depend only on its global index and the seed, not on the split or the batch.

numba caches these kernels keyed on this file alone: :data:`DEPENDS_SHA256` records the
code they inline from ``_numba_philox`` and ``_numba_vectors``
(``tests/test_dropout_kernels.py`` fails until it is updated after a change there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core.typing import signature
from numba.extending import intrinsic, overload

from . import _numba_cache, _numba_philox, _numba_vectors, _philox, _threads
from ._dropout_add import FLOAT_DTYPES, check_args
from ._exact import FORMATS
from ._numba_philox import keep_span
from ._numba_vectors import narrow, narrow_once, two_prod, two_sum, view, widen
from .torch_ import contiguous_rows

__all__ = [
    "DEPENDS_SHA256",
    "depends_digest",
    "dropout_add",
    "dropout_add_backward",
    "entry",
]

#: the digest of the inlined code this file's cached kernels were compiled with
DEPENDS_SHA256 = "feba11b26cf46d25"


def depends_digest() -> str:
    """sha256 (16 hex digits) of the functions of ``_numba_philox`` and
    ``_numba_vectors`` these kernels inline."""
    return _numba_cache.source_digest(
        _numba_philox,
        _numba_vectors.widen,
        _numba_vectors.narrow,
        _numba_vectors.narrow_once,
        _numba_vectors._fabs,
        _numba_vectors._shaped,
        _numba_vectors._constant,
        _numba_vectors._fma,
        _numba_vectors.fma,
        _numba_vectors.two_sum,
        _numba_vectors.two_prod,
        _numba_vectors._pointer,
        _numba_vectors.view.py_func,
    )


def _jit(**options):
    """``numba.njit(nogil=True)`` with the on-disk cache of ``_numba_cache``; IEEE
    division (``error_model="numpy"``), never fastmath."""
    options.setdefault("error_model", "numpy")

    def decorate(func):
        dispatcher = njit(nogil=True, cache=False, **options)(func)
        if not options.get("inline"):
            _numba_cache.enable(dispatcher)
        return dispatcher

    return decorate


# --- scalar intrinsics --------------------------------------------------------------------


@intrinsic
def _bits(typingctx, x):
    """The float64 (float32) ``x``'s bit pattern as an int64 (int32)."""
    width = 32 if x == types.float32 else 64

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(width))

    return signature(types.int32 if width == 32 else types.int64, x), codegen


@intrinsic
def _from_bits(typingctx, b):
    """The float64 of the int64 bit pattern ``b``."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return signature(types.float64, types.int64), codegen


@intrinsic
def _wide(typingctx, raw):
    """A stored element (float16 bits as int16, bfloat16 bits as uint16, float32, float64)
    as a float64, exactly."""

    def codegen(context, builder, sig, args):
        value = widen(builder, args[0], sig.args[0])
        if not isinstance(value.type, ir.DoubleType):
            value = builder.fpext(value, ir.DoubleType())
        return value

    return signature(types.float64, raw), codegen


@intrinsic
def _single(typingctx, raw):
    """A stored 16-bit element (float16 bits as int16, bfloat16 bits as uint16) as a
    float32, exactly; a float32 as it is. (float64: rounded to float32; the kernels
    never ask for it.)"""

    def codegen(context, builder, sig, args):
        value = widen(builder, args[0], sig.args[0])
        if isinstance(value.type, ir.DoubleType):
            value = builder.fptrunc(value, ir.FloatType())
        return value

    return signature(types.float32, raw), codegen


@intrinsic
def _stored_single(typingctx, value, like):
    """The float32 ``value`` (not NaN) rounded once to nearest-even in the dtype of array
    ``like``, as that array stores it: ``_numba_vectors.narrow`` (float16 by
    ``fptrunc``, bfloat16 on the bit pattern), float32 as it is, float64 widened."""
    dtype = like.dtype

    def codegen(context, builder, sig, args):
        if dtype == types.float64:
            return builder.fpext(args[0], ir.DoubleType())
        return narrow(builder, args[0], dtype)

    return signature(dtype, types.float32, like), codegen


@intrinsic
def _stored(typingctx, value, like):
    """The float64 ``value`` rounded once to nearest-even in the dtype of array ``like``,
    as that array stores it (``_numba_vectors.narrow_once``)."""
    dtype = like.dtype

    def codegen(context, builder, sig, args):
        return narrow_once(builder, args[0], dtype)

    return signature(dtype, types.float64, like), codegen


# --- exact arithmetic ---------------------------------------------------------------------


@_jit(inline="always")
def _scan(c0, c1, c2, c3, c4, c5, c6):  # pragma: no cover - compiled
    """The exact sum of seven float64 as ``(t, u, rest)``: ``t`` its float64 value when
    ``u == 0`` (exact); else the sum lies strictly between ``t`` (the nearest float64
    unless a tie) and ``t``'s neighbour on ``u``'s side, ``u`` is ``t``'s distance to the
    exact sum of the two top pieces, and ``rest`` has the sign of what lies below (0:
    nothing).

    Grow-Expansion (Shewchuk, 1997, Theorem 10) makes ``e0 .. e6`` nonoverlapping,
    increasing in magnitude, zeros anywhere, with the inputs' exact sum. From the top,
    ``(t, u) = TwoSum(t, e)``: while ``u == 0`` the sum of the pieces above is ``t``, a
    float64 whose lowest bit lies above everything below; at the first ``u != 0``, ``u``
    is a multiple of the next piece's last bit and the pieces below sum to less than it,
    so ``|u + rest| < 2|u|`` <= the spacing of float64 on ``u``'s side of ``t``."""
    e0 = c0
    q, e0 = two_sum(c1, e0)
    e1 = q
    q, e0 = two_sum(c2, e0)
    q, e1 = two_sum(q, e1)
    e2 = q
    q, e0 = two_sum(c3, e0)
    q, e1 = two_sum(q, e1)
    q, e2 = two_sum(q, e2)
    e3 = q
    q, e0 = two_sum(c4, e0)
    q, e1 = two_sum(q, e1)
    q, e2 = two_sum(q, e2)
    q, e3 = two_sum(q, e3)
    e4 = q
    q, e0 = two_sum(c5, e0)
    q, e1 = two_sum(q, e1)
    q, e2 = two_sum(q, e2)
    q, e3 = two_sum(q, e3)
    q, e4 = two_sum(q, e4)
    e5 = q
    q, e0 = two_sum(c6, e0)
    q, e1 = two_sum(q, e1)
    q, e2 = two_sum(q, e2)
    q, e3 = two_sum(q, e3)
    q, e4 = two_sum(q, e4)
    q, e5 = two_sum(q, e5)
    t = q
    u = 0.0
    rest = 0.0
    for e in (e5, e4, e3, e2, e1, e0):
        t, u, rest = _scan_step(t, u, rest, e)
    return t, u, rest


@_jit(inline="always")
def _scan_step(t, u, rest, e):  # pragma: no cover - compiled
    """One step of :func:`_scan`'s walk down the expansion, without branches (selects,
    so that LLVM vectorizes the element loops): while ``u == 0``, ``(t, u) = TwoSum(t,
    e)``; after, the first nonzero ``e`` becomes ``rest``."""
    t2, u2 = two_sum(t, e)
    still = u == 0.0
    rest = e if (not still and rest == 0.0) else rest
    return (t2 if still else t), (u2 if still else u), rest


@_jit(inline="always")
def _scan3(c0, c1, c2):  # pragma: no cover - compiled
    """:func:`_scan` of three float64 (Grow-Expansion of three, then the same walk): the
    same ``(t, u, rest)`` contract, so the same rounded sum as :func:`_scan` of these
    three and four zeros (the rounding of an exact sum is unique)."""
    q, e0 = two_sum(c1, c0)
    e1 = q
    q, e0 = two_sum(c2, e0)
    q, e1 = two_sum(q, e1)
    t, u, rest = _scan_step(q, 0.0, 0.0, e1)
    return _scan_step(t, u, rest, e0)


@_jit(inline="always")
def _neighbour(t, u):  # pragma: no cover - compiled
    """The float64 next to ``t`` (nonzero) on ``u``'s side."""
    b = _bits(t)
    return _from_bits(b + (1 if (u > 0.0) == (t > 0.0) else -1))


@_jit(inline="always")
def _rounded(t, u, rest, nearest):  # pragma: no cover - compiled
    """:func:`_scan`'s sum rounded once in float64: to nearest-even (``nearest``) or to
    odd (for a second rounding to a narrower dtype)."""
    n = _neighbour(t, u)
    if nearest:  # t is RN of the top; past a tie when the rest leans towards n
        tie = (n - t == 2.0 * u) & (rest != 0.0) & ((rest > 0.0) == (u > 0.0))
        v = n if tie else t
    else:
        v = t if _bits(t) & 1 else n
    return t if u == 0.0 else v


@_jit(inline="always")
def _finish(t, u, rest, naive, all_zero, nearest):  # pragma: no cover - compiled
    """The rounded sum, with the special values of the module's rules: ``naive`` (the IEEE
    sum of the rounded terms) when it is not finite, or when the exact sum is 0 and every
    term is a zero (its signed zero); +0.0 for any other exact zero."""
    v = _rounded(t, u, rest, nearest)
    v = (naive if all_zero else 0.0) if ((t == 0.0) & (u == 0.0)) else v
    return v if np.isfinite(naive) else naive


# --- the row kernels -----------------------------------------------------------------------


@_jit(inline="always")
def _exact_h(x0v, keep0, scale, x1v, keep1, has_x1, r, s, nearest):  # pragma: no cover
    """One element of ``h`` (float64: rounded to nearest when ``nearest``, else to odd),
    exactly as the module's docstring says. ``r``: the residual, -0.0 when absent."""
    a, b = two_prod(x0v, scale)
    c0, c1 = two_prod(a, s)
    c2, c3 = two_prod(b, s)
    n0 = a * s
    if not keep0:
        c0 = c1 = c2 = c3 = n0 = 0.0
    c4 = c5 = 0.0
    n1 = -0.0  # no term: IEEE's neutral zero
    if has_x1:
        c4, c5 = two_prod(x1v, s)
        n1 = c4
        if not keep1:
            c4 = c5 = n1 = 0.0
    t, u, rest = _scan(c0, c1, c2, c3, c4, c5, r)
    naive = (n0 + n1) + r
    all_zero = (n0 == 0.0) & (n1 == 0.0) & (r == 0.0)
    return _finish(t, u, rest, naive, all_zero, nearest)


@_jit(inline="always")
def _sum3_double_row(h_i, x0_i, x1_i, r_i, n_cols):  # pragma: no cover - compiled
    """:func:`_exact_sum3`'s row when the float64 sums are exact: ``h_i[c] =
    RN((x0 + x1) + r)`` from the float64 sum, and whether every element's was exact
    (else the caller redoes the row: then ``h_i`` holds nothing to keep). Terms read
    in place (float32 and float64 rows: 16-bit loads here make LLVM pick vectors too
    wide for float64, see :func:`_forward_rows`).

    The same bits where exact (module docstring, "The fast sums"). The TwoSum errors'
    bits (sign shifted out) are OR-ed over the row: an integer reduction, which LLVM
    vectorizes (a float one it may not reorder)."""
    open_ = 0
    for c in range(n_cols):
        a, e1 = two_sum(_wide(x0_i[c]), _wide(x1_i[c]))
        t, e2 = two_sum(a, _wide(r_i[c]))
        open_ |= (_bits(e1) | _bits(e2)) << 1
        h_i[c] = _stored(t, h_i)
    return open_ == 0


@_jit(inline="always")
def _sum3_single_row(h_i, w0, w1, wr, sums, n_cols):  # pragma: no cover - compiled
    """:func:`_sum3_double_row` in float32, for 16-bit terms already widened to the
    float32 rows ``w0``, ``w1``, ``wr``: the sums in ``sums``, then rounded to ``h_i``'s
    dtype in a loop of their own (the 16-bit stores in the sum loop make LLVM pick
    4-lane vectors: 1.2x slower). Whether every element's float32 sum was exact."""
    open_ = np.int32(0)
    for c in range(n_cols):
        a, e1 = two_sum(w0[c], w1[c])
        t, e2 = two_sum(a, wr[c])
        open_ |= (_bits(e1) | _bits(e2)) << np.int32(1)
        sums[c] = t
    if open_ != 0:
        return False
    for c in range(n_cols):
        h_i[c] = _stored_single(sums[c], h_i)
    return True


@_jit(inline="always")
def _exact_h1(x0v, keep0, r, s, nearest):  # pragma: no cover - compiled
    """:func:`_exact_h` without ``x1`` and with ``scale`` 1 (no rowscale): the pieces
    ``TwoProd(x0, s)`` and ``r`` summed by :func:`_scan3`, the same bits (the other four
    pieces are zeros there, and the rounding of an exact sum is unique; the special
    values use the same ``naive`` and ``all_zero``)."""
    c0, c1 = two_prod(x0v, s)
    n0 = c0
    if not keep0:
        c0 = c1 = n0 = 0.0
    t, u, rest = _scan3(c0, c1, r)
    naive = (n0 + -0.0) + r
    all_zero = (n0 == 0.0) & (r == 0.0)
    return _finish(t, u, rest, naive, all_zero, nearest)


@_jit(inline="always")
def _exact_sum3(x0v, x1v, r, nearest):  # pragma: no cover - compiled
    """:func:`_exact_h` when every element is kept, ``s`` is 1 and there is no rowscale
    (``dropout_p`` 0 with ``x1``): the pieces ``x0``, ``x1`` and ``r`` summed by
    :func:`_scan3`, the same bits (there ``TwoProd(v, 1) = (v, 0)``, so the other pieces
    are zeros, ``n0 = x0`` and ``n1 = x1``; the rounding of an exact sum is unique)."""
    t, u, rest = _scan3(x0v, x1v, r)
    naive = (x0v + x1v) + r
    all_zero = (x0v == 0.0) & (x1v == 0.0) & (r == 0.0)
    return _finish(t, u, rest, naive, all_zero, nearest)


@_jit(inline="always")
def _exact_prod(xv, keep, s, nearest):  # pragma: no cover - compiled
    """:func:`_exact_h1` with no residual (``r = -0.0``): ``k·s·x`` rounded once. The
    exact sum is ``c0 + c1`` of ``TwoProd(x, s)``, already the top two of the scan
    (``c0 = RN(c0 + c1)``: ``TwoSum`` gives them back), nothing below: the same
    ``(t, u, rest) = (c0, c1, 0)``, ``naive = c0`` and ``all_zero = c0 == 0``."""
    c0, c1 = two_prod(xv, s)
    if not keep:
        c0 = c1 = 0.0
    return _finish(c0, c1, 0.0, c0, c0 == 0.0, nearest)


# --- the decided-rounding passes -------------------------------------------------------------


#: the dtype each storage type of :func:`_flat` holds, narrower than float64
_STORED = {types.float32: torch.float32, types.uint16: torch.bfloat16, types.int16: torch.float16}


def _format(like):
    """``(high, half, smallest)`` of the dtype that array ``like`` stores (constants of
    the compiled code, from ``_exact.FORMATS``, IEEE's fixed formats): the float64 bits
    above that dtype's precision, the bit pattern of half its unit in the last place (in
    float64's low bits) and its smallest normal; float64: nothing is ever decided."""


@overload(_format, inline="always")
def _format_impl(like):
    if like.dtype not in _STORED:  # float64 (the callers never ask)
        return lambda like: (np.int64(0), np.int64(0), np.inf)
    fmt = FORMATS[_STORED[like.dtype]]
    low = 53 - fmt.precision
    constants = (np.int64(-(1 << low)), np.int64(1 << (low - 1)), 2.0**fmt.emin)
    return lambda like: constants


@_jit(inline="always")
def _settled(t, lo, like):  # pragma: no cover - compiled
    """``(v, decided)`` for a value ``t + lo + δ`` (``t``, ``lo`` float64, ``|δ| <=
    2^-53·|lo|``): where ``decided``, ``RN(v)`` in the dtype of array ``like`` is that
    value's rounding. ``M``, ``t``'s bits with those below the dtype's precision set to
    half a unit, is the midpoint between ``t``'s two neighbours in the dtype, and ``d = t -
    M`` is exact (same sign and binade). Decided: ``|t|`` at least the dtype's smallest
    normal (below, its boundaries are not at those bits), ``|lo| <= 2^-30·|t|`` (the
    next boundaries lie half a unit, ``2^-25·|t|`` or more, away), and either ``|d| >
    |lo + δ|`` (the value lies on ``t``'s side of ``M``: ``v = t``), or ``t = M``: a tie
    when ``lo = 0`` (``v = t``, whose rounding breaks it to even), else the value lies on
    ``lo``'s side (``v`` is ``t``'s float64 neighbour there, which rounds to the dtype's
    neighbour on that side). Past the dtype's largest finite value the same holds
    (``M`` the overflow threshold, or nothing rounds but to infinity). A NaN or an
    infinite ``t`` makes ``d`` a NaN: not decided."""
    high, half, smallest = _format(like)
    a = abs(t)
    d = t - _from_bits((_bits(t) & high) | half)
    on_midpoint = d == 0.0
    v = _neighbour(t, lo) if (on_midpoint & (lo != 0.0)) else t
    decided = (
        ((abs(d) > abs(lo) * (1.0 + 2.0**-51)) | on_midpoint)
        & (abs(lo) <= a * 2.0**-30)
        & (a >= smallest)
    )
    return v, decided


def _exact_product(x, scale):
    """Whether ``v·scale`` is exact in float64 for every value ``v`` that array ``x``
    stores: ``x`` of a dtype narrower than float64 (24 significant bits or fewer) and
    ``scale`` a float32 value (as many), so the product has at most 48 bits, and its
    magnitude lies within [2^-298, 2^256] or is zero: no underflow or overflow. Not for
    NaN (never equal to itself) nor a scale outside float32's range."""


@overload(_exact_product, inline="always")
def _exact_product_impl(x, scale):
    if x.dtype not in _STORED:  # float64 values: 53 bits
        return lambda x, scale: False
    return lambda x, scale: np.float64(np.float32(scale)) == scale


@_jit(inline="always")
def _h1_row_decided(h_i, wide0, keep0, wide_r, scale, s, n_cols):  # pragma: no cover
    """:func:`_exact_h1`'s row for a ``h`` narrower than float64 where the rounding is
    decided without the exact sum, in one vectorized loop: returns whether every element
    was (else the caller redoes the row: ``h_i`` then holds nothing to keep). ``scale``:
    the row's rowscale (1.0 without one), which the caller has checked makes
    ``x0·scale`` exact (:func:`_exact_product`).

    ``(c0, c1) = TwoProd(x0·scale, s)`` (zeros where dropped) and ``(t, e) = TwoSum(c0,
    r)`` are exact, so the sum is ``t + e + c1 = t + lo + δ`` with ``lo = RN(e + c1)``,
    ``|δ| <= 2^-53·|lo|``: :func:`_settled`, stored rounded once (``_stored``), the exact
    path's bits. What this does not decide (a zero or tiny sum, its signed zeros,
    specials, cancellation, near-midpoints) the exact path settles. (For float64 ``x0``
    whose ``c1`` underflows, both paths take the same rounded ``c1``, as the module's
    docstring says.)"""
    open_ = np.int64(0)
    for c in range(n_cols):
        c0, c1 = two_prod(wide0[c] * scale, s)
        kept = keep0[c]
        t, e = two_sum(c0 if kept else 0.0, wide_r[c])
        v, decided = _settled(t, e + (c1 if kept else 0.0), h_i)
        open_ |= np.int64(not decided)
        h_i[c] = _stored(v, h_i)
    return open_ == 0


@_jit(inline="always")
def _keep_masks(keep0, keep1, both, k0, k1, p32, base, n_cols):  # pragma: no cover
    """The keep masks of mask streams 0 (``keep0``) and 1 (``keep1``, only when
    ``both``) of the row at offset ``base``. With ``p32 == 0`` the keep rule keeps every
    element: no draw."""
    if p32 == 0.0:
        keep0[:] = True
        keep1[:] = True
    else:
        keep_span(k0, k1, 0, base, p32, keep0[:n_cols])
        if both:
            keep_span(k0, k1, 1, base, p32, keep1[:n_cols])


@_jit()
def _forward_rows(
    x0, sx0, x1, sx1, res, sres, rs, h, m0, m1,
    n_cols, k0, k1, p32, s, has_x1, has_res, has_rs, want_masks, nearest, row_lo, row_hi,
):  # fmt: skip  # pragma: no cover - compiled
    """Rows ``row_lo .. row_hi - 1`` of ``h`` (and the masks, ``want_masks``); see the
    module's docstring. Arrays are flat (row ``i`` at ``i * stride``); ``h`` and the
    masks are contiguous. Per row, three loops: the masks (LLVM vectorizes the Philox
    rounds there: 7x faster than inside the element loop), the operands widened to
    float64 rows (16-bit loads in the element loop make LLVM pick 32-lane vectors, whose
    float64 arithmetic spills: 7-10x slower), then :func:`_exact_h` per element.
    (``x0 + x1 + residual`` with every element kept and no scale: :func:`_sum3_rows`.)"""
    keep0 = np.empty(n_cols, np.bool_)
    keep1 = np.empty(n_cols, np.bool_)
    wide0 = np.empty(n_cols, np.float64)
    wide1 = np.zeros(n_cols, np.float64)
    wide_r = np.full(n_cols, -0.0)  # no residual: IEEE's neutral zero
    for i in range(row_lo, row_hi):
        scale = rs[i] if has_rs else 1.0
        base = np.int64(i) * np.int64(n_cols)
        _keep_masks(keep0, keep1, has_x1, k0, k1, p32, base, n_cols)
        # row slices: an index computed per element (i * stride + c) does not vectorize
        h_i = h[base : base + n_cols]
        x0_i = x0[i * sx0 : i * sx0 + n_cols]
        for c in range(n_cols):
            wide0[c] = _wide(x0_i[c])
        if has_x1:
            x1_i = x1[i * sx1 : i * sx1 + n_cols]
            for c in range(n_cols):
                wide1[c] = _wide(x1_i[c])
        if has_res:
            res_i = res[i * sres : i * sres + n_cols]
            for c in range(n_cols):
                wide_r[c] = _wide(res_i[c])
        decided = (
            not (has_x1 or nearest)
            and (not has_rs or _exact_product(x0, scale))
            and _h1_row_decided(h_i, wide0, keep0, wide_r, scale, s, n_cols)
        )
        if decided:
            pass
        elif has_x1 or has_rs:
            for c in range(n_cols):
                v = _exact_h(
                    wide0[c], keep0[c], scale, wide1[c], keep1[c], has_x1, wide_r[c], s, nearest
                )
                h_i[c] = _stored(v, h)
        else:
            for c in range(n_cols):
                h_i[c] = _stored(_exact_h1(wide0[c], keep0[c], wide_r[c], s, nearest), h)
        if want_masks:
            m0_i = m0[base : base + n_cols]
            for c in range(n_cols):
                m0_i[c] = keep0[c]
            if has_x1:
                m1_i = m1[base : base + n_cols]
                for c in range(n_cols):
                    m1_i[c] = keep1[c]


@_jit(inline="always")
def _exact_sum3_row(
    h_i, x0_i, x1_i, r_i, wide0, wide1, wide_r, nearest, n_cols
):  # pragma: no cover
    """The row ``h_i`` by :func:`_exact_sum3`, the operands widened to the float64 rows
    ``wide0``, ``wide1``, ``wide_r`` first (as :func:`_forward_rows`)."""
    for c in range(n_cols):
        wide0[c] = _wide(x0_i[c])
    for c in range(n_cols):
        wide1[c] = _wide(x1_i[c])
    for c in range(n_cols):
        wide_r[c] = _wide(r_i[c])
    for c in range(n_cols):
        h_i[c] = _stored(_exact_sum3(wide0[c], wide1[c], wide_r[c], nearest), h_i)


@_jit()
def _sum3_rows(
    x0, sx0, x1, sx1, res, sres, h, n_cols, nearest, row_lo, row_hi,
):  # fmt: skip  # pragma: no cover - compiled
    """Rows ``row_lo .. row_hi - 1`` of ``h = RN(x0 + x1 + residual)``: :func:`_forward_rows`
    when every element is kept (``p32`` 0), ``s`` is 1 and there is no rowscale, with
    its arrays and strides (no residual: a row of ``-0.0``, stride 0). Each row by
    :func:`_sum3_double_row` (module docstring, "The fast sums"), or where that was not
    exact by :func:`_exact_sum3_row`."""
    wide0 = np.empty(n_cols, np.float64)
    wide1 = np.empty(n_cols, np.float64)
    wide_r = np.empty(n_cols, np.float64)
    for i in range(row_lo, row_hi):
        base = np.int64(i) * np.int64(n_cols)
        # row slices, as in _forward_rows
        h_i = h[base : base + n_cols]
        x0_i = x0[i * sx0 : i * sx0 + n_cols]
        x1_i = x1[i * sx1 : i * sx1 + n_cols]
        res_i = res[i * sres : i * sres + n_cols]
        if not _sum3_double_row(h_i, x0_i, x1_i, res_i, n_cols):
            _exact_sum3_row(h_i, x0_i, x1_i, res_i, wide0, wide1, wide_r, nearest, n_cols)


@_jit()
def _sum3_rows_single(
    x0, sx0, x1, sx1, res, sres, h, n_cols, nearest, row_lo, row_hi,
):  # fmt: skip  # pragma: no cover - compiled
    """:func:`_sum3_rows` for 16-bit terms: each row by :func:`_sum3_single_row` on the
    terms widened to float32 rows, or where that was not exact by
    :func:`_exact_sum3_row`."""
    wide0 = np.empty(n_cols, np.float64)
    wide1 = np.empty(n_cols, np.float64)
    wide_r = np.empty(n_cols, np.float64)
    single0 = np.empty(n_cols, np.float32)
    single1 = np.empty(n_cols, np.float32)
    single_r = np.empty(n_cols, np.float32)
    sums = np.empty(n_cols, np.float32)
    for i in range(row_lo, row_hi):
        base = np.int64(i) * np.int64(n_cols)
        h_i = h[base : base + n_cols]
        x0_i = x0[i * sx0 : i * sx0 + n_cols]
        x1_i = x1[i * sx1 : i * sx1 + n_cols]
        res_i = res[i * sres : i * sres + n_cols]
        for c in range(n_cols):
            single0[c] = _single(x0_i[c])
        for c in range(n_cols):
            single1[c] = _single(x1_i[c])
        for c in range(n_cols):
            single_r[c] = _single(res_i[c])
        if not _sum3_single_row(h_i, single0, single1, single_r, sums, n_cols):
            _exact_sum3_row(h_i, x0_i, x1_i, res_i, wide0, wide1, wide_r, nearest, n_cols)


@_jit()
def _backward_rows(
    dh, sdh, rs, dx0, dx1, dres, n_cols, k0, k1, p32, s,
    has_rs, has_x1, has_res, nearest0, nearest1, row_lo, row_hi,
):  # fmt: skip  # pragma: no cover - compiled
    """Rows ``row_lo .. row_hi - 1`` of ``dx0``, ``dx1`` (``has_x1``) and ``dresidual``
    (``has_res``); outputs contiguous. The masks and ``dh`` widened first, in loops of
    their own, as :func:`_forward_rows`; each gradient is :func:`_exact_h` of one term
    (no ``x1``, no residual: the product rounded once), in a loop of its own."""
    keep0 = np.empty(n_cols, np.bool_)
    keep1 = np.empty(n_cols, np.bool_)
    wide = np.empty(n_cols, np.float64)
    for i in range(row_lo, row_hi):
        scale = rs[i] if has_rs else 1.0
        base = np.int64(i) * np.int64(n_cols)
        _keep_masks(keep0, keep1, has_x1, k0, k1, p32, base, n_cols)
        # row slices, as in _forward_rows
        dh_i = dh[i * sdh : i * sdh + n_cols]
        for c in range(n_cols):
            wide[c] = _wide(dh_i[c])
        dx0_i = dx0[base : base + n_cols]
        if has_rs and not _exact_product(dh, scale):
            for c in range(n_cols):
                v = _exact_h(wide[c], keep0[c], scale, 0.0, False, False, -0.0, s, nearest0)
                dx0_i[c] = _stored(v, dx0)
        else:  # dh·scale exact: the same pieces, hence the same bits, as _exact_h's
            for c in range(n_cols):
                dx0_i[c] = _stored(_exact_prod(wide[c] * scale, keep0[c], s, nearest0), dx0)
        if has_x1:
            dx1_i = dx1[base : base + n_cols]
            for c in range(n_cols):
                dx1_i[c] = _stored(_exact_prod(wide[c], keep1[c], s, nearest1), dx1)
        if has_res:
            dres_i = dres[base : base + n_cols]
            for c in range(n_cols):
                dres_i[c] = _stored(wide[c], dres)


# --- C entries --------------------------------------------------------------------------------

_F64_TAG = np.empty(0, np.float64)  # rowscale's dtype
_BOOL_TAG = np.empty(0, np.bool_)  # the masks'


@_jit(inline="always")
def _rows_size(m, stride, n):  # pragma: no cover - compiled
    """Elements from the first row's start to the last row's end (0 for no rows)."""
    return (m - 1) * stride + n if m > 0 else 0


def entry(name: str, storage_tag: np.ndarray, stream_tag: np.ndarray | None = None):
    """The C entry ``name`` of this module's kernels for compiled callers: "dropout_add"
    (:func:`_forward_rows`), "sum3" (:func:`_sum3_rows`, :func:`_sum3_rows_single` for
    16-bit terms, as :func:`_sum3` picks) or "dropout_add_backward"
    (:func:`_backward_rows`), on the arguments of ``_kernel_abi.DROPOUT_ADD`` / ``SUM3`` /
    ``DROPOUT_ADD_BACKWARD`` (addresses, sizes, flags; one span of rows), every tensor but
    the rowscale and the masks of ``storage_tag``'s dtype; with ``stream_tag`` (another
    dtype), the stream's tensors of that one: the residual and ``h`` (``dh`` and
    ``dresidual`` in the backward), the terms ``x0`` and ``x1`` (``dx0``, ``dx1``) of
    ``storage_tag``'s, as :func:`dropout_add` takes a float32 stream of 16-bit terms; compiled
    now (or loaded from the on-disk cache). It calls the kernel :func:`dropout_add` (or
    :func:`dropout_add_backward`) calls, with arrays of the types that one passes, so the
    bits are the same; the address: ``_numba_kernels.address``."""
    from ._numba_kernels import _check_parameters, entry_type

    tag = storage_tag
    stream = tag if stream_tag is None else stream_tag  # (the residual's, h's)
    nearest = stream.dtype == np.float64  # h rounded to nearest-even in float64 itself
    nearest_x = tag.dtype == np.float64  # dx0, dx1 likewise
    run: Callable[..., None]
    if name == "dropout_add":

        def dropout_add(x0, x0_stride, x1, x1_stride, residual, residual_stride, rowscale, h, mask0, mask1, m, n, k0, k1, p32, s, has_x1, has_residual, has_rowscale, want_masks, row_lo, row_hi):  # fmt: skip  # pragma: no cover - compiled
            _forward_rows(
                view(x0, _rows_size(m, x0_stride, n), tag), x0_stride,
                view(x1, _rows_size(m, x1_stride, n) if has_x1 else 0, tag), x1_stride,
                view(residual, _rows_size(m, residual_stride, n) if has_residual else 0, stream),
                residual_stride,
                view(rowscale, m if has_rowscale else 0, _F64_TAG),
                view(h, m * n, stream),
                view(mask0, m * n if want_masks else 0, _BOOL_TAG),
                view(mask1, m * n if want_masks and has_x1 else 0, _BOOL_TAG),
                n, k0, k1, np.float32(p32), s, has_x1, has_residual, has_rowscale, want_masks,
                nearest, row_lo, row_hi,
            )  # fmt: skip

        run = dropout_add
    elif name == "dropout_add_backward":

        def dropout_add_backward(dh, dh_stride, rowscale, dx0, dx1, dresidual, m, n, k0, k1, p32, s, has_rowscale, has_x1, has_residual, row_lo, row_hi):  # fmt: skip  # pragma: no cover - compiled
            _backward_rows(
                view(dh, _rows_size(m, dh_stride, n), stream), dh_stride,
                view(rowscale, m if has_rowscale else 0, _F64_TAG),
                view(dx0, m * n, tag),
                view(dx1, m * n if has_x1 else 0, tag),
                view(dresidual, m * n if has_residual else 0, stream),
                n, k0, k1, np.float32(p32), s, has_rowscale, has_x1, has_residual,
                nearest_x, nearest_x, row_lo, row_hi,
            )  # fmt: skip

        run = dropout_add_backward
    elif name == "sum3":
        # every term 16-bit: _sum3's choice (a stream of another dtype holds the residual)
        single = tag.dtype in (np.int16, np.uint16) and stream_tag is None

        def sum3(x0, x0_stride, x1, x1_stride, residual, residual_stride, h, m, n, row_lo, row_hi):  # fmt: skip  # pragma: no cover - compiled
            args = (
                view(x0, _rows_size(m, x0_stride, n), tag), x0_stride,
                view(x1, _rows_size(m, x1_stride, n), tag), x1_stride,
                view(residual, _rows_size(m, residual_stride, n), stream), residual_stride,
                view(h, m * n, stream), n, nearest, row_lo, row_hi,
            )  # fmt: skip
            if single:
                _sum3_rows_single(*args)
            else:
                _sum3_rows(*args)

        run = sum3
    else:
        raise ValueError(f"unknown dropout-add entry {name!r}")
    _check_parameters(run, name)
    # one name per entry and dtype (numba_kernels.entry says why)
    to = "" if stream_tag is None else f"_to_{stream_tag.dtype.name}"
    run.__name__ = run.__qualname__ = f"{name}_{tag.dtype.name}{to}"
    dispatcher = _jit()(run)
    dispatcher.compile(entry_type(name))
    dispatcher.disable_compile()
    return dispatcher


# --- torch front ----------------------------------------------------------------------------


def _flat(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """A (M, N) tensor with unit column stride as (flat storage array, row stride); 16-bit
    floats as their int16 (float16) / uint16 (bfloat16) patterns."""
    m, n = t.shape
    stride = t.stride(0) if m > 1 else n
    span = torch.as_strided(t, ((m - 1) * stride + n,), (1,))
    if t.dtype == torch.float16:
        return span.view(torch.int16).numpy(), stride
    if t.dtype == torch.bfloat16:
        return span.view(torch.int16).numpy().view(np.uint16), stride
    return span.numpy(), stride


def _on_cpu(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_cpu:
            raise ValueError(
                f"dropout_add: the numba kernels take CPU tensors, {name} is on {t.device}"
            )


def _rowscale(rowscale: torch.Tensor | None) -> np.ndarray:
    """``rowscale`` as float64 (exact), a one-element placeholder when absent."""
    if rowscale is None:
        return np.ones(1, np.float64)
    return rowscale.detach().to(torch.float64).contiguous().numpy()


@functools.lru_cache(maxsize=256)
def _constants(p: float) -> tuple[float, np.float32]:
    """``(s, p32)`` of a checked ``p`` by ``_philox``'s rules, cached (``threshold``
    rounds through a torch tensor: microseconds a call)."""
    return _philox.dropout_scale(p), np.float32(_philox.threshold(p))


def _all_16_bit(*tensors: torch.Tensor | None) -> bool:
    """Whether every present tensor is float16 or bfloat16 (the float32 fast sum's
    terms)."""
    return all(t is None or t.dtype in (torch.float16, torch.bfloat16) for t in tensors)


def _run(kernel, args: tuple, m: int, n: int) -> None:
    """``kernel(*args, row_lo, row_hi)`` over all rows, in spans over ``_threads``."""
    _threads.run(lambda lo, hi: kernel(*args, lo, hi), m, max(n, 1))


def _sum3(
    x0: torch.Tensor, x1: torch.Tensor, residual: torch.Tensor | None, h: torch.Tensor
) -> None:
    """``h = RN(x0 + x1 + residual)`` of nonempty checked rows, by :func:`_sum3_rows`
    (:func:`_sum3_rows_single` when every term is 16-bit)."""
    n = x0.shape[1]
    a0, s0 = _flat(contiguous_rows(x0))
    a1, s1 = _flat(contiguous_rows(x1))
    if residual is None:  # IEEE's neutral zero, one row read for every row
        ar, sr = _flat(torch.full((1, n), -0.0, dtype=x0.dtype))[0], 0
    else:
        ar, sr = _flat(contiguous_rows(residual))
    args = (a0, s0, a1, s1, ar, sr, _flat(h)[0], n, h.dtype == torch.float64)
    kernel = _sum3_rows_single if _all_16_bit(x0, x1, residual) else _sum3_rows
    _run(kernel, args, x0.shape[0], n)


def dropout_add(
    x0: torch.Tensor,
    x1: torch.Tensor | None,
    residual: torch.Tensor | None,
    rowscale: torch.Tensor | None,
    seed: int,
    p: float,
    rdtype: torch.dtype,
    want_masks: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``h = RN_rdtype(k0·s·x0·rs + k1·s·x1 + residual)`` of ``(M, N)`` rows (see the
    module), with ``x0``'s and ``x1``'s keep-masks when ``want_masks`` (``mask1`` None
    without ``x1``).

    Raises:
        TypeError, ValueError: as ``_dropout_add.check_args`` (the same checks and
            messages as the torch version), and ValueError for tensors not on the CPU.
    """
    check_args(x0, x1, residual, rowscale, seed, p, rdtype)
    _on_cpu(x0=x0)
    m, n = x0.shape
    k0, k1 = _philox.seed_key(seed)
    s, p32 = _constants(p)
    h = torch.empty((m, n), dtype=rdtype)
    if x1 is not None and rowscale is None and p32 == 0.0 and s == 1.0:  # all kept, s = 1
        if m * n:
            _sum3(x0, x1, residual, h)
        if not want_masks:
            return h, None, None
        return h, torch.ones((m, n), dtype=torch.bool), torch.ones((m, n), dtype=torch.bool)
    scale = _rowscale(rowscale)
    mask0 = torch.empty((m, n), dtype=torch.bool) if want_masks else None
    mask1 = torch.empty((m, n), dtype=torch.bool) if want_masks and x1 is not None else None
    if m * n == 0:
        return h, mask0, mask1
    a0, s0 = _flat(contiguous_rows(x0))
    a1, s1 = _flat(contiguous_rows(x1)) if x1 is not None else (a0, s0)
    ar, sr = _flat(contiguous_rows(residual)) if residual is not None else _flat(h)
    dummy = np.zeros(1, np.bool_)
    args = (
        a0, s0, a1, s1, ar, sr, scale, _flat(h)[0],
        mask0.view(-1).numpy() if mask0 is not None else dummy,
        mask1.view(-1).numpy() if mask1 is not None else dummy,
        n, k0, k1, p32, s, x1 is not None, residual is not None, rowscale is not None,
        want_masks, rdtype == torch.float64,
    )  # fmt: skip
    _run(_forward_rows, args, m, n)
    return h, mask0, mask1


def dropout_add_backward(
    dh: torch.Tensor,
    rowscale: torch.Tensor | None,
    seed: int,
    p: float,
    x0_dtype: torch.dtype,
    x1_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``dx0 = RN(dh·k0·s·rs)``, ``dx1 = RN(dh·k1·s)`` (None without ``x1_dtype``),
    ``dresidual = RN(dh)`` (None without ``residual_dtype``), each rounded once to its
    dtype, from the forward's ``(seed, p)`` and ``rowscale``.

    Raises:
        TypeError, ValueError: as :func:`dropout_add`.
    """
    check_args(dh, None, None, rowscale, seed, p, x0_dtype)
    for dtype in (x1_dtype, residual_dtype):
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dropout_add: gradient dtypes must be float dtypes, got {dtype}")
    _on_cpu(dh=dh)
    m, n = dh.shape
    k0, k1 = _philox.seed_key(seed)
    s, p32 = _constants(p)
    scale = _rowscale(rowscale)
    dx0 = torch.empty((m, n), dtype=x0_dtype)
    dx1 = torch.empty((m, n), dtype=x1_dtype) if x1_dtype is not None else None
    dres = None
    if residual_dtype == dh.dtype:  # RN is the identity: the torch version's copy
        dres = dh.clone(memory_format=torch.contiguous_format)
    elif residual_dtype is not None:
        dres = torch.empty((m, n), dtype=residual_dtype)
    if m * n == 0:
        return dx0, dx1, dres
    g, sg = _flat(contiguous_rows(dh))
    o0 = _flat(dx0)[0]
    args = (
        g, sg, scale, o0,
        _flat(dx1)[0] if dx1 is not None else o0,
        _flat(dres)[0] if dres is not None else o0,
        n, k0, k1, p32, s, rowscale is not None, dx1 is not None,
        dres is not None and residual_dtype != dh.dtype,
        x0_dtype == torch.float64, x1_dtype == torch.float64,
    )  # fmt: skip
    _run(_backward_rows, args, m, n)
    return dx0, dx1, dres
