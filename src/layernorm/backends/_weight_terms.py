"""The terms of ``dweight`` and ``dbias``, defined once for every backend (docs/contract.md §3).

``dweight = Σ_i dy_i ⊙ u_i`` and ``dbias = Σ_i dy_i`` over the rows ``i``. The exact
normalized value ``x̂ = (z - mean)/sqrt(q + eps)`` is irrational, and each backend
computes its statistics in its own order, so ``u`` is defined from three per-row scalars
that depend on the row alone, each a correctly rounded value (Ziv's test on the
backend's float64 statistics; the rare row it leaves open is settled in double-double
by the numba kernel, ``_numba_kernels._settled_weight_scalars``, or gets them from
``_exact.weight_scalars``):

- ``a``: the row's first element (layer norm), 0 for RMSNorm;
- ``r``: ``1/sqrt(q + eps)`` rounded to nearest-even to :data:`RSTD_BITS` significant
  bits (``+inf`` when ``q + eps = 0``);
- ``t``: ``(mean - a)·(1/sqrt(q + eps))`` rounded to nearest-even to a multiple of
  :data:`SHIFT_QUANTUM` (0 for RMSNorm; a row whose ``|t|`` may reach
  :data:`SHIFT_LIMIT` is left to ``_exact``, which rounds in the same grid).

Then, in float64, each operation rounded once (never fused)::

    u = ((z - a)·r) - t          term = dy·u

and the terms are added in one order, the same on every backend: the rows in blocks of
:data:`ROWS`, each block's terms in row order starting from ``0.0``, then the blocks'
totals by halving (:data:`ROWS` rows a block, ``k`` blocks: while ``k > 1``,
``h = ceil(k/2)`` and block ``j < k - h`` takes ``block_j + block_{j+h}``), rounded once
to the accumulation dtype. IEEE operations on the same values in the same order give
the same bits, so ``dweight`` and ``dbias`` are the same on every backend, at any thread
count, for a given row count. From the roundings of ``r`` (half a unit of 32 bits), of
``t`` (``2^-33``) and of the three operations::

    |u - x̂| <= (2^-32 + 2^-52)·|z - a|·rstd + 2^-33 + 2^-53·|u|

where ``|z - a|·rstd <= 2·sqrt(N)``; ``dweight`` is then within ``Σ|dy|·|u - x̂|``, the
float64 sum's ``(M + 1)·2^-53·Σ|dy·u|`` and half a unit of its dtype of the exact
``Σ dy·x̂``. (Not correctly rounded: that is a sum of square roots, with no cheap
exact fallback.)

Standard library only: the numba and triton kernels read these constants.
"""

from __future__ import annotations

__all__ = ["MAGIC", "ROWS", "RSTD_BITS", "RSTD_LOW", "SHIFT_LIMIT", "SHIFT_QUANTUM"]

#: rows a block of the partial sums (the numba kernels' ``ROW_BLOCK``)
ROWS = 32
#: significant bits of ``r``
RSTD_BITS = 32
#: the low bits of a float64 pattern that rounding ``r`` clears
RSTD_LOW = 53 - RSTD_BITS
#: the grid of ``t``
SHIFT_QUANTUM = 2.0**-32
#: ``|t|`` below which the float rounding to the grid is exact (``MAGIC`` below)
SHIFT_LIMIT = 2.0**19
#: ``(v + MAGIC) - MAGIC`` rounds ``|v| < 2^51`` to an integer, ties to even
MAGIC = 1.5 * 2.0**52
