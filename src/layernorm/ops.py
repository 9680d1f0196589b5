"""Validation, flattening to rows, backend choice, autograd and custom-op registration.

The only Python module that knows torch autograd. Data flows down once:
validate → rows → backend (picked per call) → its kernel → the input's shape. An eager
call is first offered to the compiled dispatch (:mod:`layernorm.compiled`), which runs the
common call on numba's kernels from C++, checks and autograd node included, with the same
bits; the others go straight to the backend (inference) or through :class:`_Norm`
(autograd), handing a contiguous input over as it is, whatever its dims; torch.compile and
tensor subclasses go through the custom op on (M, N) rows. A common call (see
:func:`_common_call`) skips the full checks, which it would pass unchanged: on small
inputs the checks cost as much as the kernel.

The two custom ops ``layernorm::forward`` and ``layernorm::backward`` are opaque to
torch.compile (fake kernels give their shapes), so a model using them compiles with
``fullgraph=True``. The backend is chosen inside the op, at run time, from the
``backend`` string ("" means automatic). The autograd formula saves ``mean`` and
``rstd`` per row (float32, or float64 for float64 input), never ``u``. A second
derivative goes through :func:`_composite_backward`, the same formula in differentiable
torch operations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import backends
from . import compiled as _compiled
from .backends.torch_ import contiguous_rows as _contiguous_rows
from .backends.torch_ import matrix as _matrix

__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"]

ShapeLike = int | Sequence[int] | torch.Size


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _kernels(x: Tensor, backend: str):
    # Zero-size work never reaches a compiled kernel.
    return backends.get("torch") if x.numel() == 0 else backends.pick(x, backend or None)


def _forward_impl(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, residual_out, mean, rstd = _kernels(x, backend).forward(x, residual, weight, bias, eps, rms)
    return (
        y,
        _empty(x) if residual_out is None else residual_out,
        _empty(rstd) if mean is None else mean,
        rstd,
    )


def _backward_impl(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    dresidual_out: Tensor | None,
    rms: bool,
    need_dweight: bool,
    need_dbias: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = _kernels(x, backend).backward(
        dy, x, weight, None if rms else mean, rstd, dresidual_out, rms, need_dweight, need_dbias
    )
    return (
        dx,
        _empty(rstd) if dweight is None else dweight,
        _empty(rstd) if dbias is None else dbias,
    )


# The custom ops: what torch.compile sees (opaque, with fake kernels for shapes).
_forward_op = torch.library.custom_op("layernorm::forward", mutates_args=())(_forward_impl)
_backward_op = torch.library.custom_op("layernorm::backward", mutates_args=())(_backward_impl)


@_forward_op.register_fake
def _(x, residual, weight, bias, eps, rms, backend):
    m, n = x.shape
    stat = _stat_dtype(x.dtype)
    return (
        x.new_empty((m, n)),
        x.new_empty((m, n) if residual is not None else (0,)),
        x.new_empty((0,) if rms else (m,), dtype=stat),
        x.new_empty((m,), dtype=stat),
    )


@_backward_op.register_fake
def _(dy, x, weight, mean, rstd, dresidual_out, rms, need_dweight, need_dbias, backend):
    n = x.shape[1]
    stat = _stat_dtype(x.dtype)
    return (
        x.new_empty(x.shape),
        x.new_empty((n,) if need_dweight else (0,), dtype=stat),
        x.new_empty((n,) if need_dbias else (0,), dtype=stat),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, residual, weight, bias, eps, rms, backend = inputs
    _, residual_out, mean, rstd = output
    ctx.save_for_backward(x if residual is None else residual_out, weight, mean, rstd)
    ctx.has_residual = residual is not None
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.eps, ctx.rms, ctx.backend = eps, rms, backend
    ctx.custom_op = True  # the backward goes through layernorm::backward too (_Norm says not)


def _as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _backward(ctx, dy, dresidual_out, _dmean, _drstd):
    z, weight, mean, rstd = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    need_dweight = weight is not None and ctx.needs_input_grad[2]
    need_dbias = ctx.has_bias and ctx.needs_input_grad[3]
    if not ctx.has_residual or dresidual_out is None or dresidual_out.numel() == 0:
        dresidual_out = None
    # Incoming gradients can be expanded (y.sum().backward() sends strides (0, 0)); the
    # kernels want a contiguous tensor or rows.
    n = z.shape[-1]
    dy = _kernel_rows(dy, n)
    dresidual_out = None if dresidual_out is None else _kernel_rows(dresidual_out, n)
    if torch.is_grad_enabled():  # create_graph=True: a differentiable formula
        dz, dweight, dbias = _composite_backward(dy, z, weight, ctx.eps, ctx.rms, dresidual_out)
    else:
        run = _backward_op if ctx.custom_op else _backward_impl
        dz, dweight, dbias = run(
            dy, z, weight, mean, rstd, dresidual_out, ctx.rms, need_dweight, need_dbias, ctx.backend
        )
    # (``.to`` of the same dtype returns the tensor itself, but takes ~3-5 us to say so)
    dweight = _as_dtype(dweight, weight.dtype) if need_dweight else None
    dbias = _as_dtype(dbias, ctx.bias_dtype) if need_dbias else None
    if not need_x:
        dz = None
    dresidual = None
    if ctx.has_residual and ctx.needs_input_grad[1] and dz is not None:
        # x and residual get the same gradient; never hand one tensor to two leaves.
        dresidual = dz.clone() if ctx.needs_input_grad[0] else dz
    dx = dz if ctx.needs_input_grad[0] else None
    return dx, dresidual, dweight, dbias, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _Norm(torch.autograd.Function):
    """The eager path: the same kernels, context and backward as the custom op, without
    the custom-op dispatch (which costs hundreds of microseconds a call). Its outputs are
    only ``y`` and ``residual_out`` (None without a residual): the statistics stay in the
    context instead of becoming placeholder outputs."""

    # forward(ctx, ...) rather than setup_context: the latter binds the signature with
    # inspect on every call (~50 us).
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, backend):
        y, residual_out, mean, rstd = _kernels(x, backend).forward(
            x, residual, weight, bias, eps, rms
        )
        _setup_context(
            ctx, (x, residual, weight, bias, eps, rms, backend), (y, residual_out, mean, rstd)
        )
        ctx.custom_op = False
        return y, residual_out

    @staticmethod
    def backward(ctx, dy, dresidual_out):
        return _backward(ctx, dy, dresidual_out, None, None)


def _composite_backward(
    dy: Tensor,
    z: Tensor,
    weight: Tensor | None,
    eps: float,
    rms: bool,
    dresidual_out: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """SPEC's backward in differentiable torch operations (statistics recomputed from z)."""
    acc = _stat_dtype(z.dtype)
    shape = z.shape
    zf, g = _matrix(z).to(acc), _matrix(dy).to(acc)
    if rms:
        rstd = torch.rsqrt((zf * zf).mean(1, keepdim=True) + eps)
        u = zf * rstd
    else:
        c = zf - zf.mean(1, keepdim=True)
        c = c - c.mean(1, keepdim=True)  # corrected two-pass, as in the kernels
        rstd = torch.rsqrt((c * c).mean(1, keepdim=True) + eps)
        u = c * rstd
    gh = g if weight is None else g * weight.to(acc)
    c1 = (gh * u).mean(1, keepdim=True)
    dz = rstd * (gh - u * c1) if rms else rstd * (gh - gh.mean(1, keepdim=True) - u * c1)
    if dresidual_out is not None:
        dz = dz + _matrix(dresidual_out).to(acc)
    return dz.to(z.dtype).view(shape), (g * u).sum(0), g.sum(0)


