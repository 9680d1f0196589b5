r"""Layer norm and RMSNorm of rows whose last normalized dim is sharded across ranks.

Each rank holds a contiguous slice of the last dim of ``normalized_shape`` (any widths,
uneven or zero, in rank order), so no rank sees a whole row. Instead of gathering the
rows, the ranks exchange per-row statistics.

**Forward (layer norm).** Rank ``r`` holds ``n_r`` elements of each row. It computes, in
the accumulation dtype (float32, or float64 for float64 input), the corrected two-pass
of docs/contract.md §3 on its part: ``m1_r = mean(z)``, ``d = z - m1_r``,
``delta_r = mean(d)``, ``M2_r = ‖d - delta_r‖²``, so its local mean is the unrounded pair
``m1_r + delta_r``.
The ranks all-gather ``(m1, delta, M2)`` (three floats per row) and every rank combines
them in rank order, in float64, with the parallel form of the two-pass (Chan, Golub and
LeVeque 1979), relative to a pivot ``P`` (rank 0's ``m1``) so the offset of the rows
never enters the arithmetic:

.. math::
    o_r = (m1_r - P) + \delta_r, \qquad
    n_{ab} = n_a + n_b, \quad \Delta = o_b - o_a, \quad
    o_{ab} = o_a + \Delta \frac{n_b}{n_{ab}}, \quad
    M2_{ab} = M2_a + M2_b + \Delta^2 \frac{n_a n_b}{n_{ab}}

then ``mean = P + o``, ``rstd = (M2 / N + eps)^(-1/2)``, and each rank centres its part
by ``u = (d - s_r) * rstd`` with the small shift ``s_r = (P - m1_r) + o``. Every term is
a difference of nearby values, so the error does not grow with the rows' offset
(docs/contract.md §3), and a constant row gives ``o_r`` equal on every rank, hence
``Δ = 0``, ``M2 = 0``, ``s_r = d`` and output exactly ``beta``. Never
``E[z²] - E[z]²``.

**Backward.** ``dz = rstd * (gh - c2 - u * c1)`` needs two row means over the whole row,
``c1 = mean(gh * u)`` and ``c2 = mean(gh)``: the ranks all-gather their two partial sums
per row and add them in rank order (:func:`._collectives.ordered_sum`). ``dweight`` and ``dbias`` are the local column sums:
each rank owns its slice of ``gamma`` and ``beta``.

**RMSNorm** exchanges one partial sum per row forward (``Σ z²``) and one backward
(``Σ gh * u``).

Before any of this, the ranks exchange their shapes (:func:`._collectives.agree`), so
inconsistent shards raise the same error on every rank instead of hanging. All
exchanges are ``all_gather`` followed by a fixed-order combine, so results are bitwise
identical run to run (and on every rank) for a fixed world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backends.torch_ import accumulation_dtype, column_sum, row_sum
from ..ops import _normalized_shape
from ._collectives import ProcessGroup, agree, gather, ordered_sum

__all__ = ["exchange_norm", "prepare", "sharded_backward", "sharded_forward"]

ShapeLike = int | Sequence[int] | torch.Size


# ---------------------------------------------------------------------------------------
# Validation (local, then across ranks)


def _local_error(
    op: str,
    x: Tensor,
    shape: tuple[int, ...],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Exception | None:
    """This rank's own argument errors, returned (not raised) so every rank can hear of them."""
    if not isinstance(x, Tensor):
        return TypeError(f"{op}: expected input to be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        return TypeError(f"{op} expects a floating-point input, got input of dtype {x.dtype}")
    k = len(shape)
    if x.dim() < k or tuple(x.shape[x.dim() - k : -1]) != shape[:-1]:
        return ValueError(
            f"Given normalized_shape={list(shape)} sharded on its last dim, expected input with "
            f"shape [*, {', '.join(map(str, shape[:-1]))}{', ' if k > 1 else ''}<shard>], but "
            f"got input of size {list(x.shape)}"
        )
    local = (*shape[:-1], x.shape[-1])
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, Tensor) or not p.is_floating_point():
            return TypeError(f"{op}: expected {name} to be a floating-point tensor or None")
        if tuple(p.shape) != local:
            return ValueError(
                f"Expected {name} shard of shape {list(local)} (normalized_shape with this "
                f"rank's shard width), but got {name} of shape {list(p.shape)}"
            )
        if p.device != x.device:
            return RuntimeError(
                f"Expected all tensors to be on the same device, but got input on {x.device} "
                f"and {name} on {p.device}"
            )
    if not eps >= 0:
        return ValueError(f"eps must be non-negative, got eps={eps}")
    return None


