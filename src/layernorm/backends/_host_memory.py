"""Reused host memory for large CPU outputs: a small caching allocator.

A fresh large CPU tensor is a fresh ``mmap``: Linux hands it over as zero pages and
clears each one on its first write, so a kernel writing a new 128 MiB output pays for
clearing 128 MiB before it writes a byte, which costs about as much as the normalization
itself. torch's own CPU allocator asks the system each time (glibc
returns blocks above 32 MiB to the system at once); its CUDA allocator caches, and this
module does the same for the numba backend's outputs.

Blocks of at least :data:`MIN_BYTES` are rounded up to a 2 MiB multiple and, when the last
tensor viewing one dies, kept for a later request instead of being unmapped. A request
takes the smallest idle block that fits and is at most :data:`SLACK` times its size, so
inputs whose length varies a little from call to call (sequence lengths) still reuse. At
most :func:`limit` bytes sit idle in the cache (default: 1 GiB or 1/8 of physical memory,
whichever is smaller; ``LAYERNORM_HOST_CACHE_MB`` overrides it, ``0`` turns caching off):
to keep a newly freed block, the least recently freed ones are released first (a model's
shapes change rarely, and the newest are the likeliest to be asked for again). Memory in
use is never capped: the cache only keeps what would otherwise be freed.
:func:`empty_cache` releases everything idle now. Reused memory is uninitialized, exactly
like ``torch.empty``'s.

Blocks come from NumPy (``np.empty``), which advises Linux to back them with transparent
huge pages, and start on a 64-byte cache line. Thread-safe; a block returns to the cache
from whichever thread drops the last reference to it.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

__all__ = ["MIN_BYTES", "cached_bytes", "empty", "empty_cache", "limit"]

#: smaller requests go to ``torch.empty`` directly. torch's CPU allocator is glibc's
#: ``malloc``, which keeps freed blocks below 32 MiB (its largest adaptive mmap threshold)
#: in its heap once one such block has been freed, so those come back without page
#: clearing and without this cache's Python bookkeeping (benchmarks/RESULTS.md, "Host
#: cache").
MIN_BYTES = 32 << 20
#: a request may take an idle block up to this many times its (rounded) size
SLACK = 1.5
_GRANULE = 2 << 20  # size classes: multiples of a huge page
#: blocks start on a cache line, as torch's own allocations do (NumPy's large arrays start
#: 16 bytes in, so every other 32-byte vector store would straddle two lines)
_ALIGNMENT = 64


_lock = threading.RLock()
_idle: OrderedDict[int, np.ndarray] = OrderedDict()  # token -> block nobody uses, oldest first
_tokens: dict[int, list[int]] = {}  # size class -> its idle blocks' tokens, newest last
_counter = itertools.count()
_idle_bytes = 0
_limit: int | None = None


def _after_fork_in_child() -> None:
    """A forked child starts with an empty cache and a fresh lock: another thread of the
    parent may have held the lock, mid-update, at the fork."""
    global _lock, _idle_bytes
    _lock = threading.RLock()
    _idle.clear()
    _tokens.clear()
    _idle_bytes = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def limit() -> int:
    """How many idle bytes the cache may hold (``LAYERNORM_HOST_CACHE_MB``, read once)."""
    global _limit
    if _limit is None:
        setting = os.environ.get("LAYERNORM_HOST_CACHE_MB")
        if setting is not None:
            try:
                megabytes = float(setting)
            except ValueError:
                raise ValueError(
                    f"LAYERNORM_HOST_CACHE_MB must be a number of megabytes, got {setting!r}"
                ) from None
            if not megabytes >= 0:
                raise ValueError(f"LAYERNORM_HOST_CACHE_MB must be >= 0, got {setting!r}")
            _limit = int(megabytes * (1 << 20))
        else:
            try:
                physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):  # not POSIX
                physical = 8 << 30
            _limit = min(1 << 30, physical // 8)
    return _limit


def cached_bytes() -> int:
    """Bytes held idle in the cache right now."""
    return _idle_bytes


def empty_cache() -> None:
    """Releases every idle cached block to the system (blocks in use are unaffected)."""
    global _idle_bytes
    with _lock:
        _idle.clear()
        _tokens.clear()
        _idle_bytes = 0


def _release(block: np.ndarray) -> None:
    """Called when the last view of ``block`` dies: keep it, making room by releasing the
    least recently freed blocks, unless it alone exceeds the limit."""
    global _idle_bytes
    with _lock:
        if block.nbytes > limit():
            return
        while _idle_bytes + block.nbytes > limit():
            token, old = _idle.popitem(last=False)
            _tokens[old.nbytes].remove(token)
            _idle_bytes -= old.nbytes
        token = next(_counter)
        _idle[token] = block
        _tokens.setdefault(block.nbytes, []).append(token)
        _idle_bytes += block.nbytes


def _take(size: int) -> np.ndarray:
    """The smallest idle block of ``size`` to ``SLACK * size`` bytes (the most recently
    freed of that size), else a new one of ``size`` bytes."""
    global _idle_bytes
    with _lock:
        if _tokens.get(size):  # the usual case: a block of this very size came back
            have = size
        else:
            fits = [h for h, tokens in _tokens.items() if tokens and size <= h <= SLACK * size]
            if not fits:
                return _aligned(size)
            have = min(fits)
        _idle_bytes -= have
        return _idle.pop(_tokens[have].pop())


def _aligned(size: int) -> np.ndarray:
    """A new block of ``size`` bytes starting on a :data:`_ALIGNMENT` boundary (a view
    into a slightly larger array, which it keeps alive)."""
    owner = np.empty(size + _ALIGNMENT, np.uint8)
    start = -owner.ctypes.data % _ALIGNMENT
    return owner[start : start + size]


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """``dtype``'s NumPy twin, or None (bfloat16 has none)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor, from the cache when it is large."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or limit() == 0:
        return torch.empty(shape, dtype=dtype)
    block = _take(-(-nbytes // _GRANULE) * _GRANULE)
    array = block[:nbytes]
    twin = _numpy_dtype(dtype)
    if twin is None:
        tensor = torch.frombuffer(array, dtype=dtype).view(shape)
    else:  # a NumPy view is cheaper than torch's ``.view(dtype).view(shape)``
        array = array.view(twin).reshape(shape)
        tensor = torch.from_numpy(array)
    # ``array`` is the object the tensor's storage keeps alive (its base is ``block``: a
    # NumPy view of a view points at the owner, so the finalizer goes on this last one);
    # when it dies, the block goes back to the cache.
    weakref.finalize(array, _release, block).atexit = False
    return tensor
