"""The torch dropout-add (layernorm.backends._dropout_add), the definition the other
implementations match bit for bit: every output against a ``fractions.Fraction`` oracle
of ``RN(k0·s·x0·rs + k1·s·x1 + residual)``, rounded once; the signs of zeros, Inf and
NaN; the masks (Philox streams 0 and 1, batch invariant); the backward; every error."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from layernorm.backends import _dropout_add as da
from layernorm.backends import _philox

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
#: significant bits and the smallest normal exponent of each dtype
_FORMAT = {F16: (11, -14), BF16: (8, -126), F32: (24, -126), F64: (53, -1022)}


def _floor_log2(q: Fraction) -> int:
    """floor(log2(|q|)) exactly, for q != 0."""
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    return e if Fraction(2) ** e <= q else e - 1


def exact_round(q: Fraction, dtype: torch.dtype) -> float:
    """``q`` rounded once to nearest-even in ``dtype`` (Inf past the largest finite value
    by half a unit or more); 0 for 0 (the caller gives the sign)."""
    if q == 0:
        return 0.0
    digits, emin = _FORMAT[dtype]
    e = max(_floor_log2(q), emin) - (digits - 1)
    unit = Fraction(2) ** e
    steps = q / unit
    n = math.floor(steps)
    rest = steps - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    big = Fraction(2) ** (_floor_log2(Fraction(torch.finfo(dtype).max)) + 1)
    if abs(n * unit) >= big:
        return math.inf if q > 0 else -math.inf
    return float(n * unit)  # exact: n has at most `digits` bits


def _masks(seed: int, p: float, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    offset = _philox.offsets(m, n)
    return _philox.keep(seed, offset, p, stream=0), _philox.keep(seed, offset, p, stream=1)


def oracle(x0, x1, residual, rowscale, seed, p, rdtype) -> torch.Tensor:
    """The definition, element by element, in exact rationals (finite inputs)."""
    m, n = x0.shape
    k0, k1 = _masks(seed, p, m, n)
    s = Fraction(_philox.dropout_scale(p))
    out = torch.empty(m, n, dtype=F64)
    for r, c in itertools.product(range(m), range(n)):
        terms = []  # (value, negative zero)
        v0 = float(x0[r, c]) * (1.0 if rowscale is None else float(rowscale[r]))
        if k0[r, c]:
            q = Fraction(float(x0[r, c])) * s
            if rowscale is not None:
                q *= Fraction(float(rowscale[r]))
            terms.append((q, math.copysign(1.0, v0) < 0 and q == 0))
        else:
            terms.append((Fraction(0), False))
        if x1 is not None:
            v1 = float(x1[r, c])
            keep1 = bool(k1[r, c])
            terms.append(
                (
                    Fraction(v1) * s if keep1 else Fraction(0),
                    keep1 and v1 == 0 and math.copysign(1.0, v1) < 0,
                )
            )
        if residual is not None:
            vr = float(residual[r, c])
            terms.append((Fraction(vr), vr == 0 and math.copysign(1.0, vr) < 0))
        total = sum(t for t, _ in terms)
        value = exact_round(total, rdtype)
        if value == 0:
            if total == 0:
                value = -0.0 if all(neg for _, neg in terms) else 0.0
            else:
                value = math.copysign(0.0, total)
        out[r, c] = value
    return out


def _values(shape, dtype, gen, spread=8) -> torch.Tensor:
    """Values over a wide range of exponents, both signs (normal numbers of ``dtype``)."""
    exps = torch.randint(-spread, spread + 1, shape, generator=gen).double()
    signs = torch.randint(0, 2, shape, generator=gen).double() * 2 - 1
    return (signs * (1 + torch.rand(shape, generator=gen, dtype=F64)) * 2.0**exps).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits as float64 (signed zeros told apart, NaN equal to NaN)."""
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return False
    both_nan = a.isnan() & b.isnan()
    return bool(((a == b) & (a.signbit() == b.signbit()) | both_nan).all())


