"""flash-attention's Triton layer-norm test and its tolerance rule, re-expressed.

Source: Dao-AILab/flash-attention ``tests/ops/triton/test_layer_norm.py``,
``test_layer_norm``. Its rule, for the output, the residual and every gradient::

    max |ours - ref| <= 2 * max |pt - ref| + atol

where ``pt`` is torch in the same dtypes as ours and ``ref`` the upcast reference
(flash-attention upcasts to float32; here ``ref`` is float64, from
``layernorm.reference``). ``atol`` is 5e-2 with any bfloat16 tensor, 1e-2 with any
float16, else 1e-4. Its ``prenorm`` variant returns ``x + residual`` beside the output and
back-propagates ``out * sigmoid(residual)``; that is our ``add_layer_norm`` /
``add_rms_norm`` (and, without a residual, ``layer_norm`` / ``rms_norm`` with ``x`` as the
residual). ``weight_dtype`` may differ from the input's (float32 parameters with half
inputs, or half parameters with float32 input).

Not mapped: a residual of another dtype than the input (flash-attention's
``residual_dtype=float32`` with half inputs, ``residual_in_fp32``): our ``add_*`` take one
dtype for both. Shrunk: batch 8 x seqlen 512 becomes 2 x 8 rows (2 x 2 at 8192); of its hidden sizes
192, 2048, 2560, 3000, 8192: 192 in every (input, weight) dtype pair, 3000 in each dtype
alone, 8192 in float32; of its mixed pairs, (bfloat16, float32) and (float32, float16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _peers import parametrize_backends, reference_backward, reference_forward

import layernorm


def _atol(*dtypes):
    if torch.bfloat16 in dtypes:
        return 5e-2
    if torch.float16 in dtypes:
        return 1e-2
    return 1e-4


def _within(ours, pt, ref, atol, what):
    """flash-attention's ``allclose``: max |ours - ref| <= 2 max |pt - ref| + atol."""
    ours_err = float((ours.detach().double() - ref).abs().max())
    pt_err = float((pt.detach().double() - ref).abs().max())
    assert ours_err <= 2 * pt_err + atol, f"{what}: {ours_err} > 2 * {pt_err} + {atol}"


def _torch_same_dtype(x, residual, weight, bias, rms, eps):
    """flash-attention's ``layer_norm_ref`` / ``rms_norm_ref`` without upcast: the sum in
    the input dtype, the norm by torch in the weight's dtype, the output in x's."""
    if residual is not None:
        x = (x + residual).to(x.dtype)
    z = x.to(weight.dtype)
    if rms:
        out = F.rms_norm(z, z.shape[-1:], weight, eps)
    else:
        out = F.layer_norm(z, z.shape[-1:], weight, bias, eps)
    return out.to(x.dtype), x


def _float64(x, residual, weight, bias, rms, eps, g, prenorm):
    """The float64 output, residual and gradients (x, residual, weight, bias), by
    ``layernorm.reference``, of ``out`` (or ``out * sigmoid(h)`` with prenorm)."""
    h = x.detach().double()
    if residual is not None:
        h = h + residual.detach().double()
    n = h.shape[-1]
    out = reference_forward(h, n, weight, bias, eps, rms)
    g = g.double()
    if prenorm:  # d(out * s(h)) = g s(h) d out + g out s(h) (1 - s(h)) d h
        sig = torch.sigmoid(h)
        dout, dh_direct = g * sig, g * out * sig * (1 - sig)
    else:
        dout, dh_direct = g, torch.zeros_like(h)
    dh, dweight, dbias = reference_backward(dout, h, n, weight, eps, rms)
    dh = dh + dh_direct
    return out, h, dh, dweight, dbias


