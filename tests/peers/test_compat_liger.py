"""Liger-Kernel's norm tests, re-expressed against the shims of :mod:`layernorm.compat.liger`.

Sources (linkedin/Liger-Kernel ``test/transformers/``): ``test_rms_norm.py``
(``test_correctness``: ``LigerRMSNorm(hidden_size, offset, casting_mode, in_place,
elementwise_affine)`` against the Llama, Gemma and Base reference RMSNorms;
``test_correctness_functional``: ``liger_rms_norm`` against the autograd entry),
``test_fused_add_rms_norm.py`` (``test_correctness``: ``LigerFusedAddRMSNorm`` against
``h = x + r; (reference(h), h)``) and ``test_layer_norm.py`` (``test_liger_layer_norm``,
``test_liger_layer_norm_functional``). Liger's shapes but (2, 128, 512) -> (2, 32, 512),
dtypes and (atol, rtol) tables are kept; the reference modules are rewritten
(``test_liger.py``'s). Here each casting mode runs as Liger's module is built: the shim
takes ``offset`` and ``casting_mode`` itself. Where ours and a reference differ past the
tolerance, ours must be nearer float64 (``assert_close_or_nearer``). ``in_place`` becomes
"the incoming gradient is untouched". Beyond Liger: constructor defaults, attributes,
``state_dict`` keys and ``repr`` as Liger's source writes them.
"""

from __future__ import annotations

import pytest
import torch
from _peers import assert_close_or_nearer
from test_liger import DTYPES, _base, _gemma, _llama

from layernorm.compat import liger


def _reference(kind, x, weight, eps):
    """The reference RMSNorm, with Liger's modules' ``elementwise_affine=False`` too."""
    if weight is None:
        z = x.float() if kind is not _base else x
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
        return z.to(x.dtype)
    return kind(x, weight, eps)


def _truth(x, weight, offset, eps):
    x64 = x.detach().double().requires_grad_()
    w64 = None if weight is None else weight.detach().double().requires_grad_()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64, w64, y if w64 is None else y * (offset + w64)


REFERENCES = [
    pytest.param(_llama, 0.0, "llama", id="llama"),
    pytest.param(_gemma, 1.0, "gemma", id="gemma"),
    pytest.param(_base, 0.0, "none", id="none"),
]


