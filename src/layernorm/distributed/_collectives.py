"""The few collectives the distributed ops use, and the cross-rank agreement check.

Every collective here is an ``all_gather`` (never an unordered ``all_reduce``), so each
rank receives every rank's bits and combines them in rank order: results are bitwise
identical on every rank and from run to run for a fixed world size.

A collective whose tensor sizes differ across ranks hangs or corrupts memory, and an
exception raised on one rank alone leaves the others waiting in their next collective.
So before any data moves, :func:`agree` exchanges a small fixed-size header of shape
metadata (plus a flag for a local validation failure); when the ranks disagree, every
rank raises the same exception with the same message.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

# (a torch built without distributed support has neither; group_info then says so)
if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
else:
    ProcessGroup = getattr(dist, "ProcessGroup", object)
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_flat: Callable[..., Any] | None = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)

#: dtypes by code in the header (a dtype not listed gets code 0, still compared).
_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LEAD_SLOTS = 8  # leading dims sent one by one; further ones are folded into the last slot
_SHAPE_SLOTS = 4  # normalized_shape dims sent one by one, the same way


class ShardMismatchError(ValueError):
    """The ranks of a group called a distributed op with shards that do not fit together."""


def group_info(group: ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (``None``: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "layernorm.distributed needs an initialized process group: call "
            "torch.distributed.init_process_group first (or use layernorm.layer_norm)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def gather(t: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-gathers ``t`` (same shape on every rank) into a ``(world, *t.shape)`` tensor."""
    world = dist.get_world_size(group)
    out = t.new_empty(world * t.numel())
    if t.numel() > 0:
        # every caller has passed group_info, so torch.distributed is available and has it
        assert _all_gather_flat is not None
        _all_gather_flat(out, t.contiguous().view(-1), group=group)
    return out.view(world, *t.shape)


def ordered_sum(parts: Tensor) -> Tensor:
    """Sums the ranks' parts ``(world, ...)`` (from :func:`gather`) in rank order, in float64.

    The one reduction of this package: every rank adds the same bits in the same order,
    so every rank gets the same sum, run after run, whatever the transport does. Adding
    in float64 rounds each part's contribution far below its own dtype's precision, so
    the caller rounds the result once, to whatever dtype it needs.

    Returns:
        the float64 sum over the first dim, of shape ``parts.shape[1:]``.
    """
    total = parts[0].double()
    for r in range(1, parts.shape[0]):
        total = total + parts[r].double()
    return total


def _slots(dims: tuple[int, ...], k: int) -> list[int]:
    dims = tuple(dims)
    if len(dims) > k:
        dims = (*dims[: k - 1], math.prod(dims[k - 1 :]))
    return [*dims, *([-1] * (k - len(dims)))]


def _eps_bits(eps: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(eps)))[0]


def _dtype_code(dtype: torch.dtype | None) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 0


def agree(
    op: str,
    group: ProcessGroup | None,
    device: torch.device,
    *,
    rms: bool,
    lead: tuple[int, ...],
    normalized_shape: tuple[int, ...],
    width: int,
    dtype: torch.dtype | None,
    eps: float,
    error: Exception | None,
) -> list[int]:
    """Checks with every rank of ``group`` that their shards fit together; returns the widths.

    Each rank sends one small int64 header: its local validation result, the op, dtype,
    eps, leading shape, normalized_shape and its shard width (the local size of the last
    normalized dim). Every rank then applies the same rules to the same headers, so all
    of them raise the same exception (or none does): no rank is left waiting in a
    collective its peers never reach.

    Args:
        op: the public name, for messages.
        group: the process group. ``None`` is the default group.
        device: where the header lives (the input's device; NCCL needs CUDA tensors).
        rms: RMSNorm (exchanges one statistic per row) or layer norm (three).
        lead: this rank's leading shape (all dims before the normalized ones).
        normalized_shape: the full (unsharded) normalized shape this rank was given.
        width: this rank's local size of the last normalized dim.
        dtype: the input's dtype.
        eps: the eps this rank was given.
        error: this rank's local validation failure, or ``None``.

    Returns:
        the shard width of every rank, in rank order.

    Raises:
        ShardMismatchError: on every rank, when the shards do not fit together.
        the first failing rank's exception type: on every rank, when a rank's own
        arguments failed validation (``error``).
    """
    _, world = group_info(group)
    header = [
        int(error is not None),
        int(rms),
        _dtype_code(dtype),
        _eps_bits(eps),
        width,
        len(lead),
        *_slots(lead, _LEAD_SLOTS),
        len(normalized_shape),
        *_slots(normalized_shape, _SHAPE_SLOTS),
    ]
    headers = gather(torch.tensor(header, dtype=torch.int64, device=device), group).tolist()

    failed = [r for r in range(world) if headers[r][0]]
    if failed:
        # Only on the error path: the messages themselves travel as pickled objects.
        reports: list[tuple[type, str] | None] = [None] * world
        local = None if error is None else (type(error), str(error))
        dist.all_gather_object(reports, local, group=group)
        kind = reports[failed[0]][0]  # type: ignore[index]
        lines = "; ".join(f"rank {r}: {reports[r][1]}" for r in failed)  # type: ignore[index]
        raise kind(f"{op}: invalid arguments on rank(s) {failed} of {world}: {lines}") from error

    widths = [h[4] for h in headers]
    shapes = [_describe(h) for h in headers]
    described = ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
    problems = []
    if len({h[1] for h in headers}) > 1:
        problems.append("the ranks called different ops (layer_norm vs rms_norm)")
    if len({h[2] for h in headers}) > 1:
        problems.append("the input dtypes differ")
    if len({h[3] for h in headers}) > 1:
        problems.append("eps differs")
    if len({tuple(h[5 : 6 + _LEAD_SLOTS]) for h in headers}) > 1:
        problems.append("the leading (row) dims differ")
    if len({tuple(h[6 + _LEAD_SLOTS :]) for h in headers}) > 1:
        problems.append("normalized_shape differs")
    elif sum(widths) != normalized_shape[-1]:
        problems.append(
            f"the shard widths {widths} sum to {sum(widths)}, not to "
            f"normalized_shape[-1] = {normalized_shape[-1]}"
        )
    if problems:
        raise ShardMismatchError(
            f"{op}: the shards of the {world} ranks do not fit together: "
            f"{'; '.join(problems)} (local inputs: {described})"
        )
    return widths


def _describe(h: list[int]) -> str:
    lead = [d for d in h[6 : 6 + _LEAD_SLOTS] if d >= 0][: h[5]]
    shape = [d for d in h[7 + _LEAD_SLOTS :] if d >= 0][: h[6 + _LEAD_SLOTS]]
    dtype = _DTYPES[h[2]] if 0 < h[2] < len(_DTYPES) else "other"
    eps = struct.unpack("<d", struct.pack("<q", h[3]))[0]
    local = [*lead, *shape[:-1], h[4]]
    return f"{local} of {str(dtype).removeprefix('torch.')} (normalized_shape={shape}, eps={eps:g})"
