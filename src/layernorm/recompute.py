"""Backwards that keep less (``docs/contract.md`` §2 "Options"): apex's
``memory_efficient`` norm, which saves the output and recomputes the normalized input from
it, and :func:`layer_norm_linear`, which saves the norm's input (and its statistics)
instead of its output. The compiled front door records both with C++ autograd nodes of
their own for the common call (``layernorm._compiled.cpp``, ``MemoryEfficientBackward``
and ``NormLinearBackward``), which run these backwards' steps on the same kernels (the
same bits) and hand :func:`gradients` and :func:`norm_linear_gradients` what they were
not built for.

The plain backward (``docs/contract.md`` §1) saves the input ``z`` and recomputes the
core ``u`` from it exactly. :class:`MemoryEfficientNorm` saves ``y`` (the output, which
the next layer usually keeps anyway), the parameters and ``rstd``, and recovers the core
as ``xhat = (y − beta) / gamma`` in the accumulation dtype. ``y`` is rounded, so ``xhat``
is not ``u`` and ``dx`` is not correctly rounded: per element, with ``p`` the unit
roundoff of ``y``'s dtype (``2^-24`` float32, ``2^-8`` bfloat16, ``2^-11`` float16) and
``e = 2^-24`` (float32 arithmetic; ``2^-53`` for float64 input),

    δ_i  = (p·|y_i| + 2e·|y_i − beta_i|) / |gamma_i| + e·|u_i|      (|xhat_i − u_i| ≤ δ_i)
    |dx_i − dx_i,exact| ≤ rstd · (|c1|·δ_i + |u_i|·mean_j(|gh_j|·δ_j))
                          + rstd · (|gh_i| + mean_j|gh_j| + |u_i|·mean_j|gh_j·u_j|)
                                 · (log2(N) + 8)·e
                          + half a unit in the last place of dx_i in x's dtype

(``c1``, ``c2``, ``gh`` as in §1; the second line is the float32 evaluation of the
formula and its sums: a sum's rounding scales with the sum of its terms' magnitudes,
``N·mean|gh|`` for ``c2`` (layer_norm only) and ``N·mean|gh·u|`` for ``c1``, not with ``|c2|`` or ``|c1|``,
which can cancel to 0; the third the final rounding). ``dweight`` and ``dbias`` are the
float32 sums ``Σ g·xhat`` and ``Σ g``. Where the numba backend runs the call and the
input is float32 or 16-bit, the backward is one numba kernel
(:mod:`layernorm.backends._numba_recompute`): the same formula in float64, every
rounding of which is below the float32 one the bound allows for (``docs/contract.md``
§3, "memory_efficient's backward"), the sums float64 rounded once to float32; elsewhere
torch operations. Both tested against the float64 reference
(``tests/test_options.py::test_memory_efficient_dx_is_within_its_stated_bound``).

Where it applies: eager autograd, with a gradient asked for. A ``gamma`` with a zero
cannot give back ``u`` there (``0/0``), so such a call saves the input as the plain one
does (a check of the weight on the host); so do calls under ``torch.func`` transforms,
forward AD, ``torch.compile``, export and tracing, and calls without a gradient (the
values are the same either way; only what autograd keeps differs). The backward is
once differentiable: with ``create_graph=True`` its gradients carry no graph, so a
second-order gradient through it raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _op, backends, ops
from . import compiled as _compiled
from .backends.torch_ import accumulation_dtype

__all__ = [
    "MemoryEfficientNorm",
    "NormLinear",
    "applies",
    "gradients",
    "layer_norm_linear",
    "norm",
]


def applies(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether a call of the norm on these saves its output instead of its input: eager
    autograd with something that requires grad, and a gamma without zeros."""
    if not _eager_gradient(x, weight, bias):
        return False
    return weight is None or bool(weight.all())  # all() asks each for != 0 (NaN is)


def norm(
    op: str,
    x: Tensor,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    backend: str | None,
) -> Tensor:
    """The norm with apex's ``memory_efficient=True``: :class:`MemoryEfficientNorm` where
    :func:`applies`, else the plain call (the same values)."""
    if not (isinstance(x, Tensor) and applies(x, weight, bias)):
        return ops._norm(op, x, None, normalized_shape, weight, bias, eps, rms, backend)[0]
    shape = ops._normalized_shape(normalized_shape, op)
    ops._check_input("input", x, shape, op)
    w = None if weight is None else ops._param("weight", weight, shape, x, op)
    b = None if bias is None else ops._param("bias", bias, shape, x, op)
    eps = ops._check_eps(_op.default_eps(x.dtype) if eps is None else eps)
    name = "" if backend is None else ops._check_backend(backend)
    y, _ = MemoryEfficientNorm.apply(x, weight, bias, w, b, eps, rms, name, shape)
    return y


