"""flash-attention's Triton norms (``flash_attn.ops.triton.layer_norm``) on this library's
kernels, on any device.

``from layernorm.compat.flash_attn import layer_norm_fn, rms_norm_fn, RMSNorm,
layer_norm_linear_fn`` in place of ``from flash_attn.ops.triton.layer_norm import ...``:
the same signatures, defaults, return structures (a tensor or a tuple, in flash-attn's
order), output and gradient dtypes, and ``RMSNorm``'s attributes, ``state_dict`` keys
(``weight``) and ``repr``. The values are :func:`layernorm.fused_norm`'s:

- ``residual_out`` (returned with ``prenorm=True``) is
  ``h = RN(k0·s·x·rowscale + k1·s·x1 + residual)``, the exact sum rounded once to the
  residual dtype (``residual``'s; else float32 with ``residual_in_fp32``; else ``x``'s),
  and the norm normalizes that ``h``. flash-attn normalizes its float32 sum before it is
  rounded into ``residual_out``; here ``residual_out`` is exactly what was normalized
  (the same when the residual dtype is float32 and the float32 sum is exact).
- ``out`` (``y``) and ``y1``: ``norm(h)·(weight [+1]) + bias`` correctly rounded to
  ``out_dtype`` (default ``x``'s dtype, as flash-attn's); an RMSNorm's bias is added as
  :mod:`layernorm.compat._fused` states (to the float64 norm, then rounded).
- Dropout: the keep masks of ``docs/contract.md`` §7 (Philox keyed by a seed, the
  element's offset ``row·N + col``; ``x1``'s mask the second Philox word), with the exact
  scale ``1/(1 − p)``. flash-attn's masks come from per-row seeds drawn on the GPU; these
  come from one seed drawn from torch's default CPU generator (``torch.manual_seed``
  reproduces them, on any device and batch size). The signatures take no seed, as
  flash-attn's; :func:`layernorm.fused_norm` takes ``seed=``. ``return_dropout_mask``
  returns the masks as flash-attn does (bool, ``x``'s shape; ``None`` when
  ``dropout_p == 0`` or, for the second, without ``x1``).
- ``rowscale``: ``x.shape[:-1]`` (or ``(M,)``), used as given; it gets no gradient
  (flash-attn's backward returns none): it is detached.
- ``zero_centered_weight``: the gain ``weight + 1`` (``offset=1.0``, formed exactly).
- ``out`` / ``residual_out`` (preallocated): filled with the result and returned (under
  autograd the returned tensor carries the graph, as flash-attn's). ``out``'s dtype is
  the output dtype (flash-attn writes into it); ``residual_out``'s must be the residual
  dtype (``AssertionError`` otherwise). flash-attn's ``_layer_norm_fwd`` (read at
  0251105) drops a given ``residual_out`` and returns ``x``; this fills it as documented.
- :func:`layer_norm_linear_fn`: ``F.linear(norm(h), W, b)`` with ``W``, ``b`` cast to
  ``y``'s dtype (the autocast dtype of ``x``'s device under autocast, else ``x``'s), as
  flash-attn's; :func:`layernorm.layer_norm_linear` (``y`` recomputed in the backward,
  not saved) where ``y``'s dtype is ``h``'s and the norm has no RMS bias; else the plain
  composition (same values, ``y`` saved).

Errors as flash-attn's: ``AssertionError`` for shapes (``residual``, ``x1``, ``out``,
``residual_out`` not ``x``'s) and for ``rowscale`` with ``x1`` ("rowscale is not supported
with parallel LayerNorm"). flash-attn normalizes over the last dim; so do these.

Source read (facts, not code): Dao-AILab/flash-attention
``flash_attn/ops/triton/layer_norm.py`` and ``tests/ops/triton/test_layer_norm.py`` at
0251105a2fb1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..fused import fused_norm
from ..recompute import layer_norm_linear
from ._fused import fused_last_dim

__all__ = ["RMSNorm", "layer_norm_fn", "layer_norm_linear_fn", "rms_norm_fn"]


def _residual_dtype(
    x: Tensor, residual: Tensor | None, residual_in_fp32: bool
) -> torch.dtype | None:
    """flash-attn's rule: the residual's dtype, else float32 with ``residual_in_fp32``."""
    if residual is not None:
        return residual.dtype
    return torch.float32 if residual_in_fp32 else None


def _fill(buffer: Tensor | None, value: Tensor) -> Tensor:
    """``value`` itself, or ``buffer`` filled with it (the graph carried by ``copy_``)."""
    if buffer is None:
        return value
    return buffer.copy_(value)


def _norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    x1: Tensor | None,
    weight1: Tensor | None,
    bias1: Tensor | None,
    eps: float,
    dropout_p: float,
    rowscale: Tensor | None,
    prenorm: bool,
    residual_in_fp32: bool,
    zero_centered_weight: bool,
    is_rms_norm: bool,
    return_dropout_mask: bool,
    out_dtype: torch.dtype | None,
    out: Tensor | None,
    residual_out: Tensor | None,
) -> Tensor | tuple[Tensor | None, ...]:
    """flash-attn's ``LayerNormFn.apply`` on :func:`layernorm.fused_norm`."""
    if residual is not None:
        assert residual.shape == x.shape
    if x1 is not None:
        assert x1.shape == x.shape
        assert rowscale is None, "rowscale is not supported with parallel LayerNorm"
    residual_dtype = _residual_dtype(x, residual, residual_in_fp32)
    if out is not None:
        assert out.shape == x.shape
        out_dtype = out.dtype
    if residual_out is not None:
        assert residual_out.shape == x.shape
        assert residual_out.dtype == (residual_dtype or x.dtype), (
            f"residual_out must be {residual_dtype or x.dtype}, got {residual_out.dtype}"
        )
    if rowscale is not None:
        rowscale = rowscale.detach().reshape(-1)
    result = fused_last_dim(
        x,
        weight,
        bias,
        eps,
        rms=is_rms_norm,
        residual=residual,
        x1=x1,
        weight1=weight1,
        bias1=bias1,
        dropout_p=dropout_p,
        rowscale=rowscale,
        residual_dtype=residual_dtype,
        out_dtype=out_dtype,
        offset=1.0 if zero_centered_weight else 0.0,
        return_dropout_mask=return_dropout_mask and dropout_p > 0.0,
    )
    y = _fill(out, result.y)
    h = x if result.residual_out is None else result.residual_out
    h = _fill(residual_out, h)
    outputs: list[Tensor | None] = [y]  # y first: a single output is y, a Tensor
    if weight1 is not None:
        outputs.append(result.y1)
    if prenorm:
        outputs.append(h)
    if return_dropout_mask:
        masks = (result.dropout_mask, result.dropout_mask1 if x1 is not None else None)
        outputs.extend(None if m is None else m.reshape(x.shape) for m in masks)
    return y if len(outputs) == 1 else tuple(outputs)


