"""apex's fused norm tests, re-expressed against the shims of :mod:`layernorm.compat.apex`.

Source: NVIDIA/apex ``tests/L0/run_fused_layer_norm/test_fused_layer_norm.py``
(``TestFusedLayerNorm``: ``test_layer_norm_{regular,elemwise,mixed,half,bfloat16}``,
``test_rms_norm_{regular,elemwise,mixed,half,bfloat16}``), with ``test_apex.py``'s cases
and thresholds: torch's float32 module on CPU is the reference, apex's module (here the
shim: ``FusedLayerNorm`` / ``FusedRMSNorm``, or ``MixedFused*`` where apex tests
"mixed") runs in the dtype; output and input gradient (and RMSNorm's weight gradient)
compared cast to the dtype. A ``MixedFused*`` module keeps float32 parameters, so with a
half input its output is float32 (apex's rule: the parameters' dtype), compared cast to
the input's dtype at the case's thresholds. Beyond apex's tests: the module surface (defaults,
``normalized_shape`` as a ``torch.Size``, ``state_dict`` keys, ``repr``, the mixed
modules' ``elementwise_affine`` rule) and the functions. ``memory_efficient`` runs on and
off, as apex parametrizes it (on: autograd holds :mod:`layernorm.recompute`'s node).
"""

from __future__ import annotations

import pytest
import torch
from test_apex import LAYER_NORM_CASES, NORMALIZED_SHAPE, RMS_NORM_CASES, _cases, _inputs
from torch.testing import assert_close

import layernorm
from layernorm.compat import apex


def _run(rms, dtype, mixed, batch, contiguous, affine, fwd, bwd, memory_efficient):
    theirs_cls = torch.nn.RMSNorm if rms else torch.nn.LayerNorm
    kwargs = {"eps": 1e-5} if rms else {}
    theirs = theirs_cls(NORMALIZED_SHAPE, elementwise_affine=affine, **kwargs)
    if mixed:
        ours = (apex.MixedFusedRMSNorm if rms else apex.MixedFusedLayerNorm)(
            NORMALIZED_SHAPE, memory_efficient=memory_efficient
        )
    else:
        ours = (apex.FusedRMSNorm if rms else apex.FusedLayerNorm)(
            NORMALIZED_SHAPE, elementwise_affine=affine, memory_efficient=memory_efficient
        ).to(dtype)
    x, x_dtype = _inputs(batch, contiguous, dtype)
    x_theirs = x.detach().requires_grad_(True)
    x_ours = x_dtype.detach().requires_grad_(True)
    y_theirs = theirs(x_theirs)
    dy = torch.rand_like(y_theirs)
    y_theirs.backward(dy)
    y_ours = ours(x_ours)
    out_dtype = torch.float32 if mixed else dtype
    assert y_ours.dtype == out_dtype
    assert ("MemoryEfficient" in type(y_ours.grad_fn).__name__) == memory_efficient
    # at the input's dtype, as apex compares (its reference sees the unrounded input)
    assert_close(y_ours.to(dtype), y_theirs.to(dtype), **fwd)
    y_ours.backward(dy.to(out_dtype))
    assert x_ours.grad.dtype == dtype
    assert_close(x_ours.grad, x_theirs.grad.to(dtype), **bwd)
    if rms and affine:
        assert_close(ours.weight.grad, theirs.weight.grad.to(ours.weight.dtype), **bwd)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["", "memory_efficient"])
@pytest.mark.parametrize(
    ("dtype", "mixed", "batch", "contiguous", "affine", "fwd", "bwd"),
    list(_cases(LAYER_NORM_CASES)),
)
def test_fused_layer_norm(dtype, mixed, batch, contiguous, affine, fwd, bwd, memory_efficient):
    """apex ``_test_fused_layer_norm`` on ``FusedLayerNorm`` / ``MixedFusedLayerNorm``,
    with ``memory_efficient`` off and on, as apex parametrizes it."""
    _run(False, dtype, mixed, batch, contiguous, affine, fwd, bwd, memory_efficient)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["", "memory_efficient"])
