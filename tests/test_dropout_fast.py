"""The dropout-add's fast paths give the bits of the general ones and decline what they
were not built for: the numba kernels' three-piece sum (no x1, no rowscale) and
two-piece backward against their general path (a rowscale of ones: the same exact sum),
and fused_norm's direct calls (no custom op in eager inference, ``EagerDropoutAdd`` in
eager training, dresidual passed on) against the op's path (``ops.FAST_PATHS`` off)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import layernorm
from layernorm import fused, ops
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
    # seven-piece one with the same exact sum, so the same bits; the torch version too
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
    """Counts the direct calls of fused's implementation (the op calls its own copy)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = fused._dropout_add_impl

        def spy(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(fused, "_dropout_add_impl", spy)


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
        assert "EagerDropoutAdd" in type(fast_fn).__name__
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
