"""The 16-bit outputs' cheap pass in float32 lanes (docs/contract.md §3, "float32 lanes";
``_numba_vectors.normalize_row_fast_single``, ``_numba_kernels._single_bounds``).

- The bound: for every element, the float32 value the lanes compute (emulated here in
  exact rational arithmetic, each operation rounded once to float32) lies within
  ``A + |yh|·SINGLE_RELATIVE`` of the exact result (mpmath, 60 digits), on random rows at
  offsets up to 1e4, rows whose first element is an outlier, and the adversarial rows
  below, in both 16-bit dtypes, layer norm and RMSNorm.
- End to end: rows whose exact results sit on, or within a few float32 units of, a
  rounding boundary of bfloat16 or float16 (midpoints at many exponents), at offsets up
  to 1e4, widths with whole 16-lane vectors and a tail; every element equals the exact
  oracle's correctly rounded value, bit for bit.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch

import _oracle

pytest.importorskip("numba")

import layernorm
from layernorm.backends import _numba_kernels as kernels
from layernorm.backends import _numba_vectors as vectors

mpmath.mp.dps = 60
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
PATTERNS = {torch.bfloat16: np.uint16, torch.float16: np.int16}


def _rn32(value: Fraction) -> Fraction:
    """``value`` rounded once to nearest-even float32 (no overflow in these tests)."""
    if value == 0:
        return Fraction(0)
    exponent = max(math.floor(math.log2(abs(value))), -126)
    while Fraction(2) ** exponent > abs(value) and exponent > -126:  # log2's rounding
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= abs(value):
        exponent += 1
    ulp = Fraction(2) ** (max(exponent, -126) - 23)
    return round(value / ulp) * ulp  # Fraction's round: half to even


def _exact(z, w, b, eps, rms):
    zs = [mpmath.mpf(float(v)) for v in z]
    mean = mpmath.mpf(0) if rms else mpmath.fsum(zs) / len(zs)
    rstd = 1 / mpmath.sqrt(mpmath.fsum((v - mean) ** 2 for v in zs) / len(zs) + mpmath.mpf(eps))
    return [(v - mean) * rstd * mpmath.mpf(float(wv)) + mpmath.mpf(float(bv))
            for v, wv, bv in zip(zs, w, b, strict=True)]  # fmt: skip


def _constants(x, w, b, eps, rms):
    """The row's float32 lanes constants ``(m1f, r, neg_t, a32, usable)`` from the
    kernel's own row function, for the one-row 16-bit ``x`` (a torch tensor)."""
    n = x.shape[-1]
    z = x.reshape(-1).view(torch.int16).numpy().view(PATTERNS[x.dtype])
    weight = w.numpy().astype(np.float32)
    bias = b.numpy().astype(np.float32)
    stats = np.empty(1, np.float32)
    weight_max = float(np.abs(weight).max())
    bias_max = float(np.abs(bias).max())
    row = kernels._row_constants(
        0, z, n, z, 0, False, z, stats, stats, n, eps, rms, False, weight_max, bias_max, True,
        False,
    )  # fmt: skip
    assert row[11] == 0  # not flagged
    return row[12]


def _single_values(x, w, b, constants):
    """``yh`` of ``_single_values`` for every element, in exact arithmetic rounded as the
    float32 operations round: ``d = z - m1f``, ``q = fma(d, r, -t)``, ``yh = fma(q, w, b)``."""
    m1f, r, neg_t, _, _ = (Fraction(float(c)) for c in constants)
    out = []
    for zv, wv, bv in zip(x.double().tolist(), w.tolist(), b.tolist(), strict=True):
        d = _rn32(Fraction(zv) - m1f)
        q = _rn32(d * r + neg_t)
        out.append(_rn32(q * Fraction(float(np.float32(wv))) + Fraction(float(np.float32(bv)))))
    return out


def _rows(dtype, g):
    """Random rows at offsets, an outlier first element, and near-boundary rows."""
    for offset, n in [(0.0, 48), (100.0, 40), (1e4, 40), (-3e3, 33)]:
        x = (torch.randn(n, generator=g) * 3 + offset).to(dtype)
        yield x, torch.randn(n, generator=g), torch.randn(n, generator=g)
    x = torch.randn(40, generator=g)
    x[0] = 50.0
    yield x.to(dtype), torch.rand(40, generator=g) + 0.5, torch.zeros(40)
    yield _near_boundaries(dtype, g, 48, 0.0, 0)


