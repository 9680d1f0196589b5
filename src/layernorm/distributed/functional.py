"""The public functions of :mod:`layernorm.distributed`: layer norm and RMSNorm of a
tensor whose last normalized dim is sharded across the ranks of a group, or of a DTensor.

A plain tensor is this rank's shard, and the ranks exchange per-row statistics
(:mod:`._exchange`); a DTensor is planned by its placements (:mod:`.dtensor`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._collectives import ProcessGroup
from ._exchange import exchange_norm
from .dtensor import dtensor_norm, is_dtensor

__all__ = ["layer_norm", "rms_norm"]

ShapeLike = int | Sequence[int] | torch.Size


def layer_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    group: ProcessGroup | None = None,
) -> Tensor:
    r"""Layer norm of rows whose last normalized dim is split across the ranks of ``group``.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    with ``E`` and ``Var`` over the full row, although this rank holds only its slice:
    the ranks exchange three floats per row forward (Chan et al.'s combination of
    corrected two-pass partials) and two backward. The result is this rank's slice of
    the unsharded :func:`layernorm.layer_norm`. A collective: every rank of ``group``
    must call it, with the same leading shape, dtype, ``normalized_shape`` and ``eps``;
    otherwise every rank raises the same :class:`ValueError` (none hangs).

    Args:
        input: this rank's shard, shape ``(*, *normalized_shape[:-1], w_r)``, where the
            widths ``w_r`` of the ranks (in rank order) sum to ``normalized_shape[-1]``.
        normalized_shape: the full, unsharded normalized shape.
        weight: this rank's slice of ``gamma``, shape ``(*normalized_shape[:-1], w_r)``.
            Default: ``None``.
        bias: this rank's slice of ``beta``, same shape as ``weight``. Default: ``None``.
        eps: added to the variance inside the square root, ``>= 0``. Default: ``1e-5``.
        group: the process group over which the dim is sharded. Default: ``None``, the
            default group.

    Returns:
        this rank's slice of the output, shaped like ``input``, of its dtype.

    Shape:
        - Input: ``(*, *normalized_shape[:-1], w_r)``
        - Output: same as input

    Example::

        >>> # torchrun --nproc-per-node 2; each rank holds half of the hidden dim
        >>> x = torch.randn(8, 1024)
        >>> w = 512
        >>> rank = torch.distributed.get_rank()
        >>> y = layernorm.distributed.layer_norm(x[:, rank * w : (rank + 1) * w], 1024)
        >>> torch.testing.assert_close(y, layernorm.layer_norm(x, 1024)[:, rank * w : (rank + 1) * w])
    """
    if is_dtensor(input):
        return dtensor_norm("layer_norm", input, normalized_shape, weight, bias, eps, False)
    return exchange_norm("layer_norm", input, normalized_shape, weight, bias, eps, False, group)


def rms_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    group: ProcessGroup | None = None,
) -> Tensor:
    r"""RMSNorm of rows whose last normalized dim is split across the ranks of ``group``.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \odot \gamma

    The ranks exchange one float per row forward (the partial ``Σ x²``) and one backward.

    Args:
        input: this rank's shard, shape ``(*, *normalized_shape[:-1], w_r)``.
        normalized_shape: the full, unsharded normalized shape.
        weight: this rank's slice of ``gamma``. Default: ``None``.
        eps: added inside the square root. Default: ``None``, ``torch.finfo(input.dtype).eps``.
        group: the process group. Default: ``None``, the default group.

    Returns:
        this rank's slice of the output, shaped like ``input``.

    Shape:
        - Input: ``(*, *normalized_shape[:-1], w_r)``
        - Output: same as input
    """
    if is_dtensor(input):
        return dtensor_norm("rms_norm", input, normalized_shape, weight, None, eps, True)
    return exchange_norm("rms_norm", input, normalized_shape, weight, None, eps, True, group)
