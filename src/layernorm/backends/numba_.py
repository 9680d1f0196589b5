"""Numba backend: fused, multithreaded CPU kernels for layer norm and RMSNorm.

It follows the kernel contract of :mod:`layernorm.backends.torch_` (same arguments, same
dtypes, the numerics of docs/contract.md §3) with one kernel per direction:

- forward: per row, ``residual_out = x + residual`` written in the
  same pass, the corrected two-pass statistics and ``y``; the row is read once from memory,
  and a large float32 ``y`` is written with non-temporal stores (:data:`STREAM_BYTES`).
- backward: per block of ``_numba_kernels.ROW_BLOCK`` (32) rows, ``dx``
  (``+ dresidual_out``) for each row, correctly rounded (docs/contract.md §3: the row's
  statistics recomputed from ``x`` and ``eps``, flagged rows fixed by
  :func:`_fix_backward_rows`), and float64 partial sums of ``g * u`` and ``g``
  (:mod:`._weight_terms`); a serial loop adds the block partials by halving (float64)
  for dweight/dbias.

Tensors reach the kernels as addresses (``data_ptr()``) and sizes, through per-dtype
entries of C-typed arguments only (:func:`entry`; the arguments are described once, in
:mod:`layernorm.backends._kernel_abi`), which :mod:`layernorm.compiled` also calls from C++
by their addresses (:func:`entry_address`). Inputs under :data:`SERIAL_NUMEL` elements run
in the calling thread; larger ones in spans of rows over the calling thread and helper
threads (:mod:`layernorm.backends._threads`). Both run the same compiled row function, so
a row's bits do not depend on which ran.

Outputs of ``_host_memory.MIN_BYTES`` or more come from
:mod:`layernorm.backends._host_memory`, a cache of freed output blocks: a fresh large
tensor is a fresh ``mmap`` whose pages Linux clears on first touch.
``layernorm.empty_cache()`` releases the idle blocks; ``LAYERNORM_HOST_CACHE_MB`` caps them.

float16 and bfloat16 are converted inside the kernels (no full-size float32 copies), and
so are weight and bias in the input's 16-bit dtype (no conversion per call:
``params_x_dtype`` of :mod:`layernorm.backends._kernel_abi`);
strided rows (``stride(0) != N``) are read in place. Results are bitwise identical run to
run, for a row alone or in any batch, and at any thread count (see
:mod:`layernorm.backends._numba_kernels` for why).

Threads: ``torch.get_num_threads()`` at call time (``torch.set_num_threads``,
``OMP_NUM_THREADS``), at most one kernel thread per CPU for all concurrent calls together;
no OpenMP runtime or numba threading layer of our own is started (the compiled path's
threaded calls run on torch's own OpenMP workers), forked children compute normally, and
torch's settings are never changed (:mod:`layernorm.backends._threads`).

JIT cost: nothing is compiled until the first call; each dtype then compiles its forward
or backward entries once (half a minute for a forward, seconds for a backward) and
stores them in the on-disk cache, which later processes load (:func:`build`,
``layernorm build``, compiles them all ahead). A
forward whose ``y`` has another dtype than ``x`` (``out_dtype``: float32 from float64 or
a 16-bit dtype, a 16-bit dtype from a wider or the other 16-bit one) has entries of its
own per (x's dtype, y's dtype), compiled (or loaded) on their first use only, so the
build and the same-dtype calls' cold start do not grow, except those of
:data:`BUILT_PAIRS` (apex's mixed case, and a 16-bit output from a float32 residual
stream), which :func:`build` compiles too; the compiled front door asks for them
(:func:`entry_address`) on their first use too, as for the fused dropout-add's C entries
(:data:`DROPOUT_ENTRIES`, whose Python path compiles its kernels on first use as well).
The memory-efficient backward's (:data:`RECOMPUTE_ENTRIES`, a few seconds) are built
with the plain ones, and compiled on first use where they were not. Where
the cache lives, and the lock that lets processes starting together share it:
:mod:`layernorm.backends._numba_cache` (:func:`cache_location` says where).

Automatic choice: :func:`prefers` is True for every CPU input, whatever its size.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import threading
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from . import _host_memory, _threads

__all__ = ["SERIAL_NUMEL", "backward", "cannot_run", "entry", "entry_address", "forward", "prefers"]

#: Outputs of at least this many bytes (the forward's ``y``, float32 ``dx``) are written
#: with non-temporal (streaming) stores, which skip the read-for-ownership of a plain
#: store; smaller ones stay cached for whoever reads them next. Same bits either way.
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


#: the entries compiled so far, by (dtype, kernel name) or, for a forward whose ``y`` has
#: another dtype, (dtype, kernel name, y's dtype): see :func:`entry`
_entries: dict[tuple, Callable[..., None]] = {}

#: each thread's forward flags buffer (:func:`_scratch`)
_flag_buffers = threading.local()


def _scratch(size: int) -> tuple[np.ndarray, int]:
    """This thread's reusable buffer for the forward's fallback flags, of at least
    ``size`` bytes, and its address (no allocation, no ctypes object per call): the
    kernels write every flag the caller reads, so its old contents never show. One call
    at a time per thread uses it (a forward calls no forward while its flags are live)."""
    buffer: np.ndarray | None = getattr(_flag_buffers, "buffer", None)
    if buffer is None or buffer.shape[0] < size:
        buffer = _flag_buffers.buffer = np.empty(max(size, 4096), np.uint8)
        _flag_buffers.address = buffer.ctypes.data
    return buffer, _flag_buffers.address


#: every entry :func:`entry` knows, as :func:`build` compiles them
ENTRIES = ("forward_serial", "forward_parallel", "backward_serial", "backward_parallel")
#: the (x, y) dtype pairs whose forward entries :func:`build` compiles with the plain ones,
#: so that their first call does not compile: float32 output from a 16-bit input, which
#: ``layernorm.options`` runs on them without a converted copy of the input
#: (``options._rounds_into``), and a 16-bit output from float32, the norm of a float32
#: residual stream of 16-bit terms (``residual_dtype``, ``fused_norm``, flash-attn's
#: ``residual_in_fp32``); every other pair compiles on its first use
BUILT_PAIRS = (
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
)
#: the dropout-add's C entries (``_numba_dropout.entry``; all of one dtype, or the terms'
#: and the stream's of :data:`STREAM_PAIRS`), for compiled callers only
#: (:func:`entry_address`): :func:`build` compiles them (a few seconds each), else their
#: first use
DROPOUT_ENTRIES = ("dropout_add", "sum3", "dropout_add_backward")
#: the (terms, stream) dtype pairs of the dropout-add's entries with a stream of its own:
#: a float32 residual stream of 16-bit terms (flash-attn's ``residual_in_fp32``)
STREAM_PAIRS = ((torch.bfloat16, torch.float32), (torch.float16, torch.float32))
#: the memory-efficient backward's C entry (``_numba_recompute.entry``: float32 and
#: bfloat16 only), for compiled callers only: :func:`build` compiles it, else its first use
RECOMPUTE_ENTRIES = ("memory_efficient_backward",)


def _compiled(
    dtype: torch.dtype, name: str, y_dtype: torch.dtype | None = None
) -> Callable[..., None]:
    """numba's compiled ``_numba_kernels.entry(name)`` for ``dtype`` (and a forward's
    ``y`` in ``y_dtype``, when given and not ``dtype``): loaded from the on-disk cache or
    compiled, holding the entry's lock (see :mod:`layernorm.backends._numba_cache`). An
    output dtype of its own compiles its entries on their first use only, so
    :func:`build` and a cold start of the same-dtype entries do not grow."""
    key: tuple = (dtype, name) if y_dtype is None or y_dtype == dtype else (dtype, name, y_dtype)
    kernel = _entries.get(key) or _load(key, wait=True)
    assert kernel is not None  # (waited for the lock)
    return kernel


def _load(key: tuple, wait: bool) -> Callable[..., None] | None:
    """:func:`_compiled`'s load or compile of entry ``key``; with ``wait=False``, None at
    once when another process holds the entry's lock (it is compiling it)."""
    kernels = _kernels()
    from . import _numba_cache

    dtype, name = key[:2]
    types = _TYPES[dtype]
    y_tag = None if len(key) == 2 else _TYPES[key[2]].storage
    to = "" if y_tag is None else f" to {key[2]}"
    dropout = name in DROPOUT_ENTRIES
    recompute = name in RECOMPUTE_ENTRIES
    # one lock per compiled kernel: entries that share one compile it once
    compiles = name if dropout or recompute else kernels.COMPILES[name]
    with _numba_cache.locked(f"{dtype} {compiles}{to}", wait) as held:
        if not held:
            return None
        kernel = _entries.get(key)  # another thread may have been first
        if kernel is None:
            with _numba_cache.compiling(f"{dtype} {name}{to}"):
                if dropout:
                    from . import _numba_dropout

                    kernel = _numba_dropout.entry(name, types.storage, y_tag)
                elif recompute:
                    from . import _numba_recompute

                    kernel = _numba_recompute.entry(name, types.storage)
                else:
                    kernel = kernels.entry(name, types.storage, types.acc, y_tag)
            _entries[key] = kernel
    return kernel


