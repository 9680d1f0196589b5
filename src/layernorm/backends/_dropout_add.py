"""The dropout-add of ``layernorm.fused_norm``, in torch operations on any device: the
portable implementation and the definition the numba and Triton versions match bit for
bit (docs/contract.md §7).

**Definition.** For rows ``r`` (``M`` of them) and columns ``c`` (``N``) of ``(M, N)``
row views::

    h[r, c] = RN_rdtype( k0[r,c]·s·x0[r,c]·rs[r] + k1[r,c]·s·x1[r,c] + residual[r,c] )

the exact real number, rounded ONCE to nearest-even in ``rdtype``. ``x1``, ``residual``
and ``rs`` (the rowscale, shape ``(M,)``) may be absent: their term is absent (``rs``:
1). ``k0``, ``k1`` are the keep masks of §7 (:mod:`layernorm.backends._philox`: Philox
keyed by ``seed``, offset ``r·N + c``, the keep rule of ``p``): ``k0`` from mask
stream 0, ``k1`` from stream 1 (another counter), so ``x1``'s mask is independent of
``x0``'s and, like it, a pure function of ``(seed, r, c, N)``.
``s = dropout_scale(p) = 1 / (1 - p)`` in float64 (``p = 0``: ``k = 1``, ``s = 1``;
``p = 1``: nothing kept). A dropped term is ``+0.0`` whatever ``x`` is (NaN, Inf too).

**Special values.** A zero result is ``-0.0`` iff every present term is a zero with its
sign bit set (a term's sign: the IEEE product's; dropped terms are ``+0.0``), else
``+0.0``, as IEEE addition of the terms would give. Where the float64 IEEE evaluation
``((x0·rs)·s + x1·s) + residual`` of the kept terms (dropped ones ``+0.0``) is Inf or
NaN, ``h`` is that value: Inf and NaN propagate as IEEE arithmetic; with float32 and
16-bit operands no finite term overflows float64, so this happens only for Inf and NaN
inputs.

**Arithmetic** (how the exact value is formed, so that any implementation can be
checked against this one). Every operand is widened to float64. Each term is an exact
sum of float64 numbers (a float32 or 16-bit value times the two halves of ``s``,
:func:`_times_scale`; else TwoProd, :func:`_two_prod`: Dekker's product with Veltkamp's
splitting, exact for every product of float32 and 16-bit operands);
the components are then distilled by error-free TwoSum sweeps
(:func:`_distill`) to a fixed point ``a1 > a2 > ...`` where ``fl(a_i + a_(i+1)) = a_i``:
``a1`` is then a faithful rounding of the exact sum and ``a2`` carries the sign of the
remainder, so ``round_to_odd(a1, a2)`` is the sum rounded to odd in float64, and rounding
that to float32, float16 or bfloat16 (``torch_.round_once``) rounds the sum once
(53 >= 24 + 2; Boldo and Melquiond, "When double rounding is odd"). For ``rdtype``
float64: ``fl(a1 + round_to_odd(a2, a3))``, the sum rounded once to nearest-even.
**float64 operands:** the same algorithm; it is exact, and ``h`` correctly rounded, when
no product's error term falls below float64's normal range (every nonzero ``x0·rs``,
``x0·rs·s`` and ``x1·s`` at least 2^-969 in magnitude: below, Dekker's error term loses
bits and ``h`` is the sum of the pieces as computed, rounded once) and the first TwoSum
sweep, which adds the pieces in the order of the IEEE evaluation below, does not
overflow where that evaluation does not (terms up to about 2^1023 / 2).

**Backward** (the masks regenerated from ``seed``, not stored)::

    dx0 = RN_x0_dtype(dh·k0·s·rs)    dx1 = RN_x1_dtype(dh·k1·s)    dresidual = RN_residual_dtype(dh)

each the exact product rounded once (as ``_philox.apply_dropout``), a dropped element
``+0.0``. The rowscale gets no gradient (as flash-attn's).

Row views: ``(M, N)`` tensors, contiguous or not; ``rowscale`` ``(M,)``. Offsets are those
of the whole ``(M, N)`` tensor (row ``r`` of the view is global row ``r``).
"""

from __future__ import annotations

import torch

from . import _philox
from .torch_ import round_once

#: the float dtypes the dropout-add reads and writes
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Veltkamp's splitter for float64: a = high + low with high of 26 bits and low of 27
# bits (signed), so that high·high', high·low', low·low' are exact.
_SPLITTER = float(2**27 + 1)


