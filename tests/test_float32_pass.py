"""The float32 output's cheap pass (docs/contract.md §3, "The cheap test first", float32
output): ``t = fma(z - m1, rstd, shift)``, ``yh = fma(t, w, b)``, decided where
``|yh| >= tiny`` and ``|yh - M| > fma(|yh|, B, A)``, ``M`` the midpoint of ``yh``'s
float32 neighbours.

- Its constants (``_numba_kernels._float32_bounds``) keep the inequalities the contract
  derives, in rational arithmetic.
- On rows at large offsets, with outlier shifts, at extreme scales, wide and constant,
  with the kernel's own stage-1 statistics: ``|yh - y| <= A + |yh|·B`` against the exact
  value (mpmath, 60 digits), ``yh`` emulated exactly (each fma one rounding of the exact
  value), and every element the pass decides is the oracle's correct rounding.
- Rows built so that many results lie within about ``2^-48`` (relative) of a float32
  midpoint: the pass leaves those open, and the whole forward still gives the oracle's
  bits; so do random rows at large offsets and extreme scales with random parameters.
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch

import _oracle
import layernorm

pytest.importorskip("numba")

from numba import njit

from layernorm.backends import _numba_kernels as kernels
from layernorm.backends._numba_vectors import normalize_row_fast

mpmath.mp.dps = 60
U = Fraction(2) ** -53


@njit(cache=False)
def _pass(z, y, m1, delta, rstd, shift, w, b, bound_a, bound_b, tiny):
    return normalize_row_fast(z, y, m1, delta, rstd, shift, w, b, bound_a, bound_b, tiny)


def _fma(a: float, b: float, c: float) -> float:
    """``a·b + c`` rounded once to float64 (exact rationals; ``float`` of a Fraction
    rounds to nearest even)."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def _constants(x, w, b, eps, rms):
    """The kernel's stage-1 statistics of the one-row ``x`` and the float32 pass's
    constants: ``(m1, delta, rstd, shift, A, B, tiny)``, or None for a flagged row."""
    n = x.shape[0]
    unused = np.empty(1, np.float32)
    stats = kernels._row_statistics(0, x, n, x, 0, False, x, unused, unused, n, eps, rms, False)
    _, m1, delta, rstd_i, e_mean, _, k_p, _, _, _, flag = stats
    if flag:
        return None
    w_max, b_max = float(np.max(np.abs(w))), float(np.max(np.abs(b)))
    shift, bound_a, bound_b, tiny = kernels._float32_bounds(
        delta, rstd_i, e_mean, k_p, w_max, b_max
    )  # fmt: skip
    return m1, delta, rstd_i, shift, bound_a, bound_b, tiny