class MemoryEfficientNorm(torch.autograd.Function):
    """``(y, rstd)`` of the op on ``x``'s rows, saving ``y``, the parameters and ``rstd``
    (not ``x``); the backward recovers the core from ``y`` (module docstring). ``weight``
    and ``bias`` are the caller's (their gradients take their shapes), ``w`` and ``b``
    the same as kernel arguments ((N,), contiguous). Eager autograd only (:func:`applies`),
    so ``forward`` takes the context itself: a ``setup_context`` would cost an
    ``inspect.signature`` per call."""

    @staticmethod
    def forward(ctx, x, weight, bias, w, b, eps, rms, backend, shape):  # type: ignore[override]
        rows = _op.rows(x, math.prod(shape))
        # the kernel directly where no mechanism would see the op (as ops._enter does
        # for plain inference): the same kernel, without the dispatcher's ~20 µs
        direct = (
            ops.FAST_PATHS
            and not torch._C._is_any_autocast_enabled()
            and _op.direct_call(rows, w, b)
        )
        run = _op.forward if direct else _op.forward_call
        y_rows, _, _, rstd = run(rows, None, w, b, eps, rms, backend)
        y = y_rows.view(x.shape)
        ctx.save_for_backward(y, w, b, rstd)
        ctx.rms = rms
        ctx.shapes = (x.shape, shape)
        ctx.dtypes = (
            None if weight is None else weight.dtype,
            None if bias is None else bias.dtype,
        )
        ctx.mark_non_differentiable(rstd)
        # the backward in numba (backends._numba_recompute) where numba runs the forward
        ctx.kernel = _kernel_backward(y, math.prod(shape), backend)
        return y, rstd

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, _drstd):  # type: ignore[override]
        y, w, b, rstd = ctx.saved_tensors
        x_shape, p_shape = ctx.shapes
        n = math.prod(p_shape)
        need = ctx.needs_input_grad
        if ctx.kernel and _op.direct_call(dy):
            from .backends import _numba_recompute

            dx, dweight, dbias = _numba_recompute.backward(
                _op.rows(dy, n), y.view(-1, n), w, b, rstd, ctx.rms,
                need[1], need[2] and b is not None,
            )  # fmt: skip
            dx = dx if need[0] else None
        else:
            dx, dweight, dbias = gradients(
                dy, y, w, b, rstd, n, ctx.rms, need[0], need[1], need[2] and b is not None
            )
        return (
            None if dx is None else dx.view(x_shape),
            None if dweight is None else dweight.reshape(p_shape).to(ctx.dtypes[0]),
            None if dbias is None else dbias.reshape(p_shape).to(ctx.dtypes[1]),
            None, None, None, None, None, None,
        )  # fmt: skip


