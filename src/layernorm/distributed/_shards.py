"""The one shard convention of :mod:`layernorm.distributed`: how a dim of ``n`` is cut.

A dim of ``n`` elements split over ``world`` ranks is cut as DTensor's ``Shard`` cuts it
(:meth:`torch.distributed.tensor.Shard._split_tensor`, which follows :func:`torch.chunk`):
contiguous parts in rank order, each of ``ceil(n / world)`` elements except the last
non-empty one, and ranks past the end of the dim get an empty part. So a
``layernorm.distributed.LayerNorm`` built with the default widths holds exactly the
slice of ``gamma`` that a DTensor of the same parameter sharded with ``Shard(-1)`` holds
on that rank, and the two can be mixed.

Every default split in this package comes from :func:`shard_sizes`; explicit widths
(any non-negative widths summing to ``n``) are accepted wherever widths are taken.
"""

from __future__ import annotations

__all__ = ["shard_sizes", "shard_start"]


def shard_sizes(n: int, world_size: int) -> list[int]:
    """The widths of the ``world_size`` parts of a dim of ``n``, as DTensor's ``Shard`` cuts it.

    Args:
        n: the size of the dim, ``>= 0``.
        world_size: the number of ranks, ``>= 1``.

    Returns:
        one width per rank, in rank order, summing to ``n``: ``ceil(n / world_size)``
        for the leading ranks, the remainder for the next, zero for the rest (as
        :func:`torch.chunk`, padded with empty parts to ``world_size``).

    Raises:
        ValueError: when ``n < 0`` or ``world_size < 1``.

    Example::

        >>> shard_sizes(10, 3)
        [4, 4, 2]
        >>> shard_sizes(5, 4)
        [2, 2, 1, 0]
    """
    if world_size < 1 or n < 0:
        raise ValueError(f"need n >= 0 and world_size >= 1, got n={n}, world_size={world_size}")
    chunk = -(-n // world_size)
    return [max(0, min(chunk, n - rank * chunk)) for rank in range(world_size)]


def shard_start(sizes: list[int], rank: int) -> int:
    """Where rank ``rank``'s part starts, given every rank's width in rank order."""
    return sum(sizes[:rank])
