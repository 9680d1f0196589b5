"""``patch(model)``: put this library's LayerNorm / RMSNorm into an existing model, in place.

:class:`layernorm.LayerNorm` and :class:`layernorm.RMSNorm` subclass torch's modules and
override only ``forward``, so a module of torch's class is turned into ours by changing its
class, nothing else: the very same object keeps its Parameter objects, buffers, hooks,
device, dtype, training mode, ``eps``, ``normalized_shape`` and ``elementwise_affine``; its
state_dict is unchanged, optimizers that hold its parameters keep working, and a module
shared by several parents is patched once. :func:`unpatch` changes the class back.

Only modules whose class is exactly :class:`torch.nn.LayerNorm` or :class:`torch.nn.RMSNorm`
are patched. Subclasses (for example a LayerNorm that casts to float32 first) have a
``forward`` of their own that patching would silently drop, so they are left alone, and so
are other libraries' own norm classes (such as Hugging Face's ``LlamaRMSNorm``).

One limit: :class:`torch.nn.TransformerEncoderLayer` has an inference fast path (eval mode,
no gradients, ``batch_first``) that calls a fused native kernel with the norms' parameters
and never calls any norm module's ``forward``; a patched model there still runs torch's norm.
"""

from __future__ import annotations

import torch

from .modules import LayerNorm, RMSNorm

__all__ = ["patch", "unpatch"]

#: torch's class -> ours
_OURS: dict[type, type] = {torch.nn.LayerNorm: LayerNorm, torch.nn.RMSNorm: RMSNorm}
_TORCH: dict[type, type] = {ours: theirs for theirs, ours in _OURS.items()}
_MARK = "_layernorm_patched"


def patch(model: torch.nn.Module, backend: str | None = None) -> list[str]:
    """Turns every ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` in ``model`` into this library's.

    Args:
        model: any module; ``model`` itself is patched too if it is a norm.
        backend: kernel backend for the patched modules (their ``backend`` attribute).
            Default: ``None``, the automatic choice.

    Returns:
        the qualified names (as in ``model.named_modules()``, ``""`` for ``model`` itself)
        of the modules patched, in order; empty when there were none.

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
    patched = []
    for name, module in model.named_modules():
        ours = _OURS.get(type(module))
        if ours is None:
            continue
        module.__class__ = ours
        setattr(module, _MARK, True)
        if backend is not None:
            module.backend = backend
        patched.append(name)
    return patched


def unpatch(model: torch.nn.Module) -> list[str]:
    """Reverses :func:`patch`: modules it patched become torch's classes again.

    Modules that were built as this library's own (not by :func:`patch`) stay as they are.

    Args:
        model: a module given to :func:`patch` (or containing one).

    Returns:
        the qualified names of the modules restored, in order.
    """
    restored = []
    for name, module in model.named_modules():
        theirs = _TORCH.get(type(module))
        if theirs is None or not module.__dict__.get(_MARK, False):
            continue
        module.__class__ = theirs
        del module.__dict__[_MARK]
        module.__dict__.pop("backend", None)
        restored.append(name)
    return restored