CASES = [
    # x0, x1, residual, rowscale dtypes, rdtype
    (F32, None, None, None, F32),
    (F32, F32, F32, F32, F32),
    (BF16, BF16, F32, None, F32),
    (BF16, BF16, BF16, BF16, BF16),
    (F16, F16, F32, F32, F16),
    (F16, None, F16, F16, F16),
    (F32, BF16, F16, BF16, BF16),
    (BF16, None, F32, F32, F64),
    (F32, F32, F32, None, F64),
    (F64, F64, F64, F64, F64),
    (F64, None, F64, None, F64),
    (F32, None, F32, F64, F32),
]


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "-".join(str(d)[6:] if d else "none" for d in c)
)
def test_h_is_the_exact_sum_rounded_once(case, p):
    d0, d1, dr, ds, rdtype = case
    gen = torch.Generator().manual_seed(hash((case, p)) % 2**31)
    m, n = 5, 23
    x0 = _values((m, n), d0, gen)
    x1 = None if d1 is None else _values((m, n), d1, gen)
    rowscale = None if ds is None else _values((m,), ds, gen, spread=3).abs()
    residual = None
    if dr is not None:
        # cancellation: the residual close to minus the other terms, in places
        near = -(
            x0.double()
            * _philox.dropout_scale(p)
            * (1 if rowscale is None else rowscale.double()[:, None])
        )
        residual = torch.where(
            torch.rand(m, n, generator=gen) < 0.5, near, _values((m, n), F64, gen)
        ).to(dr)
    seed = 1234 + int(p * 10)
    h, k0, k1 = da.dropout_add(x0, x1, residual, rowscale, seed, p, rdtype, True)
    assert h.dtype == rdtype and h.shape == (m, n)
    assert _same(h, oracle(x0, x1, residual, rowscale, seed, p, rdtype))
    e0, e1 = _masks(seed, p, m, n)
    assert torch.equal(k0, e0)
    assert k1 is None if x1 is None else torch.equal(k1, e1)
    h2, none0, none1 = da.dropout_add(x0, x1, residual, rowscale, seed, p, rdtype, False)
    assert none0 is None and none1 is None and _same(h, h2)


def test_one_rounding_where_float64_would_round_twice():
    # 1 + 2^-24 + 2^-80 is above float32's tie 1 + 2^-24: RN32 = 1 + 2^-23. Summed in
    # float64 first, it becomes the tie 1 + 2^-24, which float32 rounds to even: 1.
    x0 = torch.tensor([[2.0**-24]])
    x1 = torch.tensor([[2.0**-80]])
    residual = torch.tensor([[1.0]])
    h, _, _ = da.dropout_add(x0, x1, residual, None, 0, 0.0, F32, False)
    assert h.item() == 1 + 2.0**-23
    assert ((x0.double() + x1.double()) + residual.double()).float().item() == 1.0
    # and to bfloat16 from float32 operands: 1 + 2^-8 (tie) + 2^-40
    h16, _, _ = da.dropout_add(
        torch.tensor([[2.0**-8]]), torch.tensor([[2.0**-40]]), residual, None, 0, 0.0, BF16, False
    )
    assert h16.item() == 1 + 2.0**-7
    # float64 output: 1 + 2^-53 (tie) + 2^-100 rounds up
    h64, _, _ = da.dropout_add(
        torch.tensor([[2.0**-53]], dtype=F64),
        torch.tensor([[2.0**-100]], dtype=F64),
        residual.double(),
        None,
        0,
        0.0,
        F64,
        False,
    )
    assert h64.item() == 1 + 2.0**-52


def test_signed_zeros_inf_and_nan():
    neg, pos = -0.0, 0.0
    x0 = torch.tensor([[neg, neg, 1.0, math.inf, math.inf, math.nan, neg, 2.0]])
    res = torch.tensor([[neg, pos, -1.0, 1.0, -math.inf, 1.0, neg, -math.inf]])
    h, _, _ = da.dropout_add(x0, None, res, None, 0, 0.0, F32, False)
    expected = torch.tensor([[neg, pos, pos, math.inf, math.nan, math.nan, neg, -math.inf]])
    assert _same(h, expected)
    # a dropped term is +0.0, whatever it was: p = 1 drops everything
    h, k0, _ = da.dropout_add(x0, x0, None, None, 0, 1.0, BF16, True)
    assert not k0.any() and _same(h, torch.zeros_like(h))
    # (a dropped term is present: +0.0 + -0.0 is +0.0, as tl.where(keep, x·s, 0.0) + r)
    h, _, _ = da.dropout_add(x0, None, res, None, 0, 1.0, F32, False)
    assert _same(h, res + 0.0) and not h[res == 0].signbit().any()
    # rowscale: a negative scale of a zero gives -0.0; Inf times 0 is NaN
    rs = torch.tensor([-1.0])
    h, _, _ = da.dropout_add(torch.tensor([[0.0, -0.0, 3.0]]), None, None, rs, 0, 0.0, F32, False)
    assert _same(h, torch.tensor([[neg, pos, -3.0]]))
    h, _, _ = da.dropout_add(
        torch.tensor([[math.inf]]), None, None, torch.tensor([0.0]), 0, 0.0, F32, False
    )
    assert h.isnan().all()