def entry(dtype: torch.dtype, name: str, y_dtype: torch.dtype | None = None) -> Callable[..., None]:
    """Kernel ``name`` (``forward_serial``, ``forward_parallel``, ``backward_serial``
    or ``backward_parallel``) for input dtype ``dtype``, on addresses, sizes and flags
    (the arguments of :mod:`layernorm.backends._kernel_abi`); compiled on first use. A
    forward's ``y`` holds ``y_dtype`` (None: ``dtype``): one of ``torch_.OUT_DTYPES`` no wider
    than ``dtype``, or float32 from a 16-bit ``dtype``.

    The serial entries run in the calling thread; the parallel ones split the rows into
    spans that the calling thread and helper threads run (:mod:`._threads`), each with the
    compiled ``_numba_kernels`` entry of the same name, so the bits are the same."""
    if name == "forward_parallel":
        return functools.partial(_forward_over_threads, dtype, y_dtype or dtype)
    if name == "backward_parallel":
        return functools.partial(_backward_over_threads, dtype)
    return _compiled(dtype, name, y_dtype)


def entry_address(dtype: torch.dtype, name: str, y_dtype: torch.dtype | None = None) -> int:
    """The C address of the compiled ``_numba_kernels`` entry ``name`` (one of
    :data:`ENTRIES` or ``column_sums``) for ``dtype`` (a forward's ``y`` in ``y_dtype``,
    as :func:`entry`), or of the dropout-add's entry ``name`` (:data:`DROPOUT_ENTRIES`;
    with ``y_dtype``, the stream's dtype of :data:`STREAM_PAIRS`) or the memory-efficient
    backward's (:data:`RECOMPUTE_ENTRIES`),
    for compiled callers. A
    ``*_parallel`` entry runs one span of a call's rows, as :func:`entry`'s threaded
    entries hand them out; a compiled caller that spreads a call over threads of its own
    asks :func:`layernorm.backends._threads.lend` for them and adds the backward's partial
    sums with ``column_sums``, as :func:`_backward_over_threads` does."""
    return _kernels().address(_compiled(dtype, name, y_dtype))  # type: ignore[no-any-return]


