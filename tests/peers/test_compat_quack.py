"""quack's RMSNorm tests, re-expressed against the shims of :mod:`layernorm.compat.quack`.

Source: Dao-AILab/quack ``tests/test_rmsnorm.py`` (at c8ec317): ``test_rmsnorm_forward_
backward``, ``test_rmsnorm_weight_offset``, ``test_rmsnorm_noncontiguous_grad``,
``test_rmsnorm_compile_2d_then_4d``, ``test_rmsnorm_qk``, ``test_rmsnorm_strided_tensor``,
``test_rmsnorm_input_validation``, ``test_rmsnorm_with_bias``,
``test_rmsnorm_with_residual``, ``test_rmsnorm_prenorm_false``,
``test_rmsnorm_residual_dtype_override``, ``test_rmsnorm_fwd_empty``. Kept: their dtypes,
tolerances (``TOLERANCES``, rtol 1e-3, the weight gradient's sqrt(M) and 1-ulp rules),
eps, references (quack's float32 ``rmsnorm_ref``, rewritten as ``_reference``), what they
compare. Where ours and the float32 reference differ past the tolerance, ours must be
nearer float64 (``assert_close_or_nearer``). Shrunk: M 8192 -> 64 and N up to 4096 (quack:
to 262144); the strided tensor (8, 4096, 576) -> (2, 64, 576); the noncontiguous-gradient
input (2, 1024, 256) -> (2, 64, 256); ``use_compile`` runs on one case each (fullgraph).
Not mapped: the CUDA-only checks (CPU tensors and float64 are accepted here: a superset),
the compile cache and the tuned-config tests (quack's kernels' internals).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _peers import assert_close_or_nearer

import layernorm
from layernorm.compat import quack

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
TOLERANCES = {BF16: 1e-1, F16: 1e-2, F32: 1e-4}


def _reference(x, w=None, bias=None, residual=None, eps=1e-6, weight_offset=0.0, dtype=F32):
    """quack's ``rmsnorm_ref`` (rewritten), computed in ``dtype`` (float32 as quack's, or
    float64): ``out`` in x's dtype, and with a residual ``(out, h)`` with ``h`` in the
    residual's."""
    h = x.to(dtype)
    if residual is not None:
        h = h + residual.to(dtype)
    z = h / torch.sqrt(h.square().mean(-1, keepdim=True) + eps)
    out = z * (w.to(dtype) + weight_offset) if w is not None else z
    if bias is not None:
        out = out + bias.to(dtype)
    if residual is None:
        return out.to(x.dtype)
    return out.to(x.dtype), h.to(residual.dtype)


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def _64(t):
    return None if t is None else t.double()


def _close(ours, ref, ref64, atol, rtol=1e-3):
    """quack's assert_close, or ours nearer float64 than quack's float32 reference."""
    assert_close_or_nearer(ours.detach(), ref.detach(), ref64.detach(), atol=atol, rtol=rtol)


def _compare_grads(pairs, atol):
    for ours, ref, ref64 in pairs:
        _close(ours.grad, ref.grad, ref64.grad, atol)


