"""``patch(model)``: put this library's LayerNorm / RMSNorm into an existing model, in place.

:class:`layernorm.LayerNorm` and :class:`layernorm.RMSNorm` subclass torch's modules and
override only ``forward``, so a module of torch's class is turned into ours by changing its
class, nothing else: the very same object keeps its Parameter objects, buffers, hooks,
device, dtype, training mode, ``eps``, ``normalized_shape`` and ``elementwise_affine``; its
state_dict is unchanged, optimizers that hold its parameters keep working, and a module
shared by several parents is patched once. :func:`unpatch` changes the class back.

Modules of other classes (Hugging Face's ``LlamaRMSNorm``, ``GemmaRMSNorm``, ``T5LayerNorm``,
OLMo's parameter-free ``LayerNorm``, subclasses of torch's norms with a forward of their own,
...) are recognized by what they compute, not by name (``layernorm.nn._recognize``): probes
prove that the module's ``forward(x)`` is a layer norm or RMSNorm over the trailing dims with a
given ``eps``, gain (or ``1 + gain``), bias and casting order, in float32 (values and
gradients) and bfloat16 (bitwise but for rare last-bit ties); the module's class then becomes a
generated subclass of its own that differs only in ``forward``, which calls
:func:`layernorm.rms_norm` / :func:`layernorm.layer_norm` with the family's casts around them,
and runs the module's own ``forward`` for any dtype pair not proven or any extra argument.
What cannot be proven is left alone, and the summary says why.

One limit: :class:`torch.nn.TransformerEncoderLayer` has an inference fast path (eval mode,
no gradients, ``batch_first``) that calls a fused native kernel with the norms' parameters
and never calls any norm module's ``forward``; a patched model there still runs torch's norm.
"""

from __future__ import annotations

import torch

from ._recognize import NotANorm, _looks_like_norm, is_replaced, recognize, replace, restore
from .modules import OPTION_KEYS, LayerNorm, RMSNorm

__all__ = ["PatchResult", "patch", "unpatch"]

#: torch's class -> ours
_OURS: dict[type, type] = {torch.nn.LayerNorm: LayerNorm, torch.nn.RMSNorm: RMSNorm}
_TORCH: dict[type, type] = {ours: theirs for theirs, ours in _OURS.items()}
_MARK = "_layernorm_patched"


class PatchResult(list):
    """The names of the modules :func:`patch` replaced (a ``list``), with what it did.

    Attributes:
        replaced: ``(name, class name, what it computes)`` per replaced module.
        skipped: ``(name, class name, reason)`` per norm-like module left alone (class name
            containing "norm", or one of torch's norm classes).
    """

    def __init__(self) -> None:
        super().__init__()
        self.replaced: list[tuple[str, str, str]] = []
        self.skipped: list[tuple[str, str, str]] = []

    def summary(self) -> str:
        """Text: ``N modules of K classes replaced``, a line per class, then each skip and why."""
        classes: dict[str, tuple[int, set[str]]] = {}
        for _, cls, what in self.replaced:
            count, whats = classes.get(cls, (0, set()))
            classes[cls] = (count + 1, whats | {what})
        lines = [
            f"{len(self.replaced)} module{'s' * (len(self.replaced) != 1)} of "
            f"{len(classes)} class{'es' * (len(classes) != 1)} replaced, "
            f"{len(self.skipped)} skipped"
        ]
        for cls, (count, whats) in classes.items():
            lines.append(f"  replaced {count} x {cls}: {'; '.join(sorted(whats))}")
        for name, cls, reason in self.skipped:
            lines.append(f"  skipped {name or '(root)'} ({cls}): {reason}")
        return "\n".join(lines)


