"""apex's fused norms (``apex.normalization``) on this library's kernels, on any device.

``from layernorm.compat.apex import FusedLayerNorm`` in place of
``from apex.normalization import FusedLayerNorm``: the same constructors, defaults,
attributes (``normalized_shape`` a ``torch.Size``, ``eps``, ``elementwise_affine``,
``memory_efficient``), parameters (``state_dict`` keys), ``extra_repr`` and output dtypes
as apex's CUDA path:

- ``FusedLayerNorm`` / ``FusedRMSNorm``: the output in the input's dtype;
- ``MixedFusedLayerNorm`` / ``MixedFusedRMSNorm`` (always affine): the output in the
  parameters' dtype (float32 from a bfloat16 input with float32 parameters: ``out_dtype``,
  correctly rounded in it; bfloat16 from a float32 input with bfloat16 parameters,
  rounded once into it by the kernels).

``memory_efficient=True`` is :func:`layernorm.layer_norm`'s (:mod:`layernorm.recompute`):
autograd saves the output, and the backward recovers the normalized input from it, within
a stated bound (apex's semantics; the default backward is correctly rounded).
apex itself runs torch's ``F.layer_norm`` / a float32 RMSNorm for CPU inputs; these run
this library's exact kernels on every device.

Source read (facts, not code): NVIDIA/apex ``apex/normalization/fused_layer_norm.py``.
"""

from __future__ import annotations

import numbers
import warnings

import torch
from torch import Tensor
from torch.nn import Parameter, init

from ..ops import ShapeLike, layer_norm, rms_norm

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]


def _wider(input: Tensor, weight: Tensor) -> torch.dtype | None:
    """apex's mixed output dtype, the parameters', as ``out_dtype`` (None: the input's)."""
    return None if weight.dtype == input.dtype else weight.dtype


# ---------------------------------------------------------------------------------------
# Functions (apex's signatures; eps defaults 1e-6 as apex's functions, 1e-5 its modules)


def fused_layer_norm_affine(
    input: Tensor,
    weight: Tensor,
    bias: Tensor,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    return layer_norm(input, normalized_shape, weight, bias, eps, memory_efficient=memory_efficient)


def fused_layer_norm(
    input: Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False
) -> Tensor:
    return layer_norm(input, normalized_shape, None, None, eps, memory_efficient=memory_efficient)


def mixed_dtype_fused_layer_norm_affine(
    input: Tensor,
    weight: Tensor,
    bias: Tensor,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    return layer_norm(
        input, normalized_shape, weight, bias, eps,
        out_dtype=_wider(input, weight), memory_efficient=memory_efficient,
    )  # fmt: skip


def fused_rms_norm_affine(
    input: Tensor,
    weight: Tensor,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    return rms_norm(input, normalized_shape, weight, eps, memory_efficient=memory_efficient)


def fused_rms_norm(
    input: Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False
) -> Tensor:
    return rms_norm(input, normalized_shape, None, eps, memory_efficient=memory_efficient)


def mixed_dtype_fused_rms_norm_affine(
    input: Tensor,
    weight: Tensor,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    return rms_norm(
        input, normalized_shape, weight, eps,
        out_dtype=_wider(input, weight), memory_efficient=memory_efficient,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Modules


class _FusedNorm(torch.nn.Module):
    """What apex's two modules share: ``normalized_shape`` as a ``torch.Size``, ``eps``,
    ``elementwise_affine``, ``memory_efficient``, a ``weight`` of ones (and, with
    ``_bias``, a ``bias`` of zeros) or ``None``, and apex's ``extra_repr``."""

    _bias = False
    weight: Tensor  # or None without elementwise_affine, as torch's modules type it
    bias: Tensor

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)  # type: ignore[assignment]
        self.normalized_shape = torch.Size(normalized_shape)  # type: ignore[arg-type]
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        names = ("weight", "bias") if self._bias else ("weight",)
        for name in names:
            if self.elementwise_affine:
                setattr(self, name, Parameter(torch.empty(*self.normalized_shape)))
            else:
                self.register_parameter(name, None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)
            if self._bias:
                init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(
            **self.__dict__
        )


class FusedLayerNorm(_FusedNorm):
    r"""apex's ``FusedLayerNorm``: layer normalization over the trailing
    ``normalized_shape`` dims, :func:`layernorm.layer_norm` (output in the input's dtype).

    Args:
        normalized_shape: an int or a sequence (stored as a ``torch.Size``).
        eps: Default: ``1e-5``.
        elementwise_affine: learn ``weight`` (ones) and ``bias`` (zeros). Default: ``True``.
        memory_efficient: save the output, not the input, for the backward
            (:mod:`layernorm.recompute`). Default: ``False``.
    """

    _bias = True

    def forward(self, input: Tensor) -> Tensor:
        return layer_norm(
            input, self.normalized_shape, self.weight, self.bias, self.eps,
            memory_efficient=self.memory_efficient,
        )  # fmt: skip


class FusedRMSNorm(_FusedNorm):
    r"""apex's ``FusedRMSNorm``: RMSNorm over the trailing ``normalized_shape`` dims,
    :func:`layernorm.rms_norm` (output in the input's dtype).

    Args: as :class:`FusedLayerNorm` (a ``weight`` of ones only).
    """

    def forward(self, input: Tensor) -> Tensor:
        return rms_norm(
            input, self.normalized_shape, self.weight, self.eps,
            memory_efficient=self.memory_efficient,
        )  # fmt: skip


def _affine_only(name: str, kwargs: dict) -> None:
    """apex's check of the mixed modules: ``elementwise_affine`` warns, and False raises."""
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{name} does not support `elementwise_affine` argument", stacklevel=3)
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{name} does not support `elementwise_affine = False`")


class MixedFusedLayerNorm(FusedLayerNorm):
    """apex's ``MixedFusedLayerNorm``: always affine; the output in the parameters' dtype
    (float32 parameters with a bfloat16 input give a correctly rounded float32 output)."""

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        **kwargs: bool,
    ) -> None:
        _affine_only("MixedFusedLayerNorm", kwargs)
        super().__init__(
            normalized_shape=normalized_shape,
            eps=eps,
            elementwise_affine=True,
            memory_efficient=memory_efficient,
        )

    def forward(self, input: Tensor) -> Tensor:
        return mixed_dtype_fused_layer_norm_affine(
            input, self.weight, self.bias, self.normalized_shape, self.eps, self.memory_efficient
        )


class MixedFusedRMSNorm(FusedRMSNorm):
    """apex's ``MixedFusedRMSNorm``: always affine; the output in the weight's dtype."""

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        **kwargs: bool,
    ) -> None:
        _affine_only("MixedFusedRMSNorm", kwargs)
        super().__init__(
            normalized_shape=normalized_shape,
            eps=eps,
            elementwise_affine=True,
            memory_efficient=memory_efficient,
        )

    def forward(self, input: Tensor) -> Tensor:
        return mixed_dtype_fused_rms_norm_affine(
            input, self.weight, self.normalized_shape, self.eps, self.memory_efficient
        )
