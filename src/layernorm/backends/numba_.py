"""Numba backend: fused, multithreaded CPU kernels for layer norm and RMSNorm.

It follows the kernel contract of :mod:`layernorm.backends.torch_` (same arguments, same
dtypes, same SPEC §3 numerics) with one kernel per direction:

- forward: per row (``prange`` over rows), ``residual_out = x + residual`` written in the
  same pass, the corrected two-pass statistics and ``y``; the row is read once from memory,
  and a large float32 ``y`` is written with non-temporal stores (:data:`STREAM_BYTES`).
- backward: per block of ``_numba_kernels.ROW_BLOCK`` (32) rows, ``dx``
  (``+ dresidual_out``) for each row and float32 partial sums of ``g * u`` and ``g``; a
  tiny serial kernel adds the block partials in block order (float64) for dweight/dbias.

Outputs are allocated by NumPy and shared with torch (``torch.from_numpy``): NumPy advises
Linux to back arrays of 4 MiB or more with transparent huge pages, and a fresh large
tensor otherwise page-faults once per 4 KiB on first write, which costs more than the
normalization itself (``benchmarks/RESULTS.md``).

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

Automatic choice: :func:`prefers` is True for every CPU input of at least
:data:`MIN_NUMEL` elements (measured against the portable torch backend, see
``benchmarks/RESULTS.md``: no crossover; numba is faster from 64 elements up).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import numpy as np
import torch

__all__ = ["MIN_NUMEL", "backward", "cannot_run", "forward", "prefers"]

#: smallest M*N for which the automatic choice takes this backend. Measured against the
#: portable torch backend (benchmarks/RESULTS.md): numba was faster at every size from 64
#: elements up, forward and backward, so there is no crossover and the choice is size-blind.
MIN_NUMEL = 1
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
    if x.device.type != "cpu":
        return f"the numba backend runs on CPU tensors only, got a tensor on {x.device}"
    if x.dtype not in _DTYPES:
        return f"the numba backend supports float16, bfloat16, float32 and float64, got {x.dtype}"
    return None


def prefers(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.numel() >= MIN_NUMEL


def _kernels() -> ModuleType:
    global _kernels_module
    if _kernels_module is None:
        from . import _numba_kernels

        _kernels_module = _numba_kernels
    return _kernels_module


_NUMPY_DTYPES = {
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,  # bit patterns; viewed back as bfloat16
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized output tensor whose memory NumPy allocates.

    A fresh large CPU tensor is a fresh mmap: its first write takes one page fault per
    4 KiB page, which costs more than the kernel itself (measured: a 128 MiB output,
    ~70 ms of faults vs ~25 ms of work on 2 cores). NumPy advises Linux to back arrays of
    4 MiB or more with transparent huge pages (one fault per 2 MiB), and its allocations
    of mid-size arrays also came out cheaper than ``torch.empty``'s here (8 MiB outputs:
    ~800 vs ~1000 us per layer_norm call). Advice only: where the system says no,
    nothing changes but the speed.
    """
    t = torch.from_numpy(np.empty(shape, _NUMPY_DTYPES[dtype]))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy NumPy view of ``t``; 16-bit floats as their bit patterns."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float16:
        return t.numpy().view(np.int16)
    return t.numpy()


def _rows(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """The storage under an (M, N) tensor with contiguous rows as a flat view, and its row
    stride: row ``i`` is ``flat[i * stride : i * stride + N]``. No copy."""
    m, n = t.shape
    if t.is_contiguous():
        return _numpy(t.view(-1)), n
    stride = t.stride(0) if m > 1 else n
    return _numpy(t.as_strided(((m - 1) * stride + n,), (1,))), stride


_defaults: dict[tuple[int, torch.dtype, float], np.ndarray] = {}


def _negative_zeros(n: int, dtype: torch.dtype) -> np.ndarray:
    """One row of ``-0.0`` in ``dtype`` (``v + -0.0 == v`` bitwise): the absent residual
    gradient."""
    key = (n, dtype, -0.0)
    array = _defaults.get(key)
    if array is None:
        array = _defaults[key] = _numpy(torch.full((n,), -0.0, dtype=dtype))
    return array


def _param(p: torch.Tensor | None, n: int, acc: torch.dtype, default: float) -> np.ndarray:
    """``p`` as a contiguous (N,) array in the accumulation dtype; for ``None``, ones
    (weight) or ``-0.0`` (bias), since ``v * 1 + -0.0 == v`` bitwise."""
    if p is not None:
        return _numpy(p if p.dtype == acc and p.is_contiguous() else p.to(acc).contiguous())
    key = (n, acc, default)
    array = _defaults.get(key)
    if array is None:
        if len(_defaults) > 64:
            _defaults.clear()
        dtype = np.float64 if acc == torch.float64 else np.float32
        array = _defaults[key] = np.full(n, default, dtype=dtype)
    return array


def _scalar(value: float, acc: torch.dtype) -> np.floating:
    return np.float64(value) if acc == torch.float64 else np.float32(value)


def forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    kernels = _kernels()
    m, n = x.shape
    acc = _acc(x.dtype)
    x_np, xs = _rows(x)
    y = _empty((m, n), x.dtype)
    if residual is None:
        residual_out = None
        r_np, rs, h_np = x_np[:1], 0, x_np[:1]
    else:
        residual_out = _empty((m, n), x.dtype)
        r_np, rs = _rows(residual)
        h_np = _numpy(residual_out.view(-1))
    mean = torch.empty(0 if rms else m, dtype=acc)
    rstd = torch.empty(m, dtype=acc)
    kernels.forward_kernel(
        x_np,
        xs,
        r_np,
        rs,
        residual is not None,
        h_np,
        _param(weight, n, acc, 1.0),
        _param(bias, n, acc, -0.0),
        _numpy(y.view(-1)),
        mean.numpy(),
        rstd.numpy(),
        m,
        n,
        _scalar(n, acc),
        _scalar(eps, acc),
        rms,
        y.numel() * y.element_size() >= STREAM_BYTES,
    )
    return y, residual_out, None if rms else mean, rstd


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
    kernels = _kernels()
    m, n = x.shape
    acc = _acc(x.dtype)
    dy_np, gs = _rows(dy)
    x_np, xs = _rows(x)
    if dresidual_out is None:
        dro_np, ds = _negative_zeros(n, x.dtype), 0
    else:
        dro_np, ds = _rows(dresidual_out)
    stat = np.float64 if acc == torch.float64 else np.float32
    mean_np = _param(None, 1, acc, 0.0) if mean is None else _param(mean, m, acc, 0.0)
    rstd_np = _param(rstd, m, acc, 0.0)
    dx = _empty((m, n), x.dtype)
    nblocks = -(-m // kernels.ROW_BLOCK)
    partial_w = np.empty(nblocks * n, stat)
    partial_b = np.empty(nblocks * n, stat)
    kernels.backward_kernel(
        dy_np,
        gs,
        x_np,
        xs,
        dro_np,
        ds,
        _param(weight, n, acc, 1.0),
        mean_np,
        rstd_np,
        _numpy(dx.view(-1)),
        partial_w,
        partial_b,
        m,
        n,
        _scalar(n, acc),
        rms,
    )
    dweight = dbias = None
    if need_dweight:
        dweight = torch.empty(n, dtype=acc)
        kernels.column_sum_kernel(partial_w, nblocks, n, dweight.numpy())
    if need_dbias:
        dbias = torch.empty(n, dtype=acc)
        kernels.column_sum_kernel(partial_b, nblocks, n, dbias.numpy())
    return dx, dweight, dbias