def prepare(
    op: str,
    x: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    group: ProcessGroup | None,
) -> tuple[tuple[int, ...], float, list[int]]:
    """Validates this rank's arguments and agrees on the shards with every rank.

    Returns:
        ``(normalized_shape, eps, widths)``: the shape as a tuple, ``eps`` as a float
        (``None`` becomes ``finfo(x.dtype).eps``) and every rank's shard width.

    Raises:
        the same exception on every rank (see :func:`._collectives.agree`).
    """
    is_tensor = isinstance(x, Tensor)
    if eps is None:
        eps = torch.finfo(x.dtype).eps if is_tensor and x.is_floating_point() else 0.0
    eps = float(eps)
    error: Exception | None
    try:  # an error on one rank alone must reach the others too
        shape = _normalized_shape(normalized_shape, op)
    except (TypeError, ValueError) as bad_shape:
        shape, error = (0,), bad_shape
    else:
        error = _local_error(op, x, shape, weight, bias, eps)
    ok = error is None
    widths = agree(
        op,
        group,
        x.device if is_tensor else torch.device("cpu"),
        rms=rms,
        lead=tuple(x.shape[: x.dim() - len(shape)]) if ok else (),
        normalized_shape=shape,
        width=x.shape[-1] if ok else 0,
        dtype=x.dtype if is_tensor else None,
        eps=eps,
        error=error,
    )
    return shape, eps, widths


# ---------------------------------------------------------------------------------------
# The statistics and their combination


