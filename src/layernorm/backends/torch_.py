"""Portable backend: layer norm and RMSNorm in plain torch operations, on any device.

It defines the kernel contract every backend follows (see ``layernorm.backends``):

- ``x``, ``residual``, ``dy``, ``dresidual_out``: ``(*, N)`` tensors of one floating
  dtype holding M rows: contiguous of any dim (a 1-D one is one row), or 2-D with
  contiguous rows (``stride(1) == 1``) and an arbitrary ``stride(0)``. The arguments of
  one call have one shape, except that ``dy`` and ``dresidual_out`` may come as the
  (M, N) rows of a tensor shaped like ``x``.
- ``weight``, ``bias``: ``(N,)`` contiguous or ``None``; any floating dtype.
- Arithmetic in the accumulation dtype: float64 for float64 input, else float32.
  ``mean`` and ``rstd`` are ``(M,)`` in that dtype; ``mean`` is ``None`` for RMSNorm.
- ``forward`` returns ``y`` (contiguous, shaped like ``x``, ``x``'s dtype),
  ``residual_out = x + residual``
  (``x``'s dtype, or ``None`` without a residual; the normalization reads the rounded
  ``residual_out``), ``mean`` and ``rstd``.
- ``backward`` gets the normalized input (``residual_out`` when there was a residual) as
  ``x`` and returns ``dx`` (shaped like ``x``, ``x``'s dtype, ``+ dresidual_out`` when
  given) and
  ``dweight``/``dbias`` in the accumulation dtype, or ``None`` when not asked for.
  ``mean`` is rounded to the statistics dtype, so ``backward`` re-centers: with
  ``d = x − mean``, ``u = (d − mean(d)) · rstd``; otherwise the gradient's error would grow
  with the row's offset (7e−3 at offset 1e6 in float32) while the forward's does not.

Statistics are the corrected two-pass of SPEC §3. Reductions go through :func:`row_sum`
and :func:`column_sum`, whose summation order depends only on N (and the row
partition), never on M or the thread count: torch's own reductions split a long single
row across threads, which would make a row's result depend on its batch.
Trade-off: this backend makes full-size float32 temporaries; the numba and triton
backends do not.
"""

from __future__ import annotations

import torch

CHUNK = 4096  # a reduction of <= 32768 elements is never split by torch's CPU reducer
ROW_BLOCK = 1024  # fixed row partition for dweight/dbias partial sums


def unavailable_reason() -> str | None:
    return None


def cannot_run(x: torch.Tensor) -> str | None:
    return None


def prefers(x: torch.Tensor) -> bool:
    return True


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def matrix(t: torch.Tensor) -> torch.Tensor:
    """A ``(*, N)`` argument as the (M, N) matrix of its rows (a view where it can; M is
    left to ``reshape`` so that a traced graph keeps it symbolic)."""
    if t.dim() == 2:
        return t
    n = t.shape[-1]
    if n > 0:
        return t.reshape(-1, n)
    m = 1
    for size in t.shape[:-1]:
        m *= size
    return t.reshape(m, n)


def contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit column stride, copied only when it has none: autograd hands a
    backward expanded gradients (``y.sum().backward()``: strides (0, 0))."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def row_sum(t: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Sums each row of ``t`` (M, N) in an order that depends only on N. (``chunk`` is
    a parameter because TorchScript reads no globals.)"""
    n = t.shape[1]
    if n <= chunk:
        return t.sum(1)
    k = n // chunk
    total = t[:, : k * chunk].reshape(-1, k, chunk).sum(2).sum(1)
    return total + t[:, k * chunk :].sum(1) if n % chunk else total


def column_sum(t: torch.Tensor) -> torch.Tensor:
    """Sums the rows of ``t`` (M, N) over a fixed partition into blocks of ROW_BLOCK rows."""
    m, n = t.shape
    k = m // ROW_BLOCK
    partial = t[: k * ROW_BLOCK].reshape(k, ROW_BLOCK, n).sum(1)
    rest = t[k * ROW_BLOCK :].sum(0)
    return torch.cat([partial, rest[None]]).sum(0)


def forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    # (written for TorchScript too: the scripted modules run it, docs/contract.md §6)
    acc = accumulation_dtype(x.dtype)
    shape = x.shape
    rows = matrix(x)
    residual_out: torch.Tensor | None = None
    z = rows.to(acc)
    if residual is not None:
        h = (z + matrix(residual).to(acc)).to(x.dtype)
        residual_out = h.view(shape)
        z = h.to(acc)
    n = z.shape[1]
    mean: torch.Tensor | None = None
    if rms:
        rstd = torch.rsqrt(row_sum(z * z) / n + eps)
        u = z * rstd[:, None]
    else:
        m1 = row_sum(z) / n
        d = z - m1[:, None]
        delta = row_sum(d) / n
        mean = m1 + delta
        c = d - delta[:, None]
        rstd = torch.rsqrt(row_sum(c * c) / n + eps)
        u = c * rstd[:, None]
    y = u
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype).contiguous().view(shape), residual_out, mean, rstd


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
    acc = accumulation_dtype(x.dtype)
    shape = x.shape
    z = matrix(x).to(acc)
    g = matrix(dy).to(acc)
    n = z.shape[1]
    gh = g if weight is None else g * weight.to(acc)
    if rms:
        u = z * rstd[:, None]
        c1 = row_sum(gh * u) / n
        dx = rstd[:, None] * (gh - u * c1[:, None])
    else:
        # The saved mean is rounded to float32; re-centering by mean(z - mean) makes u exact
        # to the ulp of the centered values, whatever the row's offset (as in the forward).
        assert mean is not None  # the contract: mean is None only for RMSNorm
        d = z - mean[:, None]
        delta = row_sum(d) / n
        u = (d - delta[:, None]) * rstd[:, None]
        c1 = row_sum(gh * u) / n
        c2 = row_sum(gh) / n
        dx = rstd[:, None] * (gh - c2[:, None] - u * c1[:, None])
    if dresidual_out is not None:
        dx = dx + matrix(dresidual_out).to(acc)
    dweight = column_sum(g * u) if need_dweight else None
    dbias = column_sum(g) if need_dbias else None
    return dx.to(x.dtype).reshape(shape), dweight, dbias
