"""The fused dropout-add kernels (numba; Triton in its interpreter) against an exact
``fractions.Fraction`` oracle and the torch version (``_dropout_add``), bit for bit: ``h = RN(k0·s·x0·rs + k1·s·x1 + residual)`` rounded once,
the backward likewise, bit for bit across backends, batch and thread-count invariant,
special values, layouts and errors."""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _triton_interpreter import HAS_TRITON, import_for_the_interpreter
from layernorm.backends import _dropout_add as td
from layernorm.backends import _numba_dropout as nd
from layernorm.backends import _philox as philox

import_for_the_interpreter()

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PROBABILITIES = [0.0, 0.1, 0.5, 0.9, 1.0]
_DIGITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


# --- the oracle ---------------------------------------------------------------------------


def _nearest(q: Fraction, dtype: torch.dtype) -> float:
    """The exact rational ``q`` rounded once to nearest-even in ``dtype`` (past the largest
    finite value by half a unit or more: Inf)."""
    if dtype == torch.float64:
        return float(q)  # CPython's int / int is correctly rounded
    fmt = torch.finfo(dtype)
    if q == 0:
        return 0.0
    e = max(math.floor(math.log2(abs(q))), math.log2(fmt.tiny)) - (_DIGITS[dtype] - 1)
    unit = Fraction(2) ** int(e)
    steps = q / unit
    n = math.floor(steps)
    rest = steps - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    value = float(n * unit)
    if abs(value) > fmt.max:
        return math.copysign(math.inf, value)
    return value if value != 0 else math.copysign(0.0, q)


def oracle(x0, x1, residual, rowscale, seed, p, rdtype):
    """h, mask0, mask1 of the definition, element by element in exact rationals."""
    m, n = x0.shape
    k0 = philox.keep_mask(seed, m, n, p)
    k1 = philox.keep_mask(seed, m, n, p, stream=1)
    s = philox.dropout_scale(p)
    out = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        rs = 1.0 if rowscale is None else float(rowscale[i])
        for c in range(n):
            terms = []  # (exact or None when not finite, IEEE float64 value)
            a = float(x0[i, c])
            if k0[i, c]:
                naive = a * rs * s
                finite = math.isfinite(a) and math.isfinite(rs)
                terms.append((Fraction(a) * Fraction(rs) * Fraction(s) if finite else None, naive))
            else:
                terms.append((Fraction(0), 0.0))
            if x1 is not None:
                b = float(x1[i, c])
                if k1[i, c]:
                    terms.append((Fraction(b) * Fraction(s) if math.isfinite(b) else None, b * s))
                else:
                    terms.append((Fraction(0), 0.0))
            if residual is not None:
                r = float(residual[i, c])
                terms.append((Fraction(r) if math.isfinite(r) else None, r))
            naive = -0.0
            for _, v in terms:
                naive = naive + v
            if any(q is None for q, _ in terms) or not math.isfinite(naive):
                out[i, c] = naive  # IEEE: Inf, -Inf or NaN
                continue
            exact = sum(q for q, _ in terms)
            if exact == 0:
                out[i, c] = naive if all(v == 0 for _, v in terms) else 0.0
            else:
                out[i, c] = _nearest(exact, rdtype)
    return out.to(rdtype), k0, (k1 if x1 is not None else None)


def oracle_backward(dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype):
    m, n = dh.shape
    k0 = philox.keep_mask(seed, m, n, p)
    k1 = philox.keep_mask(seed, m, n, p, stream=1)
    s = philox.dropout_scale(p)
    dx0 = torch.empty(m, n, dtype=torch.float64)
    dx1 = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        rs = 1.0 if rowscale is None else float(rowscale[i])
        for c in range(n):
            g = float(dh[i, c])
            for out, kept, factor, dtype in ((dx0, k0, rs, x0_dtype), (dx1, k1, 1.0, x1_dtype)):
                if not kept[i, c] or dtype is None:
                    out[i, c] = 0.0
                elif not math.isfinite(g):
                    out[i, c] = g * factor * s
                else:
                    q = Fraction(g) * Fraction(factor) * Fraction(s)
                    out[i, c] = _nearest(q, dtype) if q != 0 else g * factor * s
    dres = dh.to(residual_dtype) if residual_dtype is not None else None
    return (
        dx0.to(x0_dtype),
        dx1.to(x1_dtype) if x1_dtype is not None else None,
        dres,
    )


