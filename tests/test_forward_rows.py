"""The numba forward's first stage (docs/contract.md §3, "How", stage 1): its shifted
one-pass statistics and per-element bound, and its software-pipelined row loop.

- The statistics take the row's first element as the shift ``m1`` and one pass for
  ``Σd`` and ``Σd²``; the bound ``E = |w|·a + |p|·b + |yh|·k_y`` that the output passes
  test must hold whatever that shift is: checked against the exact value (mpmath at 60
  digits) on rows whose first element is an outlier, rows at large offsets, constant rows,
  one- and two-element rows and a wide row.
- The cheap pass's constants (``_fast_bounds``) keep the inequalities their docstring
  states, checked in rational arithmetic.
- The row loop computes row ``i + 1``'s statistics before row ``i``'s output: every row
  must still get its own, in the serial and the threaded entries, with and without the
  fused residual, next to NaN, infinite, constant and flagged rows.
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch

import _oracle

pytest.importorskip("numba")

from layernorm.backends import _numba_kernels as kernels
from layernorm.backends import numba_

mpmath.mp.dps = 60


def _stage_one(x, w, b, eps, rms):
    """``(yh, E, flag)`` of the kernel's first stage for the one-row ``x``: its
    statistics (``_row_statistics``, whose ``e_mean`` is checked here against the exact
    mean), the bound's constants (``_folded``), and ``yh``, ``E`` as
    ``normalize_row_checked`` computes them (IEEE float64 in NumPy, in its order)."""
    n = x.shape[0]
    mean = np.empty(1, np.float32)
    rstd = np.empty(1, np.float32)
    stats = kernels._row_statistics(0, x, n, x, 0, False, x, mean, rstd, n, eps, rms, False)
    _, m1, delta, rstd_i, e_mean, k_c, k_p, k_w, w_rel, k_y, flag = stats
    if not rms:  # the mean's own bound: |delta - (mean - m1)| <= e_mean, exactly
        exact_mean = sum(Fraction(float(v)) for v in x) / n
        assert abs(Fraction(delta) - (exact_mean - Fraction(m1))) <= Fraction(e_mean)
    if flag:
        return None, None, flag
    a, bb = kernels._folded(delta, e_mean, k_c, k_p, k_w, w_rel)
    z = x.astype(np.float64)
    p = (((z - m1) - delta) * rstd_i) * w
    yh = p + b
    bound = np.abs(w) * a + np.abs(p) * bb + np.abs(yh) * k_y
    return yh, bound, flag


def _shift_rows():
    rng = np.random.default_rng(5)
    rows = []
    for outlier in (1e3, 1e6, -3e7, 1e30):  # the first element far from the rest
        rows.append(np.concatenate([[outlier], rng.standard_normal(63)]))
    rows.append(rng.standard_normal(64) * 0.5 + 1e6)  # an offset row (unit spread)
    rows.append(np.concatenate([[1e-3], rng.standard_normal(200) * 1e-6]))
    row = rng.standard_normal(64)
    rows.append(np.concatenate([[row.mean()], row]))  # the shift about the mean
    rows.append(np.full(16, 3.0))  # constant: delta, var and e_mean are 0
    rows.append(np.array([7.0]))
    rows.append(np.array([-2.0, 1e5]))
    rows.append(np.concatenate([[5e4], rng.standard_normal(8191)]))  # wide, bad shift
    return [r.astype(np.float32) for r in rows]


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_the_bound_holds_whatever_the_shift(rms, eps):
    """``|yh - y| <= E`` for every element of every row stage 1 does not flag, against
    the exact value; and stage 1 flags no row here but those without a usable bound
    (a constant row with eps 0, whose variance and eps are both 0)."""
    rng = np.random.default_rng(6)
    for x in _shift_rows():
        n = x.shape[0]
        w = rng.standard_normal(n).astype(np.float32).astype(np.float64)
        b = rng.standard_normal(n).astype(np.float32).astype(np.float64)
        yh, bound, flag = _stage_one(x, w, b, eps, rms)
        constant = bool(np.all(x == x[0])) and not rms
        if flag:
            assert constant and eps == 0.0, (n, x[0])
            continue
        exact = _oracle.exact_outputs(x, w, b, eps, rms)
        for k in range(n):
            error = abs(mpmath.mpf(float(yh[k])) - exact[k])
            assert error <= mpmath.mpf(float(bound[k])), (n, x[0], k, float(error), bound[k])


def test_the_cheap_pass_constants_keep_their_inequalities():
    """``_fast_bounds``: ``bound_a + |p|·bound_b`` covers ``|w|·a + |p|·b + |yh|·k_y``
    (with ``|yh| <= |p|(1 + u) + |beta|``), and ``tiny >= A / (FAST_MARGIN - B)``
    (``A = bound_a + beta_max·bound_b``, ``B = (1 + 2u)·bound_b``), or ``inf`` where
    ``B > FAST_MARGIN / 2``; in rational arithmetic, on random and edge constants."""
    rng = np.random.default_rng(7)
    u = Fraction(2) ** -53
    margin = Fraction(kernels.FAST_MARGIN)
    cases = [(0.0, 0.0, 2.1 * 2.0**-53, 1.0, 0.0), (1e-15, 2e-14, 2.4e-16, 3.0, 0.0)]
    cases.append((1e-15, 2.0**-28, 2.4e-16, 1.0, 1.0))  # B near FAST_MARGIN / 2
    for _ in range(200):
        a, b = 10.0 ** rng.uniform(-20, -8, 2)
        cases.append((a, b, 2.1 * 2.0**-53, 10.0 ** rng.uniform(-3, 3), rng.uniform(0, 5)))
    finite = 0
    for a, b, k_y, w_max, b_max in cases:
        bound_a, bound_b, tiny = kernels._fast_bounds(a, b, k_y, w_max, b_max)
        fa, fb, fk = Fraction(a), Fraction(b), Fraction(k_y)
        # E <= w_max·a + |p|·b + (|p|(1 + u) + b_max)·k_y, term by term
        assert Fraction(bound_a) >= Fraction(w_max) * fa + Fraction(b_max) * fk
        assert Fraction(bound_b) >= fb + fk * (1 + u)
        big_a = Fraction(bound_a) + Fraction(b_max) * Fraction(bound_b)
        big_b = (1 + 2 * u) * Fraction(bound_b)
        if big_b > margin / 2:
            assert tiny == np.inf
            continue
        finite += 1
        assert Fraction(tiny) * (margin - big_b) >= big_a
    assert finite > 100


def _same(a, b):
    """Bitwise equality of two tensors of one dtype (NaN patterns included)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _batch_rows(n, g):
    """Rows as different as rows get, so that a row given another's statistics shows."""
    rows = [torch.randn(n, generator=g) * 10.0**k + 10.0 ** (k + 2) for k in range(-3, 4)]
    rows.append(torch.full((n,), 2.5))  # constant
    nan = torch.randn(n, generator=g)
    nan[n // 2] = float("nan")
    inf = torch.randn(n, generator=g)
    inf[0] = float("inf")
    rows += [nan, inf, torch.randn(n, generator=g)]
    tie = torch.tensor([0.0, 1.0] * (n // 2) + [0.5] * (n % 2))  # exact ties (eps below)
    rows.append(tie)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("n", [1, 8, 64, 1500])
def test_each_row_gets_its_own_statistics(dtype, rms, n, monkeypatch):
    """Every prefix of a batch of unlike rows (1 to 12 rows), in the serial and the
    threaded entry, with and without a residual: each row's output, mean and rstd are
    that row's alone (bitwise the row computed by itself), and its output is the
    correctly rounded one (the oracle)."""
    g = torch.Generator().manual_seed(n)
    x = _batch_rows(n, g).to(dtype)
    residual = torch.randn(x.shape, generator=g).to(dtype)
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    bias = None if rms else b
    eps = 0.75 if n == 8 else 1e-5
    alone = [numba_.forward(x[i : i + 1], None, w, bias, eps, rms) for i in range(len(x))]
    alone_fused = [
        numba_.forward(x[i : i + 1], residual[i : i + 1], w, bias, eps, rms) for i in range(len(x))
    ]
    for serial_numel in (0, 1 << 62):
        monkeypatch.setattr(numba_, "SERIAL_NUMEL", serial_numel)
        for m in range(1, len(x) + 1):
            for res, single in ((None, alone), (residual[:m], alone_fused)):
                y, h, mean, rstd = numba_.forward(x[:m], res, w, bias, eps, rms)
                for i in range(m):
                    want = single[i]
                    assert _same(y[i], want[0][0])
                    if h is not None:
                        assert _same(h[i], want[1][0])
                    assert _same(rstd[i], want[3][0])
                    if mean is not None:
                        assert _same(mean[i], want[2][0])
    fmt = "float32" if dtype == torch.float32 else "bfloat16"
    y = numba_.forward(x, None, w, bias, eps, rms)[0]
    bits = y.contiguous().view(torch.int32 if dtype == torch.float32 else torch.int16)
    bits = bits.numpy().astype(np.int64) & (0xFFFFFFFF if dtype == torch.float32 else 0xFFFF)
    beta = np.zeros(n) if rms else b.double().numpy()
    for i, z in enumerate(x.double().numpy()):
        if not np.isfinite(z).all():
            continue  # (their own row's bits, above: NaN and inf stay in their row)
        want, zero = _oracle.forward(z, w.double().numpy(), beta, eps, rms, fmt)
        assert ((want == bits[i]) | zero).all(), i