def gradients(
    dy: Tensor,
    y: Tensor,
    w: Tensor | None,
    b: Tensor | None,
    rstd: Tensor,
    n: int,
    rms: bool,
    need_dx: bool,
    need_dweight: bool,
    need_dbias: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The memory-efficient backward by torch operations (module docstring), in the
    accumulation dtype: ``dx`` in ``y``'s shape and dtype, ``dweight`` and ``dbias``
    ``(n,)`` in the accumulation dtype (None where not needed). ``y``: the saved output,
    rows of ``n``; ``w``, ``b``: ``(n,)`` or None; ``rstd``: one per row. What
    :class:`MemoryEfficientNorm` runs where the numba kernel does not, and the compiled
    front door's node (``MemoryEfficientBackward``) where its entry does not."""
    acc = accumulation_dtype(y.dtype)
    g = dy.reshape(-1, n).to(acc)
    xhat = y.reshape(-1, n).to(acc)
    if b is not None:
        xhat = xhat - b.to(acc)
    gh = g
    if w is not None:
        gamma = w.to(acc)
        xhat = xhat / gamma
        gh = g * gamma
    r = rstd.to(acc).reshape(-1, 1)
    dx = dweight = dbias = None
    if need_dx:
        c1 = (gh * xhat).mean(-1, keepdim=True)
        c2 = 0.0 if rms else gh.mean(-1, keepdim=True)
        dx = (r * (gh - c2 - xhat * c1)).to(y.dtype).reshape(y.shape)
    if need_dweight:
        dweight = (g * xhat).sum(0)
    if need_dbias:
        dbias = g.sum(0)
    return dx, dweight, dbias


def _kernel_backward(y: Tensor, n: int, backend: str) -> bool:
    """Whether :class:`MemoryEfficientNorm`'s backward of ``y`` (rows of ``n``) runs the
    numba kernel (``backends._numba_recompute``: the same formula in float64, within
    the same bound): the fast paths on, the numba backend chosen for ``y`` (``backend``
    "" the automatic choice) and a ``y`` it takes; else the torch operations."""
    if not ops.FAST_PATHS or y.numel() == 0 or backends.choose(y, backend or None) != "numba":
        return False
    from .backends import _numba_recompute

    return _numba_recompute.runs(y, n)


# ---------------------------------------------------------------------------------------
# norm + linear


def layer_norm_linear(
    input: Tensor,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    linear_weight: Tensor,
    linear_bias: Tensor | None = None,
    eps: float | None = None,
    *,
    rms: bool = False,
    backend: str | None = None,
) -> Tensor:
    r"""``F.linear(norm(input), linear_weight, linear_bias)`` with the norm's output
    recomputed in the backward instead of saved (flash-attn's ``layer_norm_linear_fn``).

    ``norm`` is :func:`layernorm.layer_norm` (``rms=False``) or :func:`layernorm.rms_norm`
    (``rms=True``; ``bias`` must be ``None``). Autograd keeps ``input``, the norm's
    parameters, its ``mean`` and ``rstd`` (one value a row) and ``linear_weight``, not the
    norm's output ``y`` (the size of ``input``); the backward runs the norm's backward
    kernel on ``dy = dout · linear_weight`` and computes ``y`` again for
    ``linear_weight``'s gradient, the same bits (the kernels are deterministic and batch
    invariant), so the values and gradients are those of the unfused composition
    ``F.linear(layer_norm(...), ...)``: the output and the norm's gradients bit for bit,
    the linear's up to the summation order of its backward
    (``tests/test_options.py::test_layer_norm_linear_is_the_composition``).

    Where the saving does not apply (no gradient, ``torch.func`` transforms, forward AD,
    ``torch.compile``, export, tracing) the call is the composition itself. The backward
    is once differentiable.

    Args:
        input: ``(*, *normalized_shape)``; the linear acts on its last dim.
        normalized_shape, weight, bias, backend: the norm's, as in
            :func:`layernorm.layer_norm`.
        eps: the norm's. Default: ``None``, the norm's default (``1e-5`` for layer norm,
            the machine epsilon rule of :func:`layernorm.rms_norm`).
        linear_weight: ``(out_features, in_features)``. linear_bias: ``(out_features,)``.
            Default: ``None``.
        rms: RMSNorm instead of layer norm. Default: ``False``.

    Returns:
        ``(*, out_features)``.
    """
    op = "rms_norm" if rms else "layer_norm"
    if rms and bias is not None:
        raise ValueError("layer_norm_linear: rms=True takes no bias")
    if eps is None and not rms:
        eps = 1e-5
    if ops.FAST_PATHS and isinstance(input, Tensor) and not torch.compiler.is_compiling():
        # the call in C++ (compiled.norm_linear: with a gradient a node of its own, without
        # one the composition), where it takes it
        out = _compiled.norm_linear(input, normalized_shape, weight, bias, linear_weight,
                                    linear_bias, eps, rms, backend)  # fmt: skip
        if out is not None:
            return out
    tensors = (input, weight, bias, linear_weight, linear_bias)
    if not isinstance(input, Tensor) or not _eager_gradient(*tensors):
        y = ops._norm(op, input, None, normalized_shape, weight, bias, eps, rms, backend)[0]
        return torch.nn.functional.linear(y, linear_weight, linear_bias)
    shape = ops._normalized_shape(normalized_shape, op)
    ops._check_input("input", input, shape, op)
    w = None if weight is None else ops._param("weight", weight, shape, input, op)
    b = None if bias is None else ops._param("bias", bias, shape, input, op)
    eps = ops._check_eps(_op.default_eps(input.dtype) if eps is None else eps)
    name = "" if backend is None else ops._check_backend(backend)
    return NormLinear.apply(input, weight, bias, linear_weight, linear_bias, w, b,
                            (shape, eps, rms, name))  # fmt: skip


def _eager_gradient(*tensors: object) -> bool:
    """Whether eager autograd records a call on ``tensors`` that no other mechanism sees
    (``_op.records_gradient``, ``_op.unseen``): elsewhere the plain call or composition
    runs."""
    plain = tuple(t for t in tensors if isinstance(t, Tensor))
    return _op.records_gradient(*plain) and _op.unseen(*plain)


class NormLinear(torch.autograd.Function):
    """The norm's kernel, then ``F.linear``; autograd keeps the norm's input rows, its
    parameters, ``mean`` and ``rstd`` (one each a row) and ``linear_weight``, not ``y``.
    The backward computes ``dy = dout · linear_weight`` and calls the norm's backward
    kernel on it (the op's, as the plain call's autograd does: the same bits), and
    recomputes ``y`` (the same bits again: the kernels are deterministic and batch
    invariant) only for ``linear_weight``'s gradient. ``weight`` and ``bias`` are the
    caller's (their gradients take their shapes and dtypes), ``w`` and ``b`` the same as
    kernel arguments ((N,), contiguous). Eager autograd only (:func:`_eager_gradient`),
    so ``forward`` takes the context itself, as :class:`MemoryEfficientNorm`'s does."""

    @staticmethod
    def forward(ctx, x, weight, bias, linear_weight, linear_bias, w, b, config):  # type: ignore[override]
        shape, eps, rms, backend = config
        rows = _op.rows(x, math.prod(shape))
        # the kernel directly where no mechanism would see the op (as MemoryEfficientNorm)
        ctx.direct = (
            ops.FAST_PATHS
            and not torch._C._is_any_autocast_enabled()
            and _op.direct_call(rows, w, b)
        )
        run = _op.forward if ctx.direct else _op.forward_call
        y_rows, _, mean, rstd = run(rows, None, w, b, eps, rms, backend)
        ctx.save_for_backward(rows, w, b, linear_weight, mean, rstd)
        ctx.config = config
        ctx.has_linear_bias = linear_bias is not None
        ctx.dtypes = (
            None if weight is None else weight.dtype,
            None if bias is None else bias.dtype,
        )
        ctx.x_shape = x.shape
        return torch.nn.functional.linear(y_rows.view(x.shape), linear_weight, linear_bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):  # type: ignore[override]
        rows, w, b, linear_weight, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        needs = (need[0], need[1], need[2], need[3], need[4] and ctx.has_linear_bias)
        dx, dweight, dbias, dlinear_weight, dlinear_bias = norm_linear_gradients(
            dout, rows, w, b, linear_weight, mean, rstd, ctx.x_shape, ctx.config,
            ctx.direct, needs,
        )  # fmt: skip
        if dweight is not None:
            dweight = dweight.to(ctx.dtypes[0])
        if dbias is not None:
            dbias = dbias.to(ctx.dtypes[1])
        return dx, dweight, dbias, dlinear_weight, dlinear_bias, None, None, None


def norm_linear_gradients(
    dout: Tensor,
    rows: Tensor,
    w: Tensor | None,
    b: Tensor | None,
    linear_weight: Tensor,
    mean: Tensor | None,
    rstd: Tensor,
    x_shape: Sequence[int],
    config: tuple[Sequence[int], float, bool, str],
    direct: bool,
    needs: tuple[bool, bool, bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """The backward of :class:`NormLinear` (and of the compiled front door's node where
    its kernels do not run it): ``(dx, dweight, dbias, dlinear_weight, dlinear_bias)``,
    None where ``needs`` (those five) says not. ``rows``: the norm's input as (M, N) rows
    of ``x_shape``; ``w``, ``b``: the norm's parameters as kernel arguments; ``mean``,
    ``rstd``: its statistics; ``config``: ``(normalized_shape, eps, rms, backend)``;
    ``direct``: the kernels may be called without the op. ``dweight`` and ``dbias`` in
    the normalized shape and the kernel's dtype. ``dy = dout · linear_weight`` goes to the
    norm's backward kernel (the op's: a batched gradient meets its vmap rule); ``y`` is
    computed again (the same bits) only for ``linear_weight``'s gradient."""
    shape, eps, rms, backend = config
    d2 = dout.reshape(-1, linear_weight.shape[0])
    dlinear_weight = dlinear_bias = None
    if needs[3]:  # y again, for linear_weight's gradient only
        run = _op.forward if direct else _op.forward_call
        y_rows = run(rows, None, w, b, eps, rms, backend)[0]
        y = y_rows.view(tuple(x_shape)).reshape(d2.shape[0], linear_weight.shape[1])
        dlinear_weight = d2.t().mm(y)
    if needs[4]:
        dlinear_bias = d2.sum(0)
    need_dweight = w is not None and needs[1]
    need_dbias = b is not None and needs[2]
    dx = dweight = dbias = None
    if needs[0] or need_dweight or need_dbias:
        dy = _op.rows(dout.matmul(linear_weight.to(dout.dtype)), rows.shape[1])
        run_backward = _op._backward_impl if direct and _op.direct_call(dy) else _op.backward_call
        if mean is None:  # (rms_norm: the schema's empty tensor)
            mean = rstd.new_empty(0)
        dz, dw, db = run_backward(
            dy, rows, w, mean, rstd, None, rms, need_dweight, need_dbias, backend, eps
        )
        dx = dz.view(tuple(x_shape)) if needs[0] else None
        dweight = dw.reshape(tuple(shape)) if need_dweight else None
        dbias = db.reshape(tuple(shape)) if need_dbias else None
    return dx, dweight, dbias, dlinear_weight, dlinear_bias
