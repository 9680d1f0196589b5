"""The dropout-add's fast paths give the bits of the general ones and decline what they
were not built for: the numba kernels' three-piece sum (no x1, no rowscale) and
two-piece backward against the torch version and their rowscale path (a rowscale of
ones: the same exact sum; the general path for float64 terms, whose products with a
rowscale are not exact, else the rowscale's own decided pass), and fused_norm's direct calls (no custom op in eager inference, ``EagerDropoutAdd`` in
eager training, dresidual passed on) against the op's path (``ops.FAST_PATHS`` off)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import layernorm
from layernorm import compiled, fused, ops
from layernorm.backends import _dropout_add as td
from layernorm.backends import _numba_dropout as nd
from layernorm.backends import _philox as philox

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def same_bits(a: torch.Tensor, b: torch.Tensor, nan_payloads: bool = True) -> None:
    """Equal bit for bit; NaN wherever the other is NaN, payloads aside, when not
    ``nan_payloads`` (torch writes bfloat16 NaN as 0xFFFF, numba as 0x7FC0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.bool:
        assert torch.equal(a, b)
        return
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    keep = torch.ones_like(a, dtype=torch.bool)
    if not nan_payloads:
        assert torch.equal(a.isnan(), b.isnan())
        keep = ~a.isnan()
    assert torch.equal(a[keep].view(width), b[keep].view(width))


def near_midpoints(dtype: torch.dtype, rdtype: torch.dtype, p: float, seed: int):
    """``x`` over many binades with specials and signed zeros, and residuals that cancel
    ``x·s`` down to its low bits (the error terms decide the rounding)."""
    g = torch.Generator().manual_seed(seed)
    shape = (16, 97)
    top = 6 if torch.float16 in (dtype, rdtype) else 40
    mag = torch.rand(shape, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(
        -top, top, shape, generator=g
    )
    x = (mag * (torch.randint(0, 2, shape, generator=g) * 2 - 1)).to(dtype)
    nudge = 1 + torch.randint(-4, 5, shape, generator=g) * 2.0**-30
    res = (-(x.double() * philox.dropout_scale(p)) * nudge).to(rdtype)
    res[::3] = torch.randn(res[::3].shape, generator=g).to(rdtype)
    x.view(-1)[:8] = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1, -0.0, 0.0])
    res.view(-1)[:8] = torch.tensor([1.0, math.inf, 2.0, -0.0, -0.0, -math.inf, 0.0, math.nan])
    return x, res