@pytest.mark.parametrize("weight_dtype", [BF16, F32, None])
@pytest.mark.parametrize("input_dtype", [BF16, F16, F32])
@pytest.mark.parametrize("N", [192, 256, 760, 1024, 1128, 4096])
@pytest.mark.parametrize("M", [1, 199])
def test_rmsnorm_forward_backward(M, N, input_dtype, weight_dtype):
    """quack ``test_rmsnorm_forward_backward``: output, x gradient (atol by dtype, rtol
    1e-3), weight gradient (5e-6·sqrt(M) for float32, 2 ulps of the largest otherwise)."""
    atol = TOLERANCES[input_dtype]
    torch.random.manual_seed(0)
    x = torch.randn(M, N, dtype=input_dtype)
    weight = torch.randn(N, dtype=weight_dtype) if weight_dtype is not None else None
    (x_o, w_o), (x_r, w_r), (x_64, w_64) = (
        _leaves(x, weight),
        _leaves(x, weight),
        _leaves(x.double(), _64(weight)),
    )
    out = quack.rmsnorm(x_o, w_o, eps=1e-6)
    out_ref = _reference(x_r, w_r, eps=1e-6)
    out_64 = _reference(x_64, w_64, eps=1e-6, dtype=F64)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    out_ref.backward(grad_out)
    out_64.backward(grad_out.double())
    assert out.shape == x.shape and out.dtype == input_dtype
    _close(out, out_ref, out_64, atol)
    _close(x_o.grad, x_r.grad, x_64.grad, atol)
    if weight_dtype is not None:
        if weight_dtype == F32:
            weight_atol = 5e-6 * (M**0.5)
        else:
            weight_atol = 2 * torch.finfo(weight_dtype).eps * float(w_r.grad.abs().max())
        _close(w_o.grad, w_r.grad, w_64.grad, weight_atol)


@pytest.mark.parametrize("weight_dtype", [BF16, F32])
@pytest.mark.parametrize("input_dtype", [BF16, F32])
@pytest.mark.parametrize("N", [1024, 4096])
@pytest.mark.parametrize("M", [1, 199])
def test_rmsnorm_weight_offset(M, N, input_dtype, weight_dtype):
    """quack ``test_rmsnorm_weight_offset``: Gemma's ``x_hat · (1 + w)`` with a weight of
    0.1·randn; output, x and weight gradients."""
    atol = TOLERANCES[input_dtype]
    torch.random.manual_seed(0)
    x = torch.randn(M, N, dtype=input_dtype)
    weight = 0.1 * torch.randn(N, dtype=weight_dtype)
    (x_o, w_o), (x_r, w_r), (x_64, w_64) = (
        _leaves(x, weight),
        _leaves(x, weight),
        _leaves(x.double(), weight.double()),
    )
    out = quack.rmsnorm(x_o, w_o, weight_offset=1.0)
    out_ref = _reference(x_r, w_r, weight_offset=1.0)
    out_64 = _reference(x_64, w_64, weight_offset=1.0, dtype=F64)
    grad_out = torch.randn_like(out)
    for o, g in ((out, grad_out), (out_ref, grad_out), (out_64, grad_out.double())):
        o.backward(g)
    _close(out, out_ref, out_64, atol)
    _close(x_o.grad, x_r.grad, x_64.grad, atol)
    if weight_dtype == F32:
        weight_atol = 5e-6 * (M**0.5)
    else:
        weight_atol = 2 * torch.finfo(weight_dtype).eps * float(w_r.grad.abs().max())
    _close(w_o.grad, w_r.grad, w_64.grad, weight_atol)


@pytest.mark.parametrize("input_dtype", [BF16, F32])
def test_rmsnorm_noncontiguous_grad(input_dtype):
    """quack ``test_rmsnorm_noncontiguous_grad`` (its issue #88): a 3-D input whose
    gradient from ``.sum()`` is an expanded, non-contiguous tensor."""
    atol = TOLERANCES[input_dtype]
    torch.random.manual_seed(0)
    x = torch.randn(2, 64, 256, dtype=input_dtype)
    w = torch.ones(256)
    (x_o,), (x_r,), (x_64,) = _leaves(x), _leaves(x), _leaves(x.double())
    out = quack.rmsnorm(x_o, w, eps=1e-6)
    out_ref = _reference(x_r, w, eps=1e-6)
    out_64 = _reference(x_64, w, eps=1e-6, dtype=F64)
    for o in (out, out_ref, out_64):
        o.sum().backward()
    _close(out, out_ref, out_64, atol)
    _close(x_o.grad, x_r.grad, x_64.grad, atol)


