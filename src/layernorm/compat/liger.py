"""Liger-Kernel's norms (``liger_kernel.transformers``) on this library's kernels.

``from layernorm.compat.liger import LigerRMSNorm`` in place of
``from liger_kernel.transformers import LigerRMSNorm``: the same constructors, defaults,
attributes, parameters (``state_dict`` keys), ``extra_repr`` and outputs, with Liger's
``offset`` and ``casting_mode`` (:func:`layernorm.rms_norm`'s options: each casting mode
rounds where Liger's does, the arithmetic between two casts exact). Two arguments choose
how Liger's kernels run and change no value, so they are kept as attributes only:
``in_place`` (Liger's backward overwrites the incoming gradient; ours never does) and
``row_mode``. Liger normalizes over the last dim; so do these.

Source read (facts, not code): linkedin/Liger-Kernel ``src/liger_kernel/transformers/
{rms_norm,layer_norm,fused_add_rms_norm,functional}.py`` and ``ops/rms_norm.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops import add_rms_norm, layer_norm, rms_norm

__all__ = [
    "LigerFusedAddRMSNorm",
    "LigerLayerNorm",
    "LigerRMSNorm",
    "LigerRMSNormForGemma",
    "LigerRMSNormForGemma2",
    "LigerRMSNormForGemma3",
    "liger_fused_add_rms_norm",
    "liger_layer_norm",
    "liger_rms_norm",
]

#: Liger's casting modes by name and by number (``_str_to_casting_mode``)
_MODES = {"llama": "llama", "gemma": "gemma", "none": "none", 0: "llama", 1: "gemma", -1: "none"}


def _mode(casting_mode: str | int) -> str:
    if casting_mode not in _MODES:
        raise AssertionError(f"Invalid casting mode: {casting_mode}")  # Liger's assert
    return _MODES[casting_mode]


def _weight(hidden_size: int, init_fn: str) -> nn.Parameter:
    assert init_fn in [
        "ones",
        "zeros",
    ], f"init_fn must be either 'ones' or 'zeros', got {init_fn}"
    return nn.Parameter(torch.ones(hidden_size) if init_fn == "ones" else torch.zeros(hidden_size))


# ---------------------------------------------------------------------------------------
# Functions


def liger_rms_norm(
    X: Tensor,
    W: Tensor | None,
    eps: float,
    offset: float = 0.0,
    casting_mode: str | int = "llama",
    in_place: bool = True,
) -> Tensor:
    """Liger's ``liger_rms_norm``: ``X / rms(X) * (offset + W)`` over the last dim, in
    ``casting_mode``'s order; ``W=None`` normalizes only (the offset unused, as Liger's
    kernel without a weight). ``in_place`` changes no value."""
    return rms_norm(
        X,
        X.shape[-1:],
        W,
        eps,
        offset=0.0 if W is None else offset,
        casting_mode=_mode(casting_mode),
    )


def liger_fused_add_rms_norm(
    X: Tensor,
    R: Tensor,
    W: Tensor,
    eps: float,
    offset: float = 0.0,
    casting_mode: str | int = "llama",
    in_place: bool = True,
) -> tuple[Tensor, Tensor]:
    """Liger's ``liger_fused_add_rms_norm``: ``(rms_norm(X + R), X + R)``, the sum
    rounded to X's dtype and then normalized in ``casting_mode``'s order."""
    return add_rms_norm(X, R, X.shape[-1:], W, eps, offset=offset, casting_mode=_mode(casting_mode))


def liger_layer_norm(X: Tensor, W: Tensor, B: Tensor, eps: float) -> Tensor:
    """Liger's ``liger_layer_norm``: layer norm over the last dim with weight and bias."""
    return layer_norm(X, X.shape[-1:], W, B, eps)


# ---------------------------------------------------------------------------------------
# Modules