def test_the_constants_keep_their_inequalities():
    """``_float32_bounds``: ``A >= (α·b_max + λ·w_max)(1 + 2^-26)/(1 - u)``,
    ``B >= (α(1 + 2^-26) + u)/(1 - u)`` and one rounding of ``E``'s fma more, with
    ``α = 1.01·k_p``, ``λ = rstd(1.01 e_mean + 2.01u|delta|)``; ``tiny >= 2^-126`` and
    ``tiny·(2^-26 - B) >= A``; ``tiny = inf`` where ``B > 2^-27`` or a constant is not
    finite; ``shift = -delta·rstd`` rounded once; ``A`` a normal double, even where
    ``delta = e_mean = 0`` (RMSNorm): a subnormal one slowed the pass tenfold."""
    rng = np.random.default_rng(11)
    cases = [(0.0, 1.0, 0.0, 2.1 * 2.0**-53, 1.0, 0.0), (3.0, 2.0**-60, 1e-20, 1e-14, 3.0, 2.0)]
    cases.append((1.0, 1.0, 1e-16, 2.0**-28, 1.0, 1.0))  # B just under 2^-27
    cases.append((1.0, 1.0, 1e-16, 2.0**-26, 1.0, 1.0))  # B over it: not usable
    cases.append((np.nan, 1.0, np.nan, 1e-14, 1.0, 1.0))  # a NaN row
    cases.append((1.0, 1.0, 1e-16, 1e-14, 1e308, 1e308))  # A overflows
    for _ in range(300):
        delta = rng.standard_normal() * 10.0 ** rng.uniform(-3, 6)
        rstd = 10.0 ** rng.uniform(-30, 30)
        e_mean = abs(delta) * 10.0 ** rng.uniform(-16, -10)
        k_p = 10.0 ** rng.uniform(-16, -9)
        cases.append((delta, rstd, e_mean, k_p, 10.0 ** rng.uniform(-3, 3), rng.uniform(0, 5)))
    margin = Fraction(2) ** -26
    usable = 0
    for delta, rstd, e_mean, k_p, w_max, b_max in cases:
        shift, bound_a, bound_b, tiny = kernels._float32_bounds(
            delta, rstd, e_mean, k_p, w_max, b_max
        )  # fmt: skip
        if not np.isfinite(delta):
            assert tiny == np.inf
            continue
        assert shift == -float(Fraction(delta) * Fraction(rstd))
        alpha = Fraction(1.01) * Fraction(k_p)
        lam = Fraction(rstd) * (
            Fraction(1.01) * Fraction(e_mean) + Fraction(2.01) * U * abs(Fraction(delta))
        )
        slack = (1 + Fraction(2) ** -26) / (1 - U) ** 2  # 1/(1 - α₀), 1/(1 - u), E's fma
        if Fraction(bound_b) > margin / 2 or not np.isfinite(bound_a):
            assert tiny == np.inf
            continue
        usable += 1
        big_a = Fraction(bound_a)
        big_b = Fraction(bound_b)
        assert big_a >= (alpha * Fraction(b_max) + lam * Fraction(w_max)) * slack
        assert big_b >= (alpha * (1 + Fraction(2) ** -26) + U) * slack
        assert tiny >= 2.0**-126
        assert Fraction(tiny) * (margin - big_b) >= big_a
        assert bound_a >= 2.0**-1022  # normal (RMSNorm's too): no assist per fma
    assert usable > 250


def _rows(rng):
    """float32 rows that strain the bound: outlier first elements (the shift), offsets
    up to 1e6, tiny and huge scales, a constant row, one and two elements, a wide row."""
    rows = []
    for outlier in (1e3, 1e6, -3e7, 1e30):
        rows.append(np.concatenate([[outlier], rng.standard_normal(63)]))
    for offset in (1e2, 1e4, 1e6):
        rows.append(rng.standard_normal(96) + offset)
    for scale in (1e-30, 1e-10, 1e20, 1e37):
        rows.append(rng.standard_normal(64) * scale)
    rows.append(np.concatenate([[1e-3], rng.standard_normal(200) * 1e-6]))
    rows.append(np.full(16, 3.0))
    rows.append(np.array([7.0]))
    rows.append(np.array([-2.0, 1e5]))
    rows.append(np.concatenate([[5e4], rng.standard_normal(4095)]))
    return [r.astype(np.float32) for r in rows]


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_the_bound_holds_and_decided_elements_are_correctly_rounded(rms, eps):
    rng = np.random.default_rng(12)
    runs = decided = 0
    for x in _rows(rng):
        n = x.shape[0]
        w = rng.standard_normal(n).astype(np.float32).astype(np.float64)
        b = rng.standard_normal(n).astype(np.float32).astype(np.float64)
        constants = _constants(x, w, b, eps, rms)
        if constants is None:  # flagged: only a constant row with eps 0
            assert eps == 0.0 and bool(np.all(x == x[0])) and not rms
            continue
        m1, delta, rstd, shift, bound_a, bound_b, tiny = constants
        if tiny == np.inf:
            continue
        runs += 1
        y = np.empty(n, np.float32)
        row_open = _pass(x, y, m1, delta, rstd, shift, w, b, bound_a, bound_b, tiny)
        exact = _oracle.exact_outputs(x, w, b, eps, rms)
        want, _ = _oracle.forward(x.astype(np.float64), w, b, eps, rms, "float32")
        one = np.empty(1, np.float32)
        opens = []
        for k in range(n):
            t = _fma(float(np.float64(x[k]) - m1), rstd, shift)
            yh = _fma(t, float(w[k]), float(b[k]))
            assert y[k] == np.float32(yh)  # the emulation is the pass's arithmetic
            error = abs(mpmath.mpf(yh) - exact[k])
            assert error <= mpmath.mpf(bound_a) + abs(mpmath.mpf(yh)) * mpmath.mpf(bound_b)
            args = (m1, delta, rstd, shift, w[k : k + 1], b[k : k + 1], bound_a, bound_b, tiny)
            opened = _pass(x[k : k + 1], one, *args)
            opens.append(opened)
            if not opened:
                decided += 1
                assert int(one.view(np.uint32)[0]) == int(want[k]), (x[0], k, yh)
        assert row_open == int(any(opens))
    assert runs >= 12 and decided > 4000


