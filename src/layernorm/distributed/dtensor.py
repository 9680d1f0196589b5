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

Why not a sharding rule for the ``layernorm::forward`` custom op instead?
:func:`torch.distributed.tensor.experimental.register_sharding` (torch 2.13) only
declares which input placements an op accepts and what placements its outputs get;
DTensor then redistributes the inputs and runs the op *unchanged on each local
shard*. A rule cannot put a collective inside the op, and normalizing a shard of a row
needs the statistics of the whole row, so for ``Shard(last)`` the only valid rule is
"redistribute to ``Replicate()``", which is the gather this module avoids. The rows
sharded and replicated cases are registered as rules (see
:func:`register_row_sharding`), so ``layernorm.layer_norm`` itself works on DTensors
sharded on rows.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["is_dtensor", "sharded_norm"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _plan(x, k: int):
    """Placements to run with, and the mesh dim (or None) that shards the last dim."""
    from torch.distributed.tensor import Replicate, Shard

    first, last = x.ndim - k, x.ndim - 1
    placements, tp_dim = [], None
    for i, p in enumerate(x.placements):
        if type(p) is Shard and p.dim % x.ndim < first:
            placements.append(p)
        elif type(p) is Shard and p.dim % x.ndim == last and tp_dim is None:
            placements.append(Shard(last))
            tp_dim = i
        else:
            placements.append(p if isinstance(p, Replicate) else Replicate())
    return placements, tp_dim


def _local_param(p, x, placements: Sequence, tp_dim: int | None, k: int):
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


def sharded_norm(
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

    from .. import ops
    from .functional import _sharded

    shape = ops._normalized_shape(normalized_shape)
    if tuple(x.shape[x.ndim - len(shape) :]) != shape or x.ndim < len(shape):
        raise ValueError(
            f"Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {list(x.shape)}"
        )
    placements, tp_dim = _plan(x, len(shape))
    if list(placements) != list(x.placements):
        x = x.redistribute(x.device_mesh, placements)
    local = x.to_local()
    w = _local_param(weight, x, placements, tp_dim, len(shape))
    b = _local_param(bias, x, placements, tp_dim, len(shape))
    if tp_dim is None:  # whole rows on every rank
        y = (
            ops.rms_norm(local, shape, w, eps)
            if rms
            else ops.layer_norm(local, shape, w, b, 1e-5 if eps is None else eps)
        )
    else:
        group = x.device_mesh.get_group(tp_dim)
        y = _sharded(op, local, shape, w, b, eps, rms, group)
    return DTensor.from_local(
        y, x.device_mesh, placements, run_check=False, shape=x.shape, stride=x.stride()
    )
