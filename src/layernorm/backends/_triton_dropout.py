"""The fused dropout-add in Triton: ``h = RN(k0·s·x0·rs + k1·s·x1 + residual)`` rounded
once, and its backward, bit for bit the torch and numba versions
(:mod:`layernorm.backends._dropout_add` has the definition and the interface,
:mod:`layernorm.backends._numba_dropout` the exactness argument, which this module
follows operation for operation).

One program per row and block of ``BLOCK`` columns: both masks from one Philox call
(``_triton_philox.keep_pair``: mask streams 0 and 1), each term split into
float64 pieces by TwoProd (``p = a·b``, ``e = tl.fma(a, b, -p)``: an explicit fma where
one is meant), Grow-Expansion and the scan from the top by TwoSum, then the rounding
(to nearest in float64, or to odd then to nearest in a narrower dtype).

**Contraction.** The kernels are launched with ``enable_fp_fusion=False`` (as every
kernel of the triton backend): LLVM then fuses no ``a·b + c`` on its own, so the only
fmas are the explicit ``tl.fma`` (the error terms), and the operation sequence is the
interpreter's. The TwoSums hold no product; the one inexact product per TwoProd,
``p = a·b``, would change bits if it were fused into the TwoSum that adds it, which is
what the launch option rules out (``tests/test_dropout_kernels.py`` compiles the
kernels for sm_90 with the backend's options and counts the fmas in the PTX).

Modes: like ``_triton_kernels``, a copy of this module is loaded per mode
(:func:`_kernels`: compiled for CUDA tensors, interpreted for CPU tensors under
``TRITON_INTERPRET=1``), and each copy loads its own copy of ``_triton_philox`` and
``_triton_kernels`` (whose ``_round_once`` rounds float64 to the output dtype). ``import
layernorm`` does not import this module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import struct
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import torch
import triton
import triton.language as tl

from . import _philox
from ._dropout_add import FLOAT_DTYPES, check_args
from .torch_ import contiguous_rows

__all__ = ["dropout_add", "dropout_add_backward"]

#: columns per program, at most
MAX_BLOCK = 1024


def _copy(name: str) -> ModuleType:
    # a fresh copy of module ``name`` whose @triton.jit see the mode this one is loaded in
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_tphilox = _copy("layernorm.backends._triton_philox")
_tkernels = _copy("layernorm.backends._triton_kernels")
_keep_pair = _tphilox.keep_pair
_dropout_offsets = _tphilox.dropout_offsets
_round_once = _tkernels._round_once
_two_sum = _tkernels._two_sum
_two_prod = _tkernels._two_prod
_neg = _tkernels._neg


@triton.jit
def _wide(x):
    # a loaded element as float64, exactly (16-bit floats through float32)
    return x if x.dtype == tl.float64 else x.to(tl.float32).to(tl.float64)


@triton.jit
def _step(t, u, rest, e):
    # one TwoSum of the scan from the top (numba's _scan, without branches)
    t2, u2 = _two_sum(t, e)
    done = u != 0.0
    rest = tl.where(done & (rest == 0.0), e, rest)
    return tl.where(done, t, t2), tl.where(done, u, u2), rest


@triton.jit
def _scan(c0, c1, c2, c3, c4, c5, c6):
    # Grow-Expansion of seven float64 pieces, then the scan from the top:
    # _numba_dropout._scan, operation for operation
    e0 = c0
    q, e0 = _two_sum(c1, e0)
    e1 = q
    q, e0 = _two_sum(c2, e0)
    q, e1 = _two_sum(q, e1)
    e2 = q
    q, e0 = _two_sum(c3, e0)
    q, e1 = _two_sum(q, e1)
    q, e2 = _two_sum(q, e2)
    e3 = q
    q, e0 = _two_sum(c4, e0)
    q, e1 = _two_sum(q, e1)
    q, e2 = _two_sum(q, e2)
    q, e3 = _two_sum(q, e3)
    e4 = q
    q, e0 = _two_sum(c5, e0)
    q, e1 = _two_sum(q, e1)
    q, e2 = _two_sum(q, e2)
    q, e3 = _two_sum(q, e3)
    q, e4 = _two_sum(q, e4)
    e5 = q
    q, e0 = _two_sum(c6, e0)
    q, e1 = _two_sum(q, e1)
    q, e2 = _two_sum(q, e2)
    q, e3 = _two_sum(q, e3)
    q, e4 = _two_sum(q, e4)
    q, e5 = _two_sum(q, e5)
    t = q
    u = tl.zeros_like(t)
    rest = tl.zeros_like(t)
    t, u, rest = _step(t, u, rest, e5)
    t, u, rest = _step(t, u, rest, e4)
    t, u, rest = _step(t, u, rest, e3)
    t, u, rest = _step(t, u, rest, e2)
    t, u, rest = _step(t, u, rest, e1)
    t, u, rest = _step(t, u, rest, e0)
    return t, u, rest


@triton.jit
def _finish(t, u, rest, naive, all_zero, NEAREST: tl.constexpr):
    # the scan's sum rounded once in float64 (to nearest, or to odd), with the special
    # values of the definition (_numba_dropout._finish)
    bits = t.to(tl.int64, bitcast=True)
    n = tl.where((u > 0.0) == (t > 0.0), bits + 1, bits - 1).to(tl.float64, bitcast=True)
    if NEAREST:
        lean = (rest != 0.0) & ((rest > 0.0) == (u > 0.0))
        up = (u != 0.0) & (n - t == 2.0 * u) & lean
    else:
        up = (u != 0.0) & ((bits & 1) == 0)
    out = tl.where(up, n, t)
    exact_zero = (t == 0.0) & (u == 0.0)
    out = tl.where(exact_zero, tl.where(all_zero, naive, 0.0), out)
    finite = (naive - naive) == 0.0
    return tl.where(finite, out, naive)


@triton.jit
def _store(PTR, where, v, inside, NEAREST: tl.constexpr):
    # the float64 v (rounded to nearest when NEAREST, else to odd) stored in PTR's dtype
    if NEAREST:
        tl.store(PTR + where, v.to(PTR.dtype.element_ty), mask=inside)
    else:
        tl.store(PTR + where, _round_once(v, PTR.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["s_bits"])
def forward_kernel(
    X0, X1, RES, RS, H, M0, M1,
    stride_x0, stride_x1, stride_res, n_cols, seed, p, s_bits,
    HAS_X1: tl.constexpr, HAS_RES: tl.constexpr, HAS_RS: tl.constexpr,
    WANT_MASKS: tl.constexpr, NEAREST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``h`` (and the masks) of row ``program_id(0)``, columns ``program_id(1) * BLOCK``
    on; ``H``, ``M0``, ``M1`` contiguous; ``s_bits``: the float64 ``s``'s bits."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    s = s_bits.to(tl.int64).to(tl.float64, bitcast=True)
    keep0, keep1 = _keep_pair(seed, _dropout_offsets(row, cols, n_cols), p)
    zero = tl.zeros([BLOCK], dtype=tl.float64)
    lanes = _neg(zero)  # IEEE's additive identity: lanes + v is v in every lane, -0.0 included
    x0 = _wide(tl.load(X0 + row * stride_x0 + cols, mask=inside, other=0.0))
    scale = tl.load(RS + row) if HAS_RS else 1.0
    a, b = _two_prod(x0, lanes + scale)
    c0, c1 = _two_prod(a, lanes + s)
    c2, c3 = _two_prod(b, lanes + s)
    n0 = a * s
    c0 = tl.where(keep0, c0, 0.0)
    c1 = tl.where(keep0, c1, 0.0)
    c2 = tl.where(keep0, c2, 0.0)
    c3 = tl.where(keep0, c3, 0.0)
    n0 = tl.where(keep0, n0, 0.0)
    if HAS_X1:
        x1 = _wide(tl.load(X1 + row * stride_x1 + cols, mask=inside, other=0.0))
        c4, c5 = _two_prod(x1, lanes + s)
        c4 = tl.where(keep1, c4, 0.0)
        c5 = tl.where(keep1, c5, 0.0)
        n1 = c4
    else:
        c4 = zero
        c5 = zero
        n1 = _neg(zero)  # no term: IEEE's neutral zero, -0.0
    r = _neg(zero)  # no residual: IEEE's neutral zero
    if HAS_RES:
        r = _wide(tl.load(RES + row * stride_res + cols, mask=inside, other=0.0))
    t, u, rest = _scan(c0, c1, c2, c3, c4, c5, r)
    naive = (n0 + n1) + r
    all_zero = (n0 == 0.0) & (n1 == 0.0) & (r == 0.0)
    where = row * n_cols + cols
    _store(H, where, _finish(t, u, rest, naive, all_zero, NEAREST), inside, NEAREST)
    if WANT_MASKS:
        tl.store(M0 + where, keep0, mask=inside)
        if HAS_X1:
            tl.store(M1 + where, keep1, mask=inside)


@triton.jit(do_not_specialize=["s_bits"])
def backward_kernel(
    DH, RS, DX0, DX1, DRES, stride_dh, n_cols, seed, p, s_bits,
    HAS_RS: tl.constexpr, HAS_X1: tl.constexpr, HAS_RES: tl.constexpr,
    NEAREST0: tl.constexpr, NEAREST1: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``dx0``, ``dx1`` (``HAS_X1``) and ``dresidual`` (``HAS_RES``) of one row's block."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    s = s_bits.to(tl.int64).to(tl.float64, bitcast=True)
    keep0, keep1 = _keep_pair(seed, _dropout_offsets(row, cols, n_cols), p)
    zero = tl.zeros([BLOCK], dtype=tl.float64)
    lanes = _neg(zero)  # IEEE's additive identity: lanes + v is v in every lane, -0.0 included
    g = _wide(tl.load(DH + row * stride_dh + cols, mask=inside, other=0.0))
    scale = tl.load(RS + row) if HAS_RS else 1.0
    a, b = _two_prod(g, lanes + scale)
    c0, c1 = _two_prod(a, lanes + s)
    c2, c3 = _two_prod(b, lanes + s)
    n0 = tl.where(keep0, a * s, 0.0)
    c0 = tl.where(keep0, c0, 0.0)
    c1 = tl.where(keep0, c1, 0.0)
    c2 = tl.where(keep0, c2, 0.0)
    c3 = tl.where(keep0, c3, 0.0)
    where = row * n_cols + cols
    t, u, rest = _scan(c0, c1, c2, c3, zero, zero, zero)
    _store(DX0, where, _finish(t, u, rest, n0, n0 == 0.0, NEAREST0), inside, NEAREST0)
    if HAS_X1:
        c4, c5 = _two_prod(g, lanes + s)
        c4 = tl.where(keep1, c4, 0.0)
        c5 = tl.where(keep1, c5, 0.0)
        t, u, rest = _scan(c4, c5, zero, zero, zero, zero, zero)
        _store(DX1, where, _finish(t, u, rest, c4, c4 == 0.0, NEAREST1), inside, NEAREST1)
    if HAS_RES:
        if DRES.dtype.element_ty == tl.float64:
            tl.store(DRES + where, g, mask=inside)
        else:
            tl.store(DRES + where, _round_once(g, DRES.dtype.element_ty), mask=inside)


# --- torch front ----------------------------------------------------------------------------

_loaded: dict[bool, ModuleType] = {}


def _triton_interprets() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.rand, InterpretedFunction)


def _kernels() -> ModuleType:
    """This module's copy in the mode triton itself was imported in."""
    interpret = _triton_interprets()
    if interpret not in _loaded:
        from triton import knobs

        spec = importlib.util.find_spec(__name__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            spec.loader.exec_module(module)
        _loaded[interpret] = module
    return _loaded[interpret]


#: the launch options: no contraction (the module's docstring)
LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}