def layer_norm_fn(
    x,
    weight,
    bias,
    residual=None,
    x1=None,
    weight1=None,
    bias1=None,
    eps=1e-6,
    dropout_p=0.0,
    rowscale=None,
    prenorm=False,
    residual_in_fp32=False,
    zero_centered_weight=False,
    is_rms_norm=False,
    return_dropout_mask=False,
    out_dtype=None,
    out=None,
    residual_out=None,
):
    """flash-attn's ``layer_norm_fn``: dropout-add ``h = drop(x·rowscale) + drop(x1) +
    residual`` (rounded once to the residual dtype), then ``y = norm(h)·weight + bias``
    (and ``y1`` with ``weight1``, ``bias1``), over the last dim.

    Returns, as flash-attn: ``y``; ``(y, y1)`` with ``weight1``; then ``residual_out``
    appended with ``prenorm``; then ``(dropout_mask, dropout_mask1)`` appended with
    ``return_dropout_mask``. A single output is returned bare. The module docstring
    states where the values differ from flash-attn's on purpose.
    """
    return _norm(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
        residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype,
        out, residual_out,
    )  # fmt: skip


def rms_norm_fn(
    x,
    weight,
    bias,
    residual=None,
    x1=None,
    weight1=None,
    bias1=None,
    eps=1e-6,
    dropout_p=0.0,
    rowscale=None,
    prenorm=False,
    residual_in_fp32=False,
    zero_centered_weight=False,
    return_dropout_mask=False,
    out_dtype=None,
    out=None,
    residual_out=None,
):
    """flash-attn's ``rms_norm_fn``: :func:`layer_norm_fn` with ``is_rms_norm=True``
    (``y = h / rms(h) · weight + bias``)."""
    return _norm(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
        residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype, out,
        residual_out,
    )  # fmt: skip


