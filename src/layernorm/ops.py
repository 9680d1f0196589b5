"""The four public functions: validation, flattening to rows, and the choice of entry point.

Data flows down once: validate → rows → the op ``layernorm::forward`` (:mod:`layernorm._op`;
:func:`_enter` names the few calls that do not go through it, and why) → the input's
shape. Two shortcuts skip work a call does not need, and decline every call they were not
built for (``docs/contract.md`` §6):

- the compiled front door (:mod:`layernorm.compiled`) takes the common eager call on CPU
  in C++: with a gradient it calls the op through the dispatcher, without one the op's
  CPU kernel (checks, allocation and the numba kernel in C++);
- plain inference calls the backend's kernel directly, without the op.

``FAST_PATHS = False`` switches both off: every call then goes through the op (same
bits).

The keyword options (``offset``, ``casting_mode``, ``out_dtype``, ``out``,
``residual_out``, ``memory_efficient``, ``residual_dtype``: :mod:`layernorm.options`)
arrive as ``**options``, so a call without them costs one check (``if options``; explicit keyword-only parameters
would cost a lookup of each default at every call); ``options.signed`` gives each
function its full signature for ``inspect`` and ``help``.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import _op, backends
from . import compiled as _compiled
from . import options as _options

__all__ = [
    "FAST_PATHS",
    "NormalizedShapeError",
    "add_layer_norm",
    "add_rms_norm",
    "layer_norm",
    "rms_norm",
]

ShapeLike = int | Sequence[int] | torch.Size

#: whether calls may take the shortcuts (compiled dispatch, common call, direct kernel
#: calls); read at every call
FAST_PATHS = True


class NormalizedShapeError(ValueError, RuntimeError):
    """A tensor's shape does not fit ``normalized_shape`` (or it is empty). A RuntimeError,
    as torch raises, and a ValueError, as this library raised before."""


# ---------------------------------------------------------------------------------------
# Validation and flattening


def _normalized_shape(normalized_shape: ShapeLike, op: str = "layer_norm") -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of ints. What torch's ``F.layer_norm`` takes (a
    list, tuple or ``torch.Size`` of ints: Python ints, integer scalars such as numpy's,
    0-d integer tensors), and a single int as ``nn.LayerNorm`` takes it. Anything else is
    the TypeError torch raises, before any work: never a tensor of sizes, a float or a
    bool read as a size."""
    one = isinstance(normalized_shape, tuple) and len(normalized_shape) == 1
    if one and type(normalized_shape[0]) is int:  # type: ignore[index]  # the modules' own
        return normalized_shape  # type: ignore[return-value]
    if type(normalized_shape) is int:
        return (normalized_shape,)
    if not isinstance(normalized_shape, (tuple, list)):
        raise TypeError(f"{_not_ints(op)}, not {_type_name(normalized_shape)}")
    shape = tuple(_size(s, pos, op) for pos, s in enumerate(normalized_shape))
    if len(shape) == 0:
        raise NormalizedShapeError(
            "Expected normalized_shape to be at least 1-dimensional, i.e., containing at "
            f"least one element, but got normalized_shape = {list(shape)}"
        )
    return shape


def _position(op: str) -> int:
    """``normalized_shape``'s argument position in ``op``: ``add_*(input, residual,
    normalized_shape)``, else second."""
    return 3 if op.startswith("add_") else 2


def _not_ints(op: str) -> str:
    """The start of torch's message for a ``normalized_shape`` that is no tuple of ints."""
    return f"{op}(): argument 'normalized_shape' (position {_position(op)}) must be tuple of ints"


def _size(s: object, pos: int, op: str) -> int:
    """Element ``pos`` of ``op``'s ``normalized_shape``, as torch's argument parser reads
    it, with its messages; stricter in one point: a bool is no size anywhere (torch takes
    ``True`` as 1 after the first element)."""
    if type(s) is int:
        return s
    if isinstance(s, Tensor):
        integral = not (s.is_floating_point() or s.is_complex() or s.dtype == torch.bool)
        if s.dim() == 0 and integral:
            return int(s)
    elif not isinstance(s, bool) and hasattr(type(s), "__index__"):
        return operator.index(s)  # type: ignore[arg-type]
    if pos == 0:  # torch's parser tells the list's type from its first element
        raise TypeError(f"{_not_ints(op)}, but found element of type {_type_name(s)} at pos 0")
    raise TypeError(
        f"{op}(): argument 'normalized_shape' failed to unpack the object at pos "
        f'{_position(op)} with error "type must be tuple of ints,but got {_type_name(s)}"'
    )