def test_overflow_rounds_to_inf():
    big = torch.finfo(F16).max
    h, _, _ = da.dropout_add(
        torch.tensor([[big, -big]], dtype=F16),
        None,
        torch.tensor([[big, -big]], dtype=F32),
        None,
        0,
        0.0,
        F16,
        False,
    )
    assert h.tolist() == [[math.inf, -math.inf]]


def test_masks_are_philox_streams_0_and_1_and_batch_invariant():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=gen)
    seed, p = 77, 0.3
    h, k0, k1 = da.dropout_add(x, x, None, None, seed, p, F32, True)
    e0, e1 = _masks(seed, p, 64, 48)
    assert torch.equal(k0, e0) and torch.equal(k1, e1)
    agree = (k0 == k1).double().mean().item()
    assert abs(agree - (p * p + (1 - p) ** 2)) < 0.05  # independent, not equal
    # the first rows of a call are those of a call on fewer rows
    h8, m8, n8 = da.dropout_add(x[:8], x[:8], None, None, seed, p, F32, True)
    assert torch.equal(h8, h[:8]) and torch.equal(m8, k0[:8]) and torch.equal(n8, k1[:8])


def test_strided_rows_give_the_contiguous_bits():
    gen = torch.Generator().manual_seed(4)
    x0 = torch.randn(12, 20, generator=gen).t()  # (20, 12), column-major
    x1 = torch.randn(40, 12, generator=gen)[::2]
    res = torch.randn(20, 24, generator=gen)[:, ::2]
    rs = torch.rand(40, generator=gen)[::2]
    args = (11, 0.2, BF16, True)
    h, k0, k1 = da.dropout_add(x0, x1, res, rs, *args)
    hc, c0, c1 = da.dropout_add(
        x0.contiguous(), x1.contiguous(), res.contiguous(), rs.contiguous(), *args
    )
    assert torch.equal(h, hc) and torch.equal(k0, c0) and torch.equal(k1, c1)


def test_zero_size():
    for shape in [(0, 5), (3, 0), (0, 0)]:
        x = torch.empty(shape)
        h, k0, k1 = da.dropout_add(x, x, x, torch.empty(shape[0]), 1, 0.5, BF16, True)
        assert h.shape == shape and h.dtype == BF16 and k0.shape == shape and k1.shape == shape
        dx0, dx1, dr = da.dropout_add_backward(x, None, 1, 0.5, F16, F32, F64)
        assert dx0.shape == dx1.shape == dr.shape == shape


@pytest.mark.parametrize("p", [0.0, 0.1, 1.0])
@pytest.mark.parametrize(
    "dh_dtype,x0_dtype,x1_dtype,r_dtype,rs_dtype",
    [
        (F32, F32, F32, F32, F32),
        (F32, BF16, F16, BF16, None),
        (BF16, BF16, BF16, F32, BF16),
        (F64, F64, F64, F64, F64),
        (F32, F16, None, None, F32),
    ],
)
def test_backward_is_the_exact_product_rounded_once(
    p, dh_dtype, x0_dtype, x1_dtype, r_dtype, rs_dtype
):
    gen = torch.Generator().manual_seed(5)
    m, n = 4, 19
    dh = _values((m, n), dh_dtype, gen)
    rs = None if rs_dtype is None else _values((m,), rs_dtype, gen, spread=3)
    seed = 99
    dx0, dx1, dr = da.dropout_add_backward(dh, rs, seed, p, x0_dtype, x1_dtype, r_dtype)
    k0, k1 = _masks(seed, p, m, n)
    s = Fraction(_philox.dropout_scale(p))

    def expect(keep, scale_rows, dtype):
        out = torch.empty(m, n, dtype=F64)
        for r, c in itertools.product(range(m), range(n)):
            if not keep[r, c]:
                out[r, c] = 0.0
                continue
            q = (
                Fraction(float(dh[r, c]))
                * s
                * (Fraction(float(rs[r])) if scale_rows and rs is not None else 1)
            )
            out[r, c] = exact_round(q, dtype)
        return out

    assert dx0.dtype == x0_dtype and _same(dx0, expect(k0, True, x0_dtype))
    if x1_dtype is None:
        assert dx1 is None
    else:
        assert dx1.dtype == x1_dtype and _same(dx1, expect(k1, False, x1_dtype))
    if r_dtype is None:
        assert dr is None
    else:
        assert dr.dtype == r_dtype and _same(
            dr,
            torch.tensor(
                [
                    [exact_round(Fraction(float(v)), r_dtype) for v in row]
                    for row in dh.double().tolist()
                ],
                dtype=F64,
            ),
        )


