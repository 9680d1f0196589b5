"""Triton backend: fused layer norm / RMSNorm kernels for CUDA tensors.

Follows the kernel contract of :mod:`layernorm.backends.torch_`; the kernels and their
numerics are described in :mod:`layernorm.backends._triton_kernels`.

Where it runs: CUDA tensors (compiled kernels), and CPU tensors only when
``TRITON_INTERPRET=1`` is set, through Triton's interpreter (slow; for tests without a
GPU). :func:`prefers` is True only for CUDA tensors, so the automatic choice never sends
CPU work to the interpreter. Triton fixes the mode of its own ``@jit`` helpers (``tl.sum``)
when ``triton`` is first imported, so ``TRITON_INTERPRET=1`` must be set by then; this
module imports ``triton`` only when a kernel first runs, and loads the kernel file in the
mode triton was imported in, whatever the variable says later.

Launch configuration depends only on N and the dtype, never on M: a row's output is
bitwise the same alone or in any batch. The forward holds rows of at most
:data:`FUSED_FORWARD_N` elements in one program and spreads wider rows (any width, tested
past 1M elements) over chunks of :data:`CHUNK_N` columns. The backward holds rows of at
most :data:`FUSED_BACKWARD_N` elements and chunks wider ones (:data:`BACKWARD_CHUNK_N`
columns). These limits keep every kernel free of register spills on sm_90 with Triton 3.6
and 3.9, as ``tests/_triton_compile_check.py`` checks on the compiled cubins without a
GPU. They are module constants so that tests can shrink them, and untuned beyond one
measurement (benchmarks/RESULTS.md, "The triton backend on an H200"):
``benchmarks/gpu_bench.py --set NAME=INT`` is the judge. No autotuning.

The forward is correctly rounded (docs/contract.md §3; the stages are in
:mod:`layernorm.backends._triton_kernels`). It computes in float64 on every device; the
double-float variant for GPUs whose float64 is slow (consumer parts: 1/32 to 1/64 of
float32) is designed, not built (docs/contract.md §3). Host synchronization: stages 1 and
2 run on the device, but :func:`_settle` reads whether any row is left for the host's
exact fallback, one small device-to-host read per call on a GPU (docs/contract.md §5).
The backward is correctly rounded the same way (stages 1 and 2 on the device, then the
host's fallback for an open row, :func:`_settle_backward`, one read per call).
Limits: float16, bfloat16 and float32 only (float64 falls back to the other backends).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import struct
import sys
from types import ModuleType
from typing import overload

import numpy as np
import torch

from . import _weight_terms, torch_
from .torch_ import contiguous_rows, matrix

#: rows of at most this many elements are held whole in one program's registers (forward;
#: float64 arithmetic: 8 elements per thread at 8 warps; 16, at 4096, spill with Triton 3.6)
FUSED_FORWARD_N = 1 << 11
#: the backward's fused limit (float64, with stage 2 in the same program: 2 elements per
#: thread at 8 warps; 4, at 1024, spill with Triton 3.6)
FUSED_BACKWARD_N = 1 << 9
#: the backward splits wider rows into chunks of this many columns (a power of two)
BACKWARD_CHUNK_N = 1 << 11
#: wider rows are split into chunks of this many columns (a power of two)
CHUNK_N = 1 << 12
#: the backward's dweight/dbias partial buffer aims at about this many float64 values
PARTIAL_ELEMENTS = 1 << 22
#: ... with at least this many programs in flight (wide rows: counting all chunks)
MIN_PROGRAMS = 256
#: ... and at most this many row blocks
MAX_PROGRAMS = 4096

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_loaded: dict[bool, ModuleType] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "on", "yes"}


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'layernorm[triton]')"
    if torch.cuda.is_available() or _interpreting():
        return None
    return (
        "no CUDA device; set TRITON_INTERPRET=1 to run the Triton kernels on CPU tensors "
        "in Triton's (slow) interpreter"
    )


def cannot_run(x: torch.Tensor) -> str | None:
    if x.dtype not in _DTYPES:
        return f"the triton backend supports float16, bfloat16 and float32, not {x.dtype}"
    if x.device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if x.device.type == "cpu":
        if not _interpreting():
            return "CPU tensors run on the triton backend only with TRITON_INTERPRET=1 set"
        if "triton" in sys.modules and not _triton_interprets():
            return (
                "triton was imported before TRITON_INTERPRET=1 was set; its interpreter "
                "needs the variable set before triton is first imported"
            )
        return None
    return f"the triton backend runs CUDA tensors, not {x.device.type} tensors"


def prefers(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def _triton_interprets() -> bool:
    """Whether triton was imported in interpreter mode (its ``tl.sum`` is interpreted)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def _load_kernels(interpret: bool) -> ModuleType:
    """A fresh copy of the kernel module whose ``@triton.jit`` saw ``interpret``."""
    import triton

    spec = importlib.util.find_spec("layernorm.backends._triton_kernels")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # triton >= 3.4
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            spec.loader.exec_module(module)
        return module
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return module


