"""Sequence (and data) parallelism: summing the gradients of shared ``gamma``/``beta``.

When each rank of a group holds whole rows (a slice of the sequence, as in Megatron's
sequence parallelism, or of the batch), the norm's forward is local, but ``gamma`` and
``beta`` are shared by the rows of every rank: their gradient is the sum of the ranks'
gradients. (DDP and FSDP already do this for every parameter, averaging; use these
helpers where no wrapper does it, e.g. for norm parameters replicated across a
tensor-parallel group whose ranks see different sequence positions.)

Two ways, both deterministic: the ranks all-gather their gradients and add them in
rank order (not an unordered ``all_reduce``), so every rank ends with the same bits,
run after run.

- :func:`allreduce_param_grads` after ``loss.backward()`` (one collective per dtype);
- :func:`register_grad_allreduce_hooks` once, after which each backward sums each
  parameter's gradient as it is produced (one collective per parameter, before it is
  accumulated into ``.grad``, so gradient accumulation over micro-batches stays right).

Example::

    >>> norms = norm_parameters(model)           # gamma and beta of every norm layer
    >>> loss.backward()
    >>> allreduce_param_grads(norms, group=tp_group)
    >>> optimizer.step()
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ._collectives import ProcessGroup, gather, group_info, ordered_sum

__all__ = ["allreduce_param_grads", "norm_parameters", "register_grad_allreduce_hooks"]


def _params(params: torch.nn.Module | Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    return [p for p in params if p.requires_grad]


def norm_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of every ``LayerNorm``/``RMSNorm`` in ``model`` (torch's and ours), in order."""
    norms = (torch.nn.LayerNorm, torch.nn.RMSNorm)
    return [
        p
        for m in model.modules()
        if isinstance(m, norms)
        for p in m.parameters(recurse=False)
        if p.requires_grad
    ]


def allreduce_param_grads(
    params: torch.nn.Module | Iterable[torch.nn.Parameter],
    group: ProcessGroup | None = None,
    *,
    average: bool = False,
) -> None:
    """Replaces each parameter's ``.grad`` by its sum (or mean) over the ranks of ``group``.

    A collective: every rank must call it with the same parameters in the same order.
    A parameter without a gradient on this rank counts as a zero gradient (and gets one).
    Gradients are flattened per dtype into one buffer, all-gathered, added in rank
    order in float64 and rounded once to their dtype, so the result is bitwise
    identical on every rank and run to run.

    Args:
        params: a module (all its parameters that require grad) or the parameters.
        group: the process group. Default: ``None``, the default group.
        average: divide by the group's size (DDP's convention). Default: ``False``, the
            sum, which is the gradient of a loss summed over all ranks' rows.
    """
    _, world = group_info(group)
    params = _params(params)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}  # the parameters' .grad tensors
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        grads = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        total = ordered_sum(gather(flat, group))
        if average:
            total /= world
        total = total.to(dtype)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(total[offset : offset + n].view_as(g))
            offset += n


def register_grad_allreduce_hooks(
    params: torch.nn.Module | Iterable[torch.nn.Parameter],
    group: ProcessGroup | None = None,
    *,
    average: bool = False,
) -> list[torch.utils.hooks.RemovableHandle]:
    """Makes every backward sum (or average) each parameter's gradient over ``group``.

    Each parameter gets a gradient hook that all-gathers the incoming gradient and adds
    the ranks' parts in rank order (in float64, rounded once to its dtype), before it is accumulated into ``.grad``. Every rank's
    backward must reach the same parameters in the same order (true when all ranks run
    the same model); a parameter unused on one rank but used on another would leave the
    others waiting (then use :func:`allreduce_param_grads`).

    Args:
        params: a module (all its parameters that require grad) or the parameters.
        group: the process group. Default: ``None``, the default group.
        average: divide by the group's size. Default: ``False``.

    Returns:
        the hook handles; ``handle.remove()`` undoes the registration.
    """
    _, world = group_info(group)

    def hook(grad: Tensor) -> Tensor:
        total = ordered_sum(gather(grad, group))
        return (total / world if average else total).to(grad.dtype)

    return [p.register_hook(hook) for p in _params(params)]
