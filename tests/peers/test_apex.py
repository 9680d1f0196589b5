"""apex's fused layer norm tests, re-expressed against our modules.

Source: NVIDIA/apex ``tests/L0/run_fused_layer_norm/test_fused_layer_norm.py``,
``TestFusedLayerNorm``: ``test_layer_norm_{regular,elemwise,mixed,half,bfloat16}`` and
``test_rms_norm_{regular,elemwise,mixed,half,bfloat16}`` (through ``_test_fused_layer_norm``
and ``_test_fused_rms_norm``). apex runs torch's float32 module on CPU as the reference and
its fused module on CUDA in the dtype under test, then compares the output and the input
gradient (and RMSNorm's weight gradient) cast to the dtype, at its thresholds. Here ours
runs in the dtype on CPU against torch's float32 module, normalized_shape [32, 16], on
contiguous input and on the non-contiguous ``[::3, ::5, ::3]`` slice apex takes.

Mapped: ``MixedFused*`` (float32 parameters, input in the dtype) is ours with float32
parameters and a half input; apex runs it only in float32, here also in float16/bfloat16.
``memory_efficient`` runs on the shims (``test_compat_apex.py``), where apex's modules
take it. Not mapped: the CUDA autocast and ONNX export tests (other suites own them).
Shrunk: batch 65536 becomes 128.
"""

from __future__ import annotations

import pytest
import torch
from _peers import parametrize_backends
from torch.testing import assert_close

import layernorm

NORMALIZED_SHAPE = [32, 16]
BATCHES = (16, 128)

#: (test name, dtype, mixed, batches, elementwise_affine, fwd thresholds, bwd thresholds)
LAYER_NORM_CASES = [
    ("regular", torch.float32, False, BATCHES, False, {}, {}),
    ("elemwise", torch.float32, False, BATCHES, True, {}, {}),
    ("mixed", torch.float32, True, BATCHES, True, {}, {}),
    ("half", torch.float16, False, (16,), True, {"rtol": 1e-3, "atol": 1e-3}, {"rtol": 1e-3, "atol": 1e-3}),
    ("bfloat16", torch.bfloat16, False, (16,), True, {"rtol": 1.6e-2, "atol": 3e-4}, {"rtol": 1.6e-2, "atol": 3e-3}),
    # beyond apex: its mixed module with a half input (apex's half thresholds)
    ("mixed_half", torch.float16, True, (16,), True, {"rtol": 1e-3, "atol": 1e-3}, {"rtol": 1e-3, "atol": 1e-3}),
    ("mixed_bfloat16", torch.bfloat16, True, (16,), True, {"rtol": 1.6e-2, "atol": 3e-4}, {"rtol": 1.6e-2, "atol": 3e-3}),
]  # fmt: skip
RMS_NORM_CASES = [
    ("regular", torch.float32, False, BATCHES, False, {}, {}),
    ("elemwise", torch.float32, False, BATCHES, True, {}, {"rtol": 2e-3, "atol": 2e-4}),
    ("mixed", torch.float32, True, BATCHES, True, {}, {"rtol": 2e-3, "atol": 2e-4}),
    ("half", torch.float16, False, (16,), True, {}, {"rtol": 1.6e-2, "atol": 3e-3}),
    ("bfloat16", torch.bfloat16, False, (16,), True, {"rtol": 1.6e-2, "atol": 3e-4}, {"rtol": 1.6e-2, "atol": 3e-2}),
    ("mixed_half", torch.float16, True, (16,), True, {}, {"rtol": 1.6e-2, "atol": 3e-3}),
    ("mixed_bfloat16", torch.bfloat16, True, (16,), True, {"rtol": 1.6e-2, "atol": 3e-4}, {"rtol": 1.6e-2, "atol": 3e-2}),
]  # fmt: skip


def _cases(table):
    for name, dtype, mixed, batches, affine, fwd, bwd in table:
        for batch in batches:
            for contiguous in (True, False):
                yield pytest.param(
                    dtype,
                    mixed,
                    batch,
                    contiguous,
                    affine,
                    fwd,
                    bwd,
                    id=f"{name}-{batch}-{'contiguous' if contiguous else 'strided'}",
                )


def _inputs(batch, contiguous, dtype):
    """apex's input, float32 and in the dtype: (batch, 32, 16) randn, or the same shape
    sliced out of a (3 batch, 160, 48) tensor with steps (3, 5, 3) (after the cast)."""
    if contiguous:
        x = torch.randn(batch, *NORMALIZED_SHAPE)
        return x, x.to(dtype)
    source = torch.randn(batch * 3, NORMALIZED_SHAPE[0] * 5, NORMALIZED_SHAPE[1] * 3)
    return source[::3, ::5, ::3], source.to(dtype)[::3, ::5, ::3]


def _run(rms, backend, dtype, mixed, batch, contiguous, affine, fwd, bwd):
    theirs_cls, ours_cls = (
        (torch.nn.RMSNorm, layernorm.RMSNorm) if rms else (torch.nn.LayerNorm, layernorm.LayerNorm)
    )
    kwargs = {"eps": 1e-5} if rms else {}  # apex's FusedRMSNorm eps is 1e-5
    # the default init (ones, zeros), as apex: its thresholds allow for the input's
    # rounding to the dtype, which a random bias would turn into large relative errors
    theirs = theirs_cls(NORMALIZED_SHAPE, elementwise_affine=affine, **kwargs)
    ours = ours_cls(NORMALIZED_SHAPE, elementwise_affine=affine, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    ours.backend = backend
    if not mixed:
        ours.to(dtype)

    x, x_dtype = _inputs(batch, contiguous, dtype)
    x_theirs = x.detach().requires_grad_(True)
    x_ours = x_dtype.detach().requires_grad_(True)
    assert x_ours.is_contiguous() == contiguous
    y_theirs = theirs(x_theirs)
    dy = torch.rand_like(y_theirs)
    y_theirs.backward(dy)
    y_ours = ours(x_ours)
    assert y_ours.dtype == dtype
    assert_close(y_ours, y_theirs.to(dtype), **fwd)
    y_ours.backward(dy.to(dtype))
    assert_close(x_ours.grad, x_theirs.grad.to(dtype), **bwd)
    if rms and affine:  # apex's RMSNorm test also compares the weight gradient
        assert_close(ours.weight.grad, theirs.weight.grad.to(ours.weight.dtype), **bwd)


@parametrize_backends
@pytest.mark.parametrize(
    ("dtype", "mixed", "batch", "contiguous", "affine", "fwd", "bwd"),
    list(_cases(LAYER_NORM_CASES)),
)
def test_fused_layer_norm(backend, dtype, mixed, batch, contiguous, affine, fwd, bwd):
    """apex ``_test_fused_layer_norm``: output and input gradient against torch's float32
    LayerNorm cast to the dtype, at apex's thresholds per test (``{}``: assert_close's
    defaults for the dtype)."""
    _run(False, backend, dtype, mixed, batch, contiguous, affine, fwd, bwd)


@parametrize_backends
@pytest.mark.parametrize(
    ("dtype", "mixed", "batch", "contiguous", "affine", "fwd", "bwd"),
    list(_cases(RMS_NORM_CASES)),
)
def test_fused_rms_norm(backend, dtype, mixed, batch, contiguous, affine, fwd, bwd):
    """apex ``_test_fused_rms_norm``: output, input gradient and weight gradient against
    torch's float32 RMSNorm cast to the dtype, at apex's thresholds per test."""
    _run(True, backend, dtype, mixed, batch, contiguous, affine, fwd, bwd)
