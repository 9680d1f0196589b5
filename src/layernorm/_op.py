"""The op: layer norm and RMSNorm on rows, defined once for every PyTorch mechanism.

One forward (a backend's kernel), one backward formula, one analytic JVP, one vmap rule,
one autocast policy, fake kernels and one decomposition into torch operations
(``docs/contract.md`` §1 and §6). The op is ``layernorm::forward`` (with
``layernorm::backward``): :data:`forward_op`, a ``torch.library`` custom op whose
schema, fake kernels, vmap rules, autocast policy, Python autograd and Python kernel
(:func:`_forward_impl`, any backend, any device) are registered here. Where the C++ part
is built (:mod:`layernorm.compiled`), it adds CPU and AutogradCPU kernels of the same
ops, which the dispatcher prefers for CPU tensors: the same kernels and formulas, without
Python's cost. :mod:`layernorm.ops` validates a call and hands it to one entry point:

===============================  =========================================================
the call meets                   entry point
===============================  =========================================================
jit tracing, torch.export, ONNX  :func:`decomposition` (torch operations, recorded as such)
forward AD, a torch.func         :class:`TransformNorm` (the op's context, backward, vmap
transform                        rule, and the JVP that a custom op cannot carry)
plain eager inference            :func:`forward` (the backend's kernel, directly)
anything else: autograd,         :data:`forward_op` through the dispatcher
torch.compile, subclasses
===============================  =========================================================

All of them compute the same thing; the kernel-calling ones the same bits. Inside
:class:`TransformNorm` the kernel is called directly only when ``direct`` says the
tensors are plain and no dispatch mode is active (:func:`direct_call`); otherwise it
calls the op, so that a mode sees ``layernorm::forward``. Statistics saved for the
backward are ``mean`` and ``rstd`` per row (the accumulation dtype), never ``u``; a
second derivative goes through :func:`composite_backward`, the backward in
differentiable torch operations.
"""

from __future__ import annotations

import math

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from . import backends
from .backends import torch_
from .backends.torch_ import accumulation_dtype

__all__ = [
    "AUTOCAST_DTYPE",
    "PLAIN",
    "PLAIN_OR_NONE",
    "TransformNorm",
    "autocast",
    "backward_call",
    "backward_op",
    "composite_backward",
    "decomposition",
    "default_eps",
    "direct_call",
    "forward",
    "forward_call",
    "forward_op",
    "kernel_rows",
    "matrix",
    "records_gradient",
    "rows",
    "transformed",
    "unseen",
]

Outputs = tuple[Tensor, Tensor | None, Tensor | None, Tensor]


#: types a kernel may be handed directly (anything else dispatches through the custom op)
PLAIN = frozenset({Tensor, torch.nn.Parameter})
#: :data:`PLAIN` or an absent argument
PLAIN_OR_NONE = PLAIN | {type(None)}


#: layer norm's ``eps`` where a function takes ``None`` for it (``fused_norm``; torch's
#: and :func:`layernorm.layer_norm`'s default)
LAYER_NORM_EPS = 1e-5


def default_eps(dtype: torch.dtype) -> float:
    """``eps=None``: the machine epsilon of the arithmetic's dtype (float32 for half
    inputs), as torch's rms_norm (the compiled dispatch is handed this rule's values)."""
    return torch.finfo(accumulation_dtype(dtype)).eps


def _kernels(x: Tensor, backend: str):
    # Zero-size work never reaches a compiled kernel.
    return backends.get("torch") if x.numel() == 0 else backends.pick(x, backend or None)


def forward(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    backend: str,
    stats: bool = True,
    out_dtype: torch.dtype | None = None,
) -> Outputs:
    """The backend's forward on kernel arguments (``docs/contract.md`` §5):
    ``(y, residual_out, mean, rstd)``; ``backend`` "" is the automatic choice. ``y`` in
    ``out_dtype`` when given (``torch_.OUT_DTYPES``, no wider than ``x``'s or its
    accumulation dtype: each element rounded once into it; passed to the backend only
    when given)."""
    if out_dtype is None:
        return _kernels(x, backend).forward(x, residual, weight, bias, eps, rms, stats)
    return _kernels(x, backend).forward(x, residual, weight, bias, eps, rms, stats, out_dtype)


