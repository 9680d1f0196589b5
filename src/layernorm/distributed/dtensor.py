"""DTensor support: layer norm of a DTensor sharded on its last dim by statistics exchange.

:func:`layernorm.distributed.layer_norm` (and ``rms_norm``) accept a
:class:`torch.distributed.tensor.DTensor`. Per mesh dim, the input's placement decides:

- ``Shard(d)`` on a leading (row) dim, or ``Replicate()``: each rank holds whole rows
  along that mesh dim; nothing to exchange.
- ``Shard(last)``: the hidden dim is split over that mesh dim's process group; the ranks
  exchange per-row statistics (:mod:`.functional`) instead of gathering the rows.
- anything else (``Partial``, a shard of an earlier normalized dim, a second mesh dim
  sharding the last dim): redistributed to ``Replicate()`` first, the one case where
  data moves.

The local shard goes through ``to_local``, the sharded op, and back through
``DTensor.from_local`` with the same placements, shape and stride: all three are
differentiable, so autograd runs end to end and the gradient DTensors come back with
the input's placements (``gamma``/``beta`` gradients as ``Partial`` over mesh dims that
shard rows, then reduced by DTensor to the parameter's own placements).

**The library's own ops on DTensors.** ``import layernorm.distributed`` also registers
DTensor rules for the custom ops ``layernorm::forward`` and ``layernorm::backward``
(:func:`torch.library.register_torch_dispatch`, a public API), so
``layernorm.layer_norm``, ``layernorm.rms_norm``, ``layernorm.add_layer_norm`` and the
modules ``layernorm.LayerNorm``/``RMSNorm`` accept DTensors too, with the same plan: a
DTensor sharded on its last dim goes through the statistics exchange, one sharded on
rows runs the op on its local rows. On ``Shard(last)`` their backward recomputes the
core as ``(x - mean) * rstd`` from the op's saved ``mean`` (rounded to float32, and
without the single-process op's re-centring, which would cost one more exchange), so
at large row offsets that gradient is less accurate than the single-process op's;
:func:`layernorm.distributed.layer_norm` keeps the unrounded centering and is
offset-independent in both directions.

Why not :func:`torch.distributed.tensor.experimental.register_sharding`? A sharding rule
(torch 2.13) only declares which input placements an op accepts and which placements
its outputs get; DTensor then redistributes the inputs and runs the op *unchanged on
each local shard*. It cannot put a collective inside the op, and a shard of a row needs
the whole row's statistics, so for ``Shard(last)`` the only valid rule would be
"redistribute to ``Replicate()``": the gather this package avoids. A torch_dispatch
rule replaces the op's implementation for DTensor arguments instead, which is what the
statistics exchange needs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from .._op import backward_op, forward_op
from ..backends.torch_ import accumulation_dtype
from ..ops import _normalized_shape, layer_norm, rms_norm
from ._exchange import exchange_norm, prepare, sharded_backward, sharded_forward
from ._shards import shard_sizes, shard_start

__all__ = ["dtensor_norm", "is_dtensor", "register_op_rules"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _plan(x, k: int):
    """Placements to run with, and the mesh dim (or None) that shards the last dim."""
    from torch.distributed.tensor import Placement, Replicate, Shard

    first, last = x.ndim - k, x.ndim - 1
    placements: list[Placement] = []
    tp_dim: int | None = None
    for i, p in enumerate(x.placements):
        if type(p) is Shard and p.dim % x.ndim < first:
            placements.append(p)
        elif type(p) is Shard and p.dim % x.ndim == last and tp_dim is None:
            placements.append(Shard(last))
            tp_dim = i
        else:
            placements.append(p if isinstance(p, Replicate) else Replicate())
    return placements, tp_dim


def _local_param(p, x, placements: Sequence, tp_dim: int | None):
    """This rank's slice of ``gamma``/``beta`` for the chosen placements, differentiable."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if p is None:
        return None
    mesh = x.device_mesh
    if not isinstance(p, DTensor):  # a full parameter, the same on every rank
        p = DTensor.from_local(p, mesh, [Replicate()] * mesh.ndim, run_check=False)
    want = [Shard(p.ndim - 1) if i == tp_dim else Replicate() for i in range(mesh.ndim)]
    # The gradient of a parameter shared by the rows of several ranks is their sum.
    grads = [
        want[i] if i == tp_dim or not isinstance(pl, Shard) else Partial()
        for i, pl in enumerate(placements)
    ]
    return p.redistribute(mesh, want).to_local(grad_placements=grads)


