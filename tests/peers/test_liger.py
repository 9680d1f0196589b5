"""Liger-Kernel's layer norm, RMSNorm and fused add + RMSNorm tests, re-expressed.

Sources (linkedin/Liger-Kernel, ``test/transformers/``):

- ``test_layer_norm.py``: ``test_liger_layer_norm`` (module against ``torch.nn.LayerNorm``)
  and ``test_liger_layer_norm_functional`` (the function against the module entry).
- ``test_rms_norm.py``: ``test_correctness`` (module against the Llama, Gemma and "none"
  reference RMSNorms) and ``test_correctness_functional``.
- ``test_fused_add_rms_norm.py``: ``test_correctness`` and ``test_correctness_functional``
  (``(x + residual)`` normalized, and the sum returned, as Llama/Gemma decoder layers do).

Their dtypes and (atol, rtol) tables are kept, and their shapes but (2, 128, 512),
shrunk to (2, 32, 512). How Liger's RMSNorm options map
onto ours called without them (Liger's ``offset`` and ``casting_mode`` themselves run in
``test_compat_liger.py``; here ours computes in float32 and
rounds once):

- ``offset=0, casting_mode="llama"`` (LlamaRMSNorm: normalize in float32, round, then
  multiply by the weight in the dtype): compared as is; ours rounds once.
- ``offset=1, casting_mode="gemma"`` (GemmaRMSNorm: ``x * rstd * (1 + w)``, all in
  float32): ours with the float32 weight ``1 + w`` (a differentiable function of ``w``, so
  ``w``'s gradient is compared too) -- the same arithmetic.
- ``offset=0, casting_mode="none"`` (BaseRMSNorm: everything in the dtype): compared as
  is; ours computes in float32.
- ``in_place=True`` (Liger's backward overwrites the incoming gradient): no counterpart;
  ours must leave the incoming gradient untouched, which is checked instead.
"""

from __future__ import annotations

import pytest
import torch
from _peers import assert_close_or_nearer, parametrize_backends

import layernorm

# ---------------------------------------------------------------------------------------
# test_layer_norm.py


@parametrize_backends
@pytest.mark.parametrize(
    ("batch_size", "seq_len", "hidden_size"),
    [(2, 8, 64), (4, 16, 128), (1, 1, 1023), (3, 7, 256)],
)
def test_liger_layer_norm(backend, batch_size, seq_len, hidden_size):
    """Liger ``test_liger_layer_norm``: our LayerNorm against torch's (eps 1e-6, float32,
    atol = rtol = 1e-5): output and the gradients of input, weight and bias."""
    atol = rtol = 1e-5
    x = torch.randn(batch_size, seq_len, hidden_size)
    ours = layernorm.LayerNorm(hidden_size, eps=1e-6)
    ours.backend = backend
    theirs = torch.nn.LayerNorm(hidden_size, eps=1e-6)
    with torch.no_grad():  # Liger keeps the default init; random parameters test more
        theirs.weight.copy_(torch.randn(hidden_size))
        theirs.bias.copy_(torch.randn(hidden_size))
    ours.load_state_dict(theirs.state_dict())
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    assert torch.allclose(y_ours, y_theirs, atol=atol, rtol=rtol)
    dy = torch.randn_like(x)
    y_ours.backward(dy)
    y_theirs.backward(dy)
    assert torch.allclose(x_ours.grad, x_theirs.grad, atol=atol, rtol=rtol)
    assert torch.allclose(ours.weight.grad, theirs.weight.grad, atol=atol, rtol=rtol)
    assert torch.allclose(ours.bias.grad, theirs.bias.grad, atol=atol, rtol=rtol)