def _backward_kernel(
    dy: Tensor,
    z: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    dresidual_out: Tensor | None,
    rms: bool,
    need_dweight: bool,
    need_dbias: bool,
    backend: str,
    eps: float,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    return _kernels(z, backend).backward(
        dy, z, weight, None if rms else mean, rstd, dresidual_out, rms, need_dweight,
        need_dbias, eps,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# The custom ops: what torch.compile and tensor subclasses see (opaque, with fake kernels).
# Their schemas have no optional outputs, so absent ones are empty tensors.


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _forward_impl(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _schema_outputs(x, *forward(x, residual, weight, bias, eps, rms, backend))


def _schema_outputs(
    x: Tensor, y: Tensor, residual_out: Tensor | None, mean: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A forward's outputs as the ops' schemas have them (no optional outputs: an absent
    one is empty)."""
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
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = _backward_kernel(
        dy, x, weight, mean, rstd, dresidual_out, rms, need_dweight, need_dbias, backend, eps
    )
    return (
        dx,
        _empty(rstd) if dweight is None else dweight,
        _empty(rstd) if dbias is None else dbias,
    )


def _forward_to_impl(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    backend: str,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    outputs = forward(x, residual, weight, bias, eps, rms, backend, True, out_dtype)
    return _schema_outputs(x, *outputs)


forward_op = torch.library.custom_op("layernorm::forward", mutates_args=())(_forward_impl)
backward_op = torch.library.custom_op("layernorm::backward", mutates_args=())(_backward_impl)
#: ``layernorm::forward_to``: :data:`forward_op` with ``y`` in a dtype of its own
#: (``out_dtype``, narrower than ``x``'s, or float32 from a 16-bit ``x`` without a
#: gradient: ``layernorm.options``), rounded once into it by the kernels. A Python op (the
#: compiled part registers kernels for the same-dtype ops only); its backward is
#: :data:`backward_op`'s, with ``dy`` widened to ``z``'s dtype (exact: the options record
#: a gradient of it for a narrower ``y`` only).
forward_to_op = torch.library.custom_op("layernorm::forward_to", mutates_args=())(_forward_to_impl)
#: the ops' overloads, called directly: what calling :data:`forward_op` /
#: :data:`backward_op` does, without their Python wrappers' cost
forward_call = torch.ops.layernorm.forward.default
forward_to_call = torch.ops.layernorm.forward_to.default
backward_call = torch.ops.layernorm.backward.default


@forward_op.register_fake
def _forward_fake(x, residual, weight, bias, eps, rms, backend):
    m = x.numel() // x.shape[-1] if x.shape[-1] else x.shape[:-1].numel()
    stat = accumulation_dtype(x.dtype)
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape if residual is not None else (0,)),
        x.new_empty((0,) if rms else (m,), dtype=stat),
        x.new_empty((m,), dtype=stat),
    )


@forward_to_op.register_fake
def _(x, residual, weight, bias, eps, rms, backend, out_dtype):
    y, residual_out, mean, rstd = _forward_fake(x, residual, weight, bias, eps, rms, backend)
    return y.new_empty(y.shape, dtype=out_dtype), residual_out, mean, rstd


@backward_op.register_fake
def _(dy, x, weight, mean, rstd, dresidual_out, rms, need_dweight, need_dbias, backend, eps):
    n = x.shape[-1]
    stat = accumulation_dtype(x.dtype)
    return (
        x.new_empty(x.shape),
        x.new_empty((n,) if need_dweight else (0,), dtype=stat),
        x.new_empty((n,) if need_dbias else (0,), dtype=stat),
    )


# ---------------------------------------------------------------------------------------
# Autocast: the one policy. torch runs layer_norm in float32 under CUDA autocast (its fp32
# list) and leaves it alone under CPU autocast (output in the input's dtype); so do we.

#: device type -> the dtype autocast casts the floating inputs to (absent: no cast)
AUTOCAST_DTYPE: dict[str, torch.dtype] = {"cuda": torch.float32}

for _device, _dtype in AUTOCAST_DTYPE.items():
    torch.library.register_autocast(forward_op, _device, _dtype)
    torch.library.register_autocast(forward_to_op, _device, _dtype)


def autocast(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The arguments as :data:`AUTOCAST_DTYPE` casts them when autocast is enabled for
    ``x``'s device type (the casts are recorded by autograd, as torch's autocast does)."""
    dtype = AUTOCAST_DTYPE.get(x.device.type)
    if dtype is None or not torch.is_autocast_enabled(x.device.type):
        return x, residual, weight, bias

    def cast(t: Tensor | None) -> Tensor | None:
        return t if t is None or t.dtype == dtype else t.to(dtype)

    return cast(x), cast(residual), cast(weight), cast(bias)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------
# Autograd: one context, one backward, one JVP.


def _setup_context(ctx, inputs, output) -> None:
    x, residual, weight, bias, eps, rms, backend = inputs[:7]
    _, residual_out, mean, rstd = output
    z = x if residual is None else residual_out
    ctx.save_for_backward(z, weight, mean, rstd)
    ctx.has_residual = residual is not None
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.eps, ctx.rms, ctx.backend = eps, rms, backend
    ctx.y_dtype = output[0].dtype  # z's, or forward_to's out_dtype
    ctx.direct = False  # the backward goes through the op (TransformNorm may say otherwise)


def _as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def matrix(t: Tensor, n: int) -> Tensor:
    """``t`` as the (M, N) matrix of its rows of ``n`` elements (a view where it can).
    Without elements, M is spelled out: ``reshape(-1, n)`` cannot infer it, nor can it
    under vmap, where a batch of size 0 (jacrev of an empty output) has no elements."""
    if t.numel():
        return t.reshape(-1, n)
    return t.reshape(math.prod(t.shape[:-1]) if n == 0 else 0, n)


def rows(t: Tensor, n: int) -> Tensor:
    """``t`` as (M, N) with contiguous rows (unit column stride), without a copy where it
    can: autograd hands a backward expanded gradients (``y.sum().backward()``: strides
    (0, 0))."""
    return torch_.contiguous_rows(t if t.dim() == 2 and t.shape[1] == n else matrix(t, n))


def kernel_rows(t: Tensor, n: int) -> Tensor:
    """``t`` as the kernels take it (``docs/contract.md`` §5): itself when it is
    contiguous with rows of its last dim, else :func:`rows`."""
    return t if t.is_contiguous() and t.shape[-1] == n else rows(t, n)


def _backward(ctx, dy, dresidual_out, _dmean=None, _drstd=None):
    z, weight, mean, rstd = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    need_dweight = weight is not None and ctx.needs_input_grad[2]
    need_dbias = ctx.has_bias and ctx.needs_input_grad[3]
    if not ctx.has_residual or dresidual_out is None or dresidual_out.numel() == 0:
        dresidual_out = None
    n = z.shape[-1]
    if dy.dtype != z.dtype:  # y in a narrower dtype (forward_to): widening is exact
        dy = dy.to(z.dtype)
    dy = kernel_rows(dy, n)
    dresidual_out = None if dresidual_out is None else kernel_rows(dresidual_out, n)
    if torch.is_grad_enabled():  # a graph of the backward is wanted: differentiable ops
        dz, dweight, dbias = composite_backward(dy, z, weight, ctx.eps, ctx.rms, dresidual_out)
    else:
        # a batched gradient (is_grads_batched, a vmapped vjp) is a functorch wrapper: it
        # goes through the op, whose vmap rule takes it
        direct = ctx.direct and direct_call(dy, dresidual_out)
        run = _backward_impl if direct else backward_call
        dz, dweight, dbias = run(
            dy, z, weight, mean, rstd, dresidual_out, ctx.rms, need_dweight, need_dbias,
            ctx.backend, ctx.eps,
        )  # fmt: skip
    dweight = _as_dtype(dweight, weight.dtype) if need_dweight else None
    dbias = _as_dtype(dbias, ctx.bias_dtype) if need_dbias else None
    dresidual = None
    if ctx.has_residual and ctx.needs_input_grad[1] and need_x:
        # x and residual get the same gradient; never hand one tensor to two leaves.
        dresidual = dz.clone() if ctx.needs_input_grad[0] else dz
    dx = dz if ctx.needs_input_grad[0] else None
    return dx, dresidual, dweight, dbias, None, None, None


forward_op.register_autograd(_backward, setup_context=_setup_context)


def _backward_to(ctx, dy, dresidual_out, _dmean=None, _drstd=None):
    return (*_backward(ctx, dy, dresidual_out), None)


forward_to_op.register_autograd(_backward_to, setup_context=_setup_context)


def composite_backward(
    dy: Tensor,
    z: Tensor,
    weight: Tensor | None,
    eps: float,
    rms: bool,
    dresidual_out: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``docs/contract.md`` §1 in differentiable torch operations
    (statistics recomputed from ``z``): ``(dz, dweight, dbias)``."""
    acc = accumulation_dtype(z.dtype)
    n = z.shape[-1]
    zf, g = matrix(z, n).to(acc), matrix(dy, n).to(acc)
    if rms:
        rstd = torch.rsqrt((zf * zf).mean(1, keepdim=True) + eps)
        u = zf * rstd
    else:
        c = zf - zf.mean(1, keepdim=True)
        c = c - c.mean(1, keepdim=True)  # the corrected two-pass, as in the kernels
        rstd = torch.rsqrt((c * c).mean(1, keepdim=True) + eps)
        u = c * rstd
    gh = g if weight is None else g * weight.to(acc)
    c1 = (gh * u).mean(1, keepdim=True)
    dz = rstd * (gh - u * c1) if rms else rstd * (gh - gh.mean(1, keepdim=True) - u * c1)
    if dresidual_out is not None:
        dz = dz + matrix(dresidual_out, n).to(acc)
    return dz.to(z.dtype).view(z.shape), (g * u).sum(0), g.sum(0)


def _jvp(ctx, x_t, residual_t, weight_t, bias_t, *_):
    """Tangents of ``(y, residual_out)`` (``docs/contract.md`` §1; ``mean`` and ``rstd``
    are not differentiable): with ``h`` the normalized input and ``h_t`` its tangent,
    ``u_t = rstd * (h_t - mean(h_t) - u * mean(u * h_t))`` (no ``mean(h_t)`` for RMSNorm)
    and ``y_t = u_t * weight + u * weight_t + bias_t``."""
    z, weight, mean, rstd = ctx.saved_tensors
    acc = accumulation_dtype(z.dtype)
    h_t = x_t
    if residual_t is not None:
        h_t = residual_t if h_t is None else h_t + residual_t
    # on rows: the tangents come in the input's shape, the statistics one per row
    n = z.shape[-1]
    zr = matrix(z, n)
    rstd_col = rstd.reshape(-1, 1)
    if ctx.rms:
        u = zr.to(acc) * rstd_col
    else:
        d = zr.to(acc) - mean.reshape(-1, 1)
        u = (d - d.mean(-1, keepdim=True)) * rstd_col  # re-centered, as the backward
    y_t = torch.zeros_like(u)
    if h_t is not None:
        hf = matrix(h_t, n).to(acc)
        c1 = (u * hf).mean(-1, keepdim=True)
        if not ctx.rms:
            hf = hf - hf.mean(-1, keepdim=True)
        y_t = rstd_col * (hf - u * c1)
    if weight is not None:
        y_t = y_t * weight.to(acc)
    if weight_t is not None:
        y_t = y_t + u * weight_t.to(acc)
    if bias_t is not None:
        y_t = y_t + bias_t.to(acc)
    residual_out_t = None
    if ctx.has_residual:
        residual_out_t = torch.zeros_like(z) if h_t is None else h_t.to(z.dtype)
    return y_t.to(ctx.y_dtype).view(z.shape), residual_out_t, None, None


def transformed() -> bool:
    """Whether forward-mode AD (a dual level) or a ``torch.func`` transform is active:
    the calls that need :class:`TransformNorm`'s JVP and vmap rule (a custom op cannot
    carry a JVP: ``docs/contract.md`` §6)."""
    return (
        _forward_ad._current_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None
    )


def direct_call(*tensors: Tensor | None) -> bool:
    """Whether a kernel may be called on these tensors directly, as no mechanism would
    see it: plain tensors (no subclass, no functorch wrapper), not meta, and no dispatch
    or function mode active."""
    for t in tensors:
        if t is not None and (
            type(t) not in PLAIN
            or t.is_meta
            or torch._C._functorch.is_functorch_wrapped_tensor(t)
            or torch._C._functorch.is_legacy_batchedtensor(t)  # autograd's batched grads
        ):
            return False
    return not (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled())


def unseen(*tensors: Tensor | None) -> bool:
    """Whether no mechanism would see an eager call on ``tensors`` that skips the op:
    not compiling, tracing or under autocast, no forward AD or ``torch.func`` transform
    (:func:`transformed`), and :func:`direct_call`. The one test behind every eager
    shortcut of the options (``options``, ``fused``, ``recompute``); ``ops._enter``
    takes the same checks one at a time, as each picks its own route."""
    return (
        not torch.compiler.is_compiling()
        and not torch._C._is_tracing()
        and not torch._C._is_any_autocast_enabled()
        and not transformed()
        and direct_call(*tensors)
    )


def records_gradient(*tensors: object) -> bool:
    """Whether autograd records a call on ``tensors``: grad mode on, and one of them a
    tensor that requires grad (anything else among them is ignored)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in tensors
    )


def _forward_outputs(x, residual, weight, bias, eps, rms, backend, direct, out_dtype) -> Outputs:
    """The kernel called directly when ``direct`` (decided by the caller, with
    :func:`direct_call`), else the custom op."""
    if direct:
        return forward(x, residual, weight, bias, eps, rms, backend, True, out_dtype)
    return _forward_op_outputs(x, residual, weight, bias, eps, rms, backend, out_dtype)


def _save(ctx, inputs, output) -> None:
    """The context of the backward and of the JVP."""
    _setup_context(ctx, inputs, output)
    x, residual, weight = inputs[:3]
    ctx.save_for_forward(x if residual is None else output[1], weight, output[2], output[3])
    ctx.mark_non_differentiable(*(t for t in output[2:] if t is not None))


class TransformNorm(torch.autograd.Function):
    """The op's autograd as an ``autograd.Function``, for forward AD (its ``jvp``) and
    torch.func (``setup_context`` and a ``vmap`` rule): outputs ``(y, residual_out,
    mean, rstd)`` (None for an absent one); ``mean`` and ``rstd`` are not
    differentiable. ``direct``: the kernel may be called without the op
    (:func:`direct_call` decides per call). ``out_dtype``: ``y``'s dtype when not ``x``'s
    (:data:`forward_to_op`), else None."""

    @staticmethod
    def forward(x, residual, weight, bias, eps, rms, backend, direct, out_dtype):
        direct = direct and direct_call(x, residual, weight, bias)
        return _forward_outputs(x, residual, weight, bias, eps, rms, backend, direct, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save(ctx, inputs[:7], output)
        x, residual, weight, bias = inputs[:4]
        ctx.direct = inputs[7] and direct_call(x, residual, weight, bias)

    @staticmethod
    def backward(ctx, dy, dresidual_out, _dmean, _drstd):
        return (*_backward(ctx, dy, dresidual_out), None, None)

    @staticmethod
    def jvp(ctx, x_t, residual_t, weight_t, bias_t, *_):
        return _jvp(ctx, x_t, residual_t, weight_t, bias_t)

    @staticmethod
    def vmap(info, in_dims, x, residual, weight, bias, eps, rms, backend, direct, out_dtype):
        return _vmap(info, in_dims, x, residual, weight, bias, eps, rms, backend, direct, out_dtype)


class EagerNorm(torch.autograd.Function):
    """The op's autograd without the op, for eager training calls that no mechanism sees
    and that the C++ part does not take (``y`` in another dtype: ``layernorm::forward_to``
    has a Python autograd only; ``ops._enter``): the kernels called directly each way,
    the op's backward formula (:func:`_backward`: with ``create_graph``, its
    differentiable composite). ``forward`` takes the context itself (a ``setup_context``
    costs an ``inspect.signature`` a call); the custom op's Python autograd and dispatch
    cost some 50 µs a forward and backward."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, backend, out_dtype):  # type: ignore[override]
        inputs = (x, residual, weight, bias, eps, rms, backend)
        output = forward(*inputs, True, out_dtype)
        _setup_context(ctx, inputs, output)
        ctx.direct = True
        ctx.mark_non_differentiable(*(t for t in output[2:] if t is not None))
        return output

    @staticmethod
    def backward(ctx, dy, dresidual_out, _dmean, _drstd):  # type: ignore[override]
        return (*_backward(ctx, dy, dresidual_out), None)


def _vmap(info, in_dims, x, residual, weight, bias, eps, rms, backend, direct, out_dtype):
    """The vmap rule of :class:`TransformNorm`: :func:`_vmap_rows` around it."""

    def run(*arguments):
        return TransformNorm.apply(*arguments, direct, out_dtype)

    return _vmap_rows(run, info, in_dims, x, residual, weight, bias, eps, rms, backend)


def _forward_op_outputs(x, residual, weight, bias, eps, rms, backend, out_dtype=None) -> Outputs:
    """:data:`forward_op` (:data:`forward_to_op` with an ``out_dtype``) with None for the
    absent outputs (its schema has none)."""
    if out_dtype is None:
        y, residual_out, mean, rstd = forward_call(x, residual, weight, bias, eps, rms, backend)
    else:
        y, residual_out, mean, rstd = forward_to_call(
            x, residual, weight, bias, eps, rms, backend, out_dtype
        )
    return y, residual_out if residual is not None else None, None if rms else mean, rstd


def _op_vmap(info, in_dims, x, residual, weight, bias, eps, rms, backend, out_dtype=None):
    """The vmap rule of :data:`forward_op` and :data:`forward_to_op`."""

    def run(*arguments):
        return _forward_op_outputs(*arguments, out_dtype)

    outputs, out_dims = _vmap_rows(run, info, in_dims, x, residual, weight, bias, eps, rms, backend)
    # the schema has no optional outputs: an absent one is empty and unbatched
    empty = outputs[3].new_empty(0)
    return tuple(empty if t is None else t for t in outputs), out_dims


forward_op.register_vmap(_op_vmap)
forward_to_op.register_vmap(_op_vmap)


def _front(t: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """``t`` with its batch dim in front (expanded when it has none)."""
    if t is None:
        return None
    if dim is None:
        return t.expand(size, *t.shape)
    return t.movedim(dim, 0)


def _vmap_rows(run, info, in_dims, x, residual, weight, bias, eps, rms, backend):
    """The vmap rule: the batch becomes more rows. Per-sample ``weight``/``bias`` (batched)
    are applied to the core ``u`` in the accumulation dtype, outside the kernel. ``run``
    takes the op's arguments and returns :data:`Outputs` (None for an absent one)."""
    size = info.batch_size
    x_dim, residual_dim, weight_dim, bias_dim = in_dims[:4]
    xb = _front(x, x_dim, size)
    assert xb is not None
    shape = xb.shape
    n = shape[-1]
    rows = xb.reshape(-1, n)
    residual_rows = None
    if residual is not None:
        residual_rows = _front(residual, residual_dim, size).reshape(-1, n)  # type: ignore[union-attr]
    per_sample = weight_dim is not None or bias_dim is not None
    y, residual_out, mean, rstd = run(
        rows,
        residual_rows,
        None if per_sample else weight,
        None if per_sample else bias,
        eps,
        rms,
        backend,
    )
    y = y.view(shape)
    if per_sample:
        acc = accumulation_dtype(y.dtype)
        broadcast = (size,) + (1,) * (len(shape) - 2) + (n,)
        affine = y.to(acc)
        if weight is not None:
            affine = affine * _front(weight, weight_dim, size).reshape(broadcast).to(acc)  # type: ignore[union-attr]
        if bias is not None:
            affine = affine + _front(bias, bias_dim, size).reshape(broadcast).to(acc)  # type: ignore[union-attr]
        y = affine.to(y.dtype)
    stats_shape = shape[:-1]
    outputs = (
        y,
        None if residual_out is None else residual_out.view(shape),
        None if mean is None else mean.view(stats_shape),
        rstd.view(stats_shape),
    )
    return outputs, tuple(None if t is None else 0 for t in outputs)


@backward_op.register_vmap
def _(info, in_dims, dy, x, weight, mean, rstd, dresidual_out, rms, need_dw, need_db, backend, eps):
    """``dx`` alone with a shared ``weight``: the batch becomes more rows, for the kernel
    (a row's gradient depends on that row only). Per-sample ``dweight``/``dbias``, or a
    batched ``weight``: the op once per sample (the kernel's bits, per sample)."""
    size = info.batch_size
    if in_dims[2] is not None or need_dw or need_db:
        tensors = (dy, x, weight, mean, rstd, dresidual_out)
        dims = in_dims[:6]
        fronted = [t if d is None else t.movedim(d, 0) for t, d in zip(tensors, dims, strict=True)]

        def sample(i: int) -> tuple[Tensor, Tensor, Tensor]:
            args = [t if d is None else t[i] for t, d in zip(fronted, dims, strict=True)]  # type: ignore[index]
            return backward_op(*args, rms, need_dw, need_db, backend, eps)

        per_sample = [sample(i) for i in range(size)]
        dx = torch.stack([p[0] for p in per_sample])
        dw = torch.stack([p[1] for p in per_sample]) if need_dw else per_sample[0][1]
        db = torch.stack([p[2] for p in per_sample]) if need_db else per_sample[0][2]
        return (dx, dw, db), (0, 0 if need_dw else None, 0 if need_db else None)
    xb = _front(x, in_dims[1], size)
    assert xb is not None
    shape = xb.shape
    n = shape[-1]

    def batch_rows(t: Tensor | None, dim: int | None) -> Tensor | None:
        return None if t is None else rows(_front(t, dim, size), n)  # type: ignore[arg-type]

    def stats(t: Tensor, dim: int | None) -> Tensor:  # (the kernels read them densely)
        return _front(t, dim, size).reshape(-1).contiguous()  # type: ignore[union-attr]

    dx, dw, db = backward_op(
        batch_rows(dy, in_dims[0]),
        batch_rows(x, in_dims[1]),
        weight,
        mean if rms else stats(mean, in_dims[3]),
        stats(rstd, in_dims[4]),
        batch_rows(dresidual_out, in_dims[5]),
        rms,
        False,
        False,
        backend,
        eps,
    )
    return (dx.view(shape), dw, db), (0, None, None)


# ---------------------------------------------------------------------------------------
# The decomposition: the portable backend's torch operations, for whatever records them.


def decomposition(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(y, residual_out)`` in differentiable torch operations: the portable backend's
    corrected two-pass (``docs/contract.md`` §3), which jit tracing and scripting,
    torch.export and the ONNX exporters record op by op (``y`` converted once to
    ``out_dtype`` when given)."""
    y, residual_out, _, _ = torch_.portable_forward(
        x, residual, weight, bias, eps, rms, True, out_dtype
    )
    return y, residual_out


def scripted_norm(
    x: Tensor,
    normalized_shape: list[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
) -> Tensor:
    """What a TorchScript-compiled :class:`layernorm.LayerNorm` / :class:`RMSNorm` runs
    (``torch.jit.script``): the portable backend's corrected two-pass in torch operations,
    over the trailing ``normalized_shape`` dims. Written in TorchScript's subset."""
    k = len(normalized_shape)
    if x.dim() < k or x.shape[x.dim() - k :] != normalized_shape:
        raise RuntimeError(
            "Given normalized_shape="
            + str(normalized_shape)
            + ", expected input with shape [*, "
            + ", ".join([str(s) for s in normalized_shape])
            + "], but got input of size"
            + str(x.shape)
        )
    if eps is None:  # the machine epsilon of the arithmetic's dtype, as torch
        eps = 2.220446049250313e-16 if x.dtype == torch.float64 else 1.1920928955078125e-07
    rows = x.flatten(x.dim() - k) if k > 1 else x
    if weight is not None:
        weight = weight.reshape(-1)
    if bias is not None:
        bias = bias.reshape(-1)
    y, _, _, _ = torch_.portable_forward(rows, None, weight, bias, eps, rms)
    return y.view(x.shape)