def dtensor_norm(
    op: str,
    x,
    normalized_shape,
    weight,
    bias,
    eps: float | None,
    rms: bool,
):
    """Layer norm or RMSNorm of a DTensor ``x``; see the module docstring.

    Args:
        op: ``"layer_norm"`` or ``"rms_norm"``.
        x: a DTensor of shape ``(*, *normalized_shape)`` (global shape).
        normalized_shape: the full normalized shape.
        weight, bias: DTensors on ``x``'s mesh, full tensors (the same on every rank),
            or ``None``.
        eps: as in :func:`layernorm.distributed.layer_norm`.
        rms: RMSNorm instead of layer norm.

    Returns:
        a DTensor with ``x``'s shape and (after any redistribution) placements.
    """
    from torch.distributed.tensor import DTensor

    shape = _normalized_shape(normalized_shape, op)
    if tuple(x.shape[x.ndim - len(shape) :]) != shape or x.ndim < len(shape):
        raise ValueError(
            f"Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {list(x.shape)}"
        )
    placements, tp_dim = _plan(x, len(shape))
    if list(placements) != list(x.placements):
        x = x.redistribute(x.device_mesh, placements)
    local = x.to_local()
    w = _local_param(weight, x, placements, tp_dim)
    b = _local_param(bias, x, placements, tp_dim)
    if tp_dim is None:  # whole rows on every rank
        y = (
            rms_norm(local, shape, w, eps)
            if rms
            else layer_norm(local, shape, w, b, 1e-5 if eps is None else eps)
        )
    else:
        group = x.device_mesh.get_group(tp_dim)
        y = exchange_norm(op, local, shape, w, b, eps, rms, group)
    return DTensor.from_local(
        y, x.device_mesh, placements, run_check=False, shape=x.shape, stride=x.stride()
    )


# ---------------------------------------------------------------------------------------
# DTensor rules for the custom ops layernorm::forward and layernorm::backward