def _per_head_case(B, S, H, D, input_dtype, use_bias, use_residual, call):
    atol = TOLERANCES[input_dtype]
    torch.random.manual_seed(0)
    x = torch.randn(B, S, H, D, dtype=input_dtype)
    weight = torch.randn(H, D)
    bias = torch.randn(H, D) if use_bias else None
    residual = torch.randn(B, S, H, D, dtype=input_dtype) if use_residual else None
    ours = _leaves(x, weight, bias, residual)
    ref = _leaves(x, weight, bias, residual)
    ref64 = _leaves(*(_64(t) for t in (x, weight, bias, residual)))
    out = call(ours[0], ours[1], bias=ours[2], residual=ours[3], eps=1e-6)
    out_ref, out_64 = (
        _reference(r[0], r[1], r[2], r[3], eps=1e-6, dtype=d) for r, d in ((ref, F32), (ref64, F64))
    )
    if use_residual:
        out_ref, out_64 = out_ref[0], out_64[0]
    grad_out = torch.randn_like(out)
    for o, g in ((out, grad_out), (out_ref, grad_out), (out_64, grad_out.double())):
        o.backward(g)
    assert out.shape == x.shape and out.dtype == input_dtype
    _close(out, out_ref, out_64, atol)
    _compare_grads([(o, r, r64) for o, r, r64 in zip(ours, ref, ref64, strict=True)
                    if o is not None], atol)  # fmt: skip


@pytest.mark.parametrize("input_dtype", [BF16, F16, F32])
@pytest.mark.parametrize(("use_bias", "use_residual"), [(False, False), (True, True)])
@pytest.mark.parametrize(("B", "S", "H", "D"), [(2, 16, 4, 64), (1, 1, 32, 128)])
def test_rmsnorm_qk(B, S, H, D, input_dtype, use_bias, use_residual):
    """quack ``test_rmsnorm_qk``: per-head weight (and bias) of shape (H, D) on a
    (B, S, H, D) input, each head normalized over D; output and every gradient."""
    _per_head_case(B, S, H, D, input_dtype, use_bias, use_residual, quack.rmsnorm)


def test_rmsnorm_compile_2d_then_4d():
    """quack ``test_rmsnorm_compile_2d_then_4d``: under ``torch.compile(fullgraph=True)``,
    a 2-D input with a 1-D weight, then a 4-D input with per-head weight, bias and
    residual, without a reset in between."""
    torch._dynamo.reset()
    f = torch.compile(quack.rmsnorm, fullgraph=True)
    torch.random.manual_seed(0)
    x = torch.randn(32, 256, dtype=BF16)
    w = torch.randn(256)
    (x_o, w_o), (x_r, w_r), (x_64, w_64) = _leaves(x, w), _leaves(x, w), _leaves(_64(x), _64(w))
    out = f(x_o, w_o, eps=1e-5)
    out_ref = _reference(x_r, w_r, eps=1e-5)
    out_64 = _reference(x_64, w_64, eps=1e-5, dtype=F64)
    for o in (out, out_ref, out_64):
        o.sum().backward()
    _close(out, out_ref, out_64, TOLERANCES[BF16])
    _compare_grads([(x_o, x_r, x_64), (w_o, w_r, w_64)], TOLERANCES[BF16])
    _per_head_case(2, 16, 4, 64, BF16, True, True, f)


def test_rmsnorm_compile_matches_eager():
    """quack's ``use_compile=True`` variants: the compiled function (fullgraph) gives
    the eager call's outputs (residual, bias, prenorm) and gradients bit for bit. (The
    gradient is taken through ``out`` alone: inductor may add two bfloat16 gradients of
    ``residual_out`` in float32 where eager autograd rounds each.)"""
    torch.random.manual_seed(0)
    x, r = torch.randn(8, 128, dtype=BF16), torch.randn(8, 128, dtype=BF16)
    w, b = torch.randn(128), torch.randn(128)
    g = torch.randn(8, 128, dtype=BF16)
    f = torch.compile(quack.rmsnorm, fullgraph=True)
    results = []
    for call in (quack.rmsnorm, f):
        leaves = _leaves(x, w, b, r)
        out, h = call(leaves[0], leaves[1], leaves[2], leaves[3], eps=1e-6, prenorm=True)
        out.backward(g)
        results.append([out, h] + [t.grad for t in leaves])
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


