"""dweight and dbias: the same bits on every backend (docs/contract.md §3, "dweight and dbias").

The definition (``layernorm.backends._weight_terms``) is re-derived here from an oracle of
its own: mpmath at 80 digits for each row's scalars, NumPy float64 for the terms, and the
order written out as loops. Every backend, through the public functions and through its
kernel entry, must give exactly these bits; and the sums must lie within the stated bound
of the exact ``Σ dy·x̂``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import layernorm
from layernorm.backends import _exact, _weight_terms, numba_, torch_

BACKENDS = ["numba", "torch"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------------------
# The oracle: shares no code with the backends


def _oracle_scalars(z: np.ndarray, eps: float, rms: bool) -> tuple[float, float, float]:
    with mpmath.workdps(80):
        values = [mpmath.mpf(float(v)) for v in z]
        mean = mpmath.mpf(0) if rms else mpmath.fsum(values) / len(values)
        q = mpmath.fsum((v - mean) ** 2 for v in values) / len(values)
        rstd = 1 / mpmath.sqrt(q + mpmath.mpf(eps))
        e = int(mpmath.floor(mpmath.log(rstd, 2)))
        scale = mpmath.mpf(2) ** (31 - e)  # 32 significant bits
        r = float(mpmath.nint(rstd * scale) / scale)
        a = 0.0 if rms else float(z[0])
        grid = mpmath.mpf(2) ** 32
        t = 0.0 if rms else float(mpmath.nint((mean - mpmath.mpf(a)) * rstd * grid) / grid)
        return a, r, t + 0.0


def _ordered_sum(terms: np.ndarray) -> np.ndarray:
    """Blocks of 32 rows, row by row from 0.0; the blocks' totals by halving."""
    m, n = terms.shape
    blocks = []
    for start in range(0, m, 32):
        total = np.zeros(n)
        for i in range(start, min(m, start + 32)):
            total = total + terms[i]
        blocks.append(total)
    if not blocks:
        return np.zeros(n)
    while len(blocks) > 1:
        k, h = len(blocks), (len(blocks) + 1) // 2
        blocks = [blocks[j] + blocks[j + h] if j < k - h else blocks[j] for j in range(h)]
    return blocks[0]


def _oracle(dy: torch.Tensor, z: torch.Tensor, n: int, eps: float, rms: bool):
    """(dweight, dbias) as float64 arrays before their one rounding, and the terms."""
    rows = z.detach().reshape(-1, n).double().numpy()
    g = dy.detach().reshape(-1, n).double().numpy()
    u = np.empty_like(rows)
    for i, row in enumerate(rows):
        a, r, t = _oracle_scalars(row, eps, rms)
        u[i] = ((row - a) * r) - t
    return _ordered_sum(g * u), _ordered_sum(g), g, rows


def _exact_sum(g: np.ndarray, rows: np.ndarray, eps: float, rms: bool) -> np.ndarray:
    """Σ dy·x̂ with x̂ at 40 digits, per column."""
    with mpmath.workdps(40):
        out = []
        xhat = []
        for row in rows:
            values = [mpmath.mpf(float(v)) for v in row]
            mean = mpmath.mpf(0) if rms else mpmath.fsum(values) / len(values)
            q = mpmath.fsum((v - mean) ** 2 for v in values) / len(values)
            rstd = 1 / mpmath.sqrt(q + mpmath.mpf(eps))
            xhat.append([(v - mean) * rstd for v in values])
        for c in range(rows.shape[1]):
            out.append(float(mpmath.fsum(g[i, c] * xhat[i][c] for i in range(len(rows)))))
    return np.array(out)


