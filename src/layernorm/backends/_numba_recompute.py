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

``dweight``, ``dbias``: float64 partial sums per block of :data:`BLOCK` rows, added in
block order (float64) and rounded to float32: for a given ``M`` the same bits at any
thread count, since the blocks do not depend on how the rows are split over threads.
``dx``'s rows depend on their row alone.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from . import _numba_cache, _threads
from .numba_ import SERIAL_NUMEL

__all__ = ["BLOCK", "MAX_N", "backward", "runs"]

#: rows per block of the parameters' partial sums
BLOCK = 64
#: the longest row whose float64 evaluation stays within the float32 allowance (above)
MAX_N = 1 << 26


def _jit(**options):
    """``numba.njit(nogil=True)`` with the on-disk cache of ``_numba_cache``; IEEE
    division; reassociation only (the row sums vectorize; no contraction, no
    finite-math assumptions)."""

    def decorate(func):
        dispatcher = njit(nogil=True, cache=False, error_model="numpy", **options)(func)
        _numba_cache.enable(dispatcher)
        return dispatcher

    return decorate


@_jit(fastmath={"reassoc"})
def _backward_rows(
    dy, sdy, y, gamma, beta, rstd, dx, dw_part, db_part,
    n, rms, need_dw, need_db, row_lo, row_hi,
):  # fmt: skip  # pragma: no cover - compiled
    """Rows ``row_lo .. row_hi - 1`` (whole blocks of :data:`BLOCK`) of ``dx`` and their
    blocks' partial sums (module docstring). ``dy`` flat with row stride ``sdy``; ``y``,
    ``dx`` contiguous; ``gamma``, ``beta`` float64 rows; the partials ``(blocks · N)``
    float64, zeros. Two passes over the row's ``dy`` and ``y``: the sums, then ``dx`` and
    the partials (recomputing ``xhat`` and ``gh`` costs less than storing them: a third
    of the time at N = 1024)."""
    inv_gamma = 1.0 / gamma
    for i in range(row_lo, row_hi):
        g_i = dy[i * sdy : i * sdy + n]
        y_i = y[i * n : (i + 1) * n]
        s_gx = 0.0
        s_g = 0.0
        for c in range(n):
            v = (np.float64(y_i[c]) - beta[c]) * inv_gamma[c]
            h = np.float64(g_i[c]) * gamma[c]
            s_gx += h * v
            s_g += h
        c1 = s_gx / n
        c2 = 0.0 if rms else s_g / n
        r = np.float64(rstd[i])
        dx_i = dx[i * n : (i + 1) * n]
        at = (i // BLOCK) * n
        dw_i = dw_part[at : at + n] if need_dw else dw_part[:0]
        db_i = db_part[at : at + n] if need_db else db_part[:0]
        for c in range(n):
            g = np.float64(g_i[c])
            v = (np.float64(y_i[c]) - beta[c]) * inv_gamma[c]
            dx_i[c] = r * (g * gamma[c] - c2 - v * c1)
            if need_dw:
                dw_i[c] += g * v
            if need_db:
                db_i[c] += g


@_jit()
def _column_sums(part, blocks, n, out):  # pragma: no cover - compiled
    """``out[c] = RN_32(Σ_b part[b·N + c])``, the sum in block order (float64)."""
    for c in range(n):
        total = 0.0
        for b in range(blocks):
            total += part[b * n + c]
        out[c] = total


def runs(y: torch.Tensor, n: int) -> bool:
    """Whether :func:`backward` takes a backward whose saved output is ``y``, of rows of
    ``n`` elements: a CPU float32 or 16-bit tensor (float32 arithmetic in the torch
    version) with ``0 < n <=`` :data:`MAX_N`."""
    return y.is_cpu and y.dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < n <= MAX_N


def _flat(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """An (M, N) float tensor with unit column stride as (flat storage array, row stride)."""
    m, n = t.shape
    stride = t.stride(0) if m > 1 else n
    return torch.as_strided(t.detach(), ((m - 1) * stride + n,), (1,)).numpy(), stride


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
    the bound's float32 allowance covers), the sums float32 (None where not needed)."""
    m, n = y.shape
    dtype = y.dtype
    if dtype != torch.float32:  # 16-bit: float32 copies in and out
        dy, y = dy.float(), y.float()
    blocks = -(-m // BLOCK)
    dx = torch.empty((m, n), dtype=torch.float32)
    part = np.zeros((2, blocks * n) if need_dweight or need_dbias else (2, 0))
    g, sg = _flat(dy)
    args = (
        g, sg, y.detach().reshape(-1).numpy(), _row64(weight, n, 1.0), _row64(bias, n, 0.0),
        rstd.detach().reshape(-1).numpy(), dx.view(-1).numpy(), part[0], part[1],
        n, rms, need_dweight, need_dbias,
    )  # fmt: skip
    if m * n < SERIAL_NUMEL:  # as the numba backend: threads cost more than they save
        _backward_rows(*args, 0, m)
    else:
        _threads.run(lambda lo, hi: _backward_rows(*args, lo * BLOCK, min(m, hi * BLOCK)),
                     blocks, BLOCK * n)  # fmt: skip
    sums: list[torch.Tensor | None] = [None, None]
    for k, need in enumerate((need_dweight, need_dbias)):
        if need:
            total = torch.empty(n, dtype=torch.float32)
            _column_sums(part[k], blocks, n, total.numpy())
            sums[k] = total
    return dx if dtype == torch.float32 else dx.to(dtype), sums[0], sums[1]
