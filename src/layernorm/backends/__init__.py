"""A small lazy registry of kernel backends.

A backend is a module under ``layernorm.backends`` imported only when first used, so
``import layernorm`` stays fast and compiles nothing. Every backend module provides::

    unavailable_reason() -> str | None
        Why the backend cannot run on this machine at all (a missing package, no GPU),
        or None when it can.
    cannot_run(x) -> str | None
        Why it cannot handle tensors of ``x``'s device type and dtype, or None.
    prefers(x) -> bool
        True when it is the fastest correct choice for ``x``'s device type and dtype: the
        automatic choice takes the first backend in ``AUTO_ORDER`` that is available, can
        run and prefers. Both look at nothing else of ``x``, never its size, so the
        choice is remembered per device type and dtype (docs/contract.md §2, §5).
    forward(x, residual, weight, bias, eps, rms, stats=True, out_dtype=None)
        -> (y, residual_out, mean, rstd)
        (with ``stats=False`` the caller will not use mean and rstd: a backend may skip
        computing them and return None for both; ``out_dtype``, passed only when ``y``
        has a narrower dtype than ``x``: ``y`` in it, each element rounded once)
    backward(dy, x, weight, mean, rstd, dresidual_out, rms, need_dweight, need_dbias, eps)
        -> (dx, dweight, dbias)
        (``x`` is the normalized input ``z``, ``eps`` the forward's: the backward may
        recompute the statistics from them, ``mean``/``rstd`` being the forward's)

Kernels see only non-empty ``(*, N)`` tensors (``ops`` sends zero-size work to the
portable backend), each either contiguous, whatever its dims, or 2-D with contiguous rows
(``stride(1) == 1``; ``stride(0)`` may be anything), and 1-D ``(N,)`` parameters; the
contract of each argument is in ``layernorm.backends.torch_``, the portable reference
implementation. A contiguous tensor arrives as it is, not as an (M, N) view, because
on small calls making and undoing the view costs as much as the kernel.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "available_backends",
    "choose",
    "forget",
    "get",
    "named_by_environment",
    "on_forget",
    "pick",
]

#: name -> module path, in no particular order.
BACKENDS: dict[str, str] = {
    "torch": "layernorm.backends.torch_",
    "numba": "layernorm.backends.numba_",
    "triton": "layernorm.backends.triton_",
}
_NAMES = {path: name for name, path in BACKENDS.items()}
#: the automatic choice tries these in order; "torch" runs everything.
AUTO_ORDER: tuple[str, ...] = ("triton", "numba", "torch")

_modules: dict[str, ModuleType] = {}
_unavailable: dict[str, str | None] = {}
#: the automatic choice per (device type, dtype), as it was first made
_auto: dict[tuple[str, torch.dtype], ModuleType] = {}
#: called by :func:`forget`: whoever remembers a choice of this registry (the compiled
#: dispatch keeps kernel addresses) forgets it too
_forget_hooks: list[Callable[[], None]] = []


def _load(name: str) -> ModuleType | None:
    if name not in _unavailable:
        try:
            module = importlib.import_module(BACKENDS[name])
        except ImportError as error:  # the backend's package is not installed
            _unavailable[name] = f"cannot import {BACKENDS[name]}: {error}"
        else:
            _modules[name] = module
            _unavailable[name] = module.unavailable_reason()
    return _modules.get(name) if _unavailable[name] is None else None


def forget(name: str) -> None:
    """Drops what the registry remembers of backend ``name`` (its module and whether it
    is available), so the next use looks again: for a setting that changed availability
    at run time, such as ``TRITON_INTERPRET``."""
    _unavailable.pop(name, None)
    _modules.pop(name, None)
    _auto.clear()
    for hook in _forget_hooks:
        hook()


def on_forget(hook: Callable[[], None]) -> None:
    """Calls ``hook()`` at every :func:`forget`."""
    _forget_hooks.append(hook)


def get(name: str) -> ModuleType:
    """The backend module called ``name``; raises if it cannot run on this machine."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {sorted(BACKENDS)}")
    module = _load(name)
    if module is None:
        raise RuntimeError(f"backend {name!r} is not available here: {_unavailable[name]}")
    return module


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine (for some device)."""
    return [name for name in BACKENDS if _load(name) is not None]


_ENV = "LAYERNORM_BACKEND"


def _environment_choice() -> str | None:
    """The ``LAYERNORM_BACKEND`` environment variable, read at every call (so setting it
    at run time works)."""
    return os.environ.get(_ENV)


def named_by_environment() -> bool:
    """Whether ``LAYERNORM_BACKEND`` names a backend now (then :func:`pick` takes it)."""
    return bool(_environment_choice())


def pick(x: torch.Tensor, backend: str | None = None) -> ModuleType:
    """The module of the backend to run ``x`` (a kernel argument: see above) on.

    ``backend`` (or else the ``LAYERNORM_BACKEND`` environment variable) names one
    explicitly, and an explicit choice that cannot run raises. ``None`` takes the first
    backend in :data:`AUTO_ORDER` that can run ``x`` and prefers it, falling back quietly;
    that choice is made once per device type and dtype (until :func:`forget`).
    """
    name = backend or _environment_choice()
    if name:
        module = get(name)
        reason = module.cannot_run(x)
        if reason is not None:
            raise RuntimeError(f"backend {name!r} cannot run this input: {reason}")
        return module
    # x.is_cpu answers without building a torch.device
    key = ("cpu" if x.is_cpu else x.device.type, x.dtype)
    chosen = _auto.get(key)
    if chosen is None:
        chosen = _auto[key] = _automatic(x)
    return chosen


def _automatic(x: torch.Tensor) -> ModuleType:
    for module in map(_load, AUTO_ORDER):
        if module is not None and module.prefers(x) and module.cannot_run(x) is None:
            return module
    return get("torch")


def choose(x: torch.Tensor, backend: str | None = None) -> str:
    """The name of :func:`pick`'s backend for ``x``."""
    return _NAMES[pick(x, backend).__name__]