def _kernels() -> ModuleType:
    """The kernels, compiled or interpreted as triton itself is."""
    interpret = _triton_interprets()
    if interpret not in _loaded:
        _loaded[interpret] = _load_kernels(interpret)
    return _loaded[interpret]


def _quiet(kernels: ModuleType) -> contextlib.AbstractContextManager:
    # The interpreter computes in NumPy, which warns where a GPU silently makes NaN or Inf.
    return np.errstate(all="ignore") if kernels.INTERPRETED else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------
# Launch configuration: a function of N and the dtype only.


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _num_warps_forward(block: int) -> int:
    # about 8 elements per thread in float64 (8 warps hold a 2048-element row), 16 in a
    # 4096-column chunk of the wide path
    return max(4, min(8, block // 256))


def _num_warps_backward(block: int) -> int:
    # 2 elements per thread in a fused row of 512 (8 in a chunk of 2048): the backward
    # keeps z, dy, gamma, c, dweight, dbias, ... live in float64 (at 16 warps a thread
    # gets 128 registers)
    return max(4, min(8, block // 64))


def forward_path(n: int, dtype: torch.dtype) -> str:
    """How the forward runs rows of width ``n``: "fused" (one program per row) or
    "wide" (chunks over programs)."""
    return "fused" if n <= FUSED_FORWARD_N else "wide"


def _tile_shape(block: int) -> tuple[int, int]:
    """(rows, columns) of the tile a program holds ``block`` (a power of two) elements
    in: about square, so that a sum over it passes few roundings (``_sum2d``)."""
    cols = 1 << (block.bit_length() // 2)
    return block // cols, cols


def _float64_bits(value: float) -> int:
    """The bit pattern of the float64 ``value`` (the kernels' ``eps_bits``)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def uses_fused_backward(n: int, dtype: torch.dtype) -> bool:
    """True when one program holds a whole row in the backward."""
    return n <= FUSED_BACKWARD_N


def _chunk_columns(n: int) -> int:
    """Columns per chunk of the looped and wide paths."""
    return min(CHUNK_N, _next_power_of_2(n))


@overload
def _unit_stride(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _unit_stride(t: None) -> None: ...
@overload
def _unit_stride(t: torch.Tensor | None) -> torch.Tensor | None: ...
def _unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    # ``t`` with unit column stride (the kernels index columns so), or None.
    return None if t is None else contiguous_rows(t)


def _launch(num_warps: int) -> dict:
    # Explicit fp_fusion: no FMA contraction, the IEEE operation sequence the interpreter
    # runs (and Triton warns when it is left to its changing default).
    return {"num_warps": num_warps, "enable_fp_fusion": False}


def _row_blocks(m: int, n: int, num_chunks: int) -> tuple[int, int]:
    """(programs, rows per program) of the backward: a fixed partition of the M rows, in
    whole blocks of ``_weight_terms.ROWS`` (each program adds its blocks' terms)."""
    target = max(MIN_PROGRAMS // num_chunks, PARTIAL_ELEMENTS // max(n, 1), 1)
    rows = _weight_terms.ROWS
    rows_per_program = -(-m // min(target, MAX_PROGRAMS))
    rows_per_program = max(rows, -(-rows_per_program // rows) * rows)
    return -(-m // rows_per_program), rows_per_program


# ---------------------------------------------------------------------------------------
# Kernel entry points (the contract is in layernorm.backends.torch_).


def forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    stats: bool = True,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The forward (``torch_``'s contract); ``y`` in ``out_dtype`` when given (the
    kernels round into ``Y``'s element type, whatever ``x``'s)."""
    kernels = _kernels()
    shape = x.shape
    x, residual = (
        _unit_stride(matrix(x)),
        None if residual is None else _unit_stride(matrix(residual)),
    )
    weight, bias = _unit_stride(weight), _unit_stride(bias)
    with _quiet(kernels):
        y, residual_out, mean, rstd, flags = _launch_forward(
            kernels, x, residual, weight, bias, eps, rms, out_dtype
        )
        _settle(y, x if residual_out is None else residual_out, weight, bias, eps, rms, flags)
    return y.view(shape), None if residual_out is None else residual_out.view(shape), mean, rstd


def _launch_forward(
    kernels: ModuleType,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    y_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The forward's launches, no host work: ``(y, residual_out, mean, rstd, flags)``
    (``y`` in ``y_dtype``, default x's), with ``flags[i]`` 0 where stage 1 settled row ``i``, 2 where
    stage 2 did, and 1 where the row is open (``y``'s row is then not final:
    :func:`_settle`)."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=y_dtype or x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    flags = torch.empty(m, dtype=torch.int32, device=x.device)
    r = x if residual is None else residual
    h = y if residual_out is None else residual_out
    params = {"HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None, "RMS": rms}
    w = x if weight is None else weight
    b = x if bias is None else bias
    eps_bits = _float64_bits(eps)
    if forward_path(n, x.dtype) == "fused":
        rows, cols = _tile_shape(_next_power_of_2(n))
        kernels.forward_fused_kernel[(m,)](
            x, r, w, b, y, h, rstd if mean is None else mean, rstd, flags,
            x.stride(0), r.stride(0), y.stride(0), h.stride(0),
            n, eps_bits, rows + cols - 2,
            HAS_RESIDUAL=residual is not None, ROWS=rows, COLS=cols, **params,
            **_launch(_num_warps_forward(rows * cols)),
        )  # fmt: skip
    else:
        _forward_wide(
            kernels, x, r, w, b, y, h, mean, rstd, flags, eps_bits, residual is not None, params
        )
    return y, residual_out, mean, rstd, flags


def _forward_wide(
    kernels: ModuleType,
    x: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    h: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    flags: torch.Tensor,
    eps_bits: int,
    has_residual: bool,
    params: dict,
) -> None:
    """The wide path: four launches over (rows, chunks) and rows (``_triton_kernels``)."""
    m, n = x.shape
    chunk = _chunk_columns(n)
    rows, cols = _tile_shape(chunk)
    num_chunks = -(-n // chunk)
    part_a = torch.empty((m, num_chunks), dtype=torch.float64, device=x.device)
    part_b = part_a if params["RMS"] else torch.empty_like(part_a)
    part_c = part_a if params["RMS"] else torch.empty_like(part_a)
    chunk_flags = torch.empty((m, num_chunks), dtype=torch.int32, device=x.device)
    depth = rows + cols - 2 + num_chunks - 1
    tile = {"ROWS": rows, "COLS": cols, **_launch(_num_warps_forward(chunk))}
    chunks_p2 = _next_power_of_2(num_chunks)
    kernels.forward_sums_kernel[(m, num_chunks)](
        x, r, h, part_a,
        x.stride(0), r.stride(0), h.stride(0),
        n, num_chunks,
        HAS_RESIDUAL=has_residual, RMS=params["RMS"], **tile,
    )  # fmt: skip
    z = h if has_residual else x
    if not params["RMS"]:
        kernels.forward_centered_kernel[(m, num_chunks)](
            z, part_a, part_b, part_c, z.stride(0), n, num_chunks, CHUNKS_P2=chunks_p2, **tile
        )
    kernels.forward_output_kernel[(m, num_chunks)](
        z, w, b, y, rstd if mean is None else mean, rstd, part_a, part_b, part_c, chunk_flags,
        z.stride(0), y.stride(0),
        n, eps_bits, depth, num_chunks,
        CHUNKS_P2=chunks_p2, **params, **tile,
    )  # fmt: skip
    kernels.forward_precise_kernel[(m,)](
        z, w, b, y, part_a, chunk_flags, flags,
        z.stride(0), y.stride(0),
        n, eps_bits, depth, num_chunks,
        CHUNKS_P2=chunks_p2, **params, **tile,
    )  # fmt: skip


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no host reads then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _settle(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    flags: torch.Tensor,
) -> None:
    """Rewrites the rows the kernels left open with the exact fallback, on the host
    (``torch_._fix_rows``, the torch backend's; ``_exact`` is shared by every backend).
    Reading whether any row is open is this backend's one synchronization with a GPU
    per call (docs/contract.md §3, §5). While a CUDA graph is being captured nothing can
    be read: the open rows keep stage 2's rounding of their float64 value, the contract's
    one exception."""
    if _capturing():
        return
    flagged = flags == 1
    if not bool(flagged.any()):
        return
    n = y.shape[1]
    acc = torch.float32
    gamma = torch.ones(n, dtype=torch.float64, device=y.device)
    beta = torch.full((n,), -0.0, dtype=torch.float64, device=y.device)
    if weight is not None:
        gamma = weight.to(acc).to(torch.float64)
    if bias is not None:
        beta = bias.to(acc).to(torch.float64)
    torch_._fix_rows(y, z, gamma, beta, eps, rms, flagged)


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
    """The correctly rounded backward (docs/contract.md §3): every element of ``dx``
    (``+ dresidual_out``) is the exact result rounded once, the numba and torch
    backends' bits. The statistics come again from ``x`` and ``eps`` in float64;
    ``mean`` only shifts the sums and ``rstd`` is not read. A row the kernel's bound
    leaves open is rewritten on the host by the shared exact fallback
    (:func:`_settle_backward`: one read per call). ``dweight`` and ``dbias`` are the
    sums of ``_weight_terms``, the numba and torch backends' bits."""
    kernels = _kernels()
    shape = x.shape
    dy, x, weight = _unit_stride(matrix(dy)), _unit_stride(matrix(x)), _unit_stride(weight)
    dresidual_out = None if dresidual_out is None else _unit_stride(matrix(dresidual_out))
    with _quiet(kernels):
        dx, dweight, dbias, flags = _backward(
            kernels, dy, x, weight, mean, dresidual_out, rms, need_dweight, need_dbias, eps
        )
        _settle_backward(dx, dweight, dy, x, weight, mean, dresidual_out, eps, rms, flags)
    return dx.view(shape), dweight, dbias


def _backward(
    kernels: ModuleType,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    dresidual_out: torch.Tensor | None,
    rms: bool,
    need_dweight: bool,
    need_dbias: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The backward's launches, no host work: ``(dx, dweight, dbias, flags)``, with
    ``flags[i] & 3`` 0 where stage 1 settled row ``i``, 2 where stage 2 did and 1 where
    the row is open (its ``dx`` is then not final), and 4 added where its
    ``_weight_terms`` scalars are open (``dweight`` is then not final)."""
    m, n = x.shape
    device = x.device
    need_dweight = need_dweight and weight is not None
    dx = torch.empty((m, n), dtype=x.dtype, device=device)
    fused = uses_fused_backward(n, x.dtype)
    chunk = _next_power_of_2(n) if fused else min(BACKWARD_CHUNK_N, _next_power_of_2(n))
    rows, cols = _tile_shape(chunk)
    num_chunks = 1 if fused else -(-n // chunk)
    programs, rows_per_program = _row_blocks(m, n, num_chunks)
    blocks = -(-m // _weight_terms.ROWS)
    sums = int(need_dweight) + int(need_dbias)
    shape = (sums, blocks, n) if sums else (1, 1, 1)  # a placeholder when nothing is summed
    partial = torch.empty(shape, dtype=torch.float64, device=device)
    chunk_flags = torch.zeros((m, num_chunks), dtype=torch.int32, device=device)
    weight_flags = torch.zeros(m, dtype=torch.int32, device=device)
    scalars = partial  # (2, M) float64 for chunked rows with a dweight; else unread
    terms = x.dtype != torch.float64  # _weight_terms (float64: u = c·rstd, its accuracy)
    w = x if weight is None else weight
    shift = x if mean is None or rms else mean.contiguous()
    tile = {"ROWS": rows, "COLS": cols, **_launch(_num_warps_backward(chunk))}
    part = partial
    if not fused:
        part = torch.empty((5, m, num_chunks), dtype=torch.float64, device=device)
        kernels.backward_sums_kernel[(m, num_chunks)](
            dy, x, w, shift, part,
            dy.stride(0), x.stride(0),
            m, n, num_chunks,
            HAS_WEIGHT=weight is not None, RMS=rms, **tile,
        )  # fmt: skip
        if need_dweight and terms and m > 0:
            scalars = torch.empty((2, m), dtype=torch.float64, device=device)
            kernels.backward_scalars_kernel[(m,)](
                dy, x, w, shift, part, scalars, weight_flags,
                dy.stride(0), x.stride(0),
                m, n, _float64_bits(eps), rows + cols - 2 + num_chunks - 1, num_chunks,
                HAS_WEIGHT=weight is not None, RMS=rms,
                CHUNKS_P2=_next_power_of_2(num_chunks), **tile,
            )  # fmt: skip
    dres = dy if dresidual_out is None else dresidual_out
    if m > 0:
        kernels.backward_kernel[(programs, num_chunks)](
            dy, x, w, shift, dres, dx, partial[0], partial[sums - 1], part, chunk_flags,
            scalars, weight_flags,
            dy.stride(0), x.stride(0), dres.stride(0), dx.stride(0),
            m, n, _float64_bits(eps), rows + cols - 2 + num_chunks - 1,
            rows_per_program, num_chunks,
            HAS_WEIGHT=weight is not None, HAS_DRES=dresidual_out is not None,
            NEED_DW=need_dweight, NEED_DB=need_dbias, RMS=rms, FUSED=fused, WEIGHT_TERMS=terms,
            CHUNKS_P2=_next_power_of_2(num_chunks), **tile,
        )  # fmt: skip
    flags = chunk_flags[:, 0]
    if not fused and m > 0:
        flags = torch.empty(m, dtype=torch.int32, device=device)
        kernels.backward_precise_kernel[(m,)](
            dy, x, w, shift, dres, dx, part, chunk_flags, flags,
            dy.stride(0), x.stride(0), dres.stride(0), dx.stride(0),
            m, n, _float64_bits(eps), rows + cols - 2 + num_chunks - 1, num_chunks,
            HAS_WEIGHT=weight is not None, HAS_DRES=dresidual_out is not None, RMS=rms,
            CHUNKS_P2=_next_power_of_2(num_chunks), **tile,
        )  # fmt: skip
    # separate tensors: dweight and dbias must not alias
    totals = [torch_.block_totals(partial[k]).to(torch.float32) for k in range(sums)]
    dweight = totals[0] if need_dweight else None
    dbias = totals[-1] if need_dbias else None
    if need_dweight:
        flags = flags + 4 * weight_flags
    return dx, dweight, dbias, flags


def _settle_backward(
    dx: torch.Tensor,
    dweight: torch.Tensor | None,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    dresidual_out: torch.Tensor | None,
    eps: float,
    rms: bool,
    flags: torch.Tensor,
) -> None:
    """Rewrites the rows the kernel left open with the exact fallback on the host
    (``torch_._fix_backward_rows``, the torch backend's; ``_exact`` is shared), and
    ``dweight`` when a row's scalars are open (the torch backend's sums, whose exact
    fallback ``_exact.weight_scalars`` settles them: the same bits), as the forward's
    :func:`_settle` does: one read per call, none during a graph capture."""
    if _capturing():
        return
    flagged = (flags & 3) == 1
    if not bool((flagged | (flags >= 4)).any()):
        return
    if dweight is not None and bool((flags >= 4).any()):
        dweight.copy_(torch_.weight_gradient(dy, x, mean, eps, rms))
    if not bool(flagged.any()):
        return
    index = flagged.nonzero()[:, 0]
    gamma = torch.ones(x.shape[1], dtype=torch.float64, device=x.device)
    if weight is not None:
        gamma = weight.to(torch.float32).to(torch.float64)
    z = x[index].to(torch.float64)
    gh = dy[index].to(torch.float64) * gamma
    rho = torch.full_like(z, -0.0)
    if dresidual_out is not None:
        rho = dresidual_out[index].to(torch.float64)
    rows = dx[index]
    everything = torch.ones(len(index), dtype=torch.bool, device=x.device)
    torch_._fix_backward_rows(rows, z, gh, rho, eps, rms, everything)
    dx[index] = rows
