"""Optional dependencies: which extra brings which package, and one way to ask for it.

``pip install layernorm`` brings what the kernels need (numpy, torch, numba). The rest
comes with an extra:

- ``report``: matplotlib, tqdm, scikit-learn (the report, plots, experiments, progress
  bars); ``experiments`` is an alias;
- ``build``: ninja (``layernorm build``, the compiled dispatch);
- ``triton``: the GPU backend.

A feature that needs a missing package raises :class:`MissingExtra`, an
:class:`ImportError` whose message names the extra.
Progress bars are cosmetic: without tqdm, :func:`progress` shows nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

__all__ = ["MissingExtra", "progress", "require"]

#: top-level module -> the name pip knows it by, where they differ
_DISTRIBUTIONS = {"sklearn": "scikit-learn"}


class MissingExtra(ImportError):
    """A feature needs a package that comes with an extra of ``layernorm``."""


def require(module: str, extra: str, feature: str = "layernorm") -> ModuleType:
    """Imports ``module``, or raises :class:`MissingExtra` saying which extra installs it.

    Args:
        module: the module to import, e.g. ``"matplotlib.pyplot"``.
        extra: the extra of ``layernorm`` that installs it, e.g. ``"report"``.
        feature: what needs it, for the message. Default: ``"layernorm"``.

    Example::

        >>> require("numpy", "report").__name__
        'numpy'
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.partition(".")[0]
        package = _DISTRIBUTIONS.get(top, top)
        raise MissingExtra(
            f"{feature} needs {package}: pip install 'layernorm[{extra}]'", name=top
        ) from error


class _Silent:
    """What :func:`progress` returns without tqdm: iterates, and ignores bar updates."""

    def __init__(self, iterable: Iterable[Any] | None) -> None:
        self._iterable = () if iterable is None else iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable)

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _ignore(self, *args: Any, **kwargs: Any) -> None:
        return None

    update = close = refresh = set_postfix = set_postfix_str = set_description = _ignore


def progress(iterable: Iterable[Any] | None = None, **options: Any) -> Any:
    """A tqdm progress bar over ``iterable`` (``options`` are tqdm's), or, when tqdm is not
    installed or ``disable=True``, an object with the same methods that draws nothing."""
    if options.get("disable"):
        return _Silent(iterable)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Silent(iterable)
    return tqdm(iterable, **options)
