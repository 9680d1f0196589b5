"""``LayerNorm`` and ``RMSNorm``: subclasses of torch's modules that override only ``forward``.

Constructors, parameters, state_dict keys, ``reset_parameters`` and ``repr`` are torch's
own, so checkpoints load both ways and ``isinstance(m, torch.nn.LayerNorm)`` holds.
The attribute ``backend`` (default ``None``, the automatic choice) picks a kernel backend;
``offset`` and ``out_dtype`` (and ``casting_mode`` on RMSNorm), set on an instance, are
the functions' options (``docs/contract.md`` §2 "Options"); at their defaults (``0.0``,
``None``) the call is the plain one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._op import scripted_norm
from ..ops import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(torch.nn.LayerNorm):
    r"""Layer normalization over the trailing ``normalized_shape`` dims, as :class:`torch.nn.LayerNorm`.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    computed by :func:`layernorm.layer_norm` (exact statistics, batch invariant).

    Args:
        normalized_shape: the trailing dims that form one row.
        eps: added to the variance inside the square root. Default: ``1e-5``.
        elementwise_affine: learn ``weight`` (ones) and ``bias`` (zeros). Default: ``True``.
        bias: learn ``bias`` when ``elementwise_affine``. Default: ``True``.
        device, dtype: of the parameters. Default: ``None``.

    Shape:
        - Input: ``(*, *normalized_shape)``
        - Output: same as input

    Example::

        >>> m = layernorm.LayerNorm(768)
        >>> m(torch.randn(2, 10, 768)).shape
        torch.Size([2, 10, 768])
    """

    backend: str | None = None
    offset: float = 0.0
    out_dtype: torch.dtype | None = None

    def forward(self, input: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            shape = self.normalized_shape
            return scripted_norm(input, shape, self.weight, self.bias, self.eps, False)  # type: ignore[arg-type]
        return self._eager(input)

    @torch.jit.unused
    def _eager(self, input: Tensor) -> Tensor:
        if self.offset or self.out_dtype is not None:
            return layer_norm(
                input, self.normalized_shape, self.weight, self.bias, self.eps,
                backend=self.backend, offset=self.offset, out_dtype=self.out_dtype,
            )  # fmt: skip
        return layer_norm(
            input, self.normalized_shape, self.weight, self.bias, self.eps, backend=self.backend
        )


class RMSNorm(torch.nn.RMSNorm):
    r"""RMSNorm over the trailing ``normalized_shape`` dims, as :class:`torch.nn.RMSNorm`.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} * \gamma

    Args:
        normalized_shape: the trailing dims that form one row.
        eps: added inside the square root. Default: ``None``, the machine epsilon of the
            computation's dtype (float32's for half inputs), as torch uses.
        elementwise_affine: learn ``weight`` (ones). Default: ``True``.
        device, dtype: of the parameters. Default: ``None``.

    Shape:
        - Input: ``(*, *normalized_shape)``
        - Output: same as input

    Example::

        >>> m = layernorm.RMSNorm([4, 8])
        >>> m(torch.randn(3, 4, 8)).shape
        torch.Size([3, 4, 8])
    """

    backend: str | None = None
    offset: float = 0.0
    casting_mode: str | None = None
    out_dtype: torch.dtype | None = None

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            return scripted_norm(x, self.normalized_shape, self.weight, None, self.eps, True)  # type: ignore[arg-type]
        return self._eager(x)

    @torch.jit.unused
    def _eager(self, x: Tensor) -> Tensor:
        if self.offset or self.casting_mode is not None or self.out_dtype is not None:
            return rms_norm(
                x, self.normalized_shape, self.weight, self.eps, backend=self.backend,
                offset=self.offset, casting_mode=self.casting_mode, out_dtype=self.out_dtype,
            )  # fmt: skip
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, backend=self.backend)
