"""The backward of ``memory_efficient=True`` (:mod:`layernorm.recompute`) in numba: ``dx``
and the column sums for ``dweight`` / ``dbias`` from the saved output ``y``, the
parameters and ``rstd``, two passes over each row of ``dy`` and ``y``, instead of a
dozen torch operations over full-size temporaries.

For row ``i`` of ``(M, N)`` rows, with every operation in float64::

    xhat = (y − beta) · (1/gamma)        gh = g · gamma
    c1 = Σ gh·xhat / N                   c2 = Σ gh / N   (0 for RMSNorm)
    dx = RN_32(rstd · (gh − c2 − xhat·c1))   (a 16-bit dx: then rounded to its dtype)
    dweight partial += g · xhat          dbias partial += g

The formula is :mod:`layernorm.recompute`'s; only the arithmetic's precision differs:
float64 (unit roundoff ``2^-53``) where the torch operations compute in float32, for
float32 and 16-bit inputs. Each of its roundings is below the float32 one that the
bound of :mod:`layernorm.recompute` allows for, term by term, for rows of up to
:data:`MAX_N` elements: the row sums are reassociated (``fastmath`` with reassociation
only, so that LLVM vectorizes them), and a float64 sum of ``N`` terms in any order errs
by at most ``(N − 1)·2^-53`` of the sum of their magnitudes, below ``2^-27`` of it
(``docs/contract.md`` §3, "memory_efficient's backward", derives the rest). float64
inputs, whose allowance is ``(log2(N) + 8)·2^-53``, keep the torch operations
(:func:`runs`).

``dweight``, ``dbias``: float64 partial sums per block of :data:`BLOCK` rows, added by
halving in float64 (``_numba_kernels.column_sum_kernel``, as the plain backward's) and
rounded to float32: for a given ``M`` the same bits at any thread count, since the
blocks do not depend on how the rows are split over threads. ``dx``'s rows depend on
their row alone.

:func:`entry` compiles the same kernels as a C entry (``_kernel_abi.MEMORY_EFFICIENT_BACKWARD``)
for the compiled front door's autograd node (``layernorm._compiled.cpp``,
``MemoryEfficientBackward``), which adds the partials with the plain backward's
``column_sums`` entry: the same bits as :func:`backward`.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from . import _numba_cache, _numba_vectors, _threads, numba_
from ._numba_vectors import view
from .numba_ import SERIAL_NUMEL

__all__ = [
    "BLOCK",
    "DEPENDS_SHA256",
    "ENTRY_DTYPES",
    "MAX_N",
    "backward",
    "depends_digest",
    "entry",
    "runs",
]

#: numba caches these kernels keyed on this file alone: the start of the SHA-256 of the
#: ``_numba_vectors`` code their C entry compiles in (:func:`depends_digest`), so that a
#: change there changes this file (``tests/test_options.py`` fails until this is updated)
DEPENDS_SHA256 = "9fe892e488f0d1f0"


def depends_digest() -> str:
    """sha256 (16 hex digits) of the ``_numba_vectors`` functions :func:`entry` inlines."""
    return _numba_cache.source_digest(_numba_vectors.view.py_func, _numba_vectors._pointer)


#: rows per block of the parameters' partial sums
BLOCK = 64
#: the longest row whose float64 evaluation stays within the float32 allowance (above)
MAX_N = 1 << 26
#: the dtypes :func:`entry` compiles for (float16 goes through float32 copies in Python)
ENTRY_DTYPES = (torch.float32, torch.bfloat16)


def _jit(**options):
    """``numba.njit(nogil=True)`` with the on-disk cache of ``_numba_cache``; IEEE
    division; reassociation only (the row sums vectorize; no contraction, no
    finite-math assumptions)."""

    def decorate(func):
        dispatcher = njit(nogil=True, cache=False, error_model="numpy", **options)(func)
        if not options.get("inline"):  # an inlined one compiles into its callers
            _numba_cache.enable(dispatcher)
        return dispatcher

    return decorate


@_jit(inline="always")
def _row(g_i, y_i, gamma, inv_gamma, beta, r, dx_i, dw_i, db_i, n, rms, need_dw, need_db):
    """One row (module docstring): ``g_i``, ``y_i``, ``dx_i`` float32 rows, ``dw_i``,
    ``db_i`` its block's partials. Passes over the row (in cache): the sums, then ``dx``,
    then each partial (recomputing ``xhat`` and ``gh`` costs less than storing them: a
    third of the time at N = 1024). One loop per output array: LLVM vectorizes a loop
    only where it can check at run time that its stores overlap no other array, and a
    loop storing ``dx`` and both partials had too many pairs to check (1.8 → 1.1 ns an
    element at N = 1024; the same operations, so the same bits)."""  # pragma: no cover - compiled
    s_gx = 0.0
    s_g = 0.0
    for c in range(n):
        v = (np.float64(y_i[c]) - beta[c]) * inv_gamma[c]
        h = np.float64(g_i[c]) * gamma[c]
        s_gx += h * v
        s_g += h
    c1 = s_gx / n
    c2 = 0.0 if rms else s_g / n
    for c in range(n):
        v = (np.float64(y_i[c]) - beta[c]) * inv_gamma[c]
        dx_i[c] = r * (np.float64(g_i[c]) * gamma[c] - c2 - v * c1)
    if need_dw:
        for c in range(n):
            dw_i[c] += np.float64(g_i[c]) * ((np.float64(y_i[c]) - beta[c]) * inv_gamma[c])
    if need_db:
        for c in range(n):
            db_i[c] += np.float64(g_i[c])


@_jit(fastmath={"reassoc"})
def _backward_rows(
    dy, sdy, y, gamma, beta, rstd, dx, dw_part, db_part,
    n, rms, need_dw, need_db, row_lo, row_hi,
):  # fmt: skip  # pragma: no cover - compiled
    """Rows ``row_lo .. row_hi - 1`` (whole blocks of :data:`BLOCK`) of ``dx`` and their
    blocks' partial sums (:func:`_row`), float32. ``dy`` flat with row stride ``sdy``;
    ``y``, ``dx`` contiguous; ``gamma``, ``beta`` float64 rows; the partials
    ``(blocks · N)`` float64, zeros."""
    inv_gamma = 1.0 / gamma
    for i in range(row_lo, row_hi):
        at = (i // BLOCK) * n
        _row(
            dy[i * sdy : i * sdy + n], y[i * n : (i + 1) * n], gamma, inv_gamma, beta,
            np.float64(rstd[i]), dx[i * n : (i + 1) * n],
            dw_part[at : at + n] if need_dw else dw_part[:0],
            db_part[at : at + n] if need_db else db_part[:0],
            n, rms, need_dw, need_db,
        )  # fmt: skip


#: float32 bit masks and constants of the rounding to bfloat16
_ABS, _INF, _HALF = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000), np.uint32(0x7FFF)
_16, _ONE, _QNAN = np.uint32(16), np.uint32(1), np.uint16(0x7FC0)


@_jit(fastmath={"reassoc"})
def _backward_rows_bf16(
    dy, sdy, y, gamma, beta, rstd, dx, dw_part, db_part,
    n, rms, need_dw, need_db, row_lo, row_hi,
):  # fmt: skip  # pragma: no cover - compiled
    """:func:`_backward_rows` on bfloat16 rows (``dy``, ``y``, ``dx`` as their uint16
    bit patterns): each row widened to float32 (exact: the high half of its bits), then
    :func:`_row`, then ``dx`` rounded to bfloat16 to nearest-even (a NaN to ``0x7FC0``):
    the bits of the float32 path followed by ``.to(bfloat16)`` (NaN payloads aside),
    without full-size float32 copies."""
    inv_gamma = 1.0 / gamma
    g32 = np.empty(n, np.uint32)
    y32 = np.empty(n, np.uint32)
    dz = np.empty(n, np.float32)
    dz_bits = dz.view(np.uint32)
    for i in range(row_lo, row_hi):
        # row slices: an index computed per element (i * n + c) does not vectorize
        g_i, y_i, dx_i = dy[i * sdy : i * sdy + n], y[i * n : (i + 1) * n], dx[i * n : (i + 1) * n]
        for c in range(n):
            g32[c] = np.uint32(g_i[c]) << _16
            y32[c] = np.uint32(y_i[c]) << _16
        at = (i // BLOCK) * n
        _row(
            g32.view(np.float32), y32.view(np.float32), gamma, inv_gamma, beta,
            np.float64(rstd[i]), dz,
            dw_part[at : at + n] if need_dw else dw_part[:0],
            db_part[at : at + n] if need_db else db_part[:0],
            n, rms, need_dw, need_db,
        )  # fmt: skip
        for c in range(n):
            b = dz_bits[c]
            nan = (b & _ABS) > _INF
            rounded = (b + _HALF + ((b >> _16) & _ONE)) >> _16  # to nearest-even
            dx_i[c] = _QNAN if nan else np.uint16(rounded)


def runs(y: torch.Tensor, n: int) -> bool:
    """Whether :func:`backward` takes a backward whose saved output is ``y``, of rows of
    ``n`` elements: a CPU float32 or 16-bit tensor (float32 arithmetic in the torch
    version) with ``0 < n <=`` :data:`MAX_N`."""
    return y.is_cpu and y.dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < n <= MAX_N


def _flat(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """An (M, N) float32 or bfloat16 tensor with unit column stride as (flat storage
    array, row stride); bfloat16 as its uint16 bit patterns."""
    m, n = t.shape
    stride = t.stride(0) if m > 1 else n
    span = torch.as_strided(t.detach(), ((m - 1) * stride + n,), (1,))
    if t.dtype == torch.bfloat16:
        return span.view(torch.int16).numpy().view(np.uint16), stride
    return span.numpy(), stride


#: (N, value) -> a cached (N,) float64 row of ``value`` (an absent gamma or beta)
_rows: dict[tuple[int, float], np.ndarray] = {}


def _row64(p: torch.Tensor | None, n: int, default: float) -> np.ndarray:
    """``p`` as a float64 row (exact), or a cached row of ``default``."""
    if p is not None:
        return p.detach().to(torch.float64).numpy()
    row = _rows.get((n, default))
    if row is None:
        if len(_rows) > 16:
            _rows.clear()
        row = _rows[(n, default)] = np.full(n, default)
    return row


def backward(
    dy: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rstd: torch.Tensor,
    rms: bool,
    need_dweight: bool,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight, dbias)`` of (M, N) rows (:func:`runs` holds for ``y``): ``dy``
    with unit column stride, ``y`` contiguous, ``weight`` / ``bias`` (N,) or None,
    ``rstd`` (M,) float32. ``dx`` in ``y``'s dtype (16-bit: rounded from float32, which
    the bound's float32 allowance covers; bfloat16 rows in the kernel, float16 through
    float32 copies), the sums float32 (None where not needed)."""
    m, n = y.shape
    dtype = y.dtype
    if dtype == torch.float16:  # float32 copies in and out
        dy, y = dy.float(), y.float()
    kernel = _backward_rows_bf16 if dtype == torch.bfloat16 else _backward_rows
    blocks = -(-m // BLOCK)
    dx = torch.empty((m, n), dtype=y.dtype)
    part = np.zeros((2, blocks * n) if need_dweight or need_dbias else (2, 0))
    args = (
        *_flat(dy), _flat(y)[0], _row64(weight, n, 1.0), _row64(bias, n, 0.0),
        rstd.detach().reshape(-1).numpy(), _flat(dx)[0], part[0], part[1],
        n, rms, need_dweight, need_dbias,
    )  # fmt: skip
    if m * n < SERIAL_NUMEL:  # as the numba backend: threads cost more than they save
        kernel(*args, 0, m)
    else:
        _threads.run(lambda lo, hi: kernel(*args, lo * BLOCK, min(m, hi * BLOCK)),
                     blocks, BLOCK * n)  # fmt: skip
    sums: list[torch.Tensor | None] = [None, None]
    for k, need in enumerate((need_dweight, need_dbias)):
        if need:
            total = torch.empty(n, dtype=torch.float32)
            numba_._kernels().column_sum_kernel(part[k], blocks, n, total.numpy())
            sums[k] = total
    return dx if dx.dtype == dtype else dx.to(dtype), sums[0], sums[1]


_F32_TAG = np.empty(0, np.float32)
_F64_TAG = np.empty(0, np.float64)


@_jit(inline="always")
def _entry_views(
    tag, dy, dy_stride, y, gamma, beta, rstd, dx, dw_part, db_part, m, n
):  # pragma: no cover - compiled
    """The arrays :func:`backward` passes the kernels, as views of the entry's addresses
    (the partials' views whole: a kernel that does not need one never reads it)."""
    blocks = (m + BLOCK - 1) // BLOCK
    return (
        view(dy, (m - 1) * dy_stride + n, tag), dy_stride, view(y, m * n, tag),
        view(gamma, n, _F64_TAG), view(beta, n, _F64_TAG), view(rstd, m, _F32_TAG),
        view(dx, m * n, tag), view(dw_part, blocks * n, _F64_TAG),
        view(db_part, blocks * n, _F64_TAG),
    )  # fmt: skip


def entry(name: str, storage_tag: np.ndarray):
    """The C entry "memory_efficient_backward" (``_kernel_abi.MEMORY_EFFICIENT_BACKWARD``)
    for ``storage_tag``'s dtype (float32, or bfloat16 as its uint16 patterns:
    :data:`ENTRY_DTYPES`): :func:`_backward_rows` (:func:`_backward_rows_bf16`) on views of
    the addresses, the arrays :func:`backward` passes, so the bits are the same; compiled
    now (or loaded from the on-disk cache); the address: ``_numba_kernels.address``."""
    from ._numba_kernels import _check_parameters, entry_type

    if name != "memory_efficient_backward":
        raise ValueError(f"unknown memory-efficient entry {name!r}")
    if storage_tag.dtype not in (np.float32, np.uint16):
        raise ValueError(f"no memory-efficient entry for {storage_tag.dtype}")
    tag = storage_tag
    # the kernels as globals (a compiled function in the closure would defeat the cache)
    if tag.dtype == np.float32:

        def memory_efficient_backward(dy, dy_stride, y, gamma, beta, rstd, dx, dw_part, db_part, m, n, rms, need_dw, need_db, row_lo, row_hi):  # fmt: skip  # pragma: no cover - compiled
            _backward_rows(*_entry_views(tag, dy, dy_stride, y, gamma, beta, rstd, dx, dw_part, db_part, m, n), n, rms, need_dw, need_db, row_lo, row_hi)  # fmt: skip

    else:

        def memory_efficient_backward(dy, dy_stride, y, gamma, beta, rstd, dx, dw_part, db_part, m, n, rms, need_dw, need_db, row_lo, row_hi):  # fmt: skip  # pragma: no cover - compiled
            _backward_rows_bf16(*_entry_views(tag, dy, dy_stride, y, gamma, beta, rstd, dx, dw_part, db_part, m, n), n, rms, need_dw, need_db, row_lo, row_hi)  # fmt: skip

    _check_parameters(memory_efficient_backward, name)
    # one name per entry and dtype (numba_kernels.entry says why)
    memory_efficient_backward.__name__ = memory_efficient_backward.__qualname__ = (
        f"{name}_{tag.dtype.name}"
    )
    dispatcher = _jit()(memory_efficient_backward)
    dispatcher.compile(entry_type(name))
    dispatcher.disable_compile()
    return dispatcher