def patch(
    model: torch.nn.Module, backend: str | None = None, *, verbose: bool = False
) -> PatchResult:
    """Replaces every layer norm / RMSNorm in ``model`` with this library's, in place.

    Args:
        model: any module; ``model`` itself is patched too if it is a norm.
        backend: kernel backend for the patched modules. Default: ``None``, the automatic choice.
        verbose: print :meth:`PatchResult.summary`. Default: ``False``.

    Returns:
        a :class:`PatchResult`: the list of qualified names (as in ``model.named_modules()``,
        ``""`` for ``model`` itself) of the modules replaced, in order, with ``replaced``,
        ``skipped`` and ``summary()``. Modules already patched are not listed again.

    Example::

        >>> model = torch.nn.TransformerEncoder(
        ...     torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
        ...     enable_nested_tensor=False)
        >>> layernorm.patch(model)
        ['layers.0.norm1', 'layers.0.norm2', 'layers.1.norm1', 'layers.1.norm2']
        >>> layernorm.unpatch(model)
        ['layers.0.norm1', 'layers.0.norm2', 'layers.1.norm1', 'layers.1.norm2']
    """
    if backend is not None:
        from ..ops import _check_backend

        _check_backend(backend)
    result = PatchResult()
    known: dict[tuple, object] = {}  # one proof per class and attributes (a Recipe or a reason)
    for name, module in model.named_modules():
        cls = type(module)
        ours = _OURS.get(cls)
        if ours is not None:
            module.__class__ = ours
            setattr(module, _MARK, True)
            if backend is not None:
                module.backend = backend
            result.append(name)
            result.replaced.append(
                (name, cls.__name__, f"torch.nn.{cls.__name__} -> layernorm.{ours.__name__}")
            )
            continue
        if cls in _TORCH or is_replaced(module):
            continue
        key = _proof_key(module)
        outcome = known.get(key) if key is not None else None
        if outcome is None:
            try:
                outcome = recognize(module)
            except NotANorm as error:
                outcome = str(error)
            if key is not None:
                known[key] = outcome
        if isinstance(outcome, str):
            if _looks_like_norm(module):
                result.skipped.append((name, cls.__name__, outcome))
            continue
        if backend is not None:
            outcome = type(outcome)(**{**outcome.__dict__, "backend": backend})  # type: ignore[arg-type]
        replace(module, outcome)  # type: ignore[arg-type]
        result.append(name)
        result.replaced.append((name, cls.__name__, outcome.describe()))  # type: ignore[attr-defined]
    if verbose:
        print(result.summary())
    return result


def _proof_key(module: torch.nn.Module) -> tuple | None:
    """Modules that agree on this compute the same function of their parameters, so one proof
    serves them all: the class, the plain attributes and the parameters' names, shapes and
    dtypes. ``None`` (prove this one by itself) when an attribute is not hashable."""
    try:
        plain = tuple(
            sorted(
                (k, v)
                for k, v in vars(module).items()
                if not k.startswith("_") and isinstance(v, int | float | str | bool | tuple | None)
            )
        )
        params = tuple(
            (k, tuple(p.shape), p.dtype, p.device.type)
            for k, p in module._parameters.items()
            if p is not None
        )
        key = (type(module), plain, params, tuple(module._buffers), module.training)
        hash(key)
    except TypeError:
        return None
    return key


def unpatch(model: torch.nn.Module) -> list[str]:
    """Reverses :func:`patch`: modules it patched get their own class and forward back.

    Modules that were built as this library's own (not by :func:`patch`) stay as they are.

    Args:
        model: a module given to :func:`patch` (or containing one).

    Returns:
        the qualified names of the modules restored, in order.
    """
    restored = []
    for name, module in model.named_modules():
        if is_replaced(module):
            restore(module)
            restored.append(name)
            continue
        theirs = _TORCH.get(type(module))
        if theirs is None or not module.__dict__.get(_MARK, False):
            continue
        module.__class__ = theirs
        del module.__dict__[_MARK]
        for key in ("backend", *OPTION_KEYS):
            module.__dict__.pop(key, None)
        restored.append(name)
    return restored