def _grads(backend, dtype, x, dy, shape, w, b, rms, eps, residual=None):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if rms:
        if residual is None:
            y = layernorm.rms_norm(x, shape, w, eps=eps, backend=backend)
        else:
            y, _ = layernorm.add_rms_norm(x, residual, shape, w, eps=eps, backend=backend)
        (dweight,) = torch.autograd.grad(y, [w], dy)
        return dweight, None
    b = b.detach().requires_grad_()
    if residual is None:
        y = layernorm.layer_norm(x, shape, w, b, eps=eps, backend=backend)
    else:
        y, _ = layernorm.add_layer_norm(x, residual, shape, w, b, eps=eps, backend=backend)
    return torch.autograd.grad(y, [w, b], dy)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN anywhere equal to NaN (NaN payloads differ between paths)."""
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(
        a[~nan_a].view(torch.int32), b[~nan_b].view(torch.int32)
    )


# ---------------------------------------------------------------------------------------
# The definition's pieces


def test_the_kernels_record_the_weight_terms_they_are_compiled_with():
    # numba's cache sees only _numba_kernels.py: see WEIGHT_TERMS_SHA256 there
    from layernorm.backends import _numba_kernels

    digest = hashlib.sha256(Path(_weight_terms.__file__).read_bytes()).hexdigest()[:16]
    assert digest == _numba_kernels.WEIGHT_TERMS_SHA256, (
        f"_weight_terms.py changed: set WEIGHT_TERMS_SHA256 in _numba_kernels.py to {digest!r}"
    )


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_the_exact_scalars_are_the_oracles(rms):
    rng = np.random.default_rng(1)
    for n, offset, scale, eps in [
        (7, 0.0, 1.0, 1e-5), (64, 1e4, 1.0, 1e-5), (33, 1e6, 1e-2, 1e-6),
        (5, -3.0, 1e-4, 1e-5), (16, 0.0, 1e20, 0.0), (3, 1e-30, 1e-35, 0.0), (2, 0.5, 0.5, 0.75),
    ]:  # fmt: skip
        z = (rng.standard_normal(n) * scale + offset).astype(np.float32).astype(np.float64)
        assert _exact.weight_scalars(z, eps, rms) == _oracle_scalars(z, eps, rms)
    # z = (0, 1), eps = 0.75: rstd = 1 exactly, mean - a = 1/2
    assert _exact.weight_scalars(np.array([0.0, 1.0]), 0.75, False) == (0.0, 1.0, 0.5)
    assert _exact.weight_scalars(np.zeros(4), 0.0, rms) == (0.0, np.inf, 0.0)  # s = 0
    _, r, t = _exact.weight_scalars(np.array([1.0, np.inf]), 1e-5, rms)
    assert np.isnan(r) and np.isnan(t)


# ---------------------------------------------------------------------------------------
# Every backend gives the oracle's bits


def _cases():
    # (shape, normalized_shape, offset): 1-D to 4-D, multi-dim shapes, several blocks
    # with an odd count (70 rows: 3 blocks), a lone row
    return [
        ((40,), 40, 0.0),
        ((70, 33), 33, 10.0),
        ((3, 5, 24), 24, -1e3),
        ((2, 3, 4, 8), (4, 8), 0.5),
        ((1, 1, 768), 768, 1e4),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_dweight_and_dbias_are_the_definitions_bits(backend, dtype, rms):
    g = torch.Generator().manual_seed(2)
    for shape, normalized, offset in _cases():
        n = int(np.prod(normalized))
        x = (torch.randn(shape, generator=g) * 2 + offset).to(dtype)
        dy = torch.randn(shape, generator=g).to(dtype)
        w = torch.randn(normalized, generator=g)
        b = torch.randn(normalized, generator=g)
        eps = 1e-5
        dweight, dbias = _grads(backend, dtype, x, dy, normalized, w, b, rms, eps)
        expected_w, expected_b, _, _ = _oracle(dy, x, n, eps, rms)
        assert torch.equal(dweight.reshape(-1), torch.from_numpy(expected_w).float())
        if not rms:
            assert torch.equal(dbias.reshape(-1), torch.from_numpy(expected_b).float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_residual_and_a_strided_gradient_change_nothing(backend):
    # add_*: the terms are those of the normalized input h = x + residual; dy transposed
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, 48, generator=g) + 3
    residual = torch.randn(6, 5, 48, generator=g)
    dy = torch.randn(6, 48, 5, generator=g).transpose(1, 2)
    w, b = torch.randn(48, generator=g), torch.randn(48, generator=g)
    for rms in (False, True):
        dweight, dbias = _grads(backend, None, x, dy, 48, w, b, rms, 1e-5, residual)
        expected_w, expected_b, _, _ = _oracle(dy, x + residual, 48, 1e-5, rms)
        assert torch.equal(dweight, torch.from_numpy(expected_w).float())
        if not rms:
            assert torch.equal(dbias, torch.from_numpy(expected_b).float())


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_the_sums_are_within_the_stated_bound_of_the_exact_sums(rms):
    # docs/contract.md §3: |dweight - Σ dy·x̂| <= Σ|dy|·|u - x̂|'s bound + the float64
    # sum's + half a float32 unit
    g = torch.Generator().manual_seed(4)
    for offset, scale in [(0.0, 1.0), (1e4, 1.0), (3.0, 1e-3)]:
        x = torch.randn(40, 64, generator=g) * scale + offset
        dy = torch.randn(40, 64, generator=g)
        dweight, _ = _grads("numba", None, x, dy, 64, torch.ones(64), torch.zeros(64), rms, 1e-5)
        _, _, terms_g, rows = _oracle(dy, x, 64, 1e-5, rms)
        exact = _exact_sum(terms_g, rows, 1e-5, rms)
        xz = torch.from_numpy(rows)
        centred = xz if rms else xz - xz.mean(1, keepdim=True)
        rstd = (centred.square().mean(1, keepdim=True) + 1e-5).rsqrt().numpy()
        a = np.zeros((40, 1)) if rms else rows[:, :1]
        spread = np.abs(rows - a) * rstd
        u_bound = (
            (2.0**-32 + 2.0**-52) * spread
            + 2.0**-33
            + 2.0**-53 * (np.abs(centred.numpy()) * rstd + 1)
        )
        bound = (np.abs(terms_g) * u_bound).sum(0) * 1.01
        bound += 41 * 2.0**-53 * (np.abs(terms_g) * (spread + 1)).sum(0)
        bound += 2.0**-24 * np.abs(exact)
        assert (np.abs(dweight.double().numpy() - exact) <= bound).all()


# ---------------------------------------------------------------------------------------
# Backends against each other, on inputs the oracle would take too long for


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 300),
    n=st.sampled_from([1, 3, 64, 100, 257]),
    offset=st.sampled_from([0.0, 1.0, -50.0, 1e4, 1e6]),
    log_scale=st.integers(-6, 6),
    dtype=st.sampled_from(DTYPES),
    rms=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_numba_and_torch_agree_bitwise(m, n, offset, log_scale, dtype, rms, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * 10.0**log_scale + offset).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    ours = [_grads(backend, dtype, x, dy, n, w, b, rms, 1e-5) for backend in BACKENDS]
    assert _same_bits(ours[0][0], ours[1][0])  # (float16 at 1e6: rows of inf, NaN sums)
    if not rms:
        assert _same_bits(ours[0][1], ours[1][1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_calls_over_threads_give_the_torch_backends_bits(dtype):
    # 3000 x 1024: the numba backend's threaded entry (spans of blocks, their partials
    # added by halving), the compiled front door where it is built
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3000, 1024, generator=g) * 3 + 5).to(dtype)
    dy = torch.randn(3000, 1024, generator=g).to(dtype)
    w, b = torch.randn(1024, generator=g), torch.randn(1024, generator=g)
    expected = _grads("torch", dtype, x, dy, 1024, w, b, False, 1e-5)
    for backend in ("numba", None):
        got = _grads(backend, dtype, x, dy, 1024, w, b, False, 1e-5)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# ---------------------------------------------------------------------------------------
# The numba kernel settles the rows its float64 test leaves open, in double-double


def _near_ties() -> list[tuple[np.ndarray, float, bool]]:
    """(row, eps, rms) whose exact ``r`` or ``t`` lies within 2^-50 (relative) of a
    rounding midpoint: beyond any float64 test (``test_near_ties_are_beyond_float64``).

    - ``t``: z = (0, x) repeated, x = (2k + 1)·2^-32, eps = 1: ``mean - a = x/2`` is a
      midpoint of the 2^-32 grid and ``rstd = 1/sqrt(1 + x²/4)`` moves ``v`` below it by
      ``x²/8`` of itself; (x, 0) repeated: the same, negative.
    - ``r``: q = 1/4 (z = (0, 1) repeated, or 1/2 everywhere for RMSNorm) and eps =
      fl(1/m²) - 1/4, m = 1 + (2j + 1)·2^-32 a midpoint of r's 32-bit grid: ``rstd`` is
      within 2^-52 of m, and layer_norm's ``t = rstd/2`` within 2^-53 of a midpoint too.
    """
    rows = []
    for n in (2, 64, 4096):
        for k in (0, 5, 150):
            x = (2 * k + 1) * 2.0**-32
            rows.append((np.tile([0.0, x], n // 2), 1.0, False))
            rows.append((np.tile([x, 0.0], n // 2), 1.0, False))
        for j in (0, 77, 2**30 + 1):
            m = 1.0 + (2 * j + 1) * 2.0**-32
            eps = 1.0 / (m * m) - 0.25
            rows.append((np.tile([0.0, 1.0], n // 2), eps, False))
            rows.append((np.full(n, 0.5), eps, True))
    return rows


def test_near_ties_are_beyond_float64(monkeypatch):
    # the torch backend's float64 test (the numba kernel's first test, the same bound)
    # sends every one of them to _exact
    sent = []
    exact = _exact.weight_scalars

    def counting(row, eps, rms):
        sent.append(1)
        return exact(row, eps, rms)

    monkeypatch.setattr(_exact, "weight_scalars", counting)
    for row, eps, rms in _near_ties():
        z = torch.from_numpy(row).float()[None]
        dy = torch.ones_like(z)
        _, _, mean, _ = torch_.forward(z, None, None, None, eps, rms)
        before = len(sent)
        torch_.weight_gradient(dy, z, mean, eps, rms)
        assert len(sent) == before + 1, (row[:2], eps, rms)


def test_the_settled_scalars_of_near_ties_are_the_oracles():
    from layernorm.backends._numba_kernels import _settled_weight_scalars

    for row, eps, rms in _near_ties():
        a, r, t = _oracle_scalars(row, eps, rms)
        assert _settled_weight_scalars(row, len(row), eps, rms, a) == (r, t, 0.0)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 300),
    offset=st.sampled_from([0.0, 1.0, -7.0, 1e2, 1e4, 1e6]),
    log_scale=st.floats(-30, 30),
    eps=st.sampled_from([1e-5, 0.0, 1e-12, 0.75]),
    rms=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_settled_scalars_are_the_oracles(n, offset, log_scale, eps, rms, seed):
    # every float32 row: settled (open = 0), with the exact scalars' bits
    from layernorm.backends._numba_kernels import _settled_weight_scalars

    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(n) * 3 + offset) * 10.0**log_scale
    row = row.astype(np.float32).astype(np.float64)
    a, r, t = _oracle_scalars(row, eps, rms)
    if not np.isfinite(r):
        return  # (a row of one repeated value with eps = 0: s = 0)
    assert _settled_weight_scalars(row, n, eps, rms, a) == (r, t, 0.0)


def test_the_settled_scalars_of_representable_and_unsettled_rows():
    # z = (0, 1), eps = 0.75: rstd = 1 and t = 1/2 exactly, on their grids; a row of
    # zeros with eps = 0 (s = 0) and a row holding an infinity or a NaN stay open
    from layernorm.backends._numba_kernels import _settled_weight_scalars

    assert _settled_weight_scalars(np.array([0.0, 1.0]), 2, 0.75, False, 0.0) == (1.0, 0.5, 0.0)
    assert _settled_weight_scalars(np.array([2.0, 2.0]), 2, 0.0, True, 0.0) == (0.5, 0.0, 0.0)
    for row, eps in (([0.0, 0.0], 0.0), ([1.0, np.inf], 1e-5), ([np.nan, 1.0], 1e-5)):
        for rms in (False, True):
            assert _settled_weight_scalars(np.array(row), 2, eps, rms, row[0])[2] == 1.0


def test_rows_near_a_midpoint_need_no_host(monkeypatch):
    # the numba backward's dweight for rows of near ties: the oracle's bits, and the
    # host's fallback (torch_.weight_gradient) never runs
    def no_host(*args):
        raise AssertionError("dweight went to the host")

    monkeypatch.setattr(torch_, "weight_gradient", no_host)
    for n in (2, 64, 4096):
        for rms in (False, True):
            cases = [(row, eps) for row, eps, r in _near_ties() if len(row) == n and r == rms]
            for eps in {eps for _, eps in cases}:
                rows = [row for row, e in cases if e == eps]
                x = torch.from_numpy(np.stack(rows)).float()
                dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(n))
                w, b = torch.ones(n), torch.zeros(n)
                dweight, _ = _grads("numba", None, x, dy, n, w, b, rms, eps)
                expected, _, _, _ = _oracle(dy, x, n, eps, rms)
                assert torch.equal(dweight, torch.from_numpy(expected).float())


# ---------------------------------------------------------------------------------------
# The exact fallback of the scalars


def test_the_float_tests_decide_what_the_exact_scalars_give(monkeypatch):
    # every row sent to _exact.weight_scalars: the same bits as the float64 tests' verdicts
    g = torch.Generator().manual_seed(6)
    x = torch.randn(50, 40, generator=g) * 3 + 7
    dy = torch.randn(50, 40, generator=g)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    float_scalars = torch_._weight_scalars

    def every_row_open(z, m1, delta, e_mean, r, e_r, loose, eps, rms):
        return float_scalars(z, m1, delta, e_mean, r, e_r, torch.ones_like(loose), eps, rms)

    for rms in (False, True):
        decided = _grads("torch", None, x, dy, 40, w, b, rms, 1e-5)
        monkeypatch.setattr(torch_, "_weight_scalars", every_row_open)
        exact = _grads("torch", None, x, dy, 40, w, b, rms, 1e-5)
        monkeypatch.setattr(torch_, "_weight_scalars", float_scalars)
        assert torch.equal(decided[0], exact[0])


def test_the_numba_backends_open_rows_get_the_torch_backends_dweight():
    # flag bit 1 (value 2) of a row: the host rewrites dweight with the torch backend's
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 24, generator=g) + 2
    dy = torch.randn(40, 24, generator=g)
    w = torch.randn(24, generator=g)
    _, _, mean, rstd = torch_.forward(x, None, w, None, 1e-5, False)
    dx, expected, _ = torch_.backward(dy, x, w, mean, rstd, None, False, True, False, 1e-5)
    dweight = torch.full((24,), 123.0)
    flags = np.zeros(40, np.uint8)
    flags[17] = 2
    numba_._fix_backward_rows(dx.clone(), dweight, dy, x, w, mean, None, 1e-5, False, flags)
    assert torch.equal(dweight, expected)


def test_the_dweight_fallback_computes_no_dx(monkeypatch):
    # torch_.weight_gradient (the host's dweight for a row left open) has no weight:
    # under a constant dy every row's layer_norm dx is then about 0 and left open by Ziv's test,
    # and its exact fallback, a whole dx of rows never used, once cost 0.6 s a call of
    # 1024 rows of 64. It computes dweight alone: the same bits, no dx fallback.
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 48, generator=g) * 2 + 3
    dy = torch.ones(64, 48)
    _, _, mean, _ = torch_.forward(x, None, None, None, 1e-5, False)
    rstd = x.new_empty(0)
    full = torch_.backward(dy, x, None, mean, rstd, None, False, True, False, 1e-5)[1]

    def no_dx_fallback(*args):
        raise AssertionError("the dweight fallback rounded dx exactly")

    monkeypatch.setattr(torch_, "_fix_backward_rows", no_dx_fallback)
    with pytest.raises(AssertionError, match="rounded dx exactly"):  # the trap is live
        torch_.backward(dy, x, None, mean, rstd, None, False, True, False, 1e-5)
    assert torch.equal(torch_.weight_gradient(dy, x, mean, 1e-5, False), full)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_no_float_test_can_settle(backend):
    # a zero row with eps = 0 (s = 0: rstd = inf) and a row holding an infinity: their
    # scalars come from _exact on every backend (NaN terms: every column's sum is NaN)
    x = torch.randn(8, 16) + 1
    x[2] = 0.0
    dy = torch.randn(8, 16)
    w, b = torch.randn(16), torch.randn(16)
    for eps, rows in (
        (0.0, x),
        (1e-5, x.index_put((torch.tensor([5]), torch.tensor([3])), torch.tensor(np.inf))),
    ):
        for rms in (False, True):
            got = _grads(backend, None, rows, dy, 16, w, b, rms, eps)
            assert torch.isnan(got[0]).all()
