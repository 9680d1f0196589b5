"""``layernorm.fused_norm``: flash-attn's fused block, dropout, rowscale, a second input
and a second weight set, the residual add and the norm, on every backend
(docs/contract.md §2, "fused_norm"; the dropout-add's definition:
:mod:`layernorm.backends._dropout_add`).

The eager call with dropout or ``x1`` (tensors of ``x``'s dtype, none of the other
options) goes whole to the C++ front door (:mod:`layernorm.compiled`'s ``fused``), which
runs the steps below in C++, with their bits and gradients (its autograd node calls
:func:`gradients` where it does not compute them itself); every other call takes them in
Python.

Data flow: checks (all before any work) → the dropout-add ``h`` (the custom op
``layernorm::dropout_add``, one rounding into ``residual_dtype``) → the norm of ``h``
through the public :func:`layernorm.layer_norm` / :func:`layernorm.rms_norm` with their
options, once per weight set, so ``y`` and ``y1`` are correctly rounded from ``h`` and
every mechanism those functions have applies to them.

The dropout-add op has a fake kernel, an autograd formula (the masks regenerated from
the seed, never stored), a double-backward (its backward is linear: its own transpose
is the dropout-add again) and a vmap rule (the op once per sample: each sample is a call
of its own, with its own rows ``0..M-1``, so every sample gets the mask a call on it
alone would get). Forward AD and the ``torch.func`` transforms go through
:class:`TransformDropoutAdd`, an ``autograd.Function`` with a ``jvp`` (a custom op
cannot carry one; contract §6). The seed is a 0-dim int64 tensor argument of the op, so
a graph recorded by ``torch.jit.trace`` or ``torch.export`` draws a new seed per call
when the call drew one (``seed=None``), as torch's dropout does.
"""

from __future__ import annotations

import importlib
import math
import numbers
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _op, backends, ops
from . import compiled as _compiled
from . import options as _options
from .backends import _dropout_add, _philox

__all__ = ["FusedNorm", "dropout_add_op", "fused_norm"]


class FusedNorm(NamedTuple):
    """What :func:`fused_norm` returns (None for an output not asked for)."""

    #: ``norm(h)·weight + bias``, rounded once to ``out_dtype``
    y: Tensor
    #: ``norm(h)·weight1 + bias1`` (None without ``weight1``)
    y1: Tensor | None
    #: ``h``, the dropout-add in ``residual_dtype`` (None when ``h`` would be ``x`` itself)
    residual_out: Tensor | None
    #: ``x``'s keep mask, bool, ``x``'s shape (when ``return_dropout_mask``)
    dropout_mask: Tensor | None
    #: ``x1``'s keep mask (when ``return_dropout_mask`` and ``x1`` is given)
    dropout_mask1: Tensor | None


# ---------------------------------------------------------------------------------------
# Implementations of the dropout-add: every one gives the torch version's bits.

#: the backend modules with a dropout-add of their own (``dropout_add``,
#: ``dropout_add_backward``, ``cannot_run(x0) -> str | None``); the others use torch's
_KERNEL_MODULES = {
    "numba": "layernorm.backends._numba_dropout",
    "triton": "layernorm.backends._triton_dropout",
}


def _implementation(x0: Tensor, backend: str) -> ModuleType:
    """The dropout-add of ``backend`` ("" the automatic choice, as the norm's) where it
    has one that can run ``x0``, else torch's (the same bits, by definition)."""
    if x0.numel() == 0:
        return _dropout_add
    name = backends.choose(x0, backend or None)
    module_name = _KERNEL_MODULES.get(name)
    if module_name is None:
        return _dropout_add
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:  # not built (yet): torch's has the same bits
        if error.name != module_name:
            raise
        return _dropout_add
    cannot_run = getattr(module, "cannot_run", None)
    if cannot_run is not None and cannot_run(x0) is not None:
        return _dropout_add
    return module


