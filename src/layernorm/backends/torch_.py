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
- ``forward`` returns ``y`` (contiguous, shaped like ``x``, ``x``'s dtype, or
  ``out_dtype`` when given: a keyword argument after ``stats``, ``None`` or a dtype of
  :data:`OUT_DTYPES` no wider than ``x``'s or of its accumulation dtype (float32 from a
  16-bit ``x``), each element rounded once into it:
  docs/contract.md §3), ``residual_out = x + residual``
  (``x``'s dtype, or ``None`` without a residual; the normalization reads the rounded
  ``residual_out``), ``mean`` and ``rstd``.
- ``backward`` gets the normalized input (``residual_out`` when there was a residual) as
  ``x`` and returns ``dx`` (shaped like ``x``, ``x``'s dtype, ``+ dresidual_out`` when
  given) and
  ``dweight``/``dbias`` in the accumulation dtype, or ``None`` when not asked for.
  ``backward`` also gets the forward's ``eps``; :func:`backward` recomputes the row
  statistics from ``x`` and ``eps`` and rounds ``dx`` correctly (docs/contract.md §3).

Statistics are the corrected two-pass of docs/contract.md §3. Reductions go through :func:`row_sum`
and :func:`column_sum`, whose summation order depends only on N (and the row
partition), never on M or the thread count: torch's own reductions split a long single
row across threads, which would make a row's result depend on its batch.
Trade-off: this backend makes full-size float32 temporaries; the numba and triton
backends do not.
"""

from __future__ import annotations

import torch

from . import _weight_terms

CHUNK = 4096  # a reduction of <= 32768 elements is never split by torch's CPU reducer


#: the dtypes ``forward``'s ``y`` may have apart from ``x``'s (``out_dtype``), when no
#: wider than it or of its accumulation dtype (float32 from bfloat16 or float16; a wider
#: output is otherwise the input converted exactly, then normalized: ``layernorm.options``)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    """The column sums of ``t`` (M, N) in the order of :mod:`._weight_terms`: blocks of
    ``ROWS`` rows, each added row by row from ``0.0``, then :func:`block_totals`. The
    same bits as the numba and triton backends' sums of the same terms. (A short last
    block takes no addition past its rows: adding ``+0.0`` would change no partial sum,
    none of which is ``-0.0``. No padding, which for one wide row would be 31 copies.)"""
    m, n = t.shape
    rows = _weight_terms.ROWS
    full, short = divmod(m, rows)
    whole = t[: full * rows].reshape(full, rows, n)
    last = t[full * rows :]
    partial = t.new_zeros(full + (short > 0), n)
    for j in range(rows):
        partial[:full] += whole[:, j]
        if j < short:
            partial[full] += last[j]
    return block_totals(partial)


def block_totals(partial: torch.Tensor) -> torch.Tensor:
    """The column sums of the blocks' partial sums ``partial`` (k, N) by halving, as
    :mod:`._weight_terms` adds them: while ``k > 1``, ``h = ceil(k/2)`` and row
    ``j < k - h`` takes ``row_j + row_{j+h}``. Zeros for ``k = 0``."""
    if partial.shape[0] == 0:
        return partial.new_zeros(partial.shape[1])
    while partial.shape[0] > 1:
        k = partial.shape[0]
        h = (k + 1) // 2
        partial = torch.cat([partial[: k - h] + partial[h:], partial[k - h : h]])
    return partial[0]


def portable_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    stats: bool = True,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The decomposition (``_op.decomposition``, ``_op.scripted_norm``: what tracing,
    scripting, export and ONNX record): the corrected two-pass in the accumulation dtype
    (float32 for every dtype but float64), then one conversion to x's dtype (or
    ``out_dtype``). It is within the bounds of docs/contract.md §3 but not correctly
    rounded; the backend's :func:`forward` is. Written for TorchScript too."""
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
    y_dtype = x.dtype if out_dtype is None else out_dtype
    return y.to(y_dtype).contiguous().view(shape), residual_out, mean, rstd


# ---------------------------------------------------------------------------------------
# The correctly rounded forward (docs/contract.md §3): float64, a bound per element, one
# rounding, and the exact fallback (layernorm.backends._exact) for flagged rows

