"""quack's RMSNorm (``quack.rmsnorm``) on this library's kernels, on any device.

``from layernorm.compat.quack import rmsnorm, QuackRMSNorm`` in place of
``from quack.rmsnorm import rmsnorm, QuackRMSNorm``: the same signature, defaults and
return structure (``out``, or ``(out, residual_out)`` with ``prenorm=True``), output and
gradient dtypes, and ``QuackRMSNorm`` a ``torch.nn.RMSNorm`` (attributes, ``state_dict``
keys, ``repr``). The values are :func:`layernorm.fused_norm`'s (``rms=True``):

- ``residual_out`` is ``h = x + residual`` rounded once to ``residual_dtype`` (default
  ``residual``'s dtype; ``x`` itself when there is no residual and no dtype change, as
  quack returns), and the norm normalizes that ``h``. quack normalizes its float32 sum
  before it is rounded into ``residual_out``; here ``residual_out`` is exactly what was
  normalized (the same when ``residual_dtype`` is float32 and the float32 sum is exact).
- ``out = h / rms(h) · (weight + weight_offset)`` correctly rounded to ``out_dtype``
  (default ``x``'s), the gain ``weight + weight_offset`` formed exactly (``offset``); the
  weight's gradient is the gain's, as quack's. A bias is added as
  :mod:`layernorm.compat._fused` states (to the float64 norm, then rounded).
- Per-head weights (``weight`` or ``bias`` of shape ``(H, D)`` with ``x`` of shape
  ``(..., H, D)``): each head normalized over ``D`` with its own row of the parameters,
  one call per head.
- Beyond quack (CUDA only; float16, bfloat16, float32): any device, and float64.

Errors: ``weight_offset`` without a weight raises ``AssertionError`` with quack's message;
a weight of another size raises :class:`layernorm.NormalizedShapeError` (a
``ValueError``, as quack's, with this library's message). quack's ``prenorm`` without a
residual returns ``(out, x)`` and back-propagates nothing through that ``x``: here the
gradient of the returned ``residual_out`` reaches ``x`` (it is ``x``).

Source read (facts, not code): Dao-AILab/quack ``quack/rmsnorm.py`` (``rmsnorm``,
``RMSNormFunction``, ``rmsnorm_fwd``, ``rmsnorm_ref``, ``QuackRMSNorm``) and
``tests/test_rmsnorm.py`` at c8ec3170057.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._fused import fused_last_dim

__all__ = ["QuackRMSNorm", "rmsnorm"]


def _one(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    out_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
    eps: float,
    weight_offset: float,
) -> tuple[Tensor, Tensor]:
    """``(out, residual_out)`` over the last dim."""
    result = fused_last_dim(
        x,
        weight,
        bias,
        eps,
        rms=True,
        residual=residual,
        residual_dtype=residual_dtype,
        out_dtype=out_dtype,
        offset=weight_offset,
    )
    return result.y, x if result.residual_out is None else result.residual_out


def rmsnorm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual_dtype: torch.dtype | None = None,
    eps: float = 1e-6,
    prenorm: bool = False,
    weight_offset: float = 0.0,
) -> Tensor:
    """quack's ``rmsnorm``: ``out = rms_norm(h)·(weight + weight_offset) + bias`` with
    ``h = x + residual`` rounded once to ``residual_dtype`` (module docstring).

    Args:
        x: ``(..., N)``, or ``(..., H, D)`` with per-head parameters.
        weight, bias: ``(N,)`` or per-head ``(H, D)``. Default: ``None``.
        residual: ``x``'s shape. Default: ``None``.
        out_dtype: ``out``'s dtype. Default: ``None`` (``x``'s).
        residual_dtype: ``residual_out``'s dtype. Default: ``None`` (``residual``'s, else
            ``x``'s).
        eps: Default: ``1e-6``. weight_offset: added to the weight. Default: ``0.0``.
        prenorm: also return ``residual_out``. Default: ``False``.

    Returns:
        ``out``, or ``(out, residual_out)`` with ``prenorm=True``.
    """
    if weight_offset != 0.0:
        assert weight is not None, "weight_offset requires a weight"
    if residual is not None and residual_dtype is None:
        residual_dtype = residual.dtype
    per_head = (weight is not None and weight.dim() == 2) or (bias is not None and bias.dim() == 2)
    if not per_head:
        out, residual_out = _one(
            x, weight, bias, residual, out_dtype, residual_dtype, eps, weight_offset
        )
    else:
        heads = [
            _one(
                x[..., head, :],
                None if weight is None else weight[head],
                None if bias is None else bias[head],
                None if residual is None else residual[..., head, :],
                out_dtype,
                residual_dtype,
                eps,
                weight_offset,
            )
            for head in range(x.shape[-2])
        ]
        out = torch.stack([o for o, _ in heads], dim=-2)
        residual_out = torch.stack([r for _, r in heads], dim=-2)
        if residual is None and residual_out.dtype == x.dtype:
            residual_out = x
    return (out, residual_out) if prenorm else out  # type: ignore[return-value]


class QuackRMSNorm(torch.nn.RMSNorm):
    """quack's ``QuackRMSNorm``: a ``torch.nn.RMSNorm`` (``eps`` default ``1e-6``) whose
    forward is :func:`rmsnorm` ``(x, self.weight, eps=self.eps)``.

    Args:
        dim: the last dim. eps: Default: ``1e-6``. elementwise_affine: Default: ``True``.
        device, dtype: the weight's.
    """

    def __init__(
        self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, device=None,
        dtype=None,
    ) -> None:  # fmt: skip
        super().__init__(dim, eps, elementwise_affine, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return rmsnorm(x, self.weight, eps=self.eps)  # type: ignore[arg-type]