@contextlib.contextmanager
def _launching() -> Iterator[None]:
    """Where a launch runs: in the interpreter (its knob set, as a launch there needs,
    and NumPy quiet about the NaN and Inf a GPU makes silently) or compiled."""
    from triton import knobs

    interpreted = _triton_interprets()
    with knobs.runtime.scope():
        knobs.runtime.interpret = interpreted
        with np.errstate(all="ignore") if interpreted else contextlib.nullcontext():
            yield


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _s_bits(p: float) -> int:
    return struct.unpack("<q", struct.pack("<d", _philox.dropout_scale(p)))[0]


def _check_device(t: torch.Tensor) -> None:
    interpreted = _triton_interprets()
    if t.device.type == "cuda" and not interpreted:
        return
    if t.device.type == "cpu" and interpreted:
        return
    raise ValueError(
        f"dropout_add: the Triton kernels take CUDA tensors (CPU tensors under "
        f"TRITON_INTERPRET=1), got a tensor on {t.device}"
    )


def _grid(m: int, n: int) -> tuple[tuple[int, int], int]:
    block = min(MAX_BLOCK, triton.next_power_of_2(n))
    return (m, math.ceil(n / block)), block


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
    """The interface of ``_dropout_add.dropout_add``, on the tensors' device.

    Raises:
        TypeError, ValueError: as ``_dropout_add.check_args``; ValueError for a device
            the Triton kernels do not run on.
    """
    check_args(x0, x1, residual, rowscale, seed, p, rdtype)
    _check_device(x0)
    m, n = x0.shape
    device = x0.device
    h = torch.empty((m, n), dtype=rdtype, device=device)
    mask0 = torch.empty((m, n), dtype=torch.bool, device=device) if want_masks else None
    mask1 = (
        torch.empty((m, n), dtype=torch.bool, device=device)
        if want_masks and x1 is not None
        else None
    )
    if m * n == 0:
        return h, mask0, mask1
    k = _kernels()
    x0 = contiguous_rows(x0)
    x1 = None if x1 is None else contiguous_rows(x1)
    residual = None if residual is None else contiguous_rows(residual)
    rs = None if rowscale is None else rowscale.detach().to(torch.float64).contiguous()
    grid, block = _grid(m, n)
    with _launching():
        k.forward_kernel[grid](
            x0, x1 if x1 is not None else x0, residual if residual is not None else h,
            rs if rs is not None else h, h,
            mask0 if mask0 is not None else h, mask1 if mask1 is not None else h,
            _row_stride(x0), _row_stride(x1) if x1 is not None else 0,
            _row_stride(residual) if residual is not None else 0,
            n, seed, p, _s_bits(p),
            HAS_X1=x1 is not None, HAS_RES=residual is not None, HAS_RS=rs is not None,
            WANT_MASKS=want_masks, NEAREST=rdtype == torch.float64, BLOCK=block,
            **LAUNCH,
        )  # fmt: skip
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
    """The interface of ``_dropout_add.dropout_add_backward``, on ``dh``'s device.

    Raises:
        TypeError, ValueError: as :func:`dropout_add`.
    """
    check_args(dh, None, None, rowscale, seed, p, x0_dtype)
    for dtype in (x1_dtype, residual_dtype):
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dropout_add: gradient dtypes must be float dtypes, got {dtype}")
    _check_device(dh)
    m, n = dh.shape
    device = dh.device
    dx0 = torch.empty((m, n), dtype=x0_dtype, device=device)
    dx1 = None if x1_dtype is None else torch.empty((m, n), dtype=x1_dtype, device=device)
    dres = (
        None if residual_dtype is None else torch.empty((m, n), dtype=residual_dtype, device=device)
    )
    if m * n == 0:
        return dx0, dx1, dres
    k = _kernels()
    dh = contiguous_rows(dh)
    rs = None if rowscale is None else rowscale.detach().to(torch.float64).contiguous()
    grid, block = _grid(m, n)
    with _launching():
        k.backward_kernel[grid](
            dh, rs if rs is not None else dx0, dx0,
            dx1 if dx1 is not None else dx0, dres if dres is not None else dx0,
            _row_stride(dh), n, seed, p, _s_bits(p),
            HAS_RS=rs is not None, HAS_X1=dx1 is not None, HAS_RES=dres is not None,
            NEAREST0=x0_dtype == torch.float64, NEAREST1=x1_dtype == torch.float64,
            BLOCK=block, **LAUNCH,
        )  # fmt: skip
    return dx0, dx1, dres