def test_rmsnorm_strided_tensor():
    """quack ``test_rmsnorm_strided_tensor``: a (2, 64, 512) slice of a (2, 64, 576)
    bfloat16 tensor (row stride 576), eps 1e-5, atol 1e-1; output, x and weight
    gradients."""
    torch.random.manual_seed(0)
    full = torch.randn(2, 64, 576, dtype=BF16)
    x = full[:, :, :512].detach().requires_grad_()
    assert x.stride() == (64 * 576, 576, 1)
    weight = torch.randn(512)
    (w_o,), (x_r, w_r), (x_64, w_64) = (
        _leaves(weight),
        _leaves(x, weight),
        _leaves(x.double(), weight.double()),
    )
    out = quack.rmsnorm(x, w_o, eps=1e-5)
    out_ref = _reference(x_r, w_r, eps=1e-5)
    out_64 = _reference(x_64, w_64, eps=1e-5, dtype=F64)
    grad_out = torch.randn_like(out)
    for o, g in ((out, grad_out), (out_ref, grad_out), (out_64, grad_out.double())):
        o.backward(g)
    assert out.shape == x.shape
    _close(out, out_ref, out_64, 1e-1)
    _close(x.grad, x_r.grad, x_64.grad, 1e-1)
    _close(w_o.grad, w_r.grad, w_64.grad, 1e-1)


def test_rmsnorm_input_validation():
    """quack ``test_rmsnorm_input_validation``: a 3-D input works (shape and dtype kept);
    a weight of another size raises ``ValueError``. quack's CUDA-only and dtype checks
    are not mapped: here CPU tensors and float64 work."""
    x_3d = torch.randn(2, 32, 1024, dtype=F16)
    out = quack.rmsnorm(x_3d, torch.randn(1024))
    assert out.shape == x_3d.shape and out.dtype == x_3d.dtype
    with pytest.raises(ValueError, match="weight"):
        quack.rmsnorm(torch.randn(32, 1024, dtype=F16), torch.randn(512))
    x64 = torch.randn(4, 16, dtype=F64)
    assert quack.rmsnorm(x64, torch.ones(16, dtype=F64)).dtype == F64
    with pytest.raises(AssertionError, match="weight_offset requires a weight"):
        quack.rmsnorm(x64, weight_offset=1.0)


def test_rmsnorm_with_bias():
    """quack ``test_rmsnorm_with_bias``: float16 input, float32 weight and bias (M 32,
    N 1024); output and x gradient atol 1e-2, weight and bias gradients 1e-4."""
    torch.random.manual_seed(0)
    x = torch.randn(32, 1024, dtype=F16)
    weight, bias = torch.randn(1024), torch.randn(1024)
    ours, ref = _leaves(x, weight, bias), _leaves(x, weight, bias)
    ref64 = _leaves(x.double(), weight.double(), bias.double())
    out = quack.rmsnorm(ours[0], ours[1], bias=ours[2], eps=1e-6)
    out_ref = _reference(*ref, eps=1e-6)
    out_64 = _reference(*ref64, eps=1e-6, dtype=F64)
    grad_out = torch.randn_like(out)
    for o, g in ((out, grad_out), (out_ref, grad_out), (out_64, grad_out.double())):
        o.backward(g)
    assert out.shape == x.shape and out.dtype == F16
    _close(out, out_ref, out_64, 1e-2)
    _close(ours[0].grad, ref[0].grad, ref64[0].grad, 1e-2)
    _close(ours[1].grad, ref[1].grad, ref64[1].grad, 1e-4)
    _close(ours[2].grad, ref[2].grad, ref64[2].grad, 1e-4)