def _dropout_add_impl(
    x0: Tensor,
    x1: Tensor | None,
    residual: Tensor | None,
    rowscale: Tensor | None,
    seed: Tensor,
    p: float,
    rdtype: torch.dtype,
    want_masks: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    h, mask0, mask1 = _implementation(x0, backend).dropout_add(
        x0, x1, residual, rowscale, int(seed.item()), p, rdtype, want_masks
    )

    def empty() -> Tensor:  # (one per output: outputs may not alias)
        return torch.empty(0, dtype=torch.bool, device=x0.device)

    return h, empty() if mask0 is None else mask0, empty() if mask1 is None else mask1


def _dropout_add_backward_impl(
    dh: Tensor,
    rowscale: Tensor | None,
    seed: Tensor,
    p: float,
    x0_dtype: torch.dtype,
    x1_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    dx0, dx1, dresidual = _implementation(dh, backend).dropout_add_backward(
        dh, rowscale, int(seed.item()), p, x0_dtype, x1_dtype, residual_dtype
    )
    return (
        dx0,
        dh.new_empty(0) if dx1 is None else dx1,
        dh.new_empty(0) if dresidual is None else dresidual,
    )


#: ``layernorm::dropout_add``: ``(h, mask0, mask1)``, an absent mask empty (its schema
#: has no optional outputs)
dropout_add_op = torch.library.custom_op("layernorm::dropout_add", mutates_args=())(
    _dropout_add_impl
)
#: ``layernorm::dropout_add_backward``: ``(dx0, dx1, dresidual)``, an absent one empty
dropout_add_backward_op = torch.library.custom_op(
    "layernorm::dropout_add_backward", mutates_args=()
)(_dropout_add_backward_impl)


@dropout_add_op.register_fake
def _(x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend):
    mask_shape = x0.shape if want_masks else (0,)
    return (
        x0.new_empty(x0.shape, dtype=rdtype),
        x0.new_empty(mask_shape, dtype=torch.bool),
        x0.new_empty(mask_shape if x1 is not None else (0,), dtype=torch.bool),
    )


@dropout_add_backward_op.register_fake
def _(dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend):
    return (
        dh.new_empty(dh.shape, dtype=x0_dtype),
        dh.new_empty(dh.shape if x1_dtype is not None else (0,), dtype=x1_dtype or dh.dtype),
        dh.new_empty(
            dh.shape if residual_dtype is not None else (0,), dtype=residual_dtype or dh.dtype
        ),
    )


def _setup_context(ctx, inputs, output) -> None:
    x0, x1, residual, rowscale, seed, p, _rdtype, _want, backend = inputs
    ctx.save_for_backward(rowscale, seed)
    ctx.p = p
    ctx.backend = backend
    ctx.x0_dtype = x0.dtype
    ctx.x1_dtype = None if x1 is None else x1.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.mark_non_differentiable(output[1], output[2])


def gradients(
    dh: Tensor,
    rowscale: Tensor | None,
    seed: Tensor,
    p: float,
    backend: str,
    x0_dtype: torch.dtype,
    x1_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The dropout-add's backward: ``(dx0, dx1, dresidual)`` of the inputs' dtypes (None
    for an absent ``x1`` or residual), the formula of every autograd of the op (its own,
    :class:`EagerDropoutAdd`'s, the compiled front door's node where it hands a call back)."""
    # dresidual = RN(dh) is dh itself in dh's dtype: passed on as torch's add does (no
    # copy), unless a double backward is recorded (create_graph: the grad mode is on),
    # whose d(dh) must be the one rounding of the backward op's transpose.
    passed = residual_dtype == dh.dtype and not torch.is_grad_enabled()
    if (
        p == 0.0
        and rowscale is None
        and not torch.is_grad_enabled()
        and {x0_dtype, x1_dtype, residual_dtype} <= {dh.dtype, None}
    ):  # every element kept with s = 1: dx0 = RN(dh), dx1 = RN(dh) are dh too
        return (dh, None if x1_dtype is None else dh, None if residual_dtype is None else dh)
    dx0, dx1, dresidual = dropout_add_backward(
        dh.contiguous(), rowscale, seed, p, x0_dtype, x1_dtype,
        None if passed else residual_dtype, backend,
    )  # fmt: skip
    if passed:
        dresidual = dh
    return (
        dx0,
        None if x1_dtype is None else dx1,
        None if residual_dtype is None else dresidual,
    )


def _backward(ctx, dh, _dmask0=None, _dmask1=None):
    rowscale, seed = ctx.saved_tensors
    grads = gradients(
        dh, rowscale, seed, ctx.p, ctx.backend, ctx.x0_dtype, ctx.x1_dtype, ctx.residual_dtype
    )
    return (*grads, None, None, None, None, None, None)


dropout_add_op.register_autograd(_backward, setup_context=_setup_context)


def _backward_setup_context(ctx, inputs, output) -> None:
    dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend = inputs
    ctx.save_for_backward(rowscale, seed)
    ctx.p, ctx.backend, ctx.dh_dtype, ctx.shape = p, backend, dh.dtype, dh.shape
    ctx.x0_dtype, ctx.x1_dtype, ctx.residual_dtype = x0_dtype, x1_dtype, residual_dtype


def _backward_backward(ctx, ddx0, ddx1, ddresidual):
    # The backward is linear in dh, and its transpose is the dropout-add itself:
    # d(dh) = ddx0·k0·s·rs + ddx1·k1·s + ddresidual, rounded once to dh's dtype.
    rowscale, seed = ctx.saved_tensors
    present1 = ctx.x1_dtype is not None and ddx1 is not None and ddx1.numel() > 0
    presentr = ctx.residual_dtype is not None and ddresidual is not None and ddresidual.numel() > 0
    if ddx0 is None:
        ddx0 = torch.zeros(ctx.shape, dtype=ctx.x0_dtype, device=seed.device)
    ddh, _, _ = dropout_add(
        ddx0.contiguous(),
        ddx1.contiguous() if present1 else None,
        ddresidual.contiguous() if presentr else None,
        rowscale, seed, ctx.p, ctx.dh_dtype, False, ctx.backend,
    )  # fmt: skip
    return ddh, None, None, None, None, None, None, None


dropout_add_backward_op.register_autograd(_backward_backward, setup_context=_backward_setup_context)


def _vmap_per_sample(op, info, in_dims, args, n_tensors):
    """The op once per sample (a sample is a call of its own: its rows are ``0..M-1``)."""
    fronted = [
        a if d is None else a.movedim(d, 0)
        for a, d in zip(args[:n_tensors], in_dims[:n_tensors], strict=True)
    ]
    per_sample = []
    for i in range(info.batch_size):
        tensors = [a if d is None else a[i] for a, d in zip(fronted, in_dims, strict=False)]
        per_sample.append(op(*tensors, *args[n_tensors:]))
    outputs = tuple(torch.stack([s[k] for s in per_sample]) for k in range(3))
    return outputs, (0, 0, 0)


@dropout_add_op.register_vmap
def _(info, in_dims, x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend):
    args = (x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend)
    return _vmap_per_sample(dropout_add_op, info, in_dims, args, 5)


@dropout_add_backward_op.register_vmap
def _(info, in_dims, dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend):
    args = (dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend)
    return _vmap_per_sample(dropout_add_backward_op, info, in_dims, args, 3)


class TransformDropoutAdd(torch.autograd.Function):
    """The op's autograd as an ``autograd.Function``, for forward AD (its ``jvp``: the
    dropout-add is linear, so ``h_t`` is the dropout-add of the tangents, rounded once to
    ``h``'s dtype) and ``torch.func`` (its ``vmap``: the op's rule)."""

    @staticmethod
    def forward(x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend):
        return dropout_add_op(x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        ctx.rdtype = inputs[6]
        ctx.shape = inputs[0].shape
        # (saved for the jvp, which cannot read saved_tensors)
        ctx.save_for_forward(inputs[3], inputs[4])

    @staticmethod
    def backward(ctx, dh, dmask0, dmask1):
        return _backward(ctx, dh, dmask0, dmask1)

    @staticmethod
    def jvp(ctx, x0_t, x1_t, residual_t, _rowscale_t, *_):
        rowscale, seed = ctx.saved_tensors
        if x0_t is None:
            x0_t = torch.zeros(ctx.shape, dtype=ctx.x0_dtype, device=seed.device)
        h_t, _, _ = dropout_add(
            x0_t.contiguous(),
            None if x1_t is None or ctx.x1_dtype is None else x1_t.contiguous(),
            None if residual_t is None or ctx.residual_dtype is None else residual_t.contiguous(),
            rowscale, seed, ctx.p, ctx.rdtype, False, ctx.backend,
        )  # fmt: skip
        return h_t, None, None

    @staticmethod
    def vmap(info, in_dims, x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend):
        args = (x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend)
        return _vmap_per_sample(TransformDropoutAdd.apply, info, in_dims, args, 5)


def dropout_add(
    x0: Tensor,
    x1: Tensor | None,
    residual: Tensor | None,
    rowscale: Tensor | None,
    seed: Tensor,
    p: float,
    rdtype: torch.dtype,
    want_masks: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The dropout-add op on ``(M, N)`` rows, through :class:`TransformDropoutAdd` where a
    forward-AD level or a ``torch.func`` transform is active (contract §6); its
    implementation called directly where no mechanism would see the op (:func:`_direct`:
    the op's dispatch costs ~20 µs a call)."""
    if torch.compiler.is_compiling():
        return dropout_add_op(x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend)
    if _op.transformed():
        return TransformDropoutAdd.apply(
            x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend
        )
    args = (x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend)
    if _direct(x0, x1, residual, rowscale, seed):
        if _op.records_gradient(x0, x1, residual):
            return EagerDropoutAdd.apply(*args)
        return _dropout_add_impl(*args)
    return dropout_add_op(*args)


def _direct(*tensors: Tensor | None) -> bool:
    """Whether the op may be skipped for its implementation (no gradient asked for) or
    :class:`EagerDropoutAdd` (one asked for), as ``ops._enter`` calls a norm kernel
    directly: the fast paths on (``ops.FAST_PATHS``) and no mechanism that would see the
    call (``_op.unseen``)."""
    return ops.FAST_PATHS and _op.unseen(*tensors)


class EagerDropoutAdd(torch.autograd.Function):
    """The op's autograd without the op, for eager training calls that no mechanism sees
    (:func:`_direct`): the implementation forward, the op's backward formula
    (:func:`_backward`, whose backward call is direct too unless ``create_graph`` records
    a double backward: then the backward op, with its own autograd). The op's dispatch
    costs tens of µs a call each way."""

    @staticmethod
    def forward(ctx, x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend):
        output = _dropout_add_impl(x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend)
        _setup_context(
            ctx, (x0, x1, residual, rowscale, seed, p, rdtype, want_masks, backend), output
        )
        return output

    @staticmethod
    def backward(ctx, dh, dmask0, dmask1):
        return _backward(ctx, dh, dmask0, dmask1)


class TransformDropoutAddBackward(torch.autograd.Function):
    """The backward op's autograd as an ``autograd.Function``, for the backward of
    :class:`TransformDropoutAdd` under ``torch.func`` (a custom op's registered autograd
    does not run under functorch): its backward is the dropout-add (the transpose), its
    ``jvp`` the backward of the tangent (it is linear)."""

    @staticmethod
    def forward(dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend):
        return dropout_add_backward_op(
            dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        _backward_setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[1], inputs[2])

    @staticmethod
    def backward(ctx, ddx0, ddx1, ddresidual):
        return _backward_backward(ctx, ddx0, ddx1, ddresidual)

    @staticmethod
    def jvp(ctx, dh_t, *_):
        rowscale, seed = ctx.saved_tensors
        return dropout_add_backward(
            dh_t.contiguous(), rowscale, seed, ctx.p, ctx.x0_dtype, ctx.x1_dtype,
            ctx.residual_dtype, ctx.backend,
        )  # fmt: skip

    @staticmethod
    def vmap(info, in_dims, dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend):
        args = (dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend)
        return _vmap_per_sample(TransformDropoutAddBackward.apply, info, in_dims, args, 3)


def dropout_add_backward(
    dh: Tensor,
    rowscale: Tensor | None,
    seed: Tensor,
    p: float,
    x0_dtype: torch.dtype,
    x1_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward op, through :class:`TransformDropoutAddBackward` where a forward-AD
    level or a ``torch.func`` transform is active."""
    args = (dh, rowscale, seed, p, x0_dtype, x1_dtype, residual_dtype, backend)
    if torch.compiler.is_compiling():
        return dropout_add_backward_op(*args)
    if _op.transformed():
        return TransformDropoutAddBackward.apply(*args)
    if _direct(dh, rowscale, seed) and not _op.records_gradient(dh):
        return _dropout_add_backward_impl(*args)
    return dropout_add_backward_op(*args)


# ---------------------------------------------------------------------------------------
# fused_norm


def _seed_tensor(seed: int | None, generator: torch.Generator | None) -> Tensor:
    """The seed as the op takes it: a 0-dim int64 CPU tensor (a seed in
    ``[2^63, 2^64 - 1]`` as its two's complement, the same Philox key); ``None`` draws one
    by contract §7's seed rule (one ``torch.randint`` of ``generator``, by default torch's
    default CPU generator)."""
    if seed is None:
        device = torch.device("cpu") if generator is None else generator.device
        draw = torch.randint(
            _philox.SEED_DRAW_HIGH, (), dtype=torch.int64, generator=generator, device=device
        )
        return draw.cpu()
    _philox.seed_key(seed)  # the checks
    seed = int(seed)
    return torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64)


def _check_same(name: str, t: Tensor | None, x: Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"fused_norm: expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"fused_norm expects a floating-point {name}, got {t.dtype}")
    if t.shape != x.shape:
        raise ops.NormalizedShapeError(
            f"fused_norm: {name} must have the input's shape {list(x.shape)}, got {list(t.shape)}"
        )
    ops._check_device(name, t, x)


def _check_param(name: str, t: Tensor | None, shape: tuple[int, ...], x: Tensor) -> None:
    if t is not None:
        ops._param(name, t, shape, x, "fused_norm")


def _check_dtype(name: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"fused_norm: {name} must be a floating dtype, got {dtype}")


def fused_norm(
    x: Tensor,
    normalized_shape: ops.ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float | None = None,
    *,
    rms: bool = False,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    residual_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    offset: float = 0.0,
    return_dropout_mask: bool = False,
    backend: str | None = None,
) -> FusedNorm:
    r"""flash-attn's fused block: ``h = dropout(x)·rowscale + dropout(x1) + residual``,
    rounded once, then its layer norm or RMSNorm with one or two weight sets.

    For the rows ``r`` (flattened leading dims) and columns ``c`` (flattened
    ``normalized_shape``, ``N`` of them)::

        h[r, c] = RN_rdtype(k0·s·x[r,c]·rowscale[r] + k1·s·x1[r,c] + residual[r,c])

    the exact value rounded once (:mod:`layernorm.backends._dropout_add`: ``k0``, ``k1``
    independent keep masks of docs/contract.md §7 from the seed, ``s = 1/(1 - p)``);
    ``y = norm(h)·weight + bias`` and ``y1 = norm(h)·weight1 + bias1``, each correctly
    rounded to ``out_dtype`` from ``h`` (the public :func:`layernorm.layer_norm` /
    :func:`layernorm.rms_norm` on ``h``, with ``offset`` and ``out_dtype``). Without
    ``x1``, dropout or rowscale, and ``h`` in a dtype as wide as ``x``'s or wider, ``h``
    is ``x`` widened (exactly: ``x.to(residual_dtype)``), or with a ``residual`` (in
    ``h``'s dtype) the call is :func:`layernorm.add_layer_norm` /
    :func:`layernorm.add_rms_norm` (the same ``y`` and ``h``; one kernel pass), whose
    backward rounds ``dx = dresidual`` once from the exact sum of the norm's gradient
    and ``residual_out``'s, where the general composition rounds the norm's ``dx`` and
    then the sum.

    Args:
        x: input, shape ``(*, *normalized_shape)``, a floating dtype.
        normalized_shape: the trailing dims that form one row.
        weight, bias: the norm's gain and bias (``normalized_shape``). ``rms=True`` takes
            no bias (ValueError: ``y`` would be rounded twice).
        eps: ``None``: layer norm's ``1e-5``; RMSNorm's machine epsilon of ``x``'s
            accumulation dtype (the rule of :func:`layernorm.rms_norm`).
        rms: RMSNorm instead of layer norm.
        residual: added to ``h``; ``x``'s shape, any floating dtype.
        x1: a second input, dropped out with its own mask (not rowscaled); ``x``'s shape.
        weight1, bias1: a second weight set: ``y1`` (``bias1`` needs ``weight1``).
        dropout_p: the drop probability of ``x`` and ``x1``, in [0, 1].
        rowscale: ``(M,)`` (or ``x``'s leading shape), a per-row scale of ``x``'s term
            (flash-attn's drop-path), used as given; it gets no gradient (RuntimeError
            if it requires one).
        seed: the Philox seed, an int in ``[-2^63, 2^64 - 1]``; ``None`` draws one from
            ``generator`` (default torch's default CPU generator: ``torch.manual_seed``
            reproduces the masks).
        residual_dtype: ``h``'s dtype. Default: ``residual``'s dtype, else ``x``'s.
        out_dtype: ``y``'s and ``y1``'s dtype. Default: ``x``'s.
        offset: the gains are ``weight + offset`` (zero-centred weights).
        return_dropout_mask: also return the keep masks (bool, ``x``'s shape; all True at
            ``dropout_p = 0``).
        backend: as in :func:`layernorm.layer_norm`; the dropout-add runs the backend's
            own implementation where it has one, else torch's (the same bits).

    Returns:
        :class:`FusedNorm` ``(y, y1, residual_out, dropout_mask, dropout_mask1)``;
        ``residual_out`` is ``h``, or None when ``h`` would be ``x`` itself (no residual,
        no ``x1``, ``dropout_p = 0``, no rowscale and ``residual_dtype`` ``x``'s dtype).

    Raises:
        TypeError: a non-tensor or non-floating tensor or dtype, a non-int seed.
        ValueError: a shape that does not fit (``NormalizedShapeError``, also a
            RuntimeError), ``dropout_p`` outside [0, 1], a seed out of range,
            ``bias1`` without ``weight1``, ``rms`` with a bias, an unknown backend.
        RuntimeError: tensors on different devices; a rowscale that requires grad.
    """
    if ops.FAST_PATHS and not torch.compiler.is_compiling():
        done = _compiled.fused(
            x, normalized_shape, weight, bias, eps, rms, residual, x1, weight1, bias1,
            dropout_p, rowscale, seed, generator, residual_dtype, out_dtype, offset,
            return_dropout_mask, backend,
        )  # fmt: skip
        if done is not None:
            return FusedNorm(*done)
    shape = ops._normalized_shape(normalized_shape, "fused_norm")
    ops._check_input("input", x, shape, "fused_norm")
    _check_same("residual", residual, x)
    _check_same("x1", x1, x)
    for name, t in (("weight", weight), ("bias", bias), ("weight1", weight1), ("bias1", bias1)):
        _check_param(name, t, shape, x)
    if bias1 is not None and weight1 is None:
        raise ValueError("fused_norm: bias1 needs weight1 (y1 is norm(h)·weight1 + bias1)")
    if rms and (bias is not None or bias1 is not None):
        raise ValueError("fused_norm: rms=True takes no bias (RMSNorm's output has none)")
    _check_dtype("residual_dtype", residual_dtype)
    _check_dtype("out_dtype", out_dtype)
    p = _philox.check_p(dropout_p)
    if seed is not None:
        _philox.seed_key(seed)
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"fused_norm: offset must be a float, got {type(offset).__name__}")
    name = ops._check_backend(backend)
    n = math.prod(shape)
    m = x.numel() // n if n else math.prod(x.shape[: x.dim() - len(shape)])
    if rowscale is not None:
        if not isinstance(rowscale, Tensor) or not rowscale.is_floating_point():
            raise TypeError("fused_norm: rowscale must be a floating-point tensor")
        if rowscale.shape not in ((m,), x.shape[: x.dim() - len(shape)]):
            raise ops.NormalizedShapeError(
                f"fused_norm: rowscale must have shape ({m},) (one per row), got "
                f"{list(rowscale.shape)}"
            )
        ops._check_device("rowscale", rowscale, x)
        if rowscale.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "fused_norm: rowscale gets no gradient (as flash-attn's); pass rowscale.detach()"
            )
    rdtype = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    if eps is None:
        eps = ops._op.default_eps(x.dtype) if rms else ops._op.LAYER_NORM_EPS

    # No dropout, x1 or rowscale, and h in a dtype that holds x's: h is x itself, x
    # widened (exact), or x + residual, one IEEE addition as add_*'s residual_out (whose
    # kernel adds and normalizes in one pass): the dropout-add's exact sum rounded once,
    # the same bits, without its kernel
    plain = (
        x1 is None
        and p == 0.0
        and rowscale is None
        and (residual is None or residual.dtype == rdtype)
        and _options.holds(rdtype, x.dtype)
    )
    is_x = plain and residual is None and rdtype == x.dtype
    mask0 = mask1 = None
    added = None  # a residual that the norm's own call adds (add_*: h = x + residual)
    if plain:
        h = x if residual is not None else x.to(rdtype)  # (x itself for x's dtype)
        added = residual
        if return_dropout_mask:  # p = 0 keeps every element
            mask0 = torch.ones(m, n, dtype=torch.bool, device=x.device)
    else:
        if p == 0.0 and seed is None:  # every element kept, whatever the seed: no draw
            seed_t = torch.zeros((), dtype=torch.int64)  # (as torch's F.dropout, flash-attn)
        else:
            seed_t = _seed_tensor(seed, generator)
        h_rows, mask0, mask1 = dropout_add(
            x.reshape(m, n),
            None if x1 is None else x1.reshape(m, n),
            None if residual is None else residual.reshape(m, n),
            None if rowscale is None else rowscale.reshape(m),
            seed_t, p, rdtype, return_dropout_mask, name,
        )  # fmt: skip
        h = h_rows.view(x.shape)
    y, h = _norm(h, shape, weight, bias, eps, rms, offset, out_dtype or x.dtype, backend, added)
    residual_out = None if is_x else h
    y1 = None
    if weight1 is not None:
        y1 = _norm(h, shape, weight1, bias1, eps, rms, offset, out_dtype or x.dtype, backend)[0]
    if not return_dropout_mask:
        return FusedNorm(y, y1, residual_out, None, None)
    assert mask0 is not None
    return FusedNorm(
        y,
        y1,
        residual_out,
        mask0.view(x.shape),
        None if x1 is None or mask1 is None else mask1.view(x.shape),
    )


def _norm(
    h: Tensor,
    shape: tuple[int, ...],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    offset: float,
    out_dtype: torch.dtype,
    backend: str | None,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(norm(h)·weight + bias, h)``, the first in ``out_dtype``, by the public functions
    and options; ``h`` is the given one, or with ``residual``, ``h + residual`` (add_*)."""
    options: dict[str, Any] = {}
    if offset != 0.0:
        options["offset"] = float(offset)
    if out_dtype != h.dtype:
        options["out_dtype"] = out_dtype
    if residual is not None:
        if residual.dtype != h.dtype:  # the residual stream, wider
            options["residual_dtype"] = residual.dtype
        if rms:
            return ops.add_rms_norm(h, residual, shape, weight, eps, backend=backend, **options)
        return ops.add_layer_norm(
            h, residual, shape, weight, bias, eps, backend=backend, **options
        )  # fmt: skip
    if rms:
        return ops.rms_norm(h, shape, weight, eps, backend=backend, **options), h
    return ops.layer_norm(h, shape, weight, bias, eps, backend=backend, **options), h