def test_errors_before_any_work():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"\(M, N\) row view, got 3-D"):
        da.dropout_add(x[None], None, None, None, 0, 0.1, F32, False)
    with pytest.raises(TypeError, match="x1 must be a float tensor"):
        da.dropout_add(x, x.int(), None, None, 0, 0.1, F32, False)
    with pytest.raises(ValueError, match=r"residual must have shape \(3, 4\)"):
        da.dropout_add(x, None, x.t(), None, 0, 0.1, F32, False)
    with pytest.raises(ValueError, match=r"rowscale must have shape \(3,\)"):
        da.dropout_add(x, None, None, torch.ones(4), 0, 0.1, F32, False)
    with pytest.raises(TypeError, match="residual dtype must be a float dtype"):
        da.dropout_add(x, None, None, None, 0, 0.1, torch.int32, False)
    with pytest.raises(
        ValueError, match=r"dropout probability has to be between 0 and 1, but got 1\.5"
    ):
        da.dropout_add(x, None, None, None, 0, 1.5, F32, False)
    with pytest.raises(ValueError, match="dropout seed must be in"):
        da.dropout_add(x, None, None, None, 2**64, 0.1, F32, False)
    with pytest.raises(TypeError, match="dropout seed must be an int"):
        da.dropout_add(x, None, None, None, 1.0, 0.1, F32, False)
    with pytest.raises(TypeError, match="gradient dtypes must be float dtypes"):
        da.dropout_add_backward(x, None, 0, 0.1, F32, torch.int64, None)
    with pytest.raises(ValueError, match="Philox streams 0 and 1"):
        _philox.random_bits(0, torch.zeros(1, dtype=torch.int64), stream=2)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize(
    "in_dtype,rdtype", [(F32, F32), (BF16, BF16), (F32, BF16), (F16, F16), (F32, F64)]
)
def test_ties_and_near_ties_of_the_output_dtype(in_dtype, rdtype, p):
    """Sums placed on and next to the midpoints between two neighbours in ``rdtype``:
    residual v, x0·s about half a unit of v, x1 a tiny term of either sign or zero, and
    a rowscale of 1 or a float64 just off 1 (Dekker's products): against the oracle."""
    gen = torch.Generator().manual_seed(17)
    m, n = 40, 50
    digits, _ = _FORMAT[rdtype]
    v = _values((m, n), rdtype if rdtype != F64 else F32, gen, spread=4).double()
    half_unit = torch.ldexp(torch.ones(m, n, dtype=F64), torch.frexp(v).exponent - digits - 1)
    s = _philox.dropout_scale(p)
    x0 = (half_unit / s).to(in_dtype)
    sign = torch.randint(0, 3, (m, n), generator=gen).double() - 1
    x1 = (sign * half_unit * 2.0 ** -torch.randint(3, 30, (m, n), generator=gen)).to(in_dtype)
    residual = v.to(rdtype if rdtype == F64 else in_dtype)
    rowscale = torch.where(torch.rand(m, generator=gen) < 0.5, 1.0, 1.0 + 2.0**-40).double()
    for rs in (None, rowscale):
        h, _, _ = da.dropout_add(x0, x1, residual, rs, 5, p, rdtype, False)
        assert _same(h, oracle(x0, x1, residual, rs, 5, p, rdtype))


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("with_rowscale", [False, True])
def test_float64_near_its_largest_value(p, with_rowscale):
    """float64 terms up to 2^1023: the exact sum rounded once where the IEEE evaluation
    ``((x0·rs)·s + x1·s) + residual`` is finite (the splitting of Dekker's product and
    the first TwoSum sweep do not overflow there), that evaluation where it is not."""
    gen = torch.Generator().manual_seed(23)
    m, n = 6, 40

    def huge():
        signs = torch.randint(0, 2, (m, n), generator=gen).double() * 2 - 1
        exps = torch.randint(1020, 1024, (m, n), generator=gen).double()
        return signs * (1 + torch.rand(m, n, generator=gen, dtype=F64)) * 2.0**exps

    x0, x1, residual = huge(), huge(), huge()
    rs = torch.rand(m, generator=gen, dtype=F64) + 0.5 if with_rowscale else None
    h, k0, k1 = da.dropout_add(x0, x1, residual, rs, 3, p, F64, True)
    s = _philox.dropout_scale(p)
    scaled = x0 if rs is None else x0 * rs[:, None]
    naive = (torch.where(k0, scaled * s, 0.0) + torch.where(k1, x1 * s, 0.0)) + residual
    finite = naive.isfinite()
    assert 0 < int(finite.sum()) < m * n  # both kinds of element
    want = torch.where(finite, oracle(x0, x1, residual, rs, 3, p, F64), naive)
    assert _same(h, want)