#: (input dtype, weight dtype): each dtype alone, and two mixed pairs of flash-attention's
#: product (float32 parameters with a half input, half parameters with a float32 input)
DTYPE_PAIRS = [
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
]
CASES = (
    [  # hidden 192 in every pair
        pytest.param(192, x_dtype, w_dtype, id=f"192-{str(x_dtype)[6:]}-{str(w_dtype)[6:]}")
        for x_dtype, w_dtype in DTYPE_PAIRS
    ]
    + [  # 3000 (not a power of two) in each dtype alone
        pytest.param(3000, dtype, dtype, id=f"3000-{str(dtype)[6:]}")
        for dtype in (torch.float16, torch.bfloat16, torch.float32)
    ]
    + [pytest.param(8192, torch.float32, torch.float32, id="8192-float32")]
)


@parametrize_backends
@pytest.mark.parametrize(("hidden_size", "input_dtype", "weight_dtype"), CASES)
@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("prenorm", [True, False], ids=["prenorm", "postnorm"])
def test_layer_norm(
    backend, hidden_size, input_dtype, weight_dtype, has_residual, is_rms_norm, prenorm
):
    """flash-attention ``test_layer_norm``: output, residual (prenorm) and the gradients of
    x, residual, weight and bias within twice torch's same-dtype error plus atol, both
    against float64; the output in the input's dtype, the residual too. Weights and
    biases randn in ``weight_dtype``, eps 1e-6, gradient randn / batch."""
    atol = _atol(input_dtype, weight_dtype)
    batch_size, seqlen, eps = 2, 8 if hidden_size < 8192 else 2, 1e-6
    x0 = torch.randn(batch_size, seqlen, hidden_size, dtype=input_dtype)
    res = torch.randn_like(x0) if has_residual else None
    weight = torch.randn(hidden_size, dtype=weight_dtype)
    bias = None if is_rms_norm else torch.randn(hidden_size, dtype=weight_dtype)
    leaves = [t for t in (x0, res, weight, bias) if t is not None]
    ours_in = [t.clone().requires_grad_() for t in leaves]
    pt_in = [t.clone().requires_grad_() for t in leaves]

    def unpack(tensors):
        it = iter(tensors)
        x = next(it)
        r = next(it) if has_residual else None
        w = next(it)
        b = None if is_rms_norm else next(it)
        return x, r, w, b

    x, r, w, b = unpack(ours_in)
    if has_residual and is_rms_norm:
        out, residual = layernorm.add_rms_norm(x, r, hidden_size, w, eps, backend=backend)
    elif has_residual:
        out, residual = layernorm.add_layer_norm(x, r, hidden_size, w, b, eps, backend=backend)
    elif is_rms_norm:
        out, residual = layernorm.rms_norm(x, hidden_size, w, eps, backend=backend), x
    else:
        out, residual = layernorm.layer_norm(x, hidden_size, w, b, eps, backend=backend), x
    out_pt, residual_pt = _torch_same_dtype(*unpack(pt_in), is_rms_norm, eps)

    g = torch.randn_like(out) / batch_size
    out_ref, residual_ref, dh_ref, dweight_ref, dbias_ref = _float64(
        x0, res, weight, bias, is_rms_norm, eps, g, prenorm
    )
    assert out.dtype == input_dtype
    _within(out, out_pt, out_ref, atol, "out")
    if prenorm:
        assert residual.dtype == input_dtype
        _within(residual, residual_pt, residual_ref, atol, "residual")
        (out * torch.sigmoid(residual)).backward(g)
        (out_pt * torch.sigmoid(residual_pt)).backward(g)
    else:
        out.backward(g)
        out_pt.backward(g)
    # x and residual both receive d h (the sum's gradient)
    wants = [dh_ref, dh_ref if has_residual else None, dweight_ref, dbias_ref]
    names = ["x", "residual", "weight", "bias"]
    for name, mine, theirs, want in zip(
        [n for n, t in zip(names, (x0, res, weight, bias), strict=True) if t is not None],
        ours_in,
        pt_in,
        [t for t in wants if t is not None],
        strict=True,
    ):
        assert mine.grad.dtype == mine.dtype
        _within(mine.grad, theirs.grad, want, atol, f"d{name}")