def _check_operand(name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if t is None:
        return
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"dropout_add: {name} must be a float tensor, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"dropout_add: {name} must have shape {shape}, got {tuple(t.shape)}")


def check_args(
    x0: torch.Tensor,
    x1: torch.Tensor | None,
    residual: torch.Tensor | None,
    rowscale: torch.Tensor | None,
    seed: int,
    p: float,
    rdtype: torch.dtype,
) -> None:
    """Every check of :func:`dropout_add`'s arguments, before any work (the other
    implementations call it too).

    Raises:
        TypeError: a non-float operand or ``rdtype``, a non-int seed, a non-real ``p``.
        ValueError: ``x0`` not 2-D, a shape that is not ``x0``'s (``rowscale``:
            ``(M,)``), operands on other devices, ``p`` outside [0, 1], a seed outside
            ``[-2^63, 2^64 - 1]``.
    """
    if x0.dim() != 2:
        raise ValueError(f"dropout_add: x0 must be an (M, N) row view, got {x0.dim()}-D")
    shape = tuple(x0.shape)
    _check_operand("x0", x0, shape)
    _check_operand("x1", x1, shape)
    _check_operand("residual", residual, shape)
    _check_operand("rowscale", rowscale, shape[:1])
    if rdtype not in FLOAT_DTYPES:
        raise TypeError(f"dropout_add: the residual dtype must be a float dtype, got {rdtype}")
    for name, t in (("x1", x1), ("residual", residual), ("rowscale", rowscale)):
        if t is not None and t.device != x0.device:
            raise ValueError(
                f"dropout_add: {name} is on {t.device}, x0 on {x0.device}: one device needed"
            )
    _philox.check_p(p)
    _philox.seed_key(seed)


def _split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Veltkamp: a == high + low exactly, high of 26 significant bits, low of 27 (signed)
    c = a * _SPLITTER
    high = c - (c - a)
    return high, a - high


def _two_prod(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``a·b == product + error`` exactly (Dekker), when ``a·b`` is finite and
    its error term is not below float64's normal range (module docstring). Operands
    above 2^995 are scaled by 2^-60 for the splitting (which would overflow), and the
    results scaled back: powers of two, exact."""
    big = 2.0**995
    scale_a = torch.where(a.abs() > big, 2.0**-60, 1.0)
    scale_b = torch.where(b.abs() > big, 2.0**-60, 1.0)
    a, b = a * scale_a, b * scale_b
    product = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    error = ((ah * bh - product) + ah * bl + al * bh) + al * bl
    back = 1.0 / (scale_a * scale_b)
    return product * back, error * back


def _times_scale(
    wide: torch.Tensor, dtype: torch.dtype, s: float, scale: torch.Tensor
) -> list[torch.Tensor]:
    """``wide·s`` exactly, as two float64 tensors: ``wide`` (a ``dtype`` tensor widened)
    times ``s``'s two halves (29 and 24 bits, ``_philox._split``) when ``dtype`` has at
    most 24 bits (both products exact), else Dekker's product."""
    if dtype == torch.float64:
        return list(_two_prod(wide, scale))
    high, low = _philox._split(s)
    return [wide * high, wide * low]


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Knuth's TwoSum: a + b == total + error exactly
    total = a + b
    b_virtual = total - a
    error = (a - (total - b_virtual)) + (b - b_virtual)
    return total, error


def _distill(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """TwoSum sweeps (bottom to top, the sum carried up) until nothing changes: the
    result has the same exact sum, ``fl(a_i + a_(i+1)) == a_i`` for each neighbour pair
    and zeros at the bottom. The inputs must be finite."""
    parts = list(parts)
    for _ in range(4 * len(parts) + 8):
        carry = parts[-1]
        errors = []
        for part in reversed(parts[:-1]):
            carry, error = _two_sum(part, carry)
            errors.append(error)
        swept = [carry, *reversed(errors)]  # the first error is the bottom one
        if all(
            torch.equal(a.view(torch.int64), b.view(torch.int64))
            for a, b in zip(swept, parts, strict=True)
        ):
            return parts
        parts = swept
    raise RuntimeError("dropout_add: TwoSum distillation did not reach a fixed point")


def round_sum(
    parts: list[torch.Tensor],
    negative_zero: torch.Tensor,
    ieee: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The exact sum of the float64 tensors ``parts`` rounded once to ``dtype``; where it
    is zero, ``-0.0`` where ``negative_zero`` else ``+0.0``; where ``ieee`` (the IEEE
    float64 evaluation) is not finite, ``ieee`` rounded to ``dtype``."""
    finite = ieee.isfinite()
    zero = torch.zeros((), dtype=torch.float64, device=ieee.device)
    parts = [torch.where(finite, part, zero) for part in parts]
    while len(parts) < 3:
        parts.append(torch.zeros_like(parts[0]))
    # (bottom first: the first sweep adds the terms in the IEEE evaluation's order, so
    # that its partial sums overflow only where that evaluation's do)
    a = _distill(parts[::-1])
    if dtype == torch.float64:
        total = a[0] + _philox._round_to_odd(a[1], a[2])
    else:
        total = _philox._round_to_odd(a[0], a[1])
    signed_zero = torch.where(negative_zero, -0.0, zero)
    total = torch.where(total == 0, signed_zero, total)
    return round_once(torch.where(finite, total, ieee), dtype)


def _keep(seed: int, offset: torch.Tensor, p: float, stream: int) -> torch.Tensor:
    """``_philox.keep``, without drawing the Philox words where ``p32 == 0`` keeps all."""
    if _philox.threshold(p) == 0.0:
        return torch.ones(offset.shape, dtype=torch.bool, device=offset.device)
    return _philox.keep(seed, offset, p, stream=stream)


def _is_negative_zero(t: torch.Tensor) -> torch.Tensor:
    return (t == 0) & t.signbit()


def dropout_add(
    x0: torch.Tensor,
    x1: torch.Tensor | None,
    residual: torch.Tensor | None,
    rowscale: torch.Tensor | None,
    seed: int,
    p: float,
    rdtype: torch.dtype,
    want_masks: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``h = RN_rdtype(k0·s·x0·rs + k1·s·x1 + residual)`` (module docstring), with the keep
    masks ``k0`` (and ``k1`` when ``x1`` is given) as bool ``(M, N)`` tensors when
    ``want_masks``, else None. Operands: ``(M, N)`` float tensors, ``rowscale`` ``(M,)``.

    Raises:
        TypeError, ValueError: as :func:`check_args`.
    """
    check_args(x0, x1, residual, rowscale, seed, p, rdtype)
    m, n = x0.shape
    device = x0.device
    s = _philox.dropout_scale(p)
    offset = _philox.offsets(m, n, device=device)
    k0 = _keep(seed, offset, p, 0)
    k1 = None if x1 is None else _keep(seed, offset, p, 1)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    scale = torch.tensor(s, dtype=torch.float64, device=device)

    parts: list[torch.Tensor] = []
    wide = x0.to(torch.float64)
    if rowscale is not None:
        rs = rowscale.to(torch.float64)[:, None]
        product, error = _two_prod(wide, rs)
        ieee = product * s
        neg = _is_negative_zero(product)
        terms = [*_two_prod(product, scale), *_two_prod(error, scale)]
    else:
        ieee = wide * s
        neg = _is_negative_zero(wide)
        terms = _times_scale(wide, x0.dtype, s, scale)
    ieee = torch.where(k0, ieee, zero)
    neg = neg & k0
    parts += [torch.where(k0, term, zero) for term in terms]
    if x1 is not None:
        assert k1 is not None
        wide1 = x1.to(torch.float64)
        ieee = ieee + torch.where(k1, wide1 * s, zero)
        neg = neg & k1 & _is_negative_zero(wide1)
        parts += [torch.where(k1, term, zero) for term in _times_scale(wide1, x1.dtype, s, scale)]
    if residual is not None:
        wide_r = residual.to(torch.float64)
        ieee = ieee + wide_r
        neg = neg & _is_negative_zero(wide_r)
        parts.append(wide_r)
    h = round_sum(parts, neg, ieee, rdtype)
    if not want_masks:
        return h, None, None
    return h, k0, k1


def _scaled(
    dh: torch.Tensor,
    keep: torch.Tensor,
    s: float,
    rowscale: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    # RN_dtype(dh·keep·s·rs), the exact product rounded once
    device = dh.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    scale = torch.tensor(s, dtype=torch.float64, device=device)
    wide = dh.to(torch.float64)
    if rowscale is not None:
        product, error = _two_prod(wide, rowscale.to(torch.float64)[:, None])
        terms = [*_two_prod(product, scale), *_two_prod(error, scale)]
    else:
        product = wide
        terms = _times_scale(wide, dh.dtype, s, scale)
    ieee = torch.where(keep, product * s, zero)
    parts = [torch.where(keep, term, zero) for term in terms]
    return round_sum(parts, _is_negative_zero(ieee), ieee, dtype)


def dropout_add_backward(
    dh: torch.Tensor,
    rowscale: torch.Tensor | None,
    seed: int,
    p: float,
    x0_dtype: torch.dtype,
    x1_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of :func:`dropout_add` from ``dh`` (``(M, N)``, any float dtype):
    ``dx0 = RN_x0_dtype(dh·k0·s·rs)``, ``dx1 = RN_x1_dtype(dh·k1·s)`` (None when
    ``x1_dtype`` is None), ``dresidual = RN_residual_dtype(dh)`` (None when
    ``residual_dtype`` is None); each the exact product rounded once, the masks
    regenerated from ``seed``.

    Raises:
        TypeError, ValueError: as :func:`check_args`.
    """
    check_args(dh, None, None, rowscale, seed, p, x0_dtype)
    for dtype in (x1_dtype, residual_dtype):
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dropout_add: gradient dtypes must be float dtypes, got {dtype}")
    m, n = dh.shape
    s = _philox.dropout_scale(p)
    offset = _philox.offsets(m, n, device=dh.device)
    dx0 = _scaled(dh, _keep(seed, offset, p, 0), s, rowscale, x0_dtype)
    dx1 = None
    if x1_dtype is not None:
        dx1 = _scaled(dh, _keep(seed, offset, p, 1), s, None, x1_dtype)
    dresidual = None
    if residual_dtype == dh.dtype:  # a new tensor: outputs never alias inputs
        dresidual = dh.clone(memory_format=torch.contiguous_format)
    elif residual_dtype is not None:
        dresidual = round_once(dh.to(torch.float64), residual_dtype)
    return dx0, dx1, dresidual