class LigerRMSNorm(nn.Module):
    """Liger's ``LigerRMSNorm``: RMSNorm over the last dim, ``y = x / rms(x) * (offset +
    weight)`` in ``casting_mode``'s order (:func:`layernorm.rms_norm`).

    Args:
        hidden_size: the last dim. eps: Default: ``1e-6``. offset: Default: ``0.0``.
        casting_mode: ``"llama"``, ``"gemma"`` or ``"none"`` (or Liger's 0, 1, -1).
            Default: ``"llama"``.
        init_fn: the weight's initial value, ``"ones"`` or ``"zeros"``. Default: ``"ones"``.
        in_place, row_mode: kept; change no value. Defaults: ``True``, ``None``.
        elementwise_affine: learn ``weight``. Default: ``True``.

    Attributes as Liger's: ``weight``, ``variance_epsilon``, ``offset``, ``casting_mode``,
    ``in_place``, ``row_mode``, ``elementwise_affine``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str | int = "llama",
        init_fn: str = "ones",
        in_place: bool = True,
        row_mode: bool | None = None,
        elementwise_affine: bool = True,
    ) -> None:
        super().__init__()
        self.elementwise_affine = elementwise_affine
        if self.elementwise_affine:
            self.weight = _weight(hidden_size, init_fn)
        else:
            assert init_fn in ["ones", "zeros"], (
                f"init_fn must be either 'ones' or 'zeros', got {init_fn}"
            )
            self.register_parameter("weight", None)
        self.variance_epsilon, self.offset, self.casting_mode, self.in_place, self.row_mode = (
            eps,
            offset,
            casting_mode,
            in_place,
            row_mode,
        )

    def forward(self, hidden_states: Tensor) -> Tensor:
        return liger_rms_norm(
            hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode
        )

    def extra_repr(self) -> str:
        shape = tuple(self.weight.shape) if self.weight is not None else None
        return (
            f"weight_shape={shape}, eps={self.variance_epsilon}, offset={self.offset}, "
            f"in_place={self.in_place}, row_mode={self.row_mode}"
        )


class LigerRMSNormForGemma(LigerRMSNorm):
    """Liger's Gemma RMSNorm: ``offset=1.0``, ``casting_mode="gemma"``, weight of zeros."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 1.0,
        casting_mode: str | int = "gemma",
        init_fn: str = "zeros",
        in_place: bool = True,
        row_mode: bool | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place, row_mode)


class LigerRMSNormForGemma2(LigerRMSNorm):
    """Liger's Gemma 2 RMSNorm: as Gemma's, ``in_place=False``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 1.0,
        casting_mode: str | int = "gemma",
        init_fn: str = "zeros",
        in_place: bool = False,
        row_mode: bool | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place, row_mode)


class LigerRMSNormForGemma3(LigerRMSNorm):
    """Liger's Gemma 3 RMSNorm (``dim`` for q_norm and k_norm)."""

    def __init__(
        self,
        dim: int,
        eps: float = 0.000001,
        offset: float = 1.0,
        casting_mode: str | int = "gemma",
        init_fn: str = "zeros",
        in_place: bool = False,
    ) -> None:
        super().__init__(dim, eps, offset, casting_mode, init_fn, in_place)


class LigerLayerNorm(nn.Module):
    """Liger's ``LigerLayerNorm``: layer norm over the last dim.

    As Liger's, it always has a ``bias`` parameter: random normal when ``bias=True``,
    zeros otherwise (and still learned). Attributes: ``hidden_size``, ``eps``,
    ``variance_epsilon`` (the one used), ``weight``, ``bias``.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, bias: bool = False, init_fn: str = "ones"
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = _weight(hidden_size, init_fn)
        self.bias = nn.Parameter(torch.randn(hidden_size) if bias else torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        return liger_layer_norm(hidden_states, self.weight, self.bias, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class LigerFusedAddRMSNorm(nn.Module):
    """Liger's ``LigerFusedAddRMSNorm``: ``forward(hidden_states, residual)`` returns
    ``(rms_norm(hidden_states + residual), hidden_states + residual)``.

    Args as :class:`LigerRMSNorm` (``in_place`` default ``False``; no ``row_mode`` or
    ``elementwise_affine``).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str | int = "llama",
        init_fn: str = "ones",
        in_place: bool = False,
    ) -> None:
        super().__init__()
        self.weight = _weight(hidden_size, init_fn)
        self.variance_epsilon, self.offset, self.casting_mode, self.in_place = (
            eps,
            offset,
            casting_mode,
            in_place,
        )

    def forward(self, hidden_states: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return liger_fused_add_rms_norm(
            hidden_states,
            residual,
            self.weight,
            self.variance_epsilon,
            self.offset,
            self.casting_mode,
        )

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, "
            f"in_place={self.in_place}"
        )