@pytest.mark.parametrize(
    ("prenorm", "backward_type"), [(True, "only_output"), (True, "both"), (False, "only_output")]
)
def test_rmsnorm_with_residual(prenorm, backward_type):
    """quack ``test_rmsnorm_with_residual`` (prenorm=True; ``both`` back-propagates
    ``out + residual_out``) and ``test_rmsnorm_prenorm_false`` (a bare tensor): float16
    input and residual, float32 weight, atol 1e-2."""
    torch.random.manual_seed(0)
    x = torch.randn(32, 1024, dtype=F16)
    weight = torch.randn(1024)
    residual = torch.randn(32, 1024, dtype=F16)
    ours, ref = _leaves(x, weight, residual), _leaves(x, weight, residual)
    ref64 = _leaves(x.double(), weight.double(), residual.double())
    got = quack.rmsnorm(ours[0], ours[1], residual=ours[2], eps=1e-6, prenorm=prenorm)
    out_ref, h_ref = _reference(ref[0], ref[1], residual=ref[2], eps=1e-6)
    out_64, h_64 = _reference(ref64[0], ref64[1], residual=ref64[2], eps=1e-6, dtype=F64)
    if prenorm:
        out, h = got
        assert h.dtype == F16
        _close(h, h_ref, h_64, 1e-2)
    else:
        assert isinstance(got, torch.Tensor)
        out = got
    grad_out = torch.randn_like(out)
    if backward_type == "both":
        (out + h).backward(grad_out)
        (out_ref + h_ref).backward(grad_out)
        (out_64 + h_64).backward(grad_out.double())
    else:
        for o, g in ((out, grad_out), (out_ref, grad_out), (out_64, grad_out.double())):
            o.backward(g)
    assert out.shape == x.shape and out.dtype == F16
    _close(out, out_ref, out_64, 1e-2)
    _compare_grads(list(zip(ours, ref, ref64, strict=True)), 1e-2)


def test_rmsnorm_residual_dtype_override():
    """quack ``test_rmsnorm_residual_dtype_override``: a bfloat16 residual with
    ``residual_dtype=float32`` gives a float32 ``residual_out`` equal to
    ``x.float() + residual.float()`` (atol 0: one rounding), ``out`` in bfloat16."""
    torch.random.manual_seed(0)
    x = torch.randn(32, 1024, dtype=BF16)
    weight = torch.randn(1024)
    residual = torch.randn(32, 1024, dtype=BF16)
    out, residual_out = quack.rmsnorm(x, weight, residual=residual, residual_dtype=F32,
                                      eps=1e-6, prenorm=True)  # fmt: skip
    assert residual_out.dtype == F32 and out.dtype == BF16
    torch.testing.assert_close(residual_out, x.float() + residual.float(), atol=0.0, rtol=0.0)
    want = layernorm.fused_norm(residual_out, 1024, weight, None, 1e-6, rms=True,
                                out_dtype=BF16).y  # fmt: skip
    assert torch.equal(out, want)  # out is the norm of residual_out


def test_rmsnorm_fwd_empty():
    """quack ``test_rmsnorm_fwd_empty``: zero rows give empty outputs of x's shape; with
    no residual, ``residual_out`` is x."""
    x = torch.empty(0, 4096, dtype=BF16)
    out, residual_out = quack.rmsnorm(x, torch.randn(4096, dtype=BF16), prenorm=True)
    assert out.shape == x.shape and out.numel() == 0 and out.dtype == BF16
    assert residual_out is x


def test_residual_dtype_without_residual_converts_x():
    """As quack's ``rmsnorm_fwd``: no residual but a ``residual_dtype`` other than x's
    gives ``residual_out`` = x in that dtype (exactly, here), and ``out`` = the norm of x."""
    x, w = torch.randn(5, 64, dtype=BF16), torch.randn(64)
    out, residual_out = quack.rmsnorm(x, w, residual_dtype=F32, prenorm=True)
    assert residual_out.dtype == F32 and torch.equal(residual_out, x.float())
    assert out.dtype == BF16 and torch.equal(out, quack.rmsnorm(x, w))