# ---------------------------------------------------------------------------------------
# Validation and flattening


def _normalized_shape(normalized_shape: ShapeLike) -> tuple[int, ...]:
    one = isinstance(normalized_shape, tuple) and len(normalized_shape) == 1
    if one and type(normalized_shape[0]) is int:  # type: ignore[index]  # the modules' own
        return normalized_shape  # type: ignore[return-value]
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    shape = tuple(int(s) for s in normalized_shape)
    if len(shape) == 0:
        raise ValueError(
            "Expected normalized_shape to be at least 1-dimensional, i.e., containing at "
            f"least one element, but got normalized_shape = {list(shape)}"
        )
    return shape


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
        raise ValueError(
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
        raise ValueError(
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
    # two CPU tensors answer without building torch.device objects (~0.2 us a pair)
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


def _rows(t: Tensor, n: int) -> Tensor:
    """Flattens ``t`` to (M, N) with contiguous rows, without a copy where it can."""
    if t.dim() == 2 and t.shape[1] == n:  # already rows (a view costs ~1.5 us)
        return _contiguous_rows(t)
    if n == 0:  # M cannot be inferred from zero elements
        return t.reshape(math.prod(t.shape[:-1]), 0)
    return _contiguous_rows(t.reshape(-1, n))


def _kernel_rows(t: Tensor, n: int) -> Tensor:
    """``t`` as the kernels take it (see :mod:`layernorm.backends`): itself when it is
    contiguous with rows of its last dim (no view to make and undo: ~1.2 us each), else
    (M, N) with contiguous rows."""
    return t if t.is_contiguous() and t.shape[-1] == n else _rows(t, n)


#: argument types eager code may hand to kernels: not a tensor subclass (DTensor,
#: FakeTensor, ...), which only the custom op dispatches correctly
_PLAIN = frozenset({Tensor, torch.nn.Parameter, type(None)})


def _requires_grad(t: Tensor | None) -> bool:
    return t is not None and t.requires_grad


def _plain_param(p: Tensor | None, n: int) -> bool:
    return p is None or (
        type(p) in _PLAIN
        and p.is_cpu
        and p.shape == (n,)
        and p.is_floating_point()
        and p.is_contiguous()
    )


def _common_call(
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    backend: str | None,
) -> int:
    """N when the call is the common one, which the full checks would pass without
    changing anything: a plain contiguous floating CPU tensor; ``normalized_shape`` its
    last dim, as an int or a 1-tuple; a residual like ``x`` or None; plain contiguous
    (N,) floating CPU parameters or None; a non-negative float ``eps``; the automatic
    backend; not under torch.compile. 0 for any other call (the full checks take it).
    (Measured at (1, 1, 768): 3.9 us here, 5.2 us for the full checks.)"""
    one = type(normalized_shape) is tuple and len(normalized_shape) == 1
    n = normalized_shape[0] if one else normalized_shape  # type: ignore[index]
    if not (
        type(n) is int
        and n > 0
        and type(x) is Tensor
        and x.is_cpu
        and x.is_floating_point()
        and x.is_contiguous()
        and x.dim() > 0
        and x.shape[-1] == n
        and type(eps) is float
        and eps >= 0
        and backend is None
        and _plain_param(weight, n)
        and _plain_param(bias, n)
    ):
        return 0
    if residual is not None and not (
        type(residual) is Tensor
        and residual.is_cpu
        and residual.dtype == x.dtype
        and residual.shape == x.shape
        and residual.is_contiguous()
    ):
        return 0
    return 0 if torch.compiler.is_compiling() else n


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
) -> tuple[Tensor, Tensor | None]:
    if not torch.compiler.is_compiling():
        out = _compiled.norm(x, residual, normalized_shape, weight, bias, eps, rms, backend)
        if out is not None:  # the common call, run by the compiled dispatch
            return out
    n = _common_call(x, residual, normalized_shape, weight, bias, eps, backend)
    if n:  # the checks below would pass and change nothing
        rows, residual_rows, name = x, residual, ""
    else:
        shape = _normalized_shape(normalized_shape)
        _check_input("input", x, shape, op)
        if residual is not None:
            _check_input("residual", residual, shape, op)
            if residual.shape != x.shape or residual.dtype != x.dtype:
                raise ValueError(
                    f"{op}: residual must match input in shape and dtype, but got input "
                    f"{list(x.shape)} {x.dtype} and residual {list(residual.shape)} "
                    f"{residual.dtype}"
                )
            _check_device("residual", residual, x)
        if weight is not None:
            weight = _param("weight", weight, shape, x, op)
        if bias is not None:
            bias = _param("bias", bias, shape, x, op)
        # eps=None: the machine epsilon of the arithmetic's dtype (float32 for half
        # inputs), as torch
        eps = _check_eps(torch.finfo(_stat_dtype(x.dtype)).eps if eps is None else eps)
        name = "" if backend is None else _check_backend(backend)
        n = shape[0] if len(shape) == 1 else math.prod(shape)
        plain = (
            type(x) in _PLAIN
            and type(residual) in _PLAIN
            and type(weight) in _PLAIN
            and type(bias) in _PLAIN
        )
        if not plain or torch.compiler.is_compiling():
            # the custom op: torch.compile traces it, and DTensor dispatches on it (both
            # on (M, N) rows, which their shape rules assume)
            rows = _rows(x, n)
            residual_rows = None if residual is None else _rows(residual, n)
            y, residual_out, _, _ = _forward_op(rows, residual_rows, weight, bias, eps, rms, name)
            return _shaped(y, None if residual is None else residual_out, rows, x)
        rows = _kernel_rows(x, n)
        residual_rows = None if residual is None else _kernel_rows(residual, n)
    if torch.is_grad_enabled() and (
        x.requires_grad
        or _requires_grad(residual)
        or _requires_grad(weight)
        or _requires_grad(bias)
    ):  # eager autograd, without op dispatch
        y, residual_out = _Norm.apply(rows, residual_rows, weight, bias, eps, rms, name)
    else:  # inference: straight to the kernel
        y, residual_out, _, _ = _kernels(rows, name).forward(
            rows, residual_rows, weight, bias, eps, rms, stats=False
        )
    return _shaped(y, residual_out, rows, x)


def _shaped(
    y: Tensor, residual_out: Tensor | None, rows: Tensor, x: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The outputs computed on ``rows`` in the shape of ``x`` (``view_as``: ~1.3 us, a
    third of ``view(x.shape)``)."""
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

    Returns:
        a tensor shaped like ``input``, of its dtype.

    Shape:
        - Input: ``(*, *normalized_shape)``
        - Output: same as input

    Example::

        >>> x = torch.tensor([[1.0, 2.0, 3.0]])
        >>> layernorm.layer_norm(x, (3,), eps=1 / 3)
        tensor([[-1.,  0.,  1.]])
    """
    return _norm("layer_norm", input, None, normalized_shape, weight, bias, eps, False, backend)[0]


def rms_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str | None = None,
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

    Returns:
        a tensor shaped like ``input``, of its dtype.

    Example::

        >>> layernorm.rms_norm(torch.tensor([[3.0, 4.0]]), 2, eps=0.0)
        tensor([[0.8485, 1.1314]])
    """
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
) -> tuple[Tensor, Tensor]:
    """Fused residual add and layer norm: ``residual_out = x + residual``,
    ``y = layer_norm(residual_out)``, in one pass over memory where the backend allows.

    Args:
        x, residual: tensors of one shape ``(*, *normalized_shape)`` and one dtype.
        normalized_shape, weight, bias, eps, backend: as in :func:`layer_norm`.

    Returns:
        ``(y, residual_out)``, both shaped like ``x``.

    Example::

        >>> y, h = layernorm.add_layer_norm(torch.ones(1, 3), torch.tensor([[0.0, 1.0, 2.0]]), 3)
        >>> h
        tensor([[1., 2., 3.]])
    """
    y, residual_out = _norm(
        "add_layer_norm", x, residual, normalized_shape, weight, bias, eps, False, backend
    )
    return y, residual_out  # type: ignore[return-value]


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused residual add and RMSNorm: ``(rms_norm(x + residual), x + residual)``.

    Args:
        x, residual: tensors of one shape ``(*, *normalized_shape)`` and one dtype.
        normalized_shape, weight, eps, backend: as in :func:`rms_norm`.

    Returns:
        ``(y, residual_out)``, both shaped like ``x``.
    """
    y, residual_out = _norm(
        "add_rms_norm", x, residual, normalized_shape, weight, None, eps, True, backend
    )
    return y, residual_out  # type: ignore[return-value]