def assert_same_bits(got: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    """Equal bit for bit, NaN wherever the other is NaN (payloads aside)."""
    if expected is None:
        assert got is None
        return
    assert got is not None and got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.bool:
        assert torch.equal(got, expected)
        return
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = _BITS.get(got.dtype, torch.int16)
    differ = got.isnan().logical_not() & nan.logical_not() & (got.view(bits) != expected.view(bits))
    where = differ.nonzero()[:4].tolist()
    assert not differ.any(), (
        f"{int(differ.sum())} of {got.numel()} differ; first at {where}: got "
        f"{[got[tuple(i)].item() for i in where]}, expected {[expected[tuple(i)].item() for i in where]}"
    )


def check_forward(x0, x1, res, rs, seed, p, rdtype, backend=None):
    """``backend``'s dropout_add (numba's by default) is the oracle's and torch's."""
    dropout_add = nd.dropout_add if backend is None else backend
    got = dropout_add(x0, x1, res, rs, seed, p, rdtype, True)
    expected = oracle(x0, x1, res, rs, seed, p, rdtype)
    torch_version = td.dropout_add(x0, x1, res, rs, seed, p, rdtype, True)
    for a, b, c in zip(got, expected, torch_version, strict=True):
        assert_same_bits(a, b)
        assert_same_bits(c, b)
    return got


def check_backward(dh, rs, seed, p, x0_dtype, x1_dtype, res_dtype, backend=None):
    backward = nd.dropout_add_backward if backend is None else backend
    got = backward(dh, rs, seed, p, x0_dtype, x1_dtype, res_dtype)
    expected = oracle_backward(dh, rs, seed, p, x0_dtype, x1_dtype, res_dtype)
    torch_version = td.dropout_add_backward(dh, rs, seed, p, x0_dtype, x1_dtype, res_dtype)
    for a, b, c in zip(got, expected, torch_version, strict=True):
        assert_same_bits(a, b)
        assert_same_bits(c, b)


def _values(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random values over many binades, some zeros of both signs."""
    g = torch.Generator().manual_seed(seed)
    top = 6 if dtype == torch.float16 else 12
    mag = torch.rand(shape, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(
        -top, top, shape, generator=g
    )
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    x = (sign * mag).to(dtype)
    x.view(-1)[::17] = 0.0
    x.view(-1)[5::23] = -0.0
    return x


def _inputs(dtype, res_dtype, has_x1, has_res, has_rs, shape=(3, 37), seed=0):
    x0 = _values(dtype, shape, seed)
    x1 = _values(dtype, shape, seed + 1) if has_x1 else None
    res = _values(res_dtype, shape, seed + 2) if has_res else None
    rs = _values(torch.float32, shape[:1], seed + 3) if has_rs else None
    return x0, x1, res, rs


FLAGS = [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]


# --- numba against the oracle ----------------------------------------------------------------


@pytest.mark.parametrize("p", PROBABILITIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numba_forward_is_the_exact_sum_rounded_once(dtype, p):
    for has_x1, has_res, has_rs in FLAGS:
        x0, x1, res, rs = _inputs(dtype, dtype, has_x1, has_res, has_rs)
        check_forward(x0, x1, res, rs, 1234, p, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rdtype", [torch.float32, torch.float64], ids=str)
def test_numba_forward_residual_wider_than_x(dtype, rdtype):
    for has_x1, has_res, has_rs in FLAGS:
        x0, x1, res, rs = _inputs(dtype, rdtype, has_x1, has_res, has_rs, seed=5)
        check_forward(x0, x1, res, rs, 99, 0.1, rdtype)


def test_numba_forward_operands_of_other_dtypes():
    x0, x1, res, _ = _inputs(torch.float32, torch.float32, True, True, False)
    rs64 = torch.tensor([0.1, -3.0, 1 / 3], dtype=torch.float64)  # 53 significant bits
    rs16 = torch.tensor([0.1, -3.0, 1 / 3], dtype=torch.bfloat16)
    for rs in (rs64, rs16):
        check_forward(x0, x1, res, rs, 3, 0.3, torch.float32)
    # x1 in float64, x0 in bfloat16, a float16 residual, h in float32
    check_forward(x0.bfloat16(), x1.double(), res.half(), rs64, 3, 0.3, torch.float32)
    # h narrower than the operands: float32 and float64 in, bfloat16 and float16 out
    for rdtype in (torch.bfloat16, torch.float16):
        check_forward(x0, x1, res, rs16, 3, 0.3, rdtype)
        check_forward(x0.double(), x1.double(), res.double(), rs64, 3, 0.3, rdtype)


def _midpoint_p() -> float:
    # p whose s puts 0.75·s within 2^-53 of float32's midpoint 1 + 2^-24, on the side
    # where rounding 0.75·s to float64 first would round twice (test_philox's case)
    target = Fraction(1) + Fraction(1, 2**24)
    for candidate in np.arange(-40, 41) * 2.0**-54 + (1 - 3 / (4 * float(target))):
        s = philox.dropout_scale(float(candidate))
        once = _nearest(Fraction(0.75) * Fraction(s), torch.float32)
        if once != float(np.float32(0.75 * s)):
            return float(candidate)
    raise AssertionError("no double-rounding case near the midpoint")


def test_numba_adversarial_midpoints():
    f32 = torch.float32
    # x·s next to a float32 midpoint: rounded once it rounds up, twice it ties down
    p = _midpoint_p()
    x0 = torch.tensor([[0.75, -0.75, 0.75]])
    seed = next(k for k in range(100) if philox.keep_mask(k, 1, 3, p).all())
    h, _, _ = nd.dropout_add(x0, None, None, None, seed, p, f32, False)
    assert h.tolist() == [[1 + 2**-23, -(1 + 2**-23), 1 + 2**-23]]
    assert float(np.float32(0.75 * philox.dropout_scale(p))) == 1.0  # twice: down
    # residual on a midpoint, a tiny x1 term past it: the exact sum rounds up, a float64
    # sum (1 + 2^-24 + 2^-60 is 1 + 2^-24 in float64) would tie to even, down
    x0 = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    x1 = torch.tensor([[2.0**-60, -(2.0**-60), -(2.0**-60), 0.0]])
    res = torch.tensor([[2.0**-24, 2.0**-24, -(2.0**-24), 2.0**-24]])
    h, _, _ = nd.dropout_add(x0, x1, res, None, 0, 0.0, f32, False)
    assert h.tolist() == [[1 + 2**-23, 1.0, -(1 + 2**-23), 1.0]]
    # the same in float64: 1 + 2^-53 is float64's midpoint
    res64 = torch.tensor([[2.0**-53, 2.0**-53, -(2.0**-53), 2.0**-53]], dtype=torch.float64)
    h, _, _ = nd.dropout_add(x0, x1, res64, None, 0, 0.0, torch.float64, False)
    assert h.tolist() == [[1 + 2**-52, 1.0, -(1 + 2**-52), 1.0]]
    # bfloat16: the midpoint 1 + 2^-8 reached through rowscale, nudged by x1
    xb = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    rb = torch.tensor([[2.0**-8, 2.0**-8]], dtype=torch.bfloat16)
    x1b = torch.tensor([[2.0**-30, -(2.0**-30)]], dtype=torch.bfloat16)
    h, _, _ = nd.dropout_add(xb, x1b, rb, torch.tensor([1.0]), 0, 0.0, torch.bfloat16, False)
    assert h.float().tolist() == [[1 + 2**-7, 1.0]]


def test_numba_fuzz_near_midpoints():
    # many residuals that cancel x0·s down to its low bits: the sum's rounding is decided
    # by the error terms, at every p
    g = torch.Generator().manual_seed(4)
    x0 = _values(torch.float32, (8, 64), 11)
    for p in (0.1, 1 / 3, 0.7, 0.999):
        s = philox.dropout_scale(p)
        res = (-(x0.double() * s) * (1 + torch.rand(8, 64, generator=g, dtype=torch.float64)
               * 2.0**-20)).float()  # fmt: skip
        x1 = (x0.double() * 2.0**-25).float()
        for rdtype in (torch.float32, torch.bfloat16):
            r = res.to(rdtype)
            check_forward(x0, x1, r, None, 17, p, rdtype)


@pytest.mark.parametrize(
    ("dtype", "rdtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float16, torch.float32), (torch.float32, torch.bfloat16)],
    ids=str,
)  # fmt: skip
def test_numba_rowscale_rows_decided_without_the_exact_sum(dtype, rdtype):
    # Rows without zeros or cancellation, so that the decided pass settles them: with a
    # float32 rowscale x0·rs is exact and the pass takes it; a rowscale of 53 bits
    # (float64 1/3, 0.1) is not, and its rows must take the exact sum. Near-midpoint
    # residuals then push the pass to hand elements on. Forward and backward.
    g = torch.Generator().manual_seed(8)
    x0 = (torch.rand(6, 64, generator=g) + 0.5).to(dtype)
    res = (torch.randn(6, 64, generator=g) * 0.25).to(rdtype)
    rs32 = torch.tensor([0.75, -3.0, 2.0**-20, 1e3, 0.1, 1.5]).float()
    rs64 = torch.tensor([1 / 3, 0.1, -7 / 3, 1.0, 2.0**-20 / 3, 1e3 / 7], dtype=torch.float64)
    for p in (0.0, 0.1, 1 / 3):
        s = philox.dropout_scale(p)
        for rs in (rs32, rs64):
            check_forward(x0, None, res, rs, 21, p, rdtype)
            near = (-(x0.double() * rs.double()[:, None] * s) * (1 + 2.0**-30)).to(rdtype)
            check_forward(x0, None, near, rs, 21, p, rdtype)
            check_backward(res, rs, 21, p, dtype, None, rdtype)


def test_numba_special_values():
    f32 = torch.float32
    inf, nan = math.inf, math.nan
    x0 = torch.tensor([[inf, -inf, nan, inf, 1.0, 2.0, -0.0, -0.0, 0.0, 1.0]] * 8)
    x1 = torch.tensor([[1.0, 2.0, 3.0, -inf, nan, inf, -0.0, 0.0, -0.0, -1.0]] * 8)
    res = torch.tensor([[0.0, inf, 1.0, 1.0, 1.0, -inf, -0.0, -0.0, -0.0, 0.0]] * 8)
    for p in (0.0, 0.5, 1.0):
        for args in ((x1, res), (None, res), (x1, None), (None, None)):
            check_forward(x0, *args, None, 8, p, f32)
            check_forward(x0, *args, torch.tensor([1.0, -0.0, 2, 3, 4, 5, 6, 7]), 8, p, f32)
    # p = 0: everything kept, IEEE's results; -0 only when every term is -0
    h = nd.dropout_add(x0[:1], x1[:1], res[:1], None, 8, 0.0, f32, False)[0][0]
    assert h[:6].isnan().tolist() == [False, True, True, True, True, True]
    assert h[0].item() == inf
    assert [math.copysign(1, v) for v in h[6:9].tolist()] == [-1, 1, 1]
    assert h[9].item() == 0.0 and math.copysign(1, h[9].item()) == 1  # 1 - 1: +0
    # p = 1: every term dropped (+0), whatever it was: h is the residual
    h = nd.dropout_add(x0[:1], x1[:1], res[:1], None, 8, 1.0, f32, False)[0][0]
    assert_same_bits(h, res[0] + 0.0)
    h = nd.dropout_add(x0[:1], x1[:1], None, None, 8, 1.0, f32, False)[0][0]
    assert h.tolist() == [0.0] * 10 and not torch.signbit(h).any()
    # no term but x0 kept: -0 stays -0 (h is x0 itself)
    h = nd.dropout_add(x0[:1], None, None, None, 8, 0.0, f32, False)[0][0]
    assert_same_bits(h, x0[0])
    # an overflowing exact sum rounds to Inf
    big = torch.tensor([[3e38, -3e38]])
    h = nd.dropout_add(big, big, None, None, 0, 0.0, f32, False)[0]
    assert h.tolist() == [[inf, -inf]]


# --- the fast sum of x0 + x1 + residual (p = 0, no rowscale) ---------------------------------


def _fits(values: tuple[float, ...], dtype: torch.dtype) -> bool:
    return all(math.isnan(v) or float(torch.tensor(v, dtype=dtype).item()) == v for v in values)


def _sum3_cases(dtype: torch.dtype, rdtype: torch.dtype) -> list[tuple[float, float, float]]:
    """``(x0, x1, residual)`` rows at the fast sum's edges, each exact in ``dtype``: the
    terms' exponents spanning just inside and just past the fast sum's precision (float64
    for float32 terms, float32 for 16-bit ones), cancellations to zero, signed zeros,
    Inf and NaN, overflow, subnormal results of ``rdtype`` and ties in ``rdtype``,
    nudged either way by a term near and far below them."""
    digits = _DIGITS[dtype]
    top = 2.0 - 2.0 ** (1 - digits)  # every significand bit set
    wide = 24 if dtype in (torch.float16, torch.bfloat16) else 53
    rdigits = 53 if rdtype == torch.float64 else _DIGITS[rdtype]
    unit = torch.finfo(rdtype).smallest_normal * 2.0 ** (1 - rdigits)  # subnormal spacing
    inf, nan = math.inf, math.nan
    rows = [(top, top * 2.0**-g, r) for g in range(wide - digits - 3, wide - digits + 4)
            for r in (0.0, 1.0, -top * 2.0**-g)]  # fmt: skip
    for g in (wide - 3, wide + 2, 2 * wide):  # one addition exact, the other not
        rows += [(1.0, 2.0**-g, 2.0**-g), (1.0, 1.0, 2.0**-g), (1.0, 2.0**-g, -1.0)]
    rows += [
        (1.5, -1.5, 0.0), (1.5, -1.5, -0.0), (-0.0, -0.0, -0.0), (-0.0, -0.0, 0.0),
        (0.0, -0.0, -0.0), (-0.0, 0.0, -0.0), (top, 1.0, -(top + 1.0)), (1.0, -1.0, 2.0**-20),
        (inf, 1.0, 1.0), (inf, -inf, 0.0), (nan, 1.0, 0.0), (1.0, 2.0, -inf), (inf, inf, 1.0),
    ]  # fmt: skip
    big = torch.finfo(dtype).max
    rows += [(big, big, 0.0), (big, -big, 1.0), (-big, -big, -big)]
    rmax = torch.finfo(rdtype).max
    rows += [(rmax, rmax * 2.0 ** -(rdigits + 1), 0.0), (rmax, rmax * 2.0**-rdigits, 0.0)]
    tie = 2.0**-rdigits  # half a unit of rdtype at 1
    for nudge in (0.0, 2.0**-12, -(2.0**-12), 2.0**-40, -(2.0**-40)):
        rows += [(1.0, tie, tie * nudge), (1.0 + 2 * tie, tie, tie * nudge)]
        rows += [(5 * unit, unit / 2, unit * nudge), (unit, -unit / 2, unit * nudge)]
        rows += [(3 * unit, -2 * unit, unit * nudge)]
    return [row for row in rows if _fits(row, dtype)]


def _fast(x0: torch.Tensor, x1: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """Per row: whether the fast sum's additions ``(x0 + x1) + res`` are exact in its
    precision (float32 when every term is 16-bit, else float64)."""
    single = all(t.dtype in (torch.float16, torch.bfloat16) for t in (x0, x1, res))
    work = torch.float32 if single else torch.float64
    a, b, c = (t.to(work) for t in (x0, x1, res))
    exact = torch.ones(x0.shape[0], dtype=torch.bool)
    for i in range(x0.shape[0]):
        for u, v, w in zip(a[i].tolist(), b[i].tolist(), c[i].tolist(), strict=True):
            total = float(torch.tensor(u, dtype=work) + torch.tensor(v, dtype=work))
            last = float(torch.tensor(total, dtype=work) + torch.tensor(w, dtype=work))
            if not all(map(math.isfinite, (u, v, w, total, last))):
                exact[i] = False
                continue
            exact[i] &= Fraction(u) + Fraction(v) == Fraction(total)
            exact[i] &= Fraction(total) + Fraction(w) == Fraction(last)
    return exact


# (terms, residual, h): each float32 fast sum kernel's rounding to a narrower, the same
# and a wider h; 16-bit terms with a float32 residual take the float64 sum (one compile
# per combination: the main cost of these tests)
FAST_SUM_DTYPES = [
    (torch.float32, torch.float32, torch.float32),
    (torch.float32, torch.float32, torch.bfloat16),
    (torch.float32, torch.float32, torch.float64),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.float16, torch.float16, torch.float16),
    (torch.bfloat16, torch.float32, torch.float32),
]


@pytest.mark.parametrize(("dtype", "res_dtype", "rdtype"), FAST_SUM_DTYPES, ids=str)
def test_numba_fast_sum_edges(dtype, res_dtype, rdtype):
    # rows the fast sum takes and rows it hands to the exact path (both kinds present),
    # the terms in every order (a row each: one row's elements go one way), both signs
    # along the row: the oracle's bits either way
    cases = [
        [(a, b, c), (-a, -b, -c)]
        for row in _sum3_cases(dtype, rdtype)
        for a, b, c in itertools.permutations(row)
    ]
    rows = torch.tensor(cases, dtype=torch.float64)  # (rows, 2, 3)
    x0, x1 = (rows[..., k].to(dtype) for k in (0, 1))
    res = rows[..., 2].to(dtype).to(res_dtype)  # the same values, in res_dtype
    fast = _fast(x0, x1, res)
    assert fast.any() and not fast.all()
    check_forward(x0, x1, res, None, 3, 0.0, rdtype)
    # no residual (a row of -0.0 in the kernel), and a fast row after a slow one
    check_forward(x0, x1, None, None, 3, 0.0, rdtype)
    both = torch.cat([x0[~fast][:1], x0[fast][:1]] * 3)
    check_forward(both, torch.cat([x1[~fast][:1], x1[fast][:1]] * 3), None, None, 3, 0.0, rdtype)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numba_backward_is_the_exact_product_rounded_once(dtype, p):
    dh = _values(dtype, (3, 37), 21)
    dh[0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    for rs in (None, _values(torch.float32, (3,), 22)):
        for x1_dtype, res_dtype in ((None, None), (dtype, dtype)):
            check_backward(dh, rs, 5, p, dtype, x1_dtype, res_dtype)


def test_numba_backward_narrower_gradients():
    # h (and dh) in float32, x0 in bfloat16 and a bfloat16 residual: each rounded once
    dh = _values(torch.float32, (4, 50), 31)
    rs = _values(torch.float32, (4,), 32)
    bf = torch.bfloat16
    check_backward(dh, rs, 6, 0.3, bf, bf, bf)
    check_backward(dh.double(), rs.double(), 6, 0.3, torch.float32, torch.float16, bf)
    # a residual wider than h: dresidual is dh exactly
    check_backward(dh.to(bf), rs, 6, 0.3, bf, bf, torch.float32)


# --- Triton, interpreted ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tdrop():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.rand, InterpretedFunction):
        pytest.skip("triton was imported compiled: run TRITON_INTERPRET=1 pytest " + __file__)
    from layernorm.backends import _triton_dropout

    return _triton_dropout


@pytest.mark.parametrize("p", PROBABILITIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_forward_is_numbas_and_torchs(tdrop, dtype, p):
    for has_x1, has_res, has_rs in FLAGS:
        x0, x1, res, rs = _inputs(dtype, dtype, has_x1, has_res, has_rs)
        got = check_forward(x0, x1, res, rs, 1234, p, dtype, backend=tdrop.dropout_add)
        for a, b in zip(got, nd.dropout_add(x0, x1, res, rs, 1234, p, dtype, True), strict=True):
            assert_same_bits(a, b)


def test_triton_keeps_the_sign_of_a_zero_rowscale(tdrop):
    # x0·(-0.0)·s is a zero of x0's opposite sign, as numba and the oracle have it: the
    # kernels widen the row's scale onto -0.0, IEEE's additive identity (on an H200,
    # +0.0 + rowscale turned a -0.0 scale into +0.0: 198 h and 4500 dx0 zeros of the
    # wrong sign in test_gpu_dropout_add_is_the_cpu_result)
    x0 = torch.tensor([[1.0, -2.0, 0.0, -0.0, 3.0, -0.0]] * 4)
    x1 = torch.tensor([[-0.0, 0.0, -0.0, -0.0, 1.0, 0.0]] * 4)
    res = torch.tensor([[-0.0, -0.0, 0.0, -0.0, -0.0, -0.0]] * 4)
    dh = torch.tensor([[1.5, -2.0, 0.0, -0.0, 2.0**-30, -7.0]] * 4)
    rs = torch.tensor([-0.0, 0.0, -1.0, 2.0])
    f32 = torch.float32
    for p in (0.0, 0.5):
        for args in ((x1, res), (None, res), (x1, None), (None, None)):
            check_forward(x0, *args, rs, 5, p, f32, backend=tdrop.dropout_add)
        check_backward(dh, rs, 5, p, f32, f32, f32, backend=tdrop.dropout_add_backward)


def test_triton_special_values_midpoints_and_wider_residual(tdrop):
    inf, nan = math.inf, math.nan
    x0 = torch.tensor([[inf, -inf, nan, inf, 1.0, 2.0, -0.0, -0.0, 0.0, 1.0, 1.0, 1.0]] * 4)
    x1 = torch.tensor([[1.0, 2.0, 3.0, -inf, nan, inf, -0.0, 0.0, -0.0, -1.0, 2**-60, 0]] * 4)
    res = torch.tensor([[0.0, inf, 1.0, 1.0, 1.0, -inf, -0.0, -0.0, -0.0, 0.0, 2**-24, 0]] * 4)
    for p in (0.0, 0.5, 1.0):
        for args in ((x1, res), (None, res), (x1, None), (None, None)):
            check_forward(x0, *args, None, 8, p, torch.float32, backend=tdrop.dropout_add)
    res64 = res.double()
    res64[:, 10] = 2.0**-53
    check_forward(x0, x1, res64, None, 8, 0.0, torch.float64, backend=tdrop.dropout_add)
    p = _midpoint_p()
    x = torch.full((1, 64), 0.75)
    check_forward(x, None, None, None, 0, p, torch.float32, backend=tdrop.dropout_add)
    for dtype in (torch.bfloat16, torch.float16):
        for rdtype in (torch.float32, torch.float64):
            x0, x1, res, rs = _inputs(dtype, rdtype, True, True, True, seed=5)
            check_forward(x0, x1, res, rs, 99, 0.1, rdtype, backend=tdrop.dropout_add)
            check_forward(x0, x1, None, rs.double(), 99, 0.1, rdtype, backend=tdrop.dropout_add)
    # h narrower than the operands
    x0, x1, res, rs = _inputs(torch.float64, torch.float32, True, True, True, seed=6)
    for rdtype in (torch.bfloat16, torch.float16):
        check_forward(x0, x1, res, rs, 98, 0.3, rdtype, backend=tdrop.dropout_add)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_backward_is_numbas_and_torchs(tdrop, dtype):
    dh = _values(dtype, (3, 37), 21)
    dh[0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    back = tdrop.dropout_add_backward
    for p in (0.0, 0.1, 1.0):
        for rs in (None, _values(torch.float32, (3,), 22)):
            for x1_dtype, res_dtype in ((None, None), (dtype, dtype)):
                check_backward(dh, rs, 5, p, dtype, x1_dtype, res_dtype, backend=back)
    check_backward(dh, None, 5, 0.3, torch.bfloat16, torch.float16, torch.bfloat16, backend=back)


def test_triton_layouts_blocks_and_batch_invariance(tdrop):
    # rows wider than a block (several programs per row), strided rows, zero size
    base = _values(torch.bfloat16, (6, 2100), 61)
    x0, x1 = base[::2, 3:2000], base[1::2, 5:2002]
    res = _values(torch.float32, (1997, 3), 62).t()
    got = tdrop.dropout_add(x0, x1, res, None, 2**64 - 1, 0.3, torch.float32, True)
    for a, b in zip(
        got, nd.dropout_add(x0, x1, res, None, 2**64 - 1, 0.3, torch.float32, True), strict=True
    ):
        assert_same_bits(a, b)
    part = tdrop.dropout_add(x0[:2], x1[:2], res[:2], None, 2**64 - 1, 0.3, torch.float32, True)
    for a, b in zip(part, got, strict=True):
        assert_same_bits(a, b[:2])
    h, m0, m1 = tdrop.dropout_add(torch.ones(0, 5), None, None, None, 0, 0.5, torch.float32, True)
    assert h.shape == m0.shape == (0, 5) and m1 is None
    with pytest.raises(ValueError, match="x0 must be an"):
        tdrop.dropout_add(torch.ones(3), None, None, None, 0, 0.5, torch.float32, False)


_COMPILE = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from layernorm.backends import _triton_dropout as td

def fmas(fn, sig, constexprs):
    names = list(sig)
    for k in constexprs:
        sig[k] = "constexpr"
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=td.LAUNCH).asm["ptx"]
    return len(re.findall(r"\\bfma\\.rn\\.f64", ptx))

for x, out in (("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp32"), ("fp64", "fp64")):
    sig = {"X0": f"*{x}", "X1": f"*{x}", "RES": f"*{out}", "RS": "*fp64", "H": f"*{out}",
           "M0": "*i1", "M1": "*i1", "stride_x0": "i64", "stride_x1": "i64",
           "stride_res": "i64", "n_cols": "i32", "seed": "i64", "p": "fp32", "s_bits": "i64"}
    cx = {"HAS_X1": True, "HAS_RES": True, "HAS_RS": True, "WANT_MASKS": True,
          "NEAREST": out == "fp64", "BLOCK": 1024}
    print("forward", x, out, fmas(td.forward_kernel, sig, cx))
sig = {"DH": "*fp32", "RS": "*fp64", "DX0": "*bf16", "DX1": "*bf16", "DRES": "*fp32",
       "stride_dh": "i64", "n_cols": "i32", "seed": "i64", "p": "fp32", "s_bits": "i64"}
cx = {"HAS_RS": True, "HAS_X1": True, "HAS_RES": True, "NEAREST0": False, "NEAREST1": False,
      "BLOCK": 1024}
print("backward", fmas(td.backward_kernel, sig, cx))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_compile_for_sm90_with_only_the_explicit_fmas():
    # With the backend's launch options (no fp fusion), the only fmas in the PTX are the
    # four explicit tl.fma per element (TwoProd's errors: x0·rs, its two halves ·s, x1·s;
    # backward: dh·rs, ·s twice, dh·s), 8 elements per thread (1024 columns, 4 warps):
    # no product is fused into a TwoSum.
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "forward bf16 bf16 32",
        "forward fp16 fp32 32",
        "forward fp32 fp32 32",
        "forward fp64 fp64 32",
        "backward 32",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA device and triton"
)
def test_gpu_dropout_add_is_the_cpu_result():
    # compiled Triton on the GPU gives numba's (and the oracle's) bits, forward and backward
    from layernorm.backends import _triton_dropout

    for dtype, rdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                          (torch.float16, torch.float16), (torch.float64, torch.float64),
                          (torch.float32, torch.bfloat16)):  # fmt: skip
        for p in PROBABILITIES:
            x0, x1, res, rs = _inputs(dtype, rdtype, True, True, True, (67, 1500), 71)
            x0[0, :4] = torch.tensor([math.inf, -math.inf, math.nan, -0.0])
            cpu = nd.dropout_add(x0, x1, res, rs, 2**63 + 5, p, rdtype, True)
            gpu = _triton_dropout.dropout_add(
                x0.cuda(), x1.cuda(), res.cuda(), rs.cuda(), 2**63 + 5, p, rdtype, True
            )
            for a, b in zip(gpu, cpu, strict=True):
                assert_same_bits(a.cpu(), b)
            back_cpu = nd.dropout_add_backward(res, rs, 9, p, dtype, dtype, rdtype)
            back_gpu = _triton_dropout.dropout_add_backward(
                res.cuda(), rs.cuda(), 9, p, dtype, dtype, rdtype
            )
            for a, b in zip(back_gpu, back_cpu, strict=True):
                assert_same_bits(a.cpu(), b)
    x0, x1, res, _ = _inputs(torch.float32, torch.float32, True, True, False, (3, 37))
    check_forward(x0, x1, res, None, 3, 0.5, torch.float32)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(width=32), min_size=3, max_size=3),
    rs=st.floats(width=32),
    p=st.sampled_from([0.0, 0.1, 1 / 3, 0.5, 0.999]),
    seed=st.integers(0, 2**64 - 1),
)
def test_numba_any_float32_values(values, rs, p, seed):
    # any float32 operands (subnormals, Inf, NaN, the extremes) give the oracle's bits
    x0, x1, res = (torch.tensor([[v] * 4], dtype=torch.float32) for v in values)
    rowscale = torch.tensor([rs])
    for rdtype in (torch.float32, torch.bfloat16):
        got = nd.dropout_add(x0, x1, res, rowscale, seed, p, rdtype, True)
        for a, b in zip(got, oracle(x0, x1, res, rowscale, seed, p, rdtype), strict=True):
            assert_same_bits(a, b)


# --- invariance and layouts --------------------------------------------------------------


def test_batch_and_thread_count_invariance():
    x0, x1, res, rs = _inputs(torch.bfloat16, torch.float32, True, True, True, (96, 1024), 41)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = nd.dropout_add(x0, x1, res, rs, 77, 0.2, torch.float32, True)
        sum_one = nd.dropout_add(x0, x1, res, None, 77, 0.0, torch.float32, False)[0]
        torch.set_num_threads(2)
        two = nd.dropout_add(x0, x1, res, rs, 77, 0.2, torch.float32, True)
        sum_two = nd.dropout_add(x0, x1, res, None, 77, 0.0, torch.float32, False)[0]
        back_two = nd.dropout_add_backward(res, rs, 77, 0.2, x0.dtype, x1.dtype, res.dtype)
        torch.set_num_threads(1)
        back_one = nd.dropout_add_backward(res, rs, 77, 0.2, x0.dtype, x1.dtype, res.dtype)
    finally:
        torch.set_num_threads(saved)
    for a, b in zip(one, two, strict=True):
        assert_same_bits(a, b)
    assert_same_bits(sum_one, sum_two)
    for a, b in zip(back_one, back_two, strict=True):
        assert_same_bits(a, b)
    # the first rows of a call are a smaller call's rows
    part = nd.dropout_add(x0[:5], x1[:5], res[:5], rs[:5], 77, 0.2, torch.float32, True)
    for a, b in zip(part, one, strict=True):
        assert_same_bits(a, b[:5])
    assert torch.equal(one[1], philox.keep_mask(77, 96, 1024, 0.2))
    assert torch.equal(one[2], philox.keep_mask(77, 96, 1024, 0.2, stream=1))


def test_strided_rows_and_zero_size():
    base = _values(torch.float32, (6, 80), 51)
    x0 = base[::2, 3:40]  # row-strided: read in place
    x1 = base[1::2, 40:77]
    res = _values(torch.float32, (37, 3), 52).t()  # strided columns: copied
    check_forward(x0, x1, res, None, 9, 0.4, torch.float32)
    check_forward(x0, x1, res, None, 9, 0.0, torch.float32)  # the fast sum's rows
    check_backward(base[::2, 3:40], None, 9, 0.4, torch.float32, torch.float32, None)
    for shape in ((0, 5), (4, 0)):
        h, m0, m1 = nd.dropout_add(torch.ones(shape), None, None, None, 0, 0.5, torch.float32, True)
        assert h.shape == m0.shape == shape and m1 is None
        dx0, dx1, dres = nd.dropout_add_backward(
            torch.ones(shape), None, 0, 0.5, torch.float16, None, torch.float32
        )
        assert dx0.shape == dres.shape == shape and dx0.dtype == torch.float16 and dx1 is None


def test_errors_are_the_torch_versions():
    x = torch.ones(2, 3)
    calls = [
        ((x, None, torch.ones(3, 2), None, 0, 0.5, x.dtype), ValueError,
         r"residual must have shape \(2, 3\)"),
        ((x, None, None, torch.ones(3), 0, 0.5, x.dtype), ValueError,
         r"rowscale must have shape \(2,\)"),
        ((x.int(), None, None, None, 0, 0.5, x.dtype), TypeError, "x0 must be a float tensor"),
        ((x, None, None, None, 0, 1.5, x.dtype), ValueError,
         "dropout probability has to be between 0 and 1"),
        ((torch.ones(3), None, None, None, 0, 0.5, x.dtype), ValueError,
         r"x0 must be an \(M, N\) row view"),
        ((x, None, None, None, 0.5, 0.5, x.dtype), TypeError, "dropout seed must be an int"),
        ((x, None, None, None, 0, 0.5, torch.int32), TypeError, "must be a float dtype"),
    ]  # fmt: skip
    for args, error, message in calls:
        for dropout_add in (nd.dropout_add, td.dropout_add):
            with pytest.raises(error, match=message):
                dropout_add(*args, False)
    for backward in (nd.dropout_add_backward, td.dropout_add_backward):
        with pytest.raises(TypeError, match="gradient dtypes must be float dtypes"):
            backward(x, None, 0, 0.5, x.dtype, torch.int64, None)
        with pytest.raises(TypeError, match="dropout seed must be an int"):
            backward(x, None, 0.5, 0.5, x.dtype, None, None)


def test_the_kernels_record_the_code_they_inline():
    # numba's cache sees only _numba_dropout.py: see DEPENDS_SHA256 there
    digest = nd.depends_digest()
    assert digest == nd.DEPENDS_SHA256, (
        f"inlined numba code changed: set DEPENDS_SHA256 in _numba_dropout.py to {digest!r}"
    )
    assert len(hashlib.sha256(b"").hexdigest()[:16]) == len(digest)