@pytest.mark.parametrize("p", [0.0, 0.1, 1 / 3, 0.999, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_three_piece_sum_is_the_general_path(dtype, p):
    # no x1 and no rowscale: the three-piece kernel; a rowscale of ones takes the general
    # seven-piece one for float64 x (else the decided pass of x·1, then the general
    # one) with the same exact sum, so the same bits; the torch version too
    ones = torch.ones(16, dtype=torch.float64)
    for rdtype in {dtype, torch.float32, torch.float64}:
        x, res = near_midpoints(dtype, rdtype, p, 3)
        for r in (res, None):
            fast = nd.dropout_add(x, None, r, None, 9, p, rdtype, True)
            general = nd.dropout_add(x, None, r, ones, 9, p, rdtype, True)
            reference = td.dropout_add(x, None, r, None, 9, p, rdtype, True)
            for a, b, c in zip(fast[:2], general[:2], reference[:2], strict=True):
                same_bits(a, b)
                same_bits(a, c, nan_payloads=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_x1_without_dropout_is_the_general_path(dtype):
    # x1 with p = 0 and no rowscale: the three-piece sum of x0, x1 and r, and no Philox
    # draw; a rowscale of ones takes the general seven-piece path: the same bits
    ones = torch.ones(16, dtype=torch.float64)
    for rdtype in {dtype, torch.float32, torch.float64}:
        x, res = near_midpoints(dtype, rdtype, 0.0, 5)
        x1 = (-res.double() * (1 + 2.0**-40)).to(dtype).flip(0)  # cancels x0 + r in places
        x1.view(-1)[:8] = torch.tensor([0.0, -0.0, -math.inf, -0.0, -0.0, math.nan, -0.0, 1])
        for r in (res, None):
            fast = nd.dropout_add(x, x1, r, None, 9, 0.0, rdtype, True)
            general = nd.dropout_add(x, x1, r, ones, 9, 0.0, rdtype, True)
            reference = td.dropout_add(x, x1, r, None, 9, 0.0, rdtype, True)
            assert fast[1].all() and fast[2].all()  # p = 0 keeps everything
            for a, b, c in zip(fast, general, reference, strict=True):
                same_bits(a, b)
                same_bits(a, c, nan_payloads=False)


def test_three_piece_sum_float64_extremes():
    # float64 products near the subnormal range and near overflow: whatever the general
    # path computes there (docs/contract.md §7), the three-piece path computes too
    f64 = torch.float64
    x = torch.tensor([[2.0**-1070, -(2.0**-1000), 1.5 * 2.0**-1022, 1.7e308, -1.7e308, 3.0]])
    res = torch.tensor([[2.0**-1074, 2.0**-1040, -(2.0**-1022), 1e308, 1.7e308, -3.3]])
    ones = torch.ones(1, dtype=f64)
    for p in (0.0, 0.3, 0.9):
        fast = nd.dropout_add(x, None, res, None, 0, p, f64, False)[0]
        same_bits(fast, nd.dropout_add(x, None, res, ones, 0, p, f64, False)[0])


_DIGITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


def _oracle(value: Fraction, dtype: torch.dtype) -> float:
    """The exact positive ``value`` rounded once to nearest-even in ``dtype`` (its normal
    range): an oracle that shares nothing with the kernels."""
    e = math.frexp(float(value))[1] - 1
    if Fraction(2) ** e > value:  # float() rounded up to the next binade
        e -= 1
    unit = Fraction(2) ** (e - _DIGITS[dtype] + 1)
    return float(round(value / unit) * unit)  # round(): ties to even


def _low_parts(x: torch.Tensor, c0: torch.Tensor, s: float) -> list[Fraction]:
    """``x·s - c0`` exactly, element by element (``c0 = RN64(x·s)``: the TwoProd error)."""
    return [
        Fraction(v) * Fraction(s) - Fraction(c)
        for v, c in zip(x.view(-1).tolist(), c0.view(-1).tolist(), strict=True)
    ]


def _midpoint_residuals(h_dtype: torch.dtype, seed: int):
    """float32 ``x`` and float64 residuals ``r`` such that, at ``p = 0.1``, ``t =
    RN64(RN64(x·s) + r)`` lies on a midpoint between two neighbours in ``h_dtype`` or up
    to two of ``r``'s float64 units from one, with ``t`` about a tenth of ``x·s``: the
    low part ``x·s - RN64(x·s)`` decides the side of those on the midpoint. Also the
    exact values ``x·s + r``, as Fractions."""
    g = torch.Generator().manual_seed(seed)
    s = philox.dropout_scale(0.1)
    x = (torch.rand(8, 64, generator=g, dtype=torch.float64) + 0.5).float()
    offsets = torch.randint(-2, 3, (x.numel(),), generator=g).tolist()
    c0 = x.double() * s  # RN64 of the product, as the kernels' TwoProd
    y = (c0 * 0.1).to(h_dtype).double()  # values of h's dtype (positive, normal)
    half_unit = torch.ldexp(torch.ones_like(y), torch.frexp(y).exponent - 1 - _DIGITS[h_dtype])
    res = torch.tensor([
        r + k * math.ulp(r)  # (r rounded: its units are coarser than t's)
        for r, k in zip((y + half_unit - c0).view(-1).tolist(), offsets, strict=True)
    ], dtype=torch.float64).view(x.shape)  # fmt: skip
    exact = [
        Fraction(v) * Fraction(s) + Fraction(r)
        for v, r in zip(x.view(-1).tolist(), res.view(-1).tolist(), strict=True)
    ]
    return x, res, exact


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_decided_pass_settles_sums_on_a_midpoint_by_the_low_part(h_dtype):
    # _h1_row_decided (no x1, no rowscale, h narrower than float64): float64 sums t on or
    # near a midpoint of h's dtype; on it, the low part says which side the exact sum
    # lies on, and the decided pass takes it (the oracle's and the torch version's bits)
    x, res, exact = _midpoint_residuals(h_dtype, 11)
    h, mask, _ = nd.dropout_add(x, None, res, None, 5, 0.1, h_dtype, True)
    reference = td.dropout_add(x, None, res, None, 5, 0.1, h_dtype, True)
    same_bits(h, reference[0])
    kept = mask.view(-1).tolist()
    got = h.double().view(-1).tolist()
    for v, k, out in zip(exact, kept, got, strict=True):
        assert not k or out == _oracle(v, h_dtype)
    assert _settled(x, mask, res, 0.1, h_dtype).all()


def _settled(x, keep, res, p, h_dtype) -> torch.Tensor:
    """Which elements the decided pass settles, each as a row of its own."""
    wide0, keep, wide_r = x.double().view(-1).numpy(), keep.view(-1).numpy(), res.view(-1).numpy()
    one = nd._flat(torch.empty(1, 1, dtype=h_dtype))[0]
    s = philox.dropout_scale(p)
    return torch.tensor([
        nd._h1_row_decided(one, wide0[k : k + 1], keep[k : k + 1], wide_r[k : k + 1], 1.0, s, 1)
        for k in range(x.numel())
    ])  # fmt: skip


def _check_declined(x, res, p, want, h_dtype=torch.float32):
    """Every kept element of the row ``x`` (float64 ``res``, seed 0) is declined by the
    decided pass and rounded to ``want`` (the oracle's), as the torch version rounds it."""
    h, mask, _ = nd.dropout_add(x, None, res, None, 0, p, h_dtype, True)
    same_bits(h, td.dropout_add(x, None, res, None, 0, p, h_dtype, True)[0])
    kept = mask.view(-1)
    assert kept.sum() > 10 and torch.equal(h.view(-1)[kept].double(), want[kept])
    assert not _settled(x, mask, res, p, h_dtype)[kept].any()


def _half_unit_products(low: float, high: float, seed: int):
    """float64 ``x`` in ``[low, high)`` whose product with ``s = 1.25`` (``p = 0.2``) has
    a low part of exactly half a unit of ``c0 = RN64(x·s)``: ``(x, c0, c1)``."""
    s = philox.dropout_scale(0.2)
    assert s == 1.25
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(4096, generator=g, dtype=torch.float64) * (high - low) + low
    c0 = x * s
    c1 = torch.tensor([float(v) for v in _low_parts(x, c0, s)], dtype=torch.float64)
    pick = c1.abs() == torch.tensor([math.ulp(c) / 2 for c in c0.tolist()], dtype=torch.float64)
    return x[pick][:64], c0[pick][:64], c1[pick][:64]


def test_the_decided_pass_declines_a_low_part_that_crosses_a_binade():
    # t = 1 exactly from x·s near 2^29 and r = 1 - RN64(x·s) (float64), the low part of
    # the product between -2^-24 and -2^-25: the exact sum lies below 1 - 2^-25, the
    # midpoint under 1 in float32 (half of 1 - 2^-24's unit), so it rounds to 1 - 2^-24;
    # t's own midpoint, 1 + 2^-24, is further away than the low part. Only the guard
    # |lo| <= 2^-30·|t| sends these to the exact path.
    s = philox.dropout_scale(0.1)
    g = torch.Generator().manual_seed(13)
    x = ((torch.rand(4096, generator=g, dtype=torch.float64) + 1) * 2.0**29 / s).float()
    c0 = x.double() * s
    pick = torch.tensor([-(2.0**-24) < float(v) < -(2.0**-25) for v in _low_parts(x, c0, s)])
    x, c0 = x[pick][:64].view(1, -1), c0[pick][:64].view(1, -1)
    want = torch.full(x.shape, 1 - 2.0**-24, dtype=torch.float64).view(-1)
    _check_declined(x, 1 - c0, 0.1, want)


def test_the_decided_pass_declines_a_low_part_that_reaches_the_midpoint():
    # float64 x and s = 1.25 (p = 0.2): x·s = c0 + c1 with c1 = ±2^-52 (half of c0's
    # unit, c0 in [2, 4)), and r = M - c0 - c1 for a float32 midpoint M in [1, 2): t is
    # one float64 unit from M, on the side away from c1, and the exact sum is M itself, a
    # tie (to even). |d| = |lo|: the decided pass must not take t's side.
    x, c0, c1 = _half_unit_products(2.0, 2.8, 14)
    midpoint = (c0 - 1.5).float().double() + 2.0**-24  # float32 values, plus half a unit
    res = midpoint - c0 - c1  # exact: multiples of 2^-52 within (-2, -1)
    want = torch.tensor([_oracle(Fraction(m), torch.float32) for m in midpoint.tolist()])
    _check_declined(x.view(1, -1), res.view(1, -1), 0.2, want.double())


def test_the_decided_pass_declines_sums_below_the_smallest_normal():
    # float16's subnormals (below 2^-14) are spaced as its lowest binade, not as t's:
    # the same ties as above at float16 midpoints k·2^-24 + 2^-25 near 2^-19, where the
    # midpoint that t's bits would give is not one
    x, c0, c1 = _half_unit_products(2.0**-19 / 1.25, 1.15 * 2.0**-19 / 1.25, 15)
    midpoint = torch.randint(24, 40, c0.shape).double() * 2.0**-24 + 2.0**-25
    res = midpoint - c0 - c1  # exact: |res| < 2^-19, multiples of half c0's unit
    want = (midpoint / 2.0**-24).round() * 2.0**-24  # ties to even, exact
    _check_declined(x.view(1, -1), res.view(1, -1), 0.2, want, torch.float16)


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_decided_pass_settles_random_rows(h_dtype):
    # the point of the pass: random rows need no exact one (and give its bits)
    g = torch.Generator().manual_seed(12)
    x, res = torch.randn(2, 4096, generator=g), torch.randn(2, 4096, generator=g) * 3
    s = philox.dropout_scale(0.1)
    keep = torch.rand(2, 4096, generator=g) > 0.1
    for i in range(2):
        row = torch.empty(4096, dtype=h_dtype)
        assert nd._h1_row_decided(
            nd._flat(row.view(1, -1))[0], x[i].double().numpy(), keep[i].numpy(),
            res[i].double().numpy(), 1.0, s, 4096,
        )  # fmt: skip
    h = nd.dropout_add(x, None, res.to(h_dtype), None, 3, 0.1, h_dtype, False)[0]
    same_bits(h, td.dropout_add(x, None, res.to(h_dtype), None, 3, 0.1, h_dtype, False)[0])


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_piece_backward_is_the_general_path(dtype, p):
    dh, _ = near_midpoints(dtype, dtype, p, 5)
    ones = torch.ones(16, dtype=torch.float64)
    for x0_dtype in {dtype, torch.float32, torch.bfloat16}:
        for grads in ((None, None), (x0_dtype, dtype), (x0_dtype, torch.float16)):
            fast = nd.dropout_add_backward(dh, None, 4, p, x0_dtype, *grads)
            general = nd.dropout_add_backward(dh, ones, 4, p, x0_dtype, *grads)
            reference = td.dropout_add_backward(dh, None, 4, p, x0_dtype, *grads)
            for a, b, c in zip(fast, general, reference, strict=True):
                if a is None:
                    assert b is None and c is None
                    continue
                same_bits(a, b)
                same_bits(a, c, nan_payloads=False)


def test_backward_dresidual_of_dh_dtype_is_a_copy_of_dh():
    dh = torch.randn(4, 8).t()  # strided rows are read in place, the copy contiguous
    dh = dh.contiguous()[:, :5]
    dh[0, 0] = torch.tensor(float("nan"))
    _, _, dres = nd.dropout_add_backward(dh, None, 1, 0.2, torch.float32, None, torch.float32)
    same_bits(dres, dh)
    assert dres.is_contiguous() and dres.data_ptr() != dh.data_ptr()


# --- fused_norm's direct calls ---------------------------------------------------------


class _Spy:
    """Counts the calls that skip the op: fused's implementation called directly (the op
    calls its own copy), or the whole call taken by the compiled front door."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = fused._dropout_add_impl
        compiled.status()  # loaded first: loading replaces compiled.fused
        front_door = compiled.fused

        def spy(*args):
            self.calls += 1
            return original(*args)

        def front_door_spy(*args):
            result = front_door(*args)
            self.calls += result is not None
            return result

        monkeypatch.setattr(fused, "_dropout_add_impl", spy)
        monkeypatch.setattr(compiled, "fused", front_door_spy)


def _case(shape, normalized, dtype, strided):
    g = torch.Generator().manual_seed(len(shape) + len(normalized))
    full = (*shape[:-1], 2 * shape[-1]) if strided else shape
    x = torch.randn(full, generator=g).to(dtype)
    r = torch.randn(full, generator=g).to(dtype)
    x1 = torch.randn(full, generator=g).to(dtype)
    if strided:
        x, r, x1 = x[..., ::2], r[..., ::2], x1[..., ::2]
    w = (torch.rand(normalized, generator=g) + 0.5).to(dtype)
    b = torch.randn(normalized, generator=g).to(dtype)
    return x, r, x1, w, b


CASES = [
    ((7,), (7,), False),
    ((5, 33), (33,), False),
    ((2, 3, 40), (40,), True),
    ((2, 3, 4, 6), (4, 6), False),
    ((0, 16), (16,), False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape,normalized,strided", CASES)
def test_direct_inference_is_the_ops_result(monkeypatch, shape, normalized, strided, dtype):
    x, r, x1, w, b = _case(shape, normalized, dtype, strided)
    m = math.prod(shape[: len(shape) - len(normalized)])
    rs = torch.rand(m, dtype=torch.float32) + 0.5
    calls = [
        {"residual": r, "dropout_p": 0.2, "seed": 3, "return_dropout_mask": True},
        {"residual": r, "x1": x1, "rowscale": rs, "dropout_p": 0.5, "seed": 4,
         "residual_dtype": torch.float32, "return_dropout_mask": True},
    ]  # fmt: skip
    for kwargs in calls:
        monkeypatch.setattr(ops, "FAST_PATHS", False)
        spy = _Spy(monkeypatch)
        slow = layernorm.fused_norm(x, normalized, w, b, **kwargs)
        assert spy.calls == 0  # the op
        monkeypatch.setattr(ops, "FAST_PATHS", True)
        fast = layernorm.fused_norm(x, normalized, w, b, **kwargs)
        assert spy.calls == 1
        for a, c in zip(fast, slow, strict=True):
            if a is None:
                assert c is None
            else:
                same_bits(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,normalized,strided", CASES)
def test_eager_training_is_the_ops_gradients(monkeypatch, shape, normalized, strided, dtype):
    def grads(fast: bool, with_x1: bool):
        monkeypatch.setattr(ops, "FAST_PATHS", fast)
        x, r, x1, w, b = (
            t.detach().requires_grad_() for t in _case(shape, normalized, dtype, strided)
        )
        out = layernorm.fused_norm(
            x, normalized, w, b, residual=r, x1=x1 if with_x1 else None, dropout_p=0.3, seed=8
        )
        dy = torch.randn(out.y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        inputs = (x, r, w, b, x1) if with_x1 else (x, r, w, b)
        fn = out.residual_out.grad_fn
        while "View" in type(fn).__name__:  # h is a view of the op's rows
            fn = fn.next_functions[0][0]
        return fn, torch.autograd.grad((out.y * dy).sum(), inputs)

    for with_x1 in (False, True):
        fast_fn, fast = grads(True, with_x1)
        slow_fn, slow = grads(False, with_x1)
        # Python's direct path, or the compiled front door's node (contiguous tensors)
        assert "EagerDropoutAdd" in type(fast_fn).__name__ or (
            fast_fn.name() == "layernorm::DropoutAddBackward"
        )
        assert "EagerDropoutAdd" not in type(slow_fn).__name__
        for a, c in zip(fast, slow, strict=True):
            same_bits(a, c)


def test_dresidual_is_dh_passed_on_and_double_backward_is_the_ops():
    x, r = torch.randn(6, 32, requires_grad=True), torch.randn(6, 32, requires_grad=True)
    dh = torch.randn(6, 32)
    h = layernorm.fused_norm(x, 32, residual=r, dropout_p=0.4, seed=2).residual_out
    gx, gr = torch.autograd.grad(h, (x, r), dh)
    assert gr.data_ptr() == dh.data_ptr()  # as torch's add: no copy
    _, _, dres = td.dropout_add_backward(dh, None, 2, 0.4, torch.float32, None, torch.float32)
    same_bits(gr, dres)
    # create_graph: the backward op (one rounding of its transpose), the same as the op's
    results = []
    for fast in (True, False):
        ops.FAST_PATHS = fast
        try:
            x2 = x.detach().requires_grad_()
            r2 = r.detach().requires_grad_()
            h = layernorm.fused_norm(x2, 32, residual=r2, dropout_p=0.4, seed=2).residual_out
            dh2 = dh.clone().requires_grad_()
            gx, gr = torch.autograd.grad(h, (x2, r2), dh2, create_graph=True)
            results.append(torch.autograd.grad((gx * 3 + gr * 5).sum(), dh2)[0])
        finally:
            ops.FAST_PATHS = True
    same_bits(results[0], results[1])


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "op"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no-residual"])
def test_without_dropout_every_gradient_is_dh_passed_on(monkeypatch, fast, residual):
    """x1 without dropout (p = 0: every element kept, s = 1): dx = RN(dh) and dx1 = RN(dh)
    are dh itself, passed on as torch's add passes its gradient (no kernel, no copy), in
    the C++ node, the eager autograd and the op's; the op's backward op and torch's sum
    give the same values."""
    monkeypatch.setattr(ops, "FAST_PATHS", fast)
    x, x1, r = (torch.randn(3, 4, 32, requires_grad=True) for _ in range(3))
    dh = torch.randn(3, 4, 32)
    leaves = (x, x1, r) if residual else (x, x1)
    h = layernorm.fused_norm(x, 32, residual=r if residual else None, x1=x1).residual_out
    grads = torch.autograd.grad(h, leaves, dh)
    theirs = torch.autograd.grad(sum(leaves), leaves, dh)
    for ours, torchs in zip(grads, theirs, strict=True):
        assert ours.data_ptr() == dh.data_ptr() == torchs.data_ptr()
    rdtype = torch.float32 if residual else None
    general = td.dropout_add_backward(dh.view(12, 32), None, 0, 0.0, torch.float32,
                                      torch.float32, rdtype)  # fmt: skip
    for ours, want in zip(grads, general, strict=False):
        same_bits(ours, want.view(3, 4, 32))


def test_direct_calls_decline_what_a_mechanism_sees(monkeypatch):
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    spy = _Spy(monkeypatch)
    expected = layernorm.fused_norm(x, 16, residual=r, dropout_p=0.5, seed=1)
    assert spy.calls == 1

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        got = layernorm.fused_norm(x, 16, residual=r, dropout_p=0.5, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = layernorm.fused_norm(x, 16, residual=r, dropout_p=0.5, seed=1)
    assert spy.calls == 1  # both went through the op
    same_bits(got.residual_out, expected.residual_out)
    same_bits(autocast.residual_out, expected.residual_out)