def _forward_over_threads(
    dtype: torch.dtype, y_dtype: torch.dtype, x: int, x_stride: int, residual: int, residual_stride: int,
    has_residual: bool, residual_out: int, weight: int, bias: int, params_x_dtype: bool,
    y: int, mean: int,
    rstd: int, m: int, n: int, eps: float, rms: bool, stream: bool, store_stats: bool,
    flags: int,
) -> None:  # fmt: skip
    """The ``forward_parallel`` entry: spans of ``ROW_BLOCK`` rows over the threads.

    Each span writes its rows' fallback flags and its own any-flag after them, so the
    spans get disjoint stretches of one scratch array (span from block ``start`` at
    ``start * (ROW_BLOCK + 1)``); the caller's ``flags`` (m + 1 bytes) are gathered from
    it afterwards."""
    run = _compiled(dtype, "forward_parallel", y_dtype)
    size, acc_size = _TYPES[dtype].itemsize, _TYPES[dtype].acc.itemsize
    # bytes from one row to the next of each argument (0: not read, any valid address)
    x_step, y_step = x_stride * size, n * _TYPES[y_dtype].itemsize
    residual_step = residual_stride * size if has_residual else 0
    residual_out_step = n * size if has_residual else 0
    mean_step = acc_size if store_stats and not rms else 0
    rstd_step = acc_size if store_stats else 0
    rows = _kernels().ROW_BLOCK
    blocks = -(-m // rows)
    scratch, scratch_address = _scratch(blocks * (rows + 1))  # spans write all they read
    spans: list[tuple[int, int]] = []  # (first row, rows) of each span; append is atomic

    def span(start: int, stop: int) -> None:
        i = start * rows
        count = min(m, stop * rows) - i
        run(
            x + i * x_step, x_stride, residual + i * residual_step, residual_stride,
            has_residual, residual_out + i * residual_out_step, weight, bias, params_x_dtype,
            y + i * y_step,
            mean + i * mean_step, rstd + i * rstd_step, count, n, eps, rms,
            stream, store_stats, scratch_address + i + start,
        )  # fmt: skip
        spans.append((i, count))

    _threads.run(span, blocks, rows * n)
    _gather_flags(scratch, spans, rows, m, flags)


def _gather_flags(
    scratch: np.ndarray, spans: list[tuple[int, int]], rows: int, m: int, flags: int
) -> None:
    """The caller's ``flags`` (m + 1 bytes at that address) from the spans' stretches of
    ``scratch``: the span from row ``i`` wrote its ``count`` flags and its any-flag at
    ``i + i // rows``."""
    out = np.ctypeslib.as_array((ctypes.c_uint8 * (m + 1)).from_address(flags))
    out[m] = 0
    for i, count in spans:
        start = i + i // rows  # where span(i // rows, ...) wrote
        out[i : i + count] = scratch[start : start + count]
        out[m] |= scratch[start + count]


def _backward_over_threads(
    dtype: torch.dtype, dy: int, dy_stride: int, x: int, x_stride: int, dresidual_out: int,
    dresidual_out_stride: int, weight: int, params_x_dtype: bool, mean: int, rstd: int,
    dx: int, dweight: int,
    dbias: int, m: int, n: int, rms: bool, stream: bool, eps: float, flags: int,
) -> None:  # fmt: skip
    """The ``backward_parallel`` entry: spans of ``ROW_BLOCK`` rows over the threads,
    each writing its blocks' dweight/dbias partial sums, then their column sums by
    halving (float64), as ``backward_serial`` adds them. The spans' fallback flags are
    gathered into ``flags`` as :func:`_forward_over_threads` does."""
    run = _compiled(dtype, "backward_parallel")
    types = _TYPES[dtype]
    size, acc_size = types.itemsize, types.acc.itemsize
    rows = _kernels().ROW_BLOCK
    blocks = -(-m // rows)
    partial = torch.empty(2, blocks, n, dtype=torch.float64)  # float64 partial sums
    dweight_partial, dbias_partial = partial[0].data_ptr(), partial[1].data_ptr()
    dy_step, x_step, dx_step = dy_stride * size, x_stride * size, n * size
    dresidual_out_step = dresidual_out_stride * size
    mean_step = 0 if rms else acc_size
    scratch = np.zeros(blocks * (rows + 1), np.uint8)
    spans: list[tuple[int, int]] = []  # (first row, rows) of each span; append is atomic

    def span(start: int, stop: int) -> None:
        i = start * rows
        count = min(m, stop * rows) - i
        run(
            dy + i * dy_step, dy_stride, x + i * x_step, x_stride,
            dresidual_out + i * dresidual_out_step, dresidual_out_stride, weight,
            params_x_dtype, mean + i * mean_step, rstd + i * acc_size, dx + i * dx_step,
            dweight_partial + start * n * 8, dbias_partial + start * n * 8,
            count, n, rms, stream, eps, scratch.ctypes.data + i + start,
        )  # fmt: skip
        spans.append((i, count))

    _threads.run(span, blocks, rows * n)
    _gather_flags(scratch, spans, rows, m, flags)
    sums = _compiled(dtype, "column_sums")
    if dweight:
        sums(dweight_partial, blocks, n, dweight)
    if dbias:
        sums(dbias_partial, blocks, n, dbias)


def build(processes: int = 1) -> list[str]:
    """Compiles every entry of every dtype into the on-disk cache now (or checks that it
    is there), the forward entries of :data:`BUILT_PAIRS`, the dropout-add's entries
    (:data:`DROPOUT_ENTRIES`, of one dtype and of :data:`STREAM_PAIRS`), the
    memory-efficient backward's entries and the exact fallback's loops
    (:mod:`layernorm.backends._numba_exact`) too: a later process's first call of each
    then costs a cache load, not a compile. Processes that build at once share the work: each takes the next entry
    that no other is compiling, and waits only when every entry left is taken; with
    ``processes`` > 1, this one starts ``processes - 1`` more that build beside it (each
    dtype's forward is one unit of about half a minute: more than 4 gain nothing) and
    returns once they are done. Returns what was built, one line per dtype: the seconds this
    process spent on its entries."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from . import _numba_cache

    _kernels()
    _numba_cache.expect_compiles()
    folder = _numba_cache.directory()
    package_parent = str(Path(__file__).resolve().parents[2])  # the folder holding layernorm
    path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
    # the helpers import this package and fill this process's cache folder, whatever
    # their environment would resolve to now
    env = {**os.environ, "PYTHONPATH": path, "NUMBA_CACHE_DIR": str(folder)}
    helpers = [
        subprocess.Popen(
            [sys.executable, "-c", "from layernorm.backends import numba_; numba_.build()"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # (this process compiles whatever a helper leaves)
        )
        for _ in range(min(processes, len(_DTYPES)) - 1)
        if folder is not None  # (else each would compile for itself)
    ]
    seconds = dict.fromkeys(_DTYPES, 0.0)
    from . import _numba_recompute

    pending: list[tuple] = [
        (dtype, name) for dtype in _DTYPES for name in (*ENTRIES, "column_sums")
    ]  # (the keys of _entries)
    # the memory-efficient backward's entry too (the compiled front door's; small)
    pending += [
        (dtype, name) for dtype in _numba_recompute.ENTRY_DTYPES for name in RECOMPUTE_ENTRIES
    ]
    pending += [(x, name, y) for x, y in BUILT_PAIRS for name in ENTRIES[:2]]
    # the fused dropout-add's (the compiled front door's fused_norm with dropout or x1)
    pending += [(dtype, name) for dtype in _DTYPES for name in DROPOUT_ENTRIES]
    pending += [(x, name, h) for x, h in STREAM_PAIRS for name in DROPOUT_ENTRIES]
    try:
        while pending:
            waiting = []
            for key in pending:
                start = time.perf_counter()
                if key not in _entries and _load(key, wait=False) is None:
                    waiting.append(key)
                seconds[key[0]] += time.perf_counter() - start
            if len(waiting) == len(pending):  # all taken by other processes: wait on one
                key = waiting.pop(0)
                start = time.perf_counter()
                _load(key, wait=True)
                seconds[key[0]] += time.perf_counter() - start
            pending = waiting
    finally:
        for helper in helpers:
            helper.wait()
    from . import _numba_exact

    _numba_exact.compile_all()  # the exact fallback's loops (seconds)
    return [f"{str(dtype).removeprefix('torch.')} {s:.1f} s" for dtype, s in seconds.items()]


def build_processes() -> int:
    """How many processes :func:`build` should use here: one per CPU this process may
    run on, at most one per dtype (4)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, len(_DTYPES)))