def _near_midpoint_row(rng, n, offset):
    """``(x, w, b)`` whose exact results sit within about ``2^-48`` (relative) of a
    float32 midpoint: ``b`` in [1, 2) and ``w = RN32(±2^-24 / t)`` for the float64
    estimate ``t`` of each normalized value, so ``y = b ± 2^-24(1 + ε)``, ``|ε|`` about
    ``2^-24``: the midpoint half a unit above or below ``b``, missed by ``w``'s rounding."""
    x = (rng.standard_normal(n) + offset).astype(np.float32)
    z = x.astype(np.float64)
    t = (z - z.mean()) / np.sqrt(z.var() + 1e-5)
    t[np.abs(t) < 1e-3] = 1.0  # keep w finite and moderate
    sign = rng.choice([-1.0, 1.0], n)
    w = (sign * 2.0**-24 / t).astype(np.float32)
    b = rng.uniform(1.0, 2.0, n).astype(np.float32)
    return x, w, b


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_rows_near_midpoints_are_left_open_and_come_out_right(offset):
    """The pass leaves the near-midpoint elements open (it cannot tell them apart with
    stage 1's bound); the forward (checked pass, compensated statistics, exact fallback)
    gives every element the oracle's bits."""
    rng = np.random.default_rng(13)
    n = 512
    x, w, b = _near_midpoint_row(rng, n, offset)
    w64, b64 = w.astype(np.float64), b.astype(np.float64)
    constants = _constants(x, w64, b64, 1e-5, False)
    assert constants is not None
    m1, delta, rstd, shift, bound_a, bound_b, tiny = constants
    one = np.empty(1, np.float32)
    opened = sum(
        _pass(x[k : k + 1], one, m1, delta, rstd, shift, w64[k : k + 1], b64[k : k + 1],
              bound_a, bound_b, tiny)
        for k in range(n)
    )  # fmt: skip
    assert opened >= n // 2
    y = layernorm.layer_norm(
        torch.from_numpy(x)[None], (n,), torch.from_numpy(w), torch.from_numpy(b), eps=1e-5,
        backend="numba",
    )  # fmt: skip
    want, _ = _oracle.forward(x.astype(np.float64), w64, b64, 1e-5, False, "float32")
    got = y[0].view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    assert np.array_equal(got, want)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_rows_at_large_offsets_and_extreme_scales_are_correctly_rounded(rms):
    """Through the public functions, with random weight and bias: rows at offsets to
    1e6, scales 1e-30 to 1e37, and an outlier first element, every element the oracle's
    (a row may take the checked pass; the bits are the same either way)."""
    g = torch.Generator().manual_seed(14)
    rows = [torch.randn(300, generator=g, dtype=torch.float64) + c for c in (1e4, 1e6)]
    rows += [torch.randn(300, generator=g, dtype=torch.float64) * s for s in (1e-30, 1e37)]
    outlier = torch.randn(300, generator=g, dtype=torch.float64)
    outlier[0] = 1e5
    rows.append(outlier)
    x = torch.stack(rows).to(torch.float32)
    n = x.shape[1]
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    if rms:
        y = layernorm.rms_norm(x, (n,), w, eps=1e-5, backend="numba")
    else:
        y = layernorm.layer_norm(x, (n,), w, b, eps=1e-5, backend="numba")
    _oracle.assert_float32_rows_exact(y, x, w, None if rms else b, 1e-5, rms)