def _local_moments(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``m1``, ``d = z - m1`` and the stacked ``(m1, delta, M2)`` of the local part of each row."""
    m, n = z.shape
    if n == 0:
        return z.new_zeros(m), z, z.new_zeros((3, m))
    m1 = row_sum(z) / n
    d = z - m1[:, None]
    delta = row_sum(d) / n
    c = d - delta[:, None]
    return m1, d, torch.stack([m1, delta, row_sum(c.square_())])


def _combine(stats: Tensor, counts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Chan et al.'s pairwise combination of ``(m1, delta, M2)`` per rank, in rank order.

    Args:
        stats: ``(world, 3, M)`` gathered statistics.
        counts: elements per row on each rank.

    Returns:
        ``(pivot, o, M2)`` in float64, each ``(M,)``: the row mean is ``pivot + o``.
    """
    ranks = [r for r, n in enumerate(counts) if n > 0]
    first = ranks[0]
    s = stats.double()
    pivot = s[first, 0]
    n_a, o_a, m2_a = counts[first], (s[first, 0] - pivot) + s[first, 1], s[first, 2]
    for r in ranks[1:]:
        n_b = counts[r]
        o_b = (s[r, 0] - pivot) + s[r, 1]
        n_ab = n_a + n_b
        step = o_b - o_a  # exactly 0 when both parts have the same mean: o_a stays exact
        o_a = o_a + step * (n_b / n_ab)
        m2_a = m2_a + s[r, 2] + step * step * (n_a * n_b / n_ab)
        n_a = n_ab
    return pivot, o_a, m2_a


def _affine_(u: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """``u * weight + bias``, overwriting the temporary ``u`` where it can."""
    if weight is not None and bias is not None:
        return torch.addcmul(bias.to(u.dtype), u, weight.to(u.dtype))
    if weight is not None:
        return u.mul_(weight.to(u.dtype))
    return u if bias is None else u.add_(bias.to(u.dtype))


def sharded_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    counts: list[int],
    group: ProcessGroup | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """The forward on ``(M, n_local)`` rows, without autograd.

    Args:
        x: this rank's ``(M, n_local)`` rows.
        weight, bias: this rank's ``(n_local,)`` slices, or ``None``.
        eps: added to the variance.
        rms: RMSNorm instead of layer norm.
        counts: elements per row on every rank (from :func:`._collectives.agree`).
        group: the process group.

    Returns:
        ``(y, m1, shift, rstd)``: ``y`` in ``x``'s dtype; the core is
        ``u = ((x - m1) - shift) * rstd`` (``m1``, ``shift`` are ``None`` for RMSNorm:
        ``u = x * rstd``), all ``(M,)`` in the accumulation dtype. The row mean is
        ``m1 + shift`` (rounding that sum loses the offset-independence).
    """
    acc = accumulation_dtype(x.dtype)
    z = x.to(acc)
    total = sum(counts)
    if rms:
        ss = ordered_sum(gather(row_sum(z * z), group))
        rstd = torch.rsqrt(ss / total + eps).to(acc)
        m1 = shift = None
        u = z * rstd[:, None]
    else:
        m1, d, stats = _local_moments(z)
        pivot, o, m2 = _combine(gather(stats, group), counts)
        rstd = torch.rsqrt(m2 / total + eps).to(acc)
        shift = ((pivot - m1.double()) + o).to(acc)
        u = d.sub_(shift[:, None]).mul_(rstd[:, None])  # d is a temporary: reuse it
    return _affine_(u, weight, bias).to(x.dtype), m1, shift, rstd


def sharded_backward(
    dy: Tensor,
    u: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    rms: bool,
    total: int,
    group: ProcessGroup | None,
    need_dweight: bool,
    need_dbias: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The backward on ``(M, n_local)`` rows, without autograd: exchanges ``Σ gh·u`` and ``Σ gh``.

    Args:
        dy: the upstream gradient of this rank's rows.
        u: the core (in the accumulation dtype), recomputed by the caller.
        weight: this rank's slice of ``gamma``, or ``None``.
        rstd: ``(M,)``, from the forward.
        rms: RMSNorm (exchanges only ``Σ gh·u``).
        total: elements per full row.
        group: the process group.
        need_dweight, need_dbias: compute the local column sums.

    Returns:
        ``(dx, dweight, dbias)`` in the accumulation dtype (``None`` where not needed).
    """
    acc = rstd.dtype
    g = dy.to(acc)  # may be dy itself: never written to
    gh = g.clone() if weight is None else g * weight.to(acc)  # a temporary, updated in place
    if rms:
        c1 = (ordered_sum(gather(row_sum(gh * u), group)) / total).to(acc)
        dx = gh.addcmul_(u, c1[:, None], value=-1).mul_(rstd[:, None])
    else:
        sums = ordered_sum(gather(torch.stack([row_sum(gh * u), row_sum(gh)]), group))
        c1, c2 = (sums / total).to(acc)
        dx = gh.sub_(c2[:, None]).addcmul_(u, c1[:, None], value=-1).mul_(rstd[:, None])
    dweight = column_sum(g * u) if need_dweight else None
    dbias = column_sum(g) if need_dbias else None
    return dx, dweight, dbias


# ---------------------------------------------------------------------------------------
# Autograd


class _ShardedRowsNormFunction(torch.autograd.Function):
    """Autograd of the sharded norm on ``(M, n_local)`` rows."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        eps: float,
        rms: bool,
        counts: list[int],
        group: ProcessGroup | None,
    ) -> Tensor:
        y, m1, shift, rstd = sharded_forward(x, weight, bias, eps, rms, counts, group)
        ctx.save_for_backward(x, weight, m1, shift, rstd)
        ctx.rms, ctx.total, ctx.group = rms, sum(counts), group
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):
        x, weight, m1, shift, rstd = ctx.saved_tensors
        z = x.to(rstd.dtype)
        # the forward's operations in the forward's order: the same u, bit for bit
        u = z * rstd[:, None] if ctx.rms else ((z - m1[:, None]) - shift[:, None]) * rstd[:, None]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx, dweight, dbias = sharded_backward(
            dy, u, weight, rstd, ctx.rms, ctx.total, ctx.group, need_w, need_b
        )
        return (
            dx.to(x.dtype) if need_x else None,
            None if dweight is None else dweight.to(weight.dtype),
            None if dbias is None else dbias.to(ctx.bias_dtype),
            None,
            None,
            None,
            None,
        )


def exchange_norm(
    op: str,
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    rms: bool,
    group: ProcessGroup | None,
) -> Tensor:
    """Layer norm (or RMSNorm) of this rank's shard ``input`` by statistics exchange.

    The differentiable core of :func:`layernorm.distributed.layer_norm` and ``rms_norm``
    for a plain tensor; a collective over ``group``. ``eps=None`` means
    ``finfo(input.dtype).eps``.
    """
    shape, eps, widths = prepare(op, input, normalized_shape, weight, bias, eps, rms, group)
    if sum(widths) == 0:  # empty rows on every rank: nothing to normalize or exchange
        return input.clone()
    inner = math.prod(shape[:-1])
    n = inner * input.shape[-1]
    m = input.numel() // n if n else math.prod(input.shape[: input.dim() - len(shape)])
    rows = input.reshape(m, n)
    flat = [None if p is None else p.reshape(n) for p in (weight, bias)]
    y = _ShardedRowsNormFunction.apply(rows, *flat, eps, rms, [inner * w for w in widths], group)
    return y.view(input.shape)