def cache_location() -> str:
    """Where the kernels are cached on disk (``cached in <folder>``), or why not."""
    from . import _numba_cache

    return _numba_cache.location()


#: inputs of fewer elements run in the calling thread on this Python path: below this,
#: waking Python helper threads costs more than it saves (on the 2-core development
#: machine one thread beat two up to about 256 rows of 1024: ``benchmarks/RESULTS.md``,
#: "Small calls"). Same bits either way. (The compiled front door's threads, torch's
#: OpenMP workers, cost far less to wake and follow :func:`._threads.lend` alone.)
SERIAL_NUMEL = 1 << 18


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


def _output(like: torch.Tensor, nbytes: int) -> torch.Tensor:
    """An uninitialized contiguous output shaped like ``like``, of ``nbytes``: from the
    host cache when large (see :mod:`layernorm.backends._host_memory`: a fresh large
    tensor costs a page clear per page), else
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


def _kernel_param(p: torch.Tensor | None, n: int, acc: torch.dtype, default: float) -> torch.Tensor:
    """``p`` (contiguous, as the contract promises) in the accumulation dtype, or the
    default row."""
    if p is None:
        return _constant(n, acc, default)
    return p if p.dtype == acc else p.to(acc).contiguous()


def _in_x_dtype(dtype: torch.dtype, acc: torch.dtype, *params: torch.Tensor | None) -> bool:
    """Whether the kernels read ``params`` in x's dtype ``dtype`` (``params_x_dtype`` of
    :mod:`layernorm.backends._kernel_abi`): x is 16-bit, one of them is given and every
    given one holds ``dtype``. They are then widened inside the kernel, once per call
    (no conversion here); else :func:`_kernel_param` converts them to ``acc``."""
    if dtype == acc:
        return False
    given = [p for p in params if p is not None]
    return bool(given) and all(p.dtype == dtype for p in given)


def forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    stats: bool = True,
    out_dtype: torch.dtype | None = None,
    out_y: torch.Tensor | None = None,
    out_residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """torch_'s forward contract; ``out_y`` / ``out_residual``, when given, are written
    in place of fresh ``y`` / ``residual_out`` (``layernorm.options.write_into`` hands
    them over: contiguous, ``x``'s shape, the output's dtype, sharing no memory with any
    argument or each other)."""
    # Written flat on purpose: every Python step counts in a small call.
    n = x.shape[-1]
    numel = x.numel()
    m = numel // n
    types = _TYPES[x.dtype]
    nbytes = numel * types.itemsize
    if out_dtype == x.dtype:
        out_dtype = None
    if out_y is not None:
        y = out_y
    elif out_dtype is None:
        y = _output(x, nbytes)
    else:  # y of its own dtype (torch_'s contract: float32 or 16-bit), rounded into it
        y = _host_memory.empty(x.shape, out_dtype)
    params_x_dtype = _in_x_dtype(x.dtype, types.acc_dtype, weight, bias)
    param_dtype = x.dtype if params_x_dtype else types.acc_dtype
    w = _kernel_param(weight, n, param_dtype, 1.0)
    b = _kernel_param(bias, n, param_dtype, -0.0)
    x_address = x.data_ptr()
    if stats:
        mean = None if rms else torch.empty(m, dtype=types.acc_dtype)
        rstd = torch.empty(m, dtype=types.acc_dtype)
        mean_address = x_address if mean is None else mean.data_ptr()
        rstd_address = rstd.data_ptr()
    else:  # the kernel writes no statistics: any valid address will do
        mean = rstd = None
        mean_address = rstd_address = x_address
    if residual is None:  # the kernel reads no residual: any valid address will do
        residual_out = None
        residual_address, residual_stride, residual_out_address = x_address, 0, x_address
    else:
        residual_out = _output(x, nbytes) if out_residual is None else out_residual
        residual_address = residual.data_ptr()
        residual_stride = _stride(residual, n)
        residual_out_address = residual_out.data_ptr()
    # the caller's flags: the kernel sets them all; the threaded entry gathers them from
    # its own scratch (this thread's too), so they get a buffer of their own
    if numel < SERIAL_NUMEL:
        flags, flags_address = _scratch(m + 1)
    else:
        flags = np.empty(m + 1, np.uint8)
        flags_address = flags.ctypes.data
    run = entry(
        x.dtype, "forward_serial" if numel < SERIAL_NUMEL else "forward_parallel", out_dtype
    )
    # the arguments of _kernel_abi.FORWARD, in its order
    run(
        x_address,  # x
        _stride(x, n),  # x_stride
        residual_address,  # residual
        residual_stride,  # residual_stride
        residual is not None,  # has_residual
        residual_out_address,  # residual_out
        w.data_ptr(),  # weight
        b.data_ptr(),  # bias
        params_x_dtype,  # params_x_dtype
        y.data_ptr(),  # y
        mean_address,  # mean
        rstd_address,  # rstd
        m,  # m
        n,  # n
        eps,  # eps
        rms,  # rms
        nbytes >= STREAM_BYTES,  # stream
        stats,  # store_stats
        flags_address,  # flags
    )
    if flags[m]:  # rare: rows whose rounding the float64 bound left open
        _fix_rows(y, x if residual_out is None else residual_out, w, b, eps, rms, flags[:m])
    return y, residual_out, mean, rstd


def _fix_rows(
    y: torch.Tensor,
    z: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    eps: float,
    rms: bool,
    flags: np.ndarray,
) -> None:
    """Rewrites the flagged rows of ``y`` exactly, as the torch backend does
    (``torch_._fix_rows``, over :mod:`layernorm.backends._exact`)."""
    from . import torch_

    if y.dtype == torch.float64:
        return
    gamma, beta = w.to(torch.float64), b.to(torch.float64)
    flagged = torch.from_numpy(flags).bool()
    torch_._fix_rows(torch_.matrix(y), torch_.matrix(z), gamma, beta, eps, rms, flagged)


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
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    n = x.shape[-1]
    numel = x.numel()
    m = numel // n
    types = _TYPES[x.dtype]
    acc = types.acc_dtype
    nbytes = numel * types.itemsize
    params_x_dtype = _in_x_dtype(x.dtype, acc, weight)
    w = _kernel_param(weight, n, x.dtype if params_x_dtype else acc, 1.0)
    stats_rstd = _kernel_param(rstd, m, acc, 0.0)
    stats_mean = stats_rstd if mean is None else _kernel_param(mean, m, acc, 0.0)
    # no residual gradient: one row of -0.0 with a stride of 0 (v + -0.0 == v bitwise)
    dres = _constant(n, x.dtype, -0.0) if dresidual_out is None else dresidual_out
    dx = _output(x, nbytes)
    dweight = torch.empty(n, dtype=acc) if need_dweight else None
    dbias = torch.empty(n, dtype=acc) if need_dbias else None
    flags = np.zeros(m + 1, np.uint8)  # the kernel sets them all (zeros: never stale)
    run = entry(x.dtype, "backward_serial" if numel < SERIAL_NUMEL else "backward_parallel")
    # the arguments of _kernel_abi.BACKWARD, in its order
    run(
        dy.data_ptr(),  # dy
        _stride(dy, n),  # dy_stride
        x.data_ptr(),  # x
        _stride(x, n),  # x_stride
        dres.data_ptr(),  # dresidual_out
        0 if dresidual_out is None else _stride(dresidual_out, n),  # dresidual_out_stride
        w.data_ptr(),  # weight
        params_x_dtype,  # params_x_dtype
        stats_mean.data_ptr(),  # mean
        stats_rstd.data_ptr(),  # rstd
        dx.data_ptr(),  # dx
        0 if dweight is None else dweight.data_ptr(),  # dweight
        0 if dbias is None else dbias.data_ptr(),  # dbias
        m,  # m
        n,  # n
        rms,  # rms
        nbytes >= STREAM_BYTES,  # stream
        eps,  # eps
        flags.ctypes.data,  # flags
    )
    if flags[m]:  # rare: rows whose rounding the float64 bound left open
        _fix_backward_rows(dx, dweight, dy, x, w, mean, dresidual_out, eps, rms, flags[:m])
    return dx, dweight, dbias


def _fix_backward_rows(
    dx: torch.Tensor,
    dweight: torch.Tensor | None,
    dy: torch.Tensor,
    z: torch.Tensor,
    w: torch.Tensor,
    mean: torch.Tensor | None,
    dresidual_out: torch.Tensor | None,
    eps: float,
    rms: bool,
    flags: np.ndarray,
) -> None:
    """Rewrites exactly (:mod:`layernorm.backends._exact`) the rows of ``dx`` whose
    ``flags`` have bit 0, and ``dweight`` (when wanted) when some row has bit 1: that
    row's ``_weight_terms`` scalars were left open, and the torch backend's backward
    computes the same sums with their exact values (rare: a whole dweight again)."""
    from . import _exact, torch_

    if dweight is not None and (flags & 2).any():
        dweight.copy_(torch_.weight_gradient(dy, z, mean, eps, rms))
    if dx.dtype == torch.float64:
        return
    rows = torch.from_numpy(np.flatnonzero(flags & 1))
    n = z.shape[-1]
    z64, g64 = (torch_.matrix(t)[rows].to(torch.float64) for t in (z, dy))
    gh = (g64 * w.to(torch.float64)).numpy()  # exact: 24-bit by 24-bit
    rho = torch.full((len(rows), n), -0.0, dtype=torch.float64)
    if dresidual_out is not None:
        rho = torch_.matrix(dresidual_out)[rows].to(torch.float64)
    finite, fixed = _exact.fix_backward_rows(z64.numpy(), gh, rho.numpy(), eps, rms, dx.dtype)
    storage = torch_.matrix(dx).view(_exact.STORAGE[dx.dtype])
    storage[rows[torch.from_numpy(finite)]] = torch.from_numpy(fixed)