def test_residual_out_is_x_plus_residual_rounded_once():
    """``residual_out`` is the exact ``x + residual`` rounded once to ``residual_dtype``
    (every case here is an exact float64 sum, so float64 then one rounding is the
    oracle), and ``out`` is the norm of ``residual_out`` bit for bit."""
    torch.random.manual_seed(2)
    for x_dtype, r_dtype, res_dtype in [(BF16, BF16, None), (F16, F16, F32), (F32, BF16, None),
                                        (F32, F32, BF16), (BF16, F32, F16)]:  # fmt: skip
        x = torch.randn(6, 40, dtype=x_dtype)
        residual = torch.randn(6, 40, dtype=r_dtype) * 3
        w = torch.randn(40)
        out, h = quack.rmsnorm(x, w, residual=residual, residual_dtype=res_dtype, prenorm=True)
        want_dtype = res_dtype or r_dtype
        assert h.dtype == want_dtype
        assert torch.equal(h, (x.double() + residual.double()).to(want_dtype))
        assert torch.equal(out, layernorm.fused_norm(h, 40, w, None, 1e-6, rms=True,
                                                     out_dtype=x_dtype).y)  # fmt: skip


def test_signature_and_module_are_quacks():
    """``rmsnorm``'s parameters and defaults as quack's; ``QuackRMSNorm`` is a
    ``torch.nn.RMSNorm`` (eps 1e-6, ``state_dict`` ``weight``, torch's repr) whose
    forward is ``rmsnorm(x, weight, eps=eps)``."""
    empty = inspect.Parameter.empty
    assert [(p.name, p.default) for p in inspect.signature(quack.rmsnorm).parameters.values()] == [
        ("x", empty), ("weight", None), ("bias", None), ("residual", None),
        ("out_dtype", None), ("residual_dtype", None), ("eps", 1e-6), ("prenorm", False),
        ("weight_offset", 0.0),
    ]  # fmt: skip
    m = quack.QuackRMSNorm(64)
    assert isinstance(m, torch.nn.RMSNorm) and m.eps == 1e-6
    assert list(m.state_dict()) == ["weight"] and torch.equal(m.weight, torch.ones(64))
    assert repr(m) == "QuackRMSNorm((64,), eps=1e-06, elementwise_affine=True)"
    assert quack.QuackRMSNorm(8, elementwise_affine=False).weight is None
    x = torch.randn(3, 7, 64, dtype=BF16)
    with torch.no_grad():
        m.weight.normal_()
    assert torch.equal(m.to(BF16)(x), quack.rmsnorm(x, m.weight, eps=1e-6))


@pytest.mark.parametrize(("x_dtype", "out_dtype"), [(BF16, F32), (F32, BF16), (F16, F16)])
def test_out_dtype_is_fused_norms(x_dtype, out_dtype):
    """``out_dtype`` sets ``out``'s dtype, correctly rounded from ``residual_out``
    (``layernorm.fused_norm``'s, bit for bit); per-head parameters too."""
    torch.manual_seed(3)
    x, r = torch.randn(2, 5, 4, 32, dtype=x_dtype), torch.randn(2, 5, 4, 32, dtype=x_dtype)
    w = torch.randn(128)
    out = quack.rmsnorm(x.reshape(2, 5, 128), w, residual=r.reshape(2, 5, 128),
                        out_dtype=out_dtype)  # fmt: skip
    want = layernorm.fused_norm(x.reshape(2, 5, 128), 128, w, None, 1e-6, rms=True,
                                residual=r.reshape(2, 5, 128), out_dtype=out_dtype)  # fmt: skip
    assert out.dtype == out_dtype and torch.equal(out, want.y)
    wh = torch.randn(4, 32)
    out = quack.rmsnorm(x, wh, residual=r, out_dtype=out_dtype)
    for head in range(4):
        want = layernorm.fused_norm(x[..., head, :], 32, wh[head], None, 1e-6, rms=True,
                                    residual=r[..., head, :], out_dtype=out_dtype)  # fmt: skip
        assert torch.equal(out[..., head, :], want.y)
