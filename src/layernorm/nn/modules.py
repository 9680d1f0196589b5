"""``LayerNorm`` and ``RMSNorm``: subclasses of torch's modules that override only ``forward``.

Constructors, parameters, state_dict keys, ``reset_parameters`` and ``repr`` are torch's
own, so checkpoints load both ways and ``isinstance(m, torch.nn.LayerNorm)`` holds.
The attribute ``backend`` (default ``None``, the automatic choice) picks a kernel backend.
The properties ``offset`` and ``out_dtype`` (and ``casting_mode`` on RMSNorm), set on an
instance, are the functions' options (``docs/contract.md`` §2 "Options"). Setting one
stores the instance's options and gives it an ``_eager`` of its own that passes them, so
a module without options runs exactly the plain forward, with no check added. A module
with options scripts, but its scripted forward raises ``torch.jit.Error`` (TorchScript
would run the plain norm).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from .._op import scripted_norm
from ..ops import layer_norm, rms_norm

__all__ = ["OPTION_KEYS", "LayerNorm", "RMSNorm"]

#: what setting an option adds to an instance's ``__dict__`` (``unpatch`` removes them)
OPTION_KEYS = ("_options", "_eager", "_has_options")


def _option(name: str, default: Any) -> property:
    """A module option: read from the instance's options (``default`` when unset);
    setting it to anything but ``default`` routes the instance's forward through
    :func:`_with_options`."""

    def get(self: torch.nn.Module) -> Any:
        return self.__dict__.get("_options", {}).get(name, default)

    def set_(self: torch.nn.Module, value: Any) -> None:
        options = dict(self.__dict__.get("_options", {}))
        options[name] = value
        if value is default or value == default:
            del options[name]
        if options:
            self.__dict__["_options"] = options
            self.__dict__["_eager"] = functools.partial(_with_options, self)
            self.__dict__["_has_options"] = True
        else:
            for key in OPTION_KEYS:
                self.__dict__.pop(key, None)

    return property(get, set_, doc=f"the functions' ``{name}`` option. Default: ``{default!r}``.")


def _with_options(module: Any, x: Tensor) -> Tensor:
    """The forward of a module with options: the function, given them."""
    if isinstance(module, RMSNorm):
        return rms_norm(x, module.normalized_shape, module.weight, module.eps,
                        backend=module.backend, **module.__dict__["_options"])  # fmt: skip
    return layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps,  # type: ignore[attr-defined]
                      backend=module.backend, **module.__dict__["_options"])  # fmt: skip


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
    offset = _option("offset", 0.0)
    out_dtype = _option("out_dtype", None)
    __jit_unused_properties__ = ("offset", "out_dtype")
    __constants__ = [*torch.nn.LayerNorm.__constants__, "_has_options"]  # noqa: RUF012
    _has_options = False  # a constant of the scripted forward

    def forward(self, input: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            if self._has_options:
                raise RuntimeError("a module with options has no scripted forward")
            shape = self.normalized_shape
            return scripted_norm(input, shape, self.weight, self.bias, self.eps, False)  # type: ignore[arg-type]
        return self._eager(input)

    @torch.jit.unused
    def _eager(self, input: Tensor) -> Tensor:
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
    offset = _option("offset", 0.0)
    casting_mode = _option("casting_mode", None)
    out_dtype = _option("out_dtype", None)
    __jit_unused_properties__ = ("offset", "casting_mode", "out_dtype")
    __constants__ = [*torch.nn.RMSNorm.__constants__, "_has_options"]  # noqa: RUF012
    _has_options = False  # a constant of the scripted forward

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            if self._has_options:
                raise RuntimeError("a module with options has no scripted forward")
            return scripted_norm(x, self.normalized_shape, self.weight, None, self.eps, True)  # type: ignore[arg-type]
        return self._eager(x)

    @torch.jit.unused
    def _eager(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, backend=self.backend)