@parametrize_backends
@pytest.mark.parametrize(("batch_size", "seq_len", "hidden_size"), [(2, 8, 64), (4, 16, 128)])
def test_liger_layer_norm_functional(backend, batch_size, seq_len, hidden_size):
    """Liger ``test_liger_layer_norm_functional``: the function and the module entry give
    the same output and gradients (atol = rtol = 1e-5) for random weight and bias."""
    atol = rtol = 1e-5
    x = torch.randn(batch_size, seq_len, hidden_size)
    w, b = torch.randn(hidden_size), torch.randn(hidden_size)
    x1, w1, b1 = (t.clone().requires_grad_() for t in (x, w, b))
    x2 = x.clone().requires_grad_()
    y1 = layernorm.layer_norm(x1, (hidden_size,), w1, b1, 1e-6, backend=backend)
    module = layernorm.LayerNorm(hidden_size, eps=1e-6)
    module.backend = backend
    with torch.no_grad():
        module.weight.copy_(w)
        module.bias.copy_(b)
    y2 = module(x2)
    assert torch.allclose(y1, y2, atol=atol, rtol=rtol)
    dy = torch.randn_like(y2)
    y1.backward(dy)
    y2.backward(dy)
    assert torch.allclose(x1.grad, x2.grad, atol=atol, rtol=rtol)
    assert torch.allclose(w1.grad, module.weight.grad, atol=atol, rtol=rtol)
    assert torch.allclose(b1.grad, module.bias.grad, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------
# The reference RMSNorms of test_rms_norm.py / test_fused_add_rms_norm.py, rewritten


def _llama(x, weight, eps):
    z = x.float()
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    return weight * z.to(x.dtype)


def _gemma(x, weight, eps):
    z = x.float()
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    return (z * (1.0 + weight.float())).type_as(x)


def _base(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


#: (reference, offset): the casting modes that map onto ours
REFERENCES = [
    pytest.param(_llama, 0.0, id="llama"),
    pytest.param(_gemma, 1.0, id="gemma"),
    pytest.param(_base, 0.0, id="none"),
]
#: (dtype, atol, rtol), Liger's table
DTYPES = [
    pytest.param(torch.float32, 1e-4, 1e-6, id="float32"),
    pytest.param(torch.bfloat16, 2e-1, 2e-2, id="bfloat16"),
]


def _ours_rms(backend, x, weight, offset, eps, residual=None):
    """Ours with Liger's offset folded into a float32 weight ``offset + weight``."""
    gain = weight if offset == 0 else offset + weight.float()
    if residual is None:
        return layernorm.rms_norm(x, x.shape[-1:], gain, eps, backend=backend)
    return layernorm.add_rms_norm(x, residual, x.shape[-1:], gain, eps, backend=backend)


def _float64_truth(x, weight, offset, eps, dy, residual=None, dresidual=None):
    """The float64 results ``(y, h, x.grad, residual.grad, weight.grad)``: where ours and
    Liger's reference differ by more than Liger's tolerances, the nearer one is right."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    r64 = None if residual is None else residual.detach().double().requires_grad_()
    h64 = x64 if r64 is None else x64 + r64
    y64 = (offset + w64) * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    outputs, grads = [y64], [dy.double()]
    if r64 is not None:
        outputs.append(h64)
        grads.append(dresidual.double())
    torch.autograd.backward(outputs, grads)
    return y64, h64, x64.grad, None if r64 is None else r64.grad, w64.grad


# ---------------------------------------------------------------------------------------
# test_rms_norm.py


@parametrize_backends
@pytest.mark.parametrize(("bs", "sl", "hd"), [(2, 32, 512), (5, 123, 123)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize(("reference", "offset"), REFERENCES)
def test_rms_norm_correctness(backend, bs, sl, hd, dtype, atol, rtol, reference, offset):
    """Liger ``test_rms_norm.py::test_correctness``: output, weight gradient and input
    gradient against the reference RMSNorm (weight of ones, eps 1e-6, as Liger's modules
    are initialized), at Liger's (atol, rtol), or nearer the float64 result than the
    reference (whose "none" mode sums a bfloat16 weight gradient in bfloat16); the
    incoming gradient is left as it was."""
    x = torch.randn(bs, sl, hd, dtype=dtype)
    dy = torch.randn(bs, sl, hd, dtype=dtype)
    dy_before = dy.clone()
    # the module's weight of ones (Gemma's gain is then 1 + 1)
    w_ref = torch.ones(hd, dtype=dtype, requires_grad=True)
    w_ours = torch.ones(hd, dtype=dtype, requires_grad=True)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = reference(x_ref, w_ref, 1e-6)
    y_ref.backward(dy)
    y_ours = _ours_rms(backend, x_ours, w_ours, offset, 1e-6)
    y_ours.backward(dy)
    assert y_ours.dtype == dtype
    assert torch.equal(dy, dy_before)
    y64, _, dx64, _, dw64 = _float64_truth(x, w_ref, offset, 1e-6, dy)
    assert_close_or_nearer(y_ours, y_ref, y64, atol=atol, rtol=rtol)
    assert_close_or_nearer(w_ours.grad, w_ref.grad, dw64, atol=atol, rtol=rtol)
    assert_close_or_nearer(x_ours.grad, x_ref.grad, dx64, atol=atol, rtol=rtol)


@parametrize_backends
@pytest.mark.parametrize(("bs", "sl", "hd"), [(2, 2, 8), (9, 7, 41)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize(("reference", "offset"), REFERENCES[:2])
def test_rms_norm_correctness_functional(backend, bs, sl, hd, dtype, atol, rtol, reference, offset):
    """Liger ``test_rms_norm.py::test_correctness_functional``: the function with a random
    weight (Liger compares its function with its autograd.Function; here against the
    reference, the stronger check), eps 1e-6, at Liger's (atol, rtol); and the module entry
    gives the function's result."""
    x = torch.randn(bs, sl, hd, dtype=dtype)
    w = torch.randn(hd, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = _ours_rms(backend, x1, w, offset, 1e-6)
    y2 = reference(x2, w, 1e-6)
    torch.testing.assert_close(y1, y2, atol=atol, rtol=rtol)
    dy = torch.randn_like(y2)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x1.grad, x2.grad, atol=atol, rtol=rtol)
    if offset == 0:
        module = layernorm.RMSNorm(hd, eps=1e-6).to(dtype)
        module.backend = backend
        with torch.no_grad():
            module.weight.copy_(w)
        torch.testing.assert_close(module(x), y1.detach(), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------
# test_fused_add_rms_norm.py


@parametrize_backends
@pytest.mark.parametrize(("bs", "sl", "hd"), [(2, 32, 512), (5, 123, 123)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize(("reference", "offset"), REFERENCES)
def test_fused_add_rms_norm_correctness(backend, bs, sl, hd, dtype, atol, rtol, reference, offset):
    """Liger ``test_fused_add_rms_norm.py::test_correctness``: ``add_rms_norm(x,
    residual)`` against ``h = x + residual; (reference(h), h)``, gradients through both
    outputs (dh, dr), comparing both outputs and the gradients of x, residual and the
    weight (of ones), at Liger's (atol, rtol) or nearer the float64 result."""
    x = torch.randn(bs, sl, hd, dtype=dtype)
    r = torch.randn(bs, sl, hd, dtype=dtype)
    dh = torch.randn(bs, sl, hd, dtype=dtype)
    dr = torch.randn(bs, sl, hd, dtype=dtype)
    x1, r1, x2, r2 = (t.clone().requires_grad_() for t in (x, r, x, r))
    w1 = torch.ones(hd, dtype=dtype, requires_grad=True)
    w2 = torch.ones(hd, dtype=dtype, requires_grad=True)
    h_ref = x1 + r1
    y_ref = reference(h_ref, w1, 1e-6)
    torch.autograd.backward((y_ref, h_ref), (dh, dr))
    y, h = _ours_rms(backend, x2, w2, offset, 1e-6, residual=r2)
    torch.autograd.backward((y, h), (dh, dr))
    assert y.dtype == h.dtype == dtype
    y64, h64, dx64, dr64, dw64 = _float64_truth(x, w1, offset, 1e-6, dh, r, dr)
    assert_close_or_nearer(y, y_ref, y64, atol=atol, rtol=rtol)
    assert_close_or_nearer(h, h_ref, h64, atol=atol, rtol=rtol)
    assert_close_or_nearer(w2.grad, w1.grad, dw64, atol=atol, rtol=rtol)
    assert_close_or_nearer(x2.grad, x1.grad, dx64, atol=atol, rtol=rtol)
    assert_close_or_nearer(r2.grad, r1.grad, dr64, atol=atol, rtol=rtol)


@parametrize_backends
@pytest.mark.parametrize(("bs", "sl", "hd"), [(2, 2, 8), (9, 7, 41)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize(("reference", "offset"), REFERENCES[:2])
def test_fused_add_rms_norm_correctness_functional(
    backend, bs, sl, hd, dtype, atol, rtol, reference, offset
):
    """Liger ``test_fused_add_rms_norm.py::test_correctness_functional``: the function with
    a random weight against the reference, both outputs and the gradients of x and
    residual, at Liger's (atol, rtol)."""
    x = torch.randn(bs, sl, hd, dtype=dtype)
    r = torch.randn(bs, sl, hd, dtype=dtype)
    w = torch.randn(hd, dtype=dtype)
    x1, r1, x2, r2 = (t.clone().requires_grad_() for t in (x, r, x, r))
    y, h = _ours_rms(backend, x1, w, offset, 1e-6, residual=r1)
    h_ref = x2 + r2
    y_ref = reference(h_ref, w, 1e-6)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(h, h_ref, atol=atol, rtol=rtol)
    dh, dr = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward((y, h), (dh, dr))
    torch.autograd.backward((y_ref, h_ref), (dh, dr))
    torch.testing.assert_close(x1.grad, x2.grad, atol=atol, rtol=rtol)
    torch.testing.assert_close(r1.grad, r2.grad, atol=atol, rtol=rtol)