def _arguments(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _stat_placements(placements: Sequence) -> list:
    """Placements of the per-row ``mean``/``rstd`` (M,): sharded where the rows are."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(0) if type(p) is Shard and p.dim == 0 else Replicate() for p in placements]


def _wrap(t, mesh, placements, shape):
    """A DTensor of global ``shape`` (contiguous) from this rank's part ``t``."""
    from torch.distributed.tensor import DTensor, Replicate

    if t.numel() == 0 and len(shape) == 1 and shape[0] == 0:  # the ops' "absent" output
        placements = [Replicate()] * mesh.ndim
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        t, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _param_local(p, mesh, tp_dim: int | None, width: int):
    """This rank's slice of a ``(N,)`` parameter, a DTensor or a full plain tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if p is None:
        return None
    if isinstance(p, DTensor):
        want = [Shard(0) if i == tp_dim else Replicate() for i in range(mesh.ndim)]
        return p.redistribute(mesh, want).to_local()
    if tp_dim is None:
        return p
    start = shard_start(shard_sizes(p.shape[0], mesh.size(tp_dim)), mesh.get_local_rank(tp_dim))
    return p[start : start + width]


def _param_grad(local, p, mesh, placements, tp_dim: int | None):
    """The gradient of parameter ``p`` from this rank's column sums ``local``."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if p is None or local.numel() == 0:
        return local
    grad_placements = [
        Shard(0) if i == tp_dim else Partial() if isinstance(pl, Shard) else Replicate()
        for i, pl in enumerate(placements)
    ]
    grad = DTensor.from_local(
        local, mesh, grad_placements, run_check=False, shape=p.shape, stride=(1,)
    )
    if isinstance(p, DTensor):
        return grad.redistribute(mesh, p.placements)
    return grad.full_tensor()


def _local_part(t, mesh, placements):
    """This rank's part of ``t`` under ``placements``; a plain ``t`` is a full tensor
    (autograd materializes the zero gradient of an unused output as one)."""
    from torch.distributed.tensor import distribute_tensor

    if is_dtensor(t):
        return t.redistribute(mesh, placements).to_local()
    return distribute_tensor(t, mesh, placements, src_data_rank=None).to_local()


def _forward_rule(_cls, func, types, args, kwargs):
    a = _arguments(func, args, kwargs)
    x, residual = a["x"], a["residual"]
    if not is_dtensor(x) or (residual is not None and not is_dtensor(residual)):
        raise TypeError("layernorm: input and residual must both be DTensors, or neither")
    mesh, (m, n) = x.device_mesh, x.shape
    placements, tp_dim = _plan(x, 1)
    x = x.redistribute(mesh, placements)
    xl = x.to_local()
    rl = None if residual is None else residual.redistribute(mesh, placements).to_local()
    w = _param_local(a["weight"], mesh, tp_dim, xl.shape[-1])
    b = _param_local(a["bias"], mesh, tp_dim, xl.shape[-1])
    eps, rms = a["eps"], a["rms"]
    if tp_dim is None:  # whole rows: the op itself, on the local rows
        y, r_out, mean, rstd = func(xl, rl, w, b, eps, rms, a["backend"])
    else:
        group = mesh.get_group(tp_dim)
        acc = accumulation_dtype(xl.dtype)
        r_out = None if rl is None else (xl.to(acc) + rl.to(acc)).to(xl.dtype)
        z = xl if r_out is None else r_out
        op = "rms_norm" if rms else "layer_norm"
        _, _, widths = prepare(op, z, (n,), w, b, eps, rms, group)
        y, m1, shift, rstd = sharded_forward(z, w, b, eps, rms, widths, group)
        mean = rstd.new_empty(0) if rms else m1 + shift
        r_out = xl.new_empty(0) if r_out is None else r_out
    stats = _stat_placements(placements)
    return (
        _wrap(y, mesh, placements, (m, n)),
        _wrap(r_out, mesh, placements, (m, n) if r_out.numel() or rl is not None else (0,)),
        _wrap(mean, mesh, stats, (m,) if mean.numel() or not rms else (0,)),
        _wrap(rstd, mesh, stats, (m,)),
    )


def _backward_rule(_cls, func, types, args, kwargs):
    a = _arguments(func, args, kwargs)
    x, weight = a["x"], a["weight"]
    mesh, (m, n) = x.device_mesh, x.shape
    placements, tp_dim = _plan(x, 1)
    xl = x.redistribute(mesh, placements).to_local()
    dyl = _local_part(a["dy"], mesh, placements)
    dres = a["dresidual_out"]
    dres = None if dres is None else _local_part(dres, mesh, placements)
    w = _param_local(weight, mesh, tp_dim, xl.shape[-1])
    mean, rstd = a["mean"].to_local(), a["rstd"].to_local()
    rms = a["rms"]
    if tp_dim is None:
        dx, dw, db = func(
            dyl, xl, w, mean, rstd, dres, rms, a["need_dweight"], a["need_dbias"], a["backend"],
            a["eps"],
        )  # fmt: skip
    else:
        z = xl.to(rstd.dtype)
        u = z * rstd[:, None] if rms else (z - mean[:, None]) * rstd[:, None]
        dx, dw, db = sharded_backward(
            dyl, u, w, rstd, rms, n, mesh.get_group(tp_dim), a["need_dweight"], a["need_dbias"]
        )
        if dres is not None:
            dx = dx + dres.to(dx.dtype)
        dx = dx.to(xl.dtype)
        dw = rstd.new_empty(0) if dw is None else dw
        db = rstd.new_empty(0) if db is None else db
    dx = _wrap(dx, mesh, placements, (m, n)).redistribute(mesh, x.placements)
    return (
        dx,
        _param_grad(dw, weight, mesh, placements, tp_dim),
        _param_grad(db, weight, mesh, placements, tp_dim),  # beta has gamma's shape
    )


_registered = False


def register_op_rules() -> None:
    """Registers the DTensor rules of ``layernorm::forward``/``backward`` (once; idempotent)."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor import DTensor

    forward_op.register_torch_dispatch(DTensor, _forward_rule)
    backward_op.register_torch_dispatch(DTensor, _backward_rule)
    _registered = True