def _type_name(value: object) -> str:
    """The type's name as torch's messages print it (``float``, ``Tensor``,
    ``numpy.float64``)."""
    kind = type(value)
    if kind.__module__ in ("builtins", "torch"):
        return kind.__name__
    return f"{kind.__module__}.{kind.__qualname__}"


def _check_input(name: str, t: Tensor, shape: tuple[int, ...], op: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{op} expects a floating-point {name}, got {name} of dtype {t.dtype}")
    if len(shape) == 1 and t.dim() >= 1:
        mismatch = t.shape[-1] != shape[0]
    else:
        mismatch = t.dim() < len(shape) or t.shape[t.dim() - len(shape) :] != shape
    if mismatch:
        raise NormalizedShapeError(
            f"Given normalized_shape={list(shape)}, expected {name} with shape "
            f"[*, {', '.join(map(str, shape))}], but got {name} of size {list(t.shape)}"
        )


def _param(name: str, p: Tensor, shape: tuple[int, ...], x: Tensor, op: str) -> Tensor:
    """``p`` checked against ``shape`` and ``x``, as the kernels take it: (N,), contiguous."""
    if not isinstance(p, Tensor):
        raise TypeError(
            f"{op}: expected {name} to be a torch.Tensor or None, got {type(p).__name__}"
        )
    if p.shape != shape:
        raise NormalizedShapeError(
            f"Expected {name} to be of same shape as normalized_shape, but got {name} of "
            f"shape {list(p.shape)} and normalized_shape = {list(shape)}"
        )
    if not p.is_floating_point():
        raise TypeError(f"{op} expects a floating-point {name}, got {name} of dtype {p.dtype}")
    _check_device(name, p, x)
    if len(shape) == 1 and p.is_contiguous():
        return p
    return p.reshape(-1).contiguous()


def _check_device(name: str, t: Tensor, x: Tensor) -> None:
    # two CPU tensors answer without building torch.device objects
    if not (t.is_cpu and x.is_cpu) and t.device != x.device:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but got input on {x.device} "
            f"and {name} on {t.device}"
        )


def _check_eps(eps: float) -> float:
    eps = float(eps)
    if not eps >= 0:  # also rejects NaN
        raise ValueError(f"eps must be non-negative, got eps={eps}")
    return eps


def _check_backend(backend: str | None) -> str:
    if backend is not None and backend not in backends.BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; known backends: {sorted(backends.BACKENDS)}"
        )
    return backend or ""


def _requires_grad(t: Tensor | None) -> bool:
    return t is not None and t.requires_grad