_U = 2.0**-53
_SLACK = 1.0 + 2.0**-30
SUM_CHUNK = 256  # float64 sums: chunks of 256, so no path through a sum has more adds


def _sum64(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each row's sum of the float64 (M, N) ``t``, and a bound on the additions along any
    path of it (whatever order torch adds a chunk of 256 in): chunks of
    :data:`SUM_CHUNK`, zero-padded, summed level by level."""
    depth = 0
    while t.shape[1] > 1:
        n = t.shape[1]
        k = -(-n // SUM_CHUNK)
        if k * SUM_CHUNK != n:
            t = torch.nn.functional.pad(t, (0, k * SUM_CHUNK - n))
        t = t.reshape(t.shape[0], k, SUM_CHUNK).sum(2)
        depth += min(n, SUM_CHUNK)
    return t[:, 0], depth


def round_once(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``values`` rounded once to nearest-even in ``dtype``: float32 directly,
    float16 and bfloat16 through float32 rounded to odd (torch's float64 to float16
    conversion rounds twice, through float32)."""
    single = values.to(torch.float32)
    if dtype == torch.float32 or dtype == torch.float64:
        return values.to(dtype)
    back = single.to(torch.float64)
    bits = single.view(torch.int32)
    bits = torch.where(back.abs() > values.abs(), bits - 1, bits)
    bits = bits | ((back != values) & ~values.isnan()).to(torch.int32)
    return bits.view(torch.float32).to(dtype)


def _storage_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    stats: bool = True,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The backend's forward: every output element of a float32, float16 or bfloat16
    output is the exact result rounded once (docs/contract.md §3); a float64 output is
    :func:`portable_forward`'s. ``y`` has x's dtype, or ``out_dtype`` when given: float32,
    bfloat16 or float16, from any input (a float64 one included: the same float64
    arithmetic, bound and test, rounded into ``out_dtype``). Rows whose rounding the
    float64 bound leaves open are recomputed exactly on the host (``_exact``); on a GPU,
    reading the flags synchronizes (docs/contract.md §3 says so)."""
    y_dtype = x.dtype if out_dtype is None else out_dtype
    if y_dtype == torch.float64 or x.numel() == 0:
        return portable_forward(x, residual, weight, bias, eps, rms, stats, out_dtype)
    acc = accumulation_dtype(x.dtype)
    shape = x.shape
    rows = matrix(x)
    residual_out: torch.Tensor | None = None
    if residual is not None:  # one rounding: float32 holds the sum of two halves exactly
        h = (rows.to(acc) + matrix(residual).to(acc)).to(x.dtype)
        residual_out = h.view(shape)
        rows = h
    z = rows.to(torch.float64)
    n = z.shape[1]
    gamma = torch.ones(n, dtype=torch.float64, device=z.device)
    beta = torch.full((n,), -0.0, dtype=torch.float64, device=z.device)
    if weight is not None:
        gamma = weight.to(acc).to(torch.float64)
    if bias is not None:
        beta = bias.to(acc).to(torch.float64)
    if rms:
        s2, depth = _sum64(z * z)
        var = s2 / n
        m1 = delta = torch.zeros_like(var)
        e_mean = torch.zeros_like(var)
        k_c = 0.0  # c = d = z, exactly
        paths = (depth + 1) * _U
        e_var = 1.01 * ((paths / (1 - paths) + 2 * _U) * var + _U * var)
        mean = None
    else:
        total, depth = _sum64(z)
        m1 = total / n
        d = z - m1[:, None]
        s1, _ = _sum64(d)
        s2, _ = _sum64(d * d)
        delta = s1 / n
        mean = (m1 + delta).to(acc)
        paths = (depth + 1) * _U
        gamma_h = paths / (1 - paths)
        e_mean = 1.01 * ((gamma_h + 2 * _U) * (1.001 * (n * s2).sqrt()) / n + _U * delta.abs())
        var = (s2 / n - delta * delta).clamp_min(0.0)
        k_c = 1.01 * _U
        e_var = 1.01 * (
            (gamma_h + 3 * _U) * (s2 / n) + e_mean * (2 * delta.abs() + e_mean)
            + _U * (delta * delta + var)
        )  # fmt: skip
    s = var + eps
    e_s = e_var + 1.01 * _U * s
    loose = e_s >= 0.01 * s
    e_r = 0.51 * (e_s / (s - e_s)) + 2.01 * _U
    rstd = 1.0 / s.sqrt()
    k_p = (2.01 * _U + 1.02 * e_r) * _SLACK
    k_w = rstd * (1.0 + 1.02 * e_r) * _SLACK
    k_y = 2.1 * _U * _SLACK
    d = z - m1[:, None]
    c = d - delta[:, None]
    p = c * rstd[:, None] * gamma
    yh = p + beta
    e_c = (c.abs() + d.abs()) * k_c + e_mean[:, None]
    bound = e_c * gamma.abs() * k_w[:, None] + p.abs() * k_p[:, None] + yh.abs() * k_y
    y = round_once(yh, y_dtype)
    low = _storage_bits(round_once(yh - bound, y_dtype))
    high = _storage_bits(round_once(yh + bound, y_dtype))
    flagged = (low != high).any(1) | loose
    if bool(flagged.any()):
        _fix_rows(y, rows, gamma, beta, eps, rms, flagged)
    return y.contiguous().view(shape), residual_out, mean, rstd.to(acc)


def _fix_rows(
    y: torch.Tensor,
    rows: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    rms: bool,
    flagged: torch.Tensor,
) -> None:
    """Rewrites the flagged rows of ``y`` (M, N) with the exact fallback, on the host."""
    from . import _exact

    index = flagged.nonzero()[:, 0]
    values = rows[index].to(torch.float64).cpu().numpy()
    finite, fixed = _exact.fix_forward_rows(
        values, gamma.cpu().numpy(), beta.cpu().numpy(), eps, rms, y.dtype
    )
    storage = y.view(_exact.STORAGE[y.dtype])
    keep = index[torch.from_numpy(finite).to(index.device)]
    storage[keep] = torch.from_numpy(fixed).to(y.device)


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
    need_dx: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backend's backward: every element of ``dx`` (``+ dresidual_out``) of a
    float32, float16 or bfloat16 input is the exact result rounded once
    (docs/contract.md §3, the same algorithm as the numba kernel: five float64 row sums,
    the row constants of the bound, Ziv's test, the exact fallback of ``_exact`` for
    flagged rows); float64 input gets the same float64 arithmetic without the test. The
    statistics are computed again from ``x`` (the normalized input) and ``eps``; ``mean``
    only shifts the sums and ``rstd`` is not read. ``dweight`` and ``dbias`` are the
    float64 sums of ``dy * u`` and ``dy`` over a fixed partition of the rows
    (:func:`column_sum`), rounded to the accumulation dtype. Without ``need_dx``, ``dx``
    is an empty tensor and costs nothing (neither its pass nor its exact fallback)."""
    acc = accumulation_dtype(x.dtype)
    shape = x.shape
    z = matrix(x).to(torch.float64)
    g = matrix(dy).to(torch.float64)
    m, n = z.shape
    gamma = torch.ones(n, dtype=torch.float64, device=z.device)
    if weight is not None:
        gamma = weight.to(acc).to(torch.float64)
    rho = torch.full((n,), -0.0, dtype=torch.float64, device=z.device)[None, :]
    if dresidual_out is not None:
        rho = matrix(dresidual_out).to(torch.float64)
    if z.numel() == 0:
        zeros = torch.zeros(n, dtype=acc, device=z.device)
        dx = (z + rho).to(x.dtype).reshape(shape)
        return dx, zeros if need_dweight else None, zeros.clone() if need_dbias else None
    gh = g * gamma  # exact: 24-bit by 24-bit
    m1 = torch.zeros(m, dtype=torch.float64, device=z.device)
    if not rms and mean is not None:
        m1 = mean.to(torch.float64)
        m1 = torch.where(m1.isfinite(), m1, torch.zeros_like(m1))
    d = z - m1[:, None]
    s_dd, depth = _sum64(d * d)
    s_gg, _ = _sum64(gh * gh)
    s_gd, _ = _sum64(gh * d)
    paths = (depth + 1) * _U
    gamma_h = paths / (1 - paths)
    d_abs = 1.001 * (n * s_dd).sqrt()
    g_abs = 1.001 * (n * s_gg).sqrt()
    p_abs = 1.001 * s_gg.sqrt() * s_dd.sqrt()
    zero = torch.zeros_like(s_dd)
    if rms:
        delta = e_mean = c2 = e_c2 = a2 = zero
        var = s_dd / n
        e_var = 1.01 * ((gamma_h + 3 * _U) * var + _U * var)
        alpha = 0.0
    else:
        s_d, _ = _sum64(d)
        s_g, _ = _sum64(gh)
        delta = s_d / n
        e_mean = 1.01 * ((gamma_h + 2 * _U) * d_abs / n + _U * delta.abs())
        var = (s_dd / n - delta * delta).clamp_min(0.0)
        e_var = 1.01 * (
            (gamma_h + 3 * _U) * (s_dd / n) + e_mean * (2 * delta.abs() + e_mean)
            + _U * (delta * delta + var)
        )  # fmt: skip
        c2 = s_g / n
        e_c2 = 1.01 * (gamma_h * g_abs / n + _U * c2.abs())
        a2 = delta * c2
        alpha = 2.04 * _U
    a1 = s_gd / n
    a = a1 - a2
    e_a = 1.01 * (
        _U * (a.abs() + a1.abs() + a2.abs()) + (gamma_h + 2.01 * _U) * p_abs / n
        + e_mean * c2.abs() + (delta.abs() + e_mean) * e_c2
    )  # fmt: skip
    s = var + eps
    e_s = e_var + 1.01 * _U * s
    loose = e_s >= 0.01 * s
    e_r = 0.51 * (e_s / (s - e_s)) + 2.01 * _U
    r = 1.0 / s.sqrt()
    k = r * r * r * a
    r_hi = r * (1.0 + 1.01 * e_r)
    e_k = 3.02 * _U * k.abs() + r_hi * r_hi * r_hi * (3.03 * e_r * a.abs() + e_a)
    beta = 1.01 * _U * delta.abs() + e_mean
    k_t1 = r_hi * (e_r + _U) + 2.02 * _U * r  # (+ the roundings of t2, t3, t2 - t3)
    k_c = k.abs() * (alpha + 2.02 * _U) + e_k * (1.0 + alpha)
    k_0 = r_hi * e_c2 + beta * (k.abs() + e_k)
    c = d - delta[:, None]
    dweight = None
    if need_dweight and x.dtype == torch.float64:  # float64's accuracy, not shared bits
        dweight = column_sum(g * (c * r[:, None]))
    elif need_dweight:
        scalars = _weight_scalars(z, m1, delta, e_mean, r, e_r, loose, eps, rms)
        dweight = column_sum(g * weight_terms(z, *scalars)).to(acc)
    dbias = column_sum(g).to(acc) if need_dbias else None
    if not need_dx:
        return x.new_empty(0), dweight, dbias
    t1 = gh - c2[:, None]
    t2 = r[:, None] * t1
    t3 = k[:, None] * c
    t4 = t2 - t3
    y = (t4 + rho) + 0.0
    dx = round_once(y, x.dtype)
    if x.dtype != torch.float64:
        bound = k_t1[:, None] * t1.abs() + k_c[:, None] * c.abs() + k_0[:, None]
        bound = bound * _SLACK + y.abs() * (3.1 * _U * _SLACK)
        low = _storage_bits(round_once(y - bound, x.dtype))
        high = _storage_bits(round_once(y + bound, x.dtype))
        flagged = (low != high).any(1) | loose
        if bool(flagged.any()):
            _fix_backward_rows(dx, z, gh, rho.expand(m, n), eps, rms, flagged)
    return dx.contiguous().reshape(shape), dweight, dbias


def weight_gradient(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None, eps: float, rms: bool
) -> torch.Tensor:
    """:func:`backward`'s ``dweight`` alone (no ``dx``: with ``weight`` absent, its rows
    could all be left open, each costing the exact fallback): the numba and triton
    backends' fallback when their kernel leaves a row's ``_weight_terms`` scalars open,
    the same sums with the exact scalars of that row."""
    dweight = backward(dy, x, None, mean, x.new_empty(0), None, rms, True, False, eps, False)[1]
    assert dweight is not None
    return dweight


def _round_rstd(r: torch.Tensor) -> torch.Tensor:
    """float64 ``r`` (positive, or not finite) rounded to nearest-even to
    ``_weight_terms.RSTD_BITS`` significant bits, on its pattern."""
    low = (1 << _weight_terms.RSTD_LOW) - 1
    bits = r.view(torch.int64)
    bits = (bits + (low >> 1) + ((bits >> _weight_terms.RSTD_LOW) & 1)) & ~low
    return bits.view(torch.float64)


def _on_grid(v: torch.Tensor) -> torch.Tensor:
    """float64 ``v`` (``|v| < 2^19``) rounded to nearest-even to a multiple of
    ``_weight_terms.SHIFT_QUANTUM`` (exact scalings, and the rounding of ``MAGIC``)."""
    magic = _weight_terms.MAGIC
    return ((v * (1.0 / _weight_terms.SHIFT_QUANTUM) + magic) - magic) * _weight_terms.SHIFT_QUANTUM


def _weight_scalars(
    z: torch.Tensor,
    m1: torch.Tensor,
    delta: torch.Tensor,
    e_mean: torch.Tensor,
    r: torch.Tensor,
    e_r: torch.Tensor,
    loose: torch.Tensor,
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``(a, r, t)`` of :mod:`._weight_terms` from the backward's float64
    statistics and their bounds (docs/contract.md §3): ``mean = m1 + delta`` within
    ``e_mean``, ``rstd`` within ``e_r`` of itself; Ziv's test on each scalar, and
    ``_exact.weight_scalars`` for the rows it leaves open (rare; on the host)."""
    spread = r * (1.01 * e_r + 4 * _U)  # rounding r ± spread keeps the exact rstd inside
    r_t = _round_rstd(r)
    open_ = (_round_rstd(r - spread) != _round_rstd(r + spread)) | loose | ~r.isfinite()
    if rms:
        a = t = torch.zeros_like(r)
    else:
        a = z[:, 0]
        head = m1 - a
        w = head + delta  # mean - a within e_mean + u(|head| + |w|)
        v = w * r
        e_v = 1.02 * (
            (e_mean + _U * (head.abs() + w.abs())) * (r + spread)
            + v.abs() * (1.01 * e_r + 3 * _U)
        )  # fmt: skip
        t = _on_grid(v)
        limit = v.abs() + e_v >= _weight_terms.SHIFT_LIMIT
        open_ |= (_on_grid(v - e_v) != _on_grid(v + e_v)) | limit
    if bool(open_.any()):
        from . import _exact

        rows = open_.nonzero()[:, 0]
        fixed = [_exact.weight_scalars(row, eps, rms) for row in z[rows].cpu().numpy()]
        values = torch.tensor(fixed, dtype=torch.float64, device=z.device).reshape(-1, 3)
        r_t = r_t.index_put((rows,), values[:, 1])
        t = t.index_put((rows,), values[:, 2])
    return a, r_t, t


def weight_terms(
    z: torch.Tensor, a: torch.Tensor, r: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """``u = ((z - a)·r) - t`` of :mod:`._weight_terms`, per row of the float64 ``z``
    (M, N): three IEEE operations, each rounded once."""
    return (z - a[:, None]) * r[:, None] - t[:, None]


def _fix_backward_rows(
    dx: torch.Tensor,
    z: torch.Tensor,
    gh: torch.Tensor,
    rho: torch.Tensor,
    eps: float,
    rms: bool,
    flagged: torch.Tensor,
) -> None:
    """Rewrites the flagged rows of ``dx`` (M, N) with the exact fallback, on the host."""
    from . import _exact

    index = flagged.nonzero()[:, 0]
    rows = [t[index].cpu().numpy() for t in (z, gh, rho)]
    finite, fixed = _exact.fix_backward_rows(rows[0], rows[1], rows[2], eps, rms, dx.dtype)
    storage = dx.view(_exact.STORAGE[dx.dtype])
    keep = index[torch.from_numpy(finite).to(index.device)]
    storage[keep] = torch.from_numpy(fixed).to(dx.device)
