"""``LayerNorm`` / ``RMSNorm`` modules that hold this rank's shard of ``gamma`` and ``beta``.

The hidden (last normalized) dim is split across the ranks of a process group in rank
order, by default as DTensor's ``Shard`` splits it (:func:`shard_sizes`, the package's
one shard convention, in :mod:`._shards`), so this rank's ``gamma`` is the local part of
the same parameter as a DTensor sharded with ``Shard(-1)``. The helpers move between a
full module's state_dict and the shards: :func:`shard_state_dict` cuts a full one (no
communication), :func:`gather_state_dict` reassembles it on every rank (a collective),
and the result loads into :class:`layernorm.LayerNorm` or :class:`torch.nn.LayerNorm` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from ._collectives import ProcessGroup, gather, group_info
from ._shards import shard_sizes, shard_start
from .functional import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "gather_state_dict", "shard_state_dict"]


_default_sizes = shard_sizes  # the constructors' argument of that name shadows it


def _check_sizes(sizes: Sequence[int], n: int, world: int) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or sum(sizes) != n or min(sizes) < 0:
        raise ValueError(
            f"shard_sizes must be {world} non-negative widths (one per rank) summing to "
            f"normalized_shape[-1] = {n}, got {sizes}"
        )
    return sizes


def shard_state_dict(
    state_dict: Mapping[str, Tensor], sizes: Sequence[int], rank: int
) -> dict[str, Tensor]:
    """Cuts rank ``rank``'s slice of the last dim out of every tensor of a full state_dict.

    Args:
        state_dict: of a full (unsharded) norm module: ``weight`` and maybe ``bias``, of
            shape ``normalized_shape``.
        sizes: the shard widths of all ranks, in rank order.
        rank: whose slice to cut.

    Returns:
        a new state_dict of contiguous copies, loadable into the sharded module of ``rank``.
    """
    n = sum(sizes)
    start = shard_start(list(sizes), rank)
    out = {}
    for key, t in state_dict.items():
        if t.dim() == 0 or t.shape[-1] != n:
            raise ValueError(
                f"shard_state_dict: {key} has shape {list(t.shape)}, but its last dim should "
                f"be the full width {n}"
            )
        out[key] = t[..., start : start + sizes[rank]].clone()
    return out


def gather_state_dict(module: _ShardedNormModule) -> dict[str, Tensor]:
    """Reassembles the full state_dict of a sharded module on every rank (a collective).

    Args:
        module: a :class:`LayerNorm` or :class:`RMSNorm` of this package; every rank of
            its group must call this.

    Returns:
        the full state_dict (``weight``, ``bias`` of shape ``normalized_shape``), the
        same on every rank.
    """
    sizes, widest = module.shard_sizes, max(module.shard_sizes)
    full = {}
    for key, t in module.state_dict().items():
        padded = t.detach().new_zeros((*t.shape[:-1], widest))
        padded[..., : t.shape[-1]] = t.detach()
        parts = gather(padded, module.group)
        full[key] = torch.cat([parts[r][..., : sizes[r]] for r in range(len(sizes))], dim=-1)
    return full


class _FullNorm(Protocol):
    """What :meth:`_ShardedNormModule.from_full` reads of a full norm module."""

    normalized_shape: int | Sequence[int]
    eps: float | None
    elementwise_affine: bool
    weight: Tensor | None
    bias: Tensor | None


class _ShardedNormModule(torch.nn.Module):
    """The base of the sharded modules: the shard geometry and this rank's parameters."""

    weight: torch.nn.Parameter | None
    bias: torch.nn.Parameter | None

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None,
        elementwise_affine: bool,
        bias: bool,
        group: ProcessGroup | None,
        shard_sizes: Sequence[int] | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape = tuple(int(s) for s in shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.group = group
        self.rank, world = group_info(group)
        n = self.normalized_shape[-1]
        self.shard_sizes = _check_sizes(
            _default_sizes(n, world) if shard_sizes is None else shard_sizes, n, world
        )
        self.offset = shard_start(self.shard_sizes, self.rank)
        local = (*self.normalized_shape[:-1], self.shard_sizes[self.rank])
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(local, **kw))
            self.bias = torch.nn.Parameter(torch.empty(local, **kw)) if bias else None
        else:
            self.weight = self.bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def shard(self, full: Tensor) -> Tensor:
        """This rank's slice of the last dim of ``full`` (a view)."""
        return full[..., self.offset : self.offset + self.shard_sizes[self.rank]]

    @classmethod
    def from_full(
        cls,
        module: torch.nn.Module,
        *,
        group: ProcessGroup | None = None,
        shard_sizes: Sequence[int] | None = None,
    ):
        """The sharded twin of a full ``torch.nn.LayerNorm``/``RMSNorm`` (or ours), on this rank."""
        # (a torch.nn.Module's attributes are typed Tensor | Module: say which ones these are)
        full = cast(_FullNorm, module)
        kwargs = {"bias": full.bias is not None} if cls is LayerNorm else {}
        ref = full.weight if full.weight is not None else None
        twin = cls(
            full.normalized_shape,
            full.eps,
            full.elementwise_affine,
            group=group,
            shard_sizes=shard_sizes,
            device=None if ref is None else ref.device,
            dtype=None if ref is None else ref.dtype,
            **kwargs,
        )
        twin.load_state_dict(shard_state_dict(module.state_dict(), twin.shard_sizes, twin.rank))
        return twin

    def extra_repr(self) -> str:
        w = self.shard_sizes[self.rank]
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine="
            f"{self.elementwise_affine}, shard=[{self.offset}:{self.offset + w}] of "
            f"{self.normalized_shape[-1]} (rank {self.rank} of {len(self.shard_sizes)})"
        )