def _norm(
    op: str,
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    backend: str | None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One call of ``op``; with ``out_dtype`` (one of ``torch_.OUT_DTYPES``, no wider than
    the input's or its accumulation dtype: ``layernorm.options`` checks it) ``y`` is in
    that dtype, each element rounded once into it by the kernels
    (``layernorm::forward_to``), and ``residual_out``
    keeps the input's dtype. The compiled front door takes only calls without it (its
    entries are the same-dtype ones)."""
    compiling = torch.compiler.is_compiling()
    if FAST_PATHS and not compiling and out_dtype is None:
        # the common call, when no mechanism would see it: checked and run in C++
        out = _compiled.norm(x, residual, normalized_shape, weight, bias, eps, rms, backend)
        if (
            out is None
            and isinstance(residual, Tensor)
            and isinstance(x, Tensor)
            and residual.dtype != x.dtype
        ):  # a residual stream of its own dtype: a float32 one in C++ too
            out = _options._stream_front_door(
                x, residual, normalized_shape, weight, bias, eps, rms, backend, {}
            )  # fmt: skip
        if out is not None:
            return out
    arguments = (op, x, residual, normalized_shape, weight, bias, eps, rms, backend, out_dtype)
    if not compiling and torch._C._is_tracing():
        return _traced_call(*arguments)
    return _call(*arguments)


def _traced_call(*arguments: Any) -> tuple[Tensor, Tensor | None]:
    """:func:`_call` under jit.trace. The checks and the decomposition branch on sizes that
    normalized_shape fixes, which is what jit.trace warns about: the graph it records is
    right for them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return _call(*arguments)


def _call(
    op: str,
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    backend: str | None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The full checks, then :func:`_enter` on kernel arguments (``y`` in ``out_dtype``
    when given: :func:`_norm`)."""
    shape = _normalized_shape(normalized_shape, op)
    _check_input("input", x, shape, op)
    if residual is not None:
        _check_input("residual", residual, shape, op)
        if residual.dtype != x.dtype and _options.holds(residual.dtype, x.dtype):
            # a wider residual: the residual stream in its dtype (layernorm.options)
            return _options.norm(op, x, residual, normalized_shape, weight, bias, eps, rms,
                                 backend, out_dtype=out_dtype)  # fmt: skip
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise NormalizedShapeError(
                f"{op}: residual must match input in shape and dtype, but got input "
                f"{list(x.shape)} {x.dtype} and residual {list(residual.shape)} "
                f"{residual.dtype}"
            )
        _check_device("residual", residual, x)
    if weight is not None:
        weight = _param("weight", weight, shape, x, op)
    if bias is not None:
        bias = _param("bias", bias, shape, x, op)
    eps = _check_eps(_op.default_eps(x.dtype) if eps is None else eps)
    name = "" if backend is None else _check_backend(backend)
    n = shape[0] if len(shape) == 1 else math.prod(shape)
    rows = _op.kernel_rows(x, n)
    residual_rows = None if residual is None else _op.kernel_rows(residual, n)
    y, residual_out = _enter(
        rows, residual_rows, weight, bias, eps, rms, name, FAST_PATHS, out_dtype
    )
    return _shaped(y, residual_out, rows, x)


def _custom_op(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    backend: str,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The op ``layernorm::forward`` (``layernorm::forward_to`` with an ``out_dtype``) on
    (M, N) rows (the shape its DTensor rules and torch.compile's traces are written
    for), with the outputs in ``x``'s shape."""
    n = x.shape[-1]
    rows = _op.rows(x, n)
    residual_rows = None if residual is None else _op.rows(residual, n)
    y, residual_out, _, _ = _op._forward_op_outputs(
        rows, residual_rows, weight, bias, eps, rms, backend, out_dtype
    )
    return y.view_as(x), None if residual_out is None else residual_out.view_as(x)


def _enter(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    backend: str,
    fast: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Kernel arguments handed to the op (``docs/contract.md`` §6). Every call goes
    through ``layernorm::forward`` and torch's dispatcher, which runs its kernel,
    autograd, vmap rule, fake kernel or autocast policy, except:

    - what records torch operations (torch.export, jit tracing): the decomposition, which
      they record op by op (an opaque op would not export);
    - forward-mode AD (a dual level, a torch.func transform, which may hold a jvp):
      :class:`layernorm._op.TransformNorm`, since a custom op cannot carry a JVP;
    - plain inference with the fast paths on: the kernel directly, which skips the
      custom op's Python cost (tens of µs where the C++ part is not built);
    - ``y`` in another dtype with a gradient recorded, the fast paths on, no mechanism
      that would see it: :class:`layernorm._op.EagerNorm` (the C++ part takes only
      same-dtype calls).

    ``out_dtype`` (not None): ``y`` in that dtype, through ``layernorm::forward_to``.
    """
    if torch.compiler.is_compiling():  # (true under torch.export too)
        if torch.compiler.is_exporting():
            return _op.decomposition(x, residual, weight, bias, eps, rms, out_dtype)
        return _custom_op(x, residual, weight, bias, eps, rms, backend, out_dtype)
    if torch._C._is_any_autocast_enabled():
        x, residual, weight, bias = _op.autocast(x, residual, weight, bias)
    if torch._C._is_tracing():
        return _op.decomposition(x, residual, weight, bias, eps, rms, out_dtype)
    if _op.transformed():
        y, residual_out, _, _ = _op.TransformNorm.apply(
            x, residual, weight, bias, eps, rms, backend, fast, out_dtype
        )
        return y, residual_out
    if (
        fast
        and not (
            torch.is_grad_enabled()
            and (
                x.requires_grad
                or _requires_grad(residual)
                or _requires_grad(weight)
                or _requires_grad(bias)
            )
        )
        and _op.direct_call(x, residual, weight, bias)
    ):
        y, residual_out, _, _ = _op.forward(
            x, residual, weight, bias, eps, rms, backend, False, out_dtype
        )
        return y, residual_out
    if fast and out_dtype is not None and _op.direct_call(x, residual, weight, bias):
        # recorded by autograd; layernorm::forward_to has no C++ autograd
        y, residual_out, _, _ = _op.EagerNorm.apply(
            x, residual, weight, bias, eps, rms, backend, out_dtype
        )
        return y, residual_out
    return _custom_op(x, residual, weight, bias, eps, rms, backend, out_dtype)


def _shaped(
    y: Tensor, residual_out: Tensor | None, rows: Tensor, x: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The outputs computed on ``rows`` in the shape of ``x``."""
    if rows is x:
        return y, residual_out
    return y.view_as(x), None if residual_out is None else residual_out.view_as(x)


# ---------------------------------------------------------------------------------------
# Public functions


def layer_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
    **options: Any,
) -> Tensor:
    r"""Layer normalization over the trailing ``normalized_shape`` dims of ``input``.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    Mean and biased variance per row (corrected two-pass, float32-or-wider accumulation),
    ``eps`` inside the square root; a drop-in for :func:`torch.nn.functional.layer_norm`.

    Args:
        input: tensor of shape ``(*, *normalized_shape)``, any floating dtype.
        normalized_shape: the trailing dims that form one row (an int or a sequence).
        weight: gain ``gamma`` of shape ``normalized_shape``. Default: ``None``.
        bias: bias ``beta`` of shape ``normalized_shape``. Default: ``None``.
        eps: added to the variance inside the square root, ``>= 0``. Default: ``1e-5``.
        backend: ``"torch"``, ``"numba"`` or ``"triton"``; ``None`` picks the fastest
            correct one (or the ``LAYERNORM_BACKEND`` environment variable's). Default: ``None``.
        offset: the gain is ``weight + offset`` (a weight stored as an offset, e.g. ``1.0``
            for a zero-centred gain), rounded once to the accumulation dtype
            (:func:`layernorm.options.offset_gain`). Needs a weight.
            Default: ``0.0``.
        out_dtype: the output's dtype, at least as wide as the input's (float32 from a
            bfloat16 input, say): the input is converted to it exactly and normalized, so
            the output is correctly rounded in it. A narrower one raises ``ValueError``.
            Default: ``None``, the input's.
        out: a preallocated output, by torch's ``out=`` rules (dtype and device must
            match; a 0-element one is resized; no autograd). Default: ``None``.
        memory_efficient: apex's: autograd saves the output instead of the input and the
            backward recovers the normalized input from it, so ``dx`` is within a stated
            bound rather than correctly rounded (:mod:`layernorm.recompute`); eager
            autograd only, alone (not with the other options). Default: ``False``.

    Returns:
        a tensor shaped like ``input``, of its dtype (or ``out_dtype``; ``out`` when given).

    Shape:
        - Input: ``(*, *normalized_shape)``
        - Output: same as input

    Example::

        >>> x = torch.tensor([[1.0, 2.0, 3.0]])
        >>> layernorm.layer_norm(x, (3,), eps=1 / 3)
        tensor([[-1.,  0.,  1.]])
    """
    if options:
        return _options.call(
            "layer_norm", input, None, normalized_shape, weight, bias, eps, False, backend, options
        )[0]
    return _norm("layer_norm", input, None, normalized_shape, weight, bias, eps, False, backend)[0]


def rms_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str | None = None,
    **options: Any,
) -> Tensor:
    r"""RMSNorm over the trailing ``normalized_shape`` dims: ``y = x / sqrt(mean(x²) + eps) ⊙ gamma``.

    A drop-in for :func:`torch.nn.functional.rms_norm`.

    Args:
        input: tensor of shape ``(*, *normalized_shape)``, any floating dtype.
        normalized_shape: the trailing dims that form one row.
        weight: gain ``gamma`` of shape ``normalized_shape``. Default: ``None``.
        eps: added inside the square root. Default: ``None``, the machine epsilon of the computation's dtype, as torch
            uses: ``torch.finfo(torch.float32).eps`` for float16/bfloat16/float32 input.
        backend: as in :func:`layer_norm`. Default: ``None``.
        offset, out_dtype, out, memory_efficient: as in :func:`layer_norm`.
        casting_mode: Liger's casting order, ``"llama"``, ``"gemma"`` or ``"none"``, with
            exact arithmetic between its casts (:func:`layernorm.options.cast_rms_norm`);
            not with ``out_dtype``. Default: ``None``, one rounding.

    Returns:
        a tensor shaped like ``input``, of its dtype (or ``out_dtype``; ``out`` when given).

    Example::

        >>> layernorm.rms_norm(torch.tensor([[3.0, 4.0]]), 2, eps=0.0)
        tensor([[0.8485, 1.1314]])
    """
    if options:
        return _options.call(
            "rms_norm", input, None, normalized_shape, weight, None, eps, True, backend, options
        )[0]
    return _norm("rms_norm", input, None, normalized_shape, weight, None, eps, True, backend)[0]


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """Fused residual add and layer norm: ``residual_out = x + residual``,
    ``y = layer_norm(residual_out)``, in one pass over memory where the backend allows.

    Args:
        x, residual: tensors of one shape ``(*, *normalized_shape)``; the residual of
            ``x``'s dtype or a wider one (then the residual stream keeps its dtype, as
            with ``residual_dtype``).
        normalized_shape, weight, bias, eps, backend, offset, out: as in :func:`layer_norm`.
        out_dtype: ``y``'s dtype, as in :func:`layer_norm`; ``residual_out`` keeps ``x``'s.
        residual_out: a preallocated ``residual_out``, by the rules of ``out``.
        residual_dtype: the residual stream's dtype (quack's; flash-attn's
            ``residual_in_fp32=True`` is ``torch.float32``): ``residual_out`` is the exact
            ``x + residual`` rounded once into it, ``y`` its norm rounded once into
            ``x``'s dtype (:func:`layernorm.options.residual_stream`). Default: ``None``,
            the residual's dtype.

    Returns:
        ``(y, residual_out)``, both shaped like ``x``.

    Example::

        >>> y, h = layernorm.add_layer_norm(torch.ones(1, 3), torch.tensor([[0.0, 1.0, 2.0]]), 3)
        >>> h
        tensor([[1., 2., 3.]])
    """
    if options:
        return _options.call(  # type: ignore[return-value]
            "add_layer_norm", x, residual, normalized_shape, weight, bias, eps, False, backend,
            options,
        )  # fmt: skip
    y, h = _norm("add_layer_norm", x, residual, normalized_shape, weight, bias, eps, False, backend)
    return y, h  # type: ignore[return-value]


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """Fused residual add and RMSNorm: ``(rms_norm(x + residual), x + residual)``.

    Args:
        x, residual: tensors of one shape ``(*, *normalized_shape)`` and one dtype.
        normalized_shape, weight, eps, backend, offset, casting_mode, out: as in
            :func:`rms_norm` (a casting mode applies to the rounded ``x + residual``).
        out_dtype, residual_out, residual_dtype: as in :func:`add_layer_norm`.

    Returns:
        ``(y, residual_out)``, both shaped like ``x``.
    """
    if options:
        return _options.call(  # type: ignore[return-value]
            "add_rms_norm", x, residual, normalized_shape, weight, None, eps, True, backend,
            options,
        )  # fmt: skip
    y, h = _norm("add_rms_norm", x, residual, normalized_shape, weight, None, eps, True, backend)
    return y, h  # type: ignore[return-value]


for _function, _names in _options.OPTIONS.items():
    _options.signed(globals()[_function], _names)