@pytest.mark.parametrize(
    ("dtype", "mixed", "batch", "contiguous", "affine", "fwd", "bwd"),
    list(_cases(RMS_NORM_CASES)),
)
def test_fused_rms_norm(dtype, mixed, batch, contiguous, affine, fwd, bwd, memory_efficient):
    """apex ``_test_fused_rms_norm`` on ``FusedRMSNorm`` / ``MixedFusedRMSNorm``, with
    ``memory_efficient`` off and on."""
    _run(True, dtype, mixed, batch, contiguous, affine, fwd, bwd, memory_efficient)


def test_modules_have_apexs_surface():
    m = apex.FusedLayerNorm([32, 16])
    assert m.normalized_shape == torch.Size([32, 16]) and isinstance(m.normalized_shape, torch.Size)
    assert (m.eps, m.elementwise_affine, m.memory_efficient) == (1e-5, True, False)
    assert list(m.state_dict()) == ["weight", "bias"]
    assert repr(m) == "FusedLayerNorm(torch.Size([32, 16]), eps=1e-05, elementwise_affine=True)"
    assert list(apex.FusedLayerNorm(8, elementwise_affine=False).state_dict()) == []
    r = apex.FusedRMSNorm(8, memory_efficient=True)
    assert list(r.state_dict()) == ["weight"] and r.memory_efficient is True
    assert repr(r) == "FusedRMSNorm(torch.Size([8]), eps=1e-05, elementwise_affine=True)"
    # checkpoints load both ways with torch's modules
    torch_ln = torch.nn.LayerNorm([32, 16])
    m.load_state_dict(torch_ln.state_dict())
    torch_ln.load_state_dict(m.state_dict())
    for cls in (apex.MixedFusedLayerNorm, apex.MixedFusedRMSNorm):
        with pytest.warns(UserWarning, match="does not support `elementwise_affine` argument"):
            cls(8, elementwise_affine=True)
        with (
            pytest.warns(UserWarning, match="does not support"),
            pytest.raises(RuntimeError, match="does not support `elementwise_affine = False`"),
        ):
            cls(8, elementwise_affine=False)


def test_functions_are_the_modules():
    x = torch.randn(4, 32, 16, dtype=torch.bfloat16)
    w, b = torch.randn(32, 16), torch.randn(32, 16)
    shape = (32, 16)
    ln = apex.MixedFusedLayerNorm(shape)
    rms = apex.MixedFusedRMSNorm(shape)
    with torch.no_grad():
        ln.weight.copy_(w)
        ln.bias.copy_(b)
        rms.weight.copy_(w)
    assert torch.equal(ln(x), apex.mixed_dtype_fused_layer_norm_affine(x, w, b, shape, 1e-5))
    assert torch.equal(rms(x), apex.mixed_dtype_fused_rms_norm_affine(x, w, shape, 1e-5))
    assert torch.equal(ln(x), layernorm.layer_norm(x, shape, w, b, out_dtype=torch.float32))
    xb, wb, bb = x, w.bfloat16(), b.bfloat16()
    assert torch.equal(apex.fused_layer_norm_affine(xb, wb, bb, shape),
                       layernorm.layer_norm(xb, shape, wb, bb, 1e-6))  # fmt: skip
    assert torch.equal(apex.fused_layer_norm(xb, shape), layernorm.layer_norm(xb, shape, eps=1e-6))
    assert torch.equal(apex.fused_rms_norm_affine(xb, wb, shape),
                       layernorm.rms_norm(xb, shape, wb, 1e-6))  # fmt: skip
    assert torch.equal(apex.fused_rms_norm(xb, shape), layernorm.rms_norm(xb, shape, eps=1e-6))


def test_mixed_parameters_narrower_than_the_input_give_their_dtype():
    """apex's mixed modules output the parameters' dtype, a narrower one too: the norm
    rounded once into it (``out_dtype``, ``tests/test_out_dtype.py``)."""
    m = apex.MixedFusedRMSNorm(8).to(torch.bfloat16)
    x = torch.randn(2, 8)
    y = m(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, layernorm.rms_norm(x, 8, m.weight, 1e-5, out_dtype=torch.bfloat16))