def _near_boundaries(dtype, g, n, offset, steps):
    """A row whose exact results lie within a few float32 units of boundaries of
    ``dtype`` (midpoints of values over many exponents): ``bias`` = the midpoint minus
    the normalized value times the weight, rounded to float32, moved ``steps`` float32
    units."""
    x = (torch.randn(n, generator=g) * 2 + offset).to(dtype)
    w = torch.randn(n, generator=g)
    z = x.double()
    u = (z - z.mean()) / torch.sqrt(((z - z.mean()) ** 2).mean() + 1e-5)
    values = (torch.randn(n, generator=g) * 4).exp()
    if dtype == torch.float16:  # its range, subnormals included
        values = values.clamp(1e-6, 3e4)
    values = values * torch.sign(torch.randn(n, generator=g))
    values = values.to(dtype).double()
    ulp = torch.tensor([_ulp(v, dtype) for v in values.tolist()], dtype=torch.float64)
    midpoints = values + ulp / 2
    b = (midpoints - w.double() * u).to(torch.float32)
    if steps:  # one float32 unit up or down
        b = torch.nextafter(b, torch.full_like(b, math.inf * steps))
    return x, w, b


def _ulp(v: float, dtype) -> float:
    mantissa = 7 if dtype == torch.bfloat16 else 10
    smallest = -126 if dtype == torch.bfloat16 else -14
    return 2.0 ** (max(math.frexp(abs(v))[1] - 1, smallest) - mantissa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_the_float32_lanes_stay_within_their_bound(dtype, rms):
    g = torch.Generator().manual_seed(11)
    eps = 1e-5
    checked = 0
    for x, w, b in _rows(dtype, g):
        if rms:
            b = torch.zeros_like(b)
        constants = _constants(x, w, b, eps, rms)
        assert constants[4]  # usable: these rows run in float32 lanes
        yh = _single_values(x, w, b, constants)
        exact = _exact(x.double().tolist(), w.float().tolist(), b.float().tolist(), eps, rms)
        a32 = Fraction(float(constants[3]))
        relative = Fraction(vectors.SINGLE_RELATIVE)
        for value, want in zip(yh, exact, strict=True):
            error = abs(mpmath.mpf(value.numerator) / value.denominator - want)
            assert error <= mpmath.mpf(float(a32 + abs(value) * relative))
            checked += 1
    assert checked > 200


def _assert_correctly_rounded(x, w, b, eps, rms):
    n = x.shape[-1]
    if rms:
        y = layernorm.rms_norm(x, (n,), w, eps=eps, backend="numba")
    else:
        y = layernorm.layer_norm(x, (n,), w, b, eps=eps, backend="numba")
    got = y.reshape(-1, n).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    gamma = w.double().numpy()
    beta = np.zeros(n) if rms else b.float().double().numpy()
    wrong = 0
    for i, z in enumerate(x.reshape(-1, n).double().numpy()):
        want, zero = _oracle.forward(z, gamma, beta, eps, rms, NAMES[x.dtype])
        wrong += int(((want != got[i]) & ~zero).sum())
    assert wrong == 0, f"{wrong} of {x.numel()} elements not correctly rounded"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rows_on_and_near_boundaries_are_correctly_rounded(dtype):
    g = torch.Generator().manual_seed(12)
    for offset in (0.0, 100.0, 1e4):
        for n in (16, 64, 77):
            for steps in (0, 1, -1):
                rows = [_near_boundaries(dtype, g, n, offset, steps) for _ in range(4)]
                x = torch.stack([r[0] for r in rows])
                for k, (_, w, b) in enumerate(rows):
                    _assert_correctly_rounded(x[k : k + 1], w, b, 1e-5, False)
    # ties exactly: z = (0, 1, ...), eps = 0.75, rstd = 1: y = beta ± w/2 on midpoints
    ulp = float(torch.finfo(dtype).eps)
    x = torch.tensor([[0.0, 1.0] * 32]).to(dtype)
    for scale in (1.0, 2.0**-10, 2.0**10):
        w = torch.full((64,), ulp * scale) * torch.tensor([1.0, 3.0] * 32)
        b = torch.full((64,), scale)
        _assert_correctly_rounded(x, w, b, 0.75, False)
        for k in range(20, 51, 6):
            _assert_correctly_rounded(x, w, b, 0.75 + 2.0**-k, False)
            _assert_correctly_rounded(x, w, b, 0.75 - 2.0**-k, False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_random_batches_are_correctly_rounded(dtype, rms):
    g = torch.Generator().manual_seed(13)
    for offset, (m, n) in [(0.0, (8, 64)), (100.0, (4, 1024)), (1e4, (3, 1100))]:
        x = (torch.randn(m, n, generator=g) * 3 + offset).to(dtype)
        w = torch.randn(n, generator=g)
        b = torch.randn(n, generator=g)
        _assert_correctly_rounded(x, w, b, 1e-5, rms)