class RMSNorm(torch.nn.Module):
    """flash-attn's ``RMSNorm`` module: ``weight`` of ones (zeros with
    ``zero_centered_weight``, the gain then ``1 + weight``), no bias (``bias`` registered as
    ``None``), dropout ``drop`` (a ``torch.nn.Dropout`` or ``None``; its ``p`` applies in
    training only) before the residual add. ``forward(x, residual=None, prenorm=False,
    residual_in_fp32=False)`` returns :func:`rms_norm_fn`'s ``y`` or ``(y, residual)``.

    Args:
        hidden_size: the last dim. eps: Default: ``1e-5``. dropout_p: Default: ``0.0``.
        zero_centered_weight: Default: ``False``. device, dtype: the weight's.
    """

    def __init__(
        self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None,
        dtype=None,
    ):  # fmt: skip
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, **factory_kwargs))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        if not self.zero_centered_weight:
            torch.nn.init.ones_(self.weight)
        else:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_fn(
            x,
            self.weight,
            self.bias,
            residual=residual,
            eps=self.eps,
            dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
            prenorm=prenorm,
            residual_in_fp32=residual_in_fp32,
            zero_centered_weight=self.zero_centered_weight,
        )


def _exactly_wider(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value is a ``dst`` value (the conversion is exact)."""
    if src == dst or dst == torch.float64:
        return True
    return dst == torch.float32 and src in (torch.float16, torch.bfloat16)


def _add(x: Tensor, residual: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``x + residual`` rounded once to ``dtype`` (``x`` converted without a residual):
    one IEEE addition where both convert exactly, else :func:`layernorm.fused_norm`'s
    ``residual_out``."""
    exact = _exactly_wider(x.dtype, dtype)
    if residual is None:
        if exact:
            return x.to(dtype)
    elif exact and _exactly_wider(residual.dtype, dtype):
        return x.to(dtype) + residual.to(dtype)
    result = fused_norm(x, x.shape[-1:], residual=residual, residual_dtype=dtype)
    return x if result.residual_out is None else result.residual_out


def layer_norm_linear_fn(
    x,
    norm_weight,
    norm_bias,
    linear_weight,
    linear_bias,
    residual=None,
    eps=1e-6,
    prenorm=False,
    residual_in_fp32=False,
    is_rms_norm=False,
):
    """flash-attn's ``layer_norm_linear_fn``: ``h = x + residual`` (rounded once to the
    residual dtype), ``y = norm(h)`` in ``x``'s dtype (the autocast dtype under autocast),
    ``out = F.linear(y, linear_weight, linear_bias)`` with the linear's parameters cast to
    ``y``'s dtype. Returns ``out``, or ``(out, h)`` with ``prenorm``. ``y`` is recomputed
    in the backward where :func:`layernorm.layer_norm_linear` applies (module docstring).
    """
    if residual is not None:
        assert residual.shape == x.shape
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    y_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
    residual_dtype = _residual_dtype(x, residual, residual_in_fp32) or x.dtype
    with torch.autocast(device_type, enabled=False):
        h = (
            x
            if residual is None and residual_dtype == x.dtype
            else _add(x, residual, residual_dtype)
        )
        weight = linear_weight.to(y_dtype)
        bias = None if linear_bias is None else linear_bias.to(y_dtype)
        if h.dtype == y_dtype and not (is_rms_norm and norm_bias is not None):
            out = layer_norm_linear(
                h, h.shape[-1:], norm_weight, norm_bias, weight, bias, eps, rms=is_rms_norm
            )
        else:
            y = fused_last_dim(h, norm_weight, norm_bias, eps, rms=is_rms_norm,
                               out_dtype=y_dtype).y  # fmt: skip
            out = F.linear(y, weight, bias)
    return out if not prenorm else (out, h)