@pytest.mark.parametrize(("bs", "sl", "hd"), [(2, 32, 512), (5, 123, 123)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize(("reference", "offset", "casting_mode"), REFERENCES)
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("elementwise_affine", [True, False])
def test_rms_norm_correctness(
    bs, sl, hd, dtype, atol, rtol, reference, offset, casting_mode, in_place, elementwise_affine
):
    """Liger ``test_rms_norm.py::test_correctness`` on ``LigerRMSNorm``: output, weight
    gradient and input gradient against the reference module (weights of ones)."""
    x = torch.randn(bs, sl, hd, dtype=dtype)
    dy = torch.randn(bs, sl, hd, dtype=dtype)
    dy_before = dy.clone()
    ref_w = torch.ones(hd, dtype=dtype, requires_grad=True) if elementwise_affine else None
    ours = liger.LigerRMSNorm(
        hidden_size=hd,
        offset=offset,
        casting_mode=casting_mode,
        in_place=in_place,
        elementwise_affine=elementwise_affine,
    ).to(dtype)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = _reference(reference, x_ref, ref_w, 1e-6)
    y_ref.backward(dy)
    y_ours = ours(x_ours)
    y_ours.backward(dy)
    assert y_ours.dtype == dtype
    assert torch.equal(dy, dy_before)
    x64, w64, y64 = _truth(x, ref_w, offset, 1e-6)
    y64.backward(dy.double())
    assert_close_or_nearer(y_ours, y_ref, y64, atol=atol, rtol=rtol)
    if elementwise_affine:
        assert_close_or_nearer(ours.weight.grad, ref_w.grad, w64.grad, atol=atol, rtol=rtol)
    assert_close_or_nearer(x_ours.grad, x_ref.grad, x64.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("bs", "sl", "hd"), [(2, 2, 8), (9, 7, 41)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize(("reference", "offset", "casting_mode"), REFERENCES)
def test_rms_norm_correctness_functional(bs, sl, hd, dtype, atol, rtol, reference, offset,
                                         casting_mode):  # fmt: skip
    """Liger ``test_rms_norm.py::test_correctness_functional``: ``liger_rms_norm`` and the
    module give the same output and gradients, bit for bit (Liger: atol, rtol), with a
    random weight."""
    x = torch.randn(bs, sl, hd, dtype=dtype)
    w = torch.randn(hd, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    w1 = w.clone().requires_grad_()
    y1 = liger.liger_rms_norm(x1, w1, 1e-6, offset=offset, casting_mode=casting_mode)
    module = liger.LigerRMSNorm(hd, eps=1e-6, offset=offset, casting_mode=casting_mode).to(dtype)
    with torch.no_grad():
        module.weight.copy_(w)
    y2 = module(x2)
    assert torch.equal(y1, y2)
    dy = torch.randn_like(y2)
    y1.backward(dy)
    y2.backward(dy)
    assert torch.equal(x1.grad, x2.grad) and torch.equal(w1.grad, module.weight.grad)


@pytest.mark.parametrize(("bs", "sl", "hd"), [(2, 32, 512), (5, 123, 123)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize(("reference", "offset", "casting_mode"), REFERENCES)
@pytest.mark.parametrize("in_place", [True, False])
def test_fused_add_rms_norm_correctness(
    bs, sl, hd, dtype, atol, rtol, reference, offset, casting_mode, in_place
):
    """Liger ``test_fused_add_rms_norm.py::test_correctness`` on ``LigerFusedAddRMSNorm``:
    both outputs and the gradients of x, residual and weight, through both outputs."""
    x = torch.randn(bs, sl, hd, dtype=dtype)
    r = torch.randn(bs, sl, hd, dtype=dtype)
    dy = torch.randn(bs, sl, hd, dtype=dtype)
    dh = torch.randn(bs, sl, hd, dtype=dtype)
    x1, r1, x2, r2 = (t.clone().requires_grad_() for t in (x, r, x, r))
    w1 = torch.ones(hd, dtype=dtype, requires_grad=True)
    h_ref = x1 + r1
    y_ref = reference(h_ref, w1, 1e-6)
    torch.autograd.backward((y_ref, h_ref), (dy, dh))
    ours = liger.LigerFusedAddRMSNorm(hd, offset=offset, casting_mode=casting_mode,
                                      in_place=in_place).to(dtype)  # fmt: skip
    y, h = ours(x2, r2)
    torch.autograd.backward((y, h), (dy, dh))
    assert y.dtype == h.dtype == dtype
    assert torch.equal(h, h_ref)  # both round x + r once
    x64 = x.double().requires_grad_()
    r64 = r.double().requires_grad_()
    w64 = torch.ones(hd, dtype=torch.float64, requires_grad=True)
    h64 = x64 + r64
    y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w64)
    torch.autograd.backward((y64, h64), (dy.double(), dh.double()))
    assert_close_or_nearer(y, y_ref, y64, atol=atol, rtol=rtol)
    assert_close_or_nearer(ours.weight.grad, w1.grad, w64.grad, atol=atol, rtol=rtol)
    assert_close_or_nearer(x2.grad, x1.grad, x64.grad, atol=atol, rtol=rtol)
    assert_close_or_nearer(r2.grad, r1.grad, r64.grad, atol=atol, rtol=rtol)


LAYER_DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="float32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bfloat16"),
]


@pytest.mark.parametrize(("batch_size", "seq_len", "hidden_size"),
                         [(2, 8, 64), (4, 16, 128), (1, 1, 1023), (3, 7, 256), (1, 1, 1500)])  # fmt: skip
@pytest.mark.parametrize(("dtype", "atol", "rtol"), LAYER_DTYPES)
def test_liger_layer_norm(batch_size, seq_len, hidden_size, dtype, atol, rtol):
    """Liger ``test_layer_norm.py::test_liger_layer_norm``: ``LigerLayerNorm(hidden_size,
    eps=1e-6)`` against ``torch.nn.LayerNorm`` with its parameters: output and the
    gradients of input, weight and bias (``torch.allclose`` at Liger's tolerances, or
    nearer float64)."""
    x = torch.randn(batch_size, seq_len, hidden_size, dtype=dtype)
    ours = liger.LigerLayerNorm(hidden_size, eps=1e-6).to(dtype)
    theirs = torch.nn.LayerNorm(hidden_size, eps=1e-6).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        theirs.bias.copy_(ours.bias)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    dy = torch.randn_like(x)
    y_ours.backward(dy)
    y_theirs.backward(dy)
    x64 = x.double().requires_grad_()
    w64, b64 = (p.detach().double().requires_grad_() for p in (ours.weight, ours.bias))
    y64 = torch.nn.functional.layer_norm(x64, (hidden_size,), w64, b64, 1e-6)
    y64.backward(dy.double())
    assert_close_or_nearer(y_ours, y_theirs, y64, atol=atol, rtol=rtol)
    assert_close_or_nearer(x_ours.grad, x_theirs.grad, x64.grad, atol=atol, rtol=rtol)
    assert_close_or_nearer(ours.weight.grad, theirs.weight.grad, w64.grad, atol=atol, rtol=rtol)
    assert_close_or_nearer(ours.bias.grad, theirs.bias.grad, b64.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("batch_size", "seq_len", "hidden_size"), [(2, 8, 64), (4, 16, 128)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), LAYER_DTYPES)
def test_liger_layer_norm_functional(batch_size, seq_len, hidden_size, dtype, atol, rtol):
    """Liger ``test_layer_norm.py::test_liger_layer_norm_functional``: ``liger_layer_norm``
    and the module with the same random weight and bias agree bit for bit."""
    x = torch.randn(batch_size, seq_len, hidden_size, dtype=dtype)
    w, b = torch.randn(hidden_size, dtype=dtype), torch.randn(hidden_size, dtype=dtype)
    x1, w1, b1 = (t.clone().requires_grad_() for t in (x, w, b))
    x2 = x.clone().requires_grad_()
    y1 = liger.liger_layer_norm(X=x1, W=w1, B=b1, eps=1e-6)
    module = liger.LigerLayerNorm(hidden_size, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(w)
        module.bias.copy_(b)
    y2 = module(x2)
    assert torch.equal(y1, y2)
    dy = torch.randn_like(y2)
    y1.backward(dy)
    y2.backward(dy)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(w1.grad, module.weight.grad) and torch.equal(b1.grad, module.bias.grad)


# ---------------------------------------------------------------------------------------
# Beyond Liger's tests: the module surface as Liger's source defines it


def test_modules_have_ligers_surface():
    m = liger.LigerRMSNorm(8)
    assert list(m.state_dict()) == ["weight"] and torch.equal(m.weight, torch.ones(8))
    assert (m.variance_epsilon, m.offset, m.casting_mode, m.in_place, m.row_mode) == (
        1e-6, 0.0, "llama", True, None)  # fmt: skip
    assert (
        repr(m)
        == "LigerRMSNorm(weight_shape=(8,), eps=1e-06, offset=0.0, in_place=True, row_mode=None)"
    )
    m = liger.LigerRMSNorm(8, elementwise_affine=False)
    assert m.weight is None and list(m.state_dict()) == []
    assert "weight_shape=None" in repr(m)
    g = liger.LigerRMSNormForGemma(8)
    assert (g.offset, g.casting_mode, g.in_place) == (1.0, "gemma", True)
    assert torch.equal(g.weight, torch.zeros(8))
    assert liger.LigerRMSNormForGemma2(8).in_place is False
    assert liger.LigerRMSNormForGemma3(8).offset == 1.0
    ln = liger.LigerLayerNorm(8)
    assert list(ln.state_dict()) == ["weight", "bias"] and torch.equal(ln.bias, torch.zeros(8))
    assert (ln.hidden_size, ln.eps, ln.variance_epsilon) == (8, 1e-6, 1e-6)
    assert repr(ln) == "LigerLayerNorm(8, eps=1e-06)"
    assert not torch.equal(liger.LigerLayerNorm(8, bias=True).bias, torch.zeros(8))  # randn
    fa = liger.LigerFusedAddRMSNorm(8, init_fn="zeros")
    assert list(fa.state_dict()) == ["weight"] and torch.equal(fa.weight, torch.zeros(8))
    assert repr(fa) == "LigerFusedAddRMSNorm((8,), eps=1e-06, offset=0.0, in_place=False)"
    with pytest.raises(AssertionError, match="init_fn must be either 'ones' or 'zeros'"):
        liger.LigerRMSNorm(8, init_fn="twos")
    with pytest.raises(AssertionError, match="Invalid casting mode"):
        liger.LigerRMSNorm(8, casting_mode="fp8")(torch.randn(2, 8))


def test_casting_modes_by_number_are_the_named_ones():
    """Liger also takes 0, 1, -1 for "llama", "gemma", "none"."""
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    for number, name in ((0, "llama"), (1, "gemma"), (-1, "none")):
        assert torch.equal(
            liger.liger_rms_norm(x, w, 1e-6, 1.0, number),
            liger.liger_rms_norm(x, w, 1e-6, 1.0, name),
        )