class LayerNorm(_ShardedNormModule):
    r"""Layer norm over a hidden dim sharded across ``group``; holds this rank's ``gamma``/``beta``.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    computed by :func:`layernorm.distributed.layer_norm` (statistics exchange, no row
    gathering). Same constructor as :class:`torch.nn.LayerNorm` plus the group and the
    shard widths; ``normalized_shape`` is the full one.

    Args:
        normalized_shape: the full normalized shape; its last dim is sharded.
        eps: added to the variance inside the square root. Default: ``1e-5``.
        elementwise_affine: learn ``weight`` (ones) and ``bias`` (zeros). Default: ``True``.
        bias: learn ``bias`` when ``elementwise_affine``. Default: ``True``.
        group: the process group. Default: ``None``, the default group.
        shard_sizes: the widths of all ranks, in rank order. Default: ``None``, as
            :func:`shard_sizes`.
        device, dtype: of the parameters. Default: ``None``.

    Shape:
        - Input: ``(*, *normalized_shape[:-1], shard_sizes[rank])``
        - Output: same as input

    Example::

        >>> full = layernorm.LayerNorm(1024)
        >>> m = layernorm.distributed.LayerNorm.from_full(full)  # in each rank
        >>> y = m(m.shard(x))                                  # this rank's slice of full(x)
        >>> full.load_state_dict(gather_state_dict(m))         # and back
    """

    eps: float  # the constructor's eps is a float (RMSNorm's may be None)

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        group: ProcessGroup | None = None,
        shard_sizes: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, bias, group, shard_sizes, device, dtype
        )

    def forward(self, input: Tensor) -> Tensor:
        return layer_norm(
            input, self.normalized_shape, self.weight, self.bias, self.eps, group=self.group
        )


class RMSNorm(_ShardedNormModule):
    r"""RMSNorm over a hidden dim sharded across ``group``; holds this rank's ``gamma``.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} * \gamma

    Args:
        normalized_shape: the full normalized shape; its last dim is sharded.
        eps: added inside the square root. Default: ``None``, ``torch.finfo(x.dtype).eps``.
        elementwise_affine: learn ``weight`` (ones). Default: ``True``.
        group, shard_sizes, device, dtype: as in :class:`LayerNorm`.

    Shape:
        - Input: ``(*, *normalized_shape[:-1], shard_sizes[rank])``
        - Output: same as input
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        group: ProcessGroup | None = None,
        shard_sizes: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, False, group, shard_sizes, device, dtype
        )

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, group=self.group)
