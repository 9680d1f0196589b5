"""Numba backend: fused, multithreaded CPU kernels for layer norm and RMSNorm.

It follows the kernel contract of :mod:`layernorm.backends.torch_` (same arguments, same
dtypes, same SPEC §3 numerics) with one kernel per direction:

- forward: per row (``prange`` over rows), ``residual_out = x + residual`` written in the
  same pass, the corrected two-pass statistics and ``y``; the row is read once from memory,
  and a large float32 ``y`` is written with non-temporal stores (:data:`STREAM_BYTES`).
- backward: per block of ``_numba_kernels.ROW_BLOCK`` (32) rows, ``dx``
  (``+ dresidual_out``) for each row and float32 partial sums of ``g * u`` and ``g``; a
  tiny serial loop adds the block partials in block order (float64) for dweight/dbias.

Tensors reach the kernels as addresses (``data_ptr()``) and sizes, through per-dtype
entries of C-typed arguments only (:func:`entry`), which numba's dispatcher types in about
a microsecond and :mod:`layernorm.compiled` calls from C++ by their addresses
(:func:`entry_address`); inputs under :data:`SERIAL_NUMEL` elements run in
the calling thread (no parallel region to wake), larger ones over numba's threads. Both
variants run the same compiled row function, so a row's bits do not depend on which ran.

Outputs of 32 MiB or more come from :mod:`layernorm.backends._host_memory`, a cache of
freed output blocks: a fresh large tensor is a fresh ``mmap`` whose pages Linux clears on
first touch, which costs more than the normalization itself (``benchmarks/RESULTS.md``).
``layernorm.empty_cache()`` releases the idle blocks; ``LAYERNORM_HOST_CACHE_MB`` caps them.

float16 and bfloat16 are converted inside the kernels (no full-size float32 copies);
strided rows (``stride(0) != N``) are read in place. Results are bitwise identical run to
run, for a row alone or in any batch, and at any thread count (see
:mod:`layernorm.backends._numba_kernels` for why).

Threads: numba's pool, so ``numba.set_num_threads(k)`` or ``NUMBA_NUM_THREADS`` apply.

JIT cost: nothing is compiled until the first call; each dtype then compiles its forward
or backward kernel once (a few seconds) and stores it in numba's on-disk cache, which later
processes load in milliseconds. The cache lives in ``NUMBA_CACHE_DIR`` when that
environment variable is set (set it before numba is imported), else in ``__pycache__``
beside the kernels, else (read-only install) in numba's user-wide cache directory
(``~/.cache/numba`` or the platform's equivalent); with no writable place at all the
kernels still run, compiled in memory.

Automatic choice: :func:`prefers` is True for every CPU input, whatever its size (measured
against the portable torch backend, see ``benchmarks/RESULTS.md``: no crossover; numba
was faster at every size from 64 elements up, forward and backward).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from . import _host_memory

__all__ = ["SERIAL_NUMEL", "backward", "cannot_run", "entry", "entry_address", "forward", "prefers"]

#: float32 outputs of at least this many bytes are written with non-temporal (streaming)
#: stores, which skip the read-for-ownership of a plain store; smaller ones stay cached
#: for whoever reads them next. Same bits either way.
STREAM_BYTES = 16 << 20


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_kernels_module: ModuleType | None = None


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed (pip install numba)"
    return None


def cannot_run(x: torch.Tensor) -> str | None:
    if not x.is_cpu:
        return f"the numba backend runs on CPU tensors only, got a tensor on {x.device}"
    if x.dtype not in _DTYPES:
        return f"the numba backend supports float16, bfloat16, float32 and float64, got {x.dtype}"
    return None


def prefers(x: torch.Tensor) -> bool:
    return x.is_cpu


def _kernels() -> ModuleType:
    global _kernels_module
    if _kernels_module is None:
        from . import _numba_kernels

        _kernels_module = _numba_kernels
    return _kernels_module


#: the entries compiled so far, by (dtype, kernel name): see :func:`entry`
_entries: dict[tuple[torch.dtype, str], Callable[..., None]] = {}


def entry(dtype: torch.dtype, name: str) -> Callable[..., None]:
    """Kernel ``name`` (``forward_serial``, ``forward_parallel``, ``backward_serial``
    or ``backward_parallel``) for input dtype ``dtype``, on addresses, sizes and flags
    (:func:`layernorm.backends._numba_kernels.entry`); compiled on first use."""
    kernel = _entries.get((dtype, name))
    if kernel is None:
        types = _TYPES[dtype]
        kernel = _entries[dtype, name] = _kernels().entry(name, types.storage, types.acc)
    return kernel


def entry_address(dtype: torch.dtype, name: str) -> int:
    """The C address of :func:`entry` ``(dtype, name)``, for compiled callers (which
    bypass numba's dispatcher: so numba's threads are started here)."""
    import numba

    numba.get_num_threads()  # starts the threading layer once
    return _kernels().address(entry(dtype, name))


#: inputs of fewer elements run in the calling thread: below this, waking numba's threads
#: costs more than it saves (measured, benchmarks/RESULTS.md). Same bits either way.
SERIAL_NUMEL = 1 << 15


class _Types(NamedTuple):
    """What the kernels need to know of an input dtype."""

    storage: np.ndarray  # an empty array of x's storage dtype as numba sees it (16-bit
    #                      floats as their bit patterns): it carries the dtype into the kernels
    acc: np.ndarray  # the same for the accumulation dtype
    acc_dtype: torch.dtype
    itemsize: int


_F32, _F64 = np.empty(0, np.float32), np.empty(0, np.float64)
_TYPES = {
    torch.float16: _Types(np.empty(0, np.int16), _F32, torch.float32, 2),
    torch.bfloat16: _Types(np.empty(0, np.uint16), _F32, torch.float32, 2),
    torch.float32: _Types(_F32, _F32, torch.float32, 4),
    torch.float64: _Types(_F64, _F64, torch.float64, 8),
}


def _empty(like: torch.Tensor, nbytes: int) -> torch.Tensor:
    """An uninitialized contiguous output shaped like ``like``, of ``nbytes``: from the
    host cache when large (see :mod:`layernorm.backends._host_memory`: a fresh large
    tensor costs a page clear per page, more than the normalization itself), else
    ``torch.empty_like`` (contiguous for every input the kernels see: 2-D rows that are
    not dense, ``stride(0) > N``, give a contiguous result)."""
    if nbytes >= _host_memory.MIN_BYTES:
        return _host_memory.empty(like.shape, like.dtype)
    return torch.empty_like(like)


def _stride(t: torch.Tensor, n: int) -> int:
    """Row stride of a ``(*, N)`` kernel argument: row ``i`` starts ``i * stride``
    elements after ``t.data_ptr()``. Contiguous tensors of any dim have stride N; the
    others are 2-D with contiguous rows, read in place (strided and broadcast rows)."""
    return n if t.is_contiguous() else t.stride(0)


_constants: dict[tuple[int, torch.dtype, float, float], torch.Tensor] = {}


def _constant(n: int, dtype: torch.dtype, value: float) -> torch.Tensor:
    """A cached (N,) tensor full of ``value``: ones for a missing weight, ``-0.0`` for a
    missing bias or residual gradient (``v * 1 + -0.0 == v`` bitwise, so the kernels have
    no branches for absent arguments)."""
    key = (n, dtype, value, math.copysign(1.0, value))  # -0.0 == 0.0 as a dict key
    t = _constants.get(key)
    if t is None:
        if len(_constants) > 64:
            _constants.clear()
        t = _constants[key] = torch.full((n,), value, dtype=dtype)
    return t


def _param(p: torch.Tensor | None, n: int, acc: torch.dtype, default: float) -> torch.Tensor:
    """``p`` (contiguous, as the contract promises) in the accumulation dtype, or the
    default row."""
    if p is None:
        return _constant(n, acc, default)
    return p if p.dtype == acc else p.to(acc).contiguous()


def forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    # Every Python step here costs ~0.1 us, and a small call is a few us in all: the body
    # is written flat on purpose.
    n = x.shape[-1]
    numel = x.numel()
    m = numel // n
    types = _TYPES[x.dtype]
    nbytes = numel * types.itemsize
    y = _empty(x, nbytes)
    w = _param(weight, n, types.acc_dtype, 1.0)
    b = _param(bias, n, types.acc_dtype, -0.0)
    x_address = x.data_ptr()
    if stats:
        mean = None if rms else torch.empty(m, dtype=types.acc_dtype)
        rstd = torch.empty(m, dtype=types.acc_dtype)
        mean_address = x_address if mean is None else mean.data_ptr()
        rstd_address = rstd.data_ptr()
    else:  # the kernel writes no statistics: any valid address will do
        mean = rstd = None
        mean_address = rstd_address = x_address
    if residual is None:
        residual_out = None
        r_address, rs, h_address = x_address, 0, x_address
    else:
        residual_out = _empty(x, nbytes)
        r_address, rs, h_address = (
            residual.data_ptr(),
            _stride(residual, n),
            residual_out.data_ptr(),
        )
    run = entry(x.dtype, "forward_serial" if numel < SERIAL_NUMEL else "forward_parallel")
    run(
        x_address,
        _stride(x, n),
        r_address,
        rs,
        residual is not None,
        h_address,
        w.data_ptr(),
        b.data_ptr(),
        y.data_ptr(),
        mean_address,
        rstd_address,
        m,
        n,
        eps,
        rms,
        nbytes >= STREAM_BYTES,
        stats,
    )
    return y, residual_out, mean, rstd


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    rms: bool,
    need_dweight: bool,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    n = x.shape[-1]
    numel = x.numel()
    m = numel // n
    types = _TYPES[x.dtype]
    acc = types.acc_dtype
    nbytes = numel * types.itemsize
    w = _param(weight, n, acc, 1.0)
    stats_rstd = _param(rstd, m, acc, 0.0)
    stats_mean = stats_rstd if mean is None else _param(mean, m, acc, 0.0)
    dro = _constant(n, x.dtype, -0.0) if dresidual_out is None else dresidual_out
    dx = _empty(x, nbytes)
    dweight = torch.empty(n, dtype=acc) if need_dweight else None
    dbias = torch.empty(n, dtype=acc) if need_dbias else None
    run = entry(x.dtype, "backward_serial" if numel < SERIAL_NUMEL else "backward_parallel")
    run(
        dy.data_ptr(),
        _stride(dy, n),
        x.data_ptr(),
        _stride(x, n),
        dro.data_ptr(),
        0 if dresidual_out is None else _stride(dresidual_out, n),
        w.data_ptr(),
        stats_mean.data_ptr(),
        stats_rstd.data_ptr(),
        dx.data_ptr(),
        0 if dweight is None else dweight.data_ptr(),
        0 if dbias is None else dbias.data_ptr(),
        m,
        n,
        rms,
        nbytes >= STREAM_BYTES,
    )
    return dx, dweight, dbias
