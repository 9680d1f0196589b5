""":func:`layernorm.fused_norm` over the last dim, as flash-attn's and quack's shims call
it, with one addition: an RMSNorm with a bias (theirs have one; ``fused_norm(rms=True)``
takes none, as RMSNorm's output has none).

With a bias, RMSNorm's output is ``RN_out(RN64(n) + bias)`` with ``n = h / rms(h) · gain``:
the norm correctly rounded to float64 (``out_dtype=torch.float64``), the bias added in
float64 (rounded), the sum rounded to ``out_dtype``. So ``|y − (n + bias)|`` is at most
half a unit in the last place of ``y`` in ``out_dtype`` plus ``2^-53·(|n| + |n + bias|)``
(the two float64 roundings): ``y`` is the correctly rounded ``n + bias`` except where
that value lies within about ``2^-52·(|n| + |bias|)`` of a rounding boundary of
``out_dtype`` (for float64 output: the two roundings, faithful where there is no
cancellation). Without a bias, and for layer norm, the call is
:func:`layernorm.fused_norm`'s, correctly rounded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..fused import FusedNorm, fused_norm

__all__ = ["fused_last_dim"]


def _plus_bias(y64: Tensor, bias: Tensor, dtype: torch.dtype) -> Tensor:
    return (y64 + bias.to(torch.float64)).to(dtype)


def fused_last_dim(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    *,
    rms: bool,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    offset: float = 0.0,
    **options,
) -> FusedNorm:
    """:func:`layernorm.fused_norm` over ``x``'s last dim (its other options in
    ``options``), an RMSNorm ``bias`` / ``bias1`` added as the module docstring states."""
    shape = x.shape[-1:]
    if not rms or (bias is None and bias1 is None):
        return fused_norm(x, shape, weight, bias, eps, rms=rms, weight1=weight1, bias1=bias1,
                          out_dtype=out_dtype, offset=offset, **options)  # fmt: skip
    dtype = out_dtype or x.dtype
    first = fused_norm(x, shape, weight, None, eps, rms=True, offset=offset,
                       out_dtype=torch.float64 if bias is not None else dtype,
                       **options)  # fmt: skip
    y = first.y if bias is None else _plus_bias(first.y, bias, dtype)
    y1 = None
    if weight1 is not None:
        h = x if first.residual_out is None else first.residual_out
        y1 = fused_norm(h, shape, weight1, None, eps, rms=True, offset=offset,
                        out_dtype=torch.float64 if bias1 is not None else dtype).y  # fmt: skip
        y1 = y1 if bias1 is None else _plus_bias(y1, bias1, dtype)
    elif bias1 is not None:
        raise ValueError("fused_norm: bias1 needs weight1 (y1 is norm(h)·weight1 + bias1)")
    return first._replace(y=y, y1=y1)
