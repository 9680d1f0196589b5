"""Correct rounding of the backward (docs/contract.md §3): every element of ``dx`` (and of
the residual gradient, ``dx + dresidual_out``) of a float32, float16 or bfloat16 input is
the exact backward of §1 on the given ``dy``, ``z``, weight and eps, rounded once; the
same bits on the numba and torch backends, at any thread count and layout.

The oracle (layernorm/report/oracle.py, imported as tests/_oracle) shares no code with the
kernels: integers, mpmath and squares of rationals. Inputs: random rows at offsets up to
1e6 and widths up to 2**20, rows whose exact result is a rounding midpoint (ties to even)
or within 2**-40 (relative) of one, float32 rows over the whole range, and 10**7 random
elements per dtype compared bitwise between the backends.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import _oracle
import layernorm
from layernorm.backends import numba_, torch_

pytest.importorskip("numba")
from numba import njit

from layernorm.backends import _numba_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
MASK = {torch.float32: 0xFFFFFFFF, torch.bfloat16: 0xFFFF, torch.float16: 0xFFFF}
BACKENDS = {"numba": numba_, "torch": torch_}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(BITS[t.dtype]).numpy().astype(np.int64) & MASK[t.dtype]


def _wrong(dx, z, dy, w, rho, eps, rms) -> int:
    """How many elements of ``dx`` (M, N) differ from the oracle's correctly rounded
    backward; an exact zero must be ``+0.0``."""
    n = z.shape[-1]
    got = _bits(dx).reshape(-1, n)
    gamma = np.ones(n) if w is None else w.float().double().numpy()
    rows = z.reshape(-1, n).double().numpy()
    grads = dy.reshape(-1, n).double().numpy()
    rhos = np.full(rows.shape, -0.0) if rho is None else rho.reshape(-1, n).double().numpy()
    wrong = 0
    for i in range(rows.shape[0]):
        want, zero = _oracle.backward(rows[i], grads[i], gamma, rhos[i], eps, rms, NAMES[dx.dtype])
        want = np.where(zero, 0, want)  # an exact zero is +0.0
        wrong += int((want != got[i]).sum())
    return wrong


def _kernel_dx(backend, dy, z, w, rho, eps, rms):
    """The backend's dx from its own forward statistics (``mean`` only shifts its sums)."""
    kernels = BACKENDS[backend]
    _, _, mean, rstd = kernels.forward(z, None, w, None, eps, rms)
    dx, _, _ = kernels.backward(dy, z, w, mean, rstd, rho, rms, False, False, eps)
    return dx


def _assert_correctly_rounded(backend, dy, z, w, rho, eps, rms):
    dx = _kernel_dx(backend, dy, z, w, rho, eps, rms)
    wrong = _wrong(dx, z, dy, w, rho, eps, rms)
    assert wrong == 0, f"{wrong} of {dx.numel()} elements not correctly rounded ({backend})"
    return dx


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_random_rows_are_correctly_rounded(backend, dtype, rms):
    g = torch.Generator().manual_seed(11)
    for offset, shape in [(0.0, (3, 768)), (100.0, (2, 1000)), (1e4, (2, 513)), (1e6, (1, 4096))]:
        if dtype != torch.float32 and offset > 1e4:
            offset = 300.0  # the halves cannot hold a unit spread at 1e6
        z = (torch.randn(shape, generator=g) * 3 + offset).to(dtype)
        dy = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
        rho = torch.randn(shape, generator=g).to(dtype)
        w = torch.randn(shape[1], generator=g)
        _assert_correctly_rounded(backend, dy, z, w, None, 1e-5, rms)
        _assert_correctly_rounded(backend, dy, z, None, rho, 1e-5, rms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_wide_row_is_correctly_rounded(dtype):
    n = (1 << 20) if dtype == torch.float32 else (1 << 17)
    g = torch.Generator().manual_seed(12)
    z = (torch.randn(1, n, generator=g) + 1e3).to(dtype)
    dy = torch.randn(1, n, generator=g).to(dtype)
    w = torch.rand(n, generator=g) + 0.5
    _assert_correctly_rounded("numba", dy, z, w, None, 1e-5, False)


def _ulp_one(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def _tie_row(dtype, n=8):
    """z = (0, 1, 0, 1, ...) with eps = 0.75: mean 1/2, q = 1/4, rstd = 1 exactly,
    v = ∓1/2. dy = (4 ulp, 0, ...): mean(gh) = 2 ulp, mean(gh v) = -ulp, so
    dz = 3 ulp / 2 where z = 0 and -3 ulp / 2 where z = 1. With dresidual_out = 1:
    1 + 3 ulp/2, a tie between 1 + ulp and 1 + 2 ulp (even), and 1 - 3 ulp/2, exact."""
    ulp = _ulp_one(dtype)
    z = torch.tensor([[0.0, 1.0] * (n // 2)]).to(dtype)
    dy = torch.tensor([[4 * ulp, 0.0] * (n // 2)]).to(dtype)
    return z, dy, torch.ones(1, n).to(dtype), [1.0 + 2 * ulp, 1.0 - 1.5 * ulp] * (n // 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_midpoints_round_to_even(backend, dtype):
    z, dy, rho, want = _tie_row(dtype)
    dx = _assert_correctly_rounded(backend, dy, z, None, rho, 0.75, False)
    assert dx[0].double().tolist() == want
    # RMSNorm: z = (1, -1, ...) with eps = 0 gives rstd = 1; dy = (ulp, 0, ...) gives
    # mean(gh z) = ulp/2 and dz = ulp/2 everywhere: 1 + ulp/2 is a tie, rounding to 1
    zr = torch.tensor([[1.0, -1.0] * 4]).to(dtype)
    dyr = torch.tensor([[_ulp_one(dtype), 0.0] * 4]).to(dtype)
    dx = _assert_correctly_rounded(backend, dyr, zr, None, rho, 0.0, True)
    assert dx[0].double().tolist() == [1.0] * 8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_within_2_to_the_minus_40_of_a_midpoint(backend, dtype):
    # eps = 0.75 + t moves rstd = 1/sqrt(1 + t) off 1: the tie 1 + 3 ulp/2 of
    # _tie_row moves by about 3 ulp t / 2, to either side, for t = ±2**-20 ... ±2**-50.
    z, dy, rho, _ = _tie_row(dtype)
    ulp = _ulp_one(dtype)
    for k in range(20, 51, 3):
        for t in (2.0**-k, -(2.0**-k)):
            dx = _assert_correctly_rounded(backend, dy, z, None, rho, 0.75 + t, False)
            assert dx[0, 0].item() == (1.0 + ulp if t > 0 else 1.0 + 2 * ulp)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_a_weight_in_the_input_s_dtype(backend, dtype, rms):
    # a 16-bit weight in x's dtype, which the numba kernels read as it is and widen
    # inside: random rows, and the ties of _tie_row within 2**-50 (the exact fallback,
    # which gets that weight too); gh = dy * 1 exactly
    g = torch.Generator().manual_seed(12)
    for offset, shape in [(0.0, (3, 768)), (300.0, (2, 513))]:
        z = (torch.randn(shape, generator=g) * 3 + offset).to(dtype)
        dy = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
        rho = torch.randn(shape, generator=g).to(dtype)
        w = torch.randn(shape[1], generator=g).to(dtype)
        _assert_correctly_rounded(backend, dy, z, w, rho, 1e-5, rms)
        _assert_correctly_rounded(backend, dy, z, w, None, 1e-5, rms)
    z, dy, rho, want = _tie_row(dtype)
    ones = torch.ones(z.shape[-1], dtype=dtype)
    dx = _assert_correctly_rounded(backend, dy, z, ones, rho, 0.75, False)
    assert dx[0].double().tolist() == want
    ulp = _ulp_one(dtype)
    for t in (2.0**-50, -(2.0**-50)):
        dx = _assert_correctly_rounded(backend, dy, z, ones, rho, 0.75 + t, False)
        assert dx[0, 0].item() == (1.0 + ulp if t > 0 else 1.0 + 2 * ulp)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_midpoints_without_a_residual(backend, dtype):
    # RMSNorm of z = (1, -1, ...) with eps = 0: rstd = 1, u = z, and dy = (a, b, ...)
    # gives dz = (a + b)/2 everywhere; a = 1 + ulp, b = 1 + 2 ulp make it the tie
    # 1 + 3 ulp/2, which rounds to even, 1 + 2 ulp. eps = 2**-k moves rstd below 1 and
    # every dz below the tie by about 2**-(k+1) (relative), so it rounds to 1 + ulp:
    # rounded once, not through float32 (whose nearest value is the tie itself for
    # k >= 24). No residual gradient (numba's dx pass then skips it); 68 columns: whole
    # vectors and a tail.
    ulp = _ulp_one(dtype)
    n = 68
    z = torch.tensor([[1.0, -1.0] * (n // 2)]).to(dtype)
    dy = torch.tensor([[1.0 + ulp, 1.0 + 2 * ulp] * (n // 2)]).to(dtype)
    dx = _assert_correctly_rounded(backend, dy, z, None, None, 0.0, True)
    assert dx.double().unique().tolist() == [1.0 + 2 * ulp]
    for k in range(26, 51, 4):
        dx = _assert_correctly_rounded(backend, dy, z, None, None, 2.0**-k, True)
        assert dx.double().unique().tolist() == [1.0 + ulp], k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_exact_zero_is_positive(backend, dtype):
    # a constant gradient: gh - mean(gh) = 0 and mean(gh v) = 0, so dz = 0 exactly
    g = torch.Generator().manual_seed(13)
    z = torch.randn(3, 64, generator=g).to(dtype)
    dy = torch.full((3, 64), -0.5).to(dtype)
    for rho in (None, torch.full((3, 64), -0.0).to(dtype)):
        dx = _kernel_dx(backend, dy, z, None, rho, 1e-5, False)
        assert (_bits(dx) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_float32_rows_over_the_whole_range(backend, rms):
    g = torch.Generator().manual_seed(14)
    for scale in (1e-38, 1e-30, 1e-10, 1e10, 1e20, 1e30, 1e37, 3e38 / 4):
        z = (torch.randn(2, 256, generator=g, dtype=torch.float64) * scale).clamp(-3e38, 3e38)
        z = z.to(torch.float32)
        dy = torch.randn(2, 256, generator=g)
        for eps in (1e-5, 0.0):
            _assert_correctly_rounded(backend, dy, z, None, None, eps, rms)


def _random_batch(dtype, g, m, n):
    z = torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g) * 10
    z = z + torch.randn(m, 1, generator=g) * 100
    dy = torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g)
    rho = torch.randn(m, n, generator=g)
    return z.to(dtype), dy.to(dtype), torch.randn(n, generator=g), rho.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numba_and_torch_agree_bitwise_on_ten_million_elements(dtype):
    g = torch.Generator().manual_seed(15)
    total = 0
    for rms in (False, True):
        for m, n in [(3000, 768), (450, 4096), (30, 32768)]:
            z, dy, w, rho = _random_batch(dtype, g, m, n)
            res = rho if m == 450 else None
            a = _kernel_dx("numba", dy, z, w, res, 1e-5, rms)
            c = _kernel_dx("torch", dy, z, w, res, 1e-5, rms)
            assert (_bits(a) == _bits(c)).all(), f"{int((_bits(a) != _bits(c)).sum())} differ"
            total += z.numel()
    assert total >= 10**7


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_thread_count_gives_the_same_bits_and_fixes_every_span(dtype, monkeypatch):
    # tie rows (flagged for the exact fallback) in several spans of a threaded call, and
    # random rows: 1, 2 and 3 threads, the serial entry and each row alone agree
    n, m = 64, 1024
    monkeypatch.setattr(numba_, "SERIAL_NUMEL", 1 << 15)  # (numba_.backward reads it)
    assert m * n >= numba_.SERIAL_NUMEL  # the threaded entry
    g = torch.Generator().manual_seed(16)
    z, dy, w, rho = _random_batch(dtype, g, m, n)
    w = torch.ones(n)
    tie_z, tie_dy, tie_rho, want = _tie_row(dtype, n)
    ties = [0, 1, 31, 32, 33, 95, 96, 256, 500, 511, 512, 768, 1023]
    z[ties], dy[ties], rho[ties] = tie_z, tie_dy, tie_rho
    threads = torch.get_num_threads()
    runs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            runs.append(_bits(_kernel_dx("numba", dy, z, w, rho, 0.75, False)))
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(numba_, "SERIAL_NUMEL", 1 << 62)
    runs.append(_bits(_kernel_dx("numba", dy, z, w, rho, 0.75, False)))
    assert all((r == runs[0]).all() for r in runs)
    dx = _kernel_dx("numba", dy, z, w, rho, 0.75, False)
    for i in ties:
        assert dx[i].double().tolist() == want, i
    for i in range(0, m, 37):
        alone = _kernel_dx("numba", dy[i : i + 1], z[i : i + 1], w, rho[i : i + 1], 0.75, False)
        assert (_bits(alone)[0] == runs[0][i]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_autograd_3d_4d_and_strided_gradients(backend, dtype):
    # through layer_norm / rms_norm / add_layer_norm's autograd: 1-D, 3-D and 4-D inputs, a
    # normalized_shape of two dims, a non-contiguous dy, the residual's gradient
    g = torch.Generator().manual_seed(17)
    x1 = (torch.randn(96, generator=g) + 5).to(dtype).requires_grad_()  # one row, 1-D
    dy1 = torch.randn(96, generator=g).to(dtype)
    layernorm.layer_norm(x1, 96, backend=backend).backward(dy1)
    assert _wrong(x1.grad, x1.detach(), dy1, None, None, 1e-5, False) == 0

    x3 = (torch.randn(2, 3, 96, generator=g) * 2 + 50).to(dtype).requires_grad_()
    w = torch.randn(96, generator=g)
    dy3 = torch.randn(2, 96, 3, generator=g).to(dtype).transpose(1, 2)  # non-contiguous
    layernorm.layer_norm(x3, 96, w, None, backend=backend).backward(dy3)
    assert _wrong(x3.grad, x3.detach(), dy3, w, None, 1e-5, False) == 0

    x4 = (torch.randn(2, 2, 4, 24, generator=g) + 3).to(dtype).requires_grad_()
    dy4 = torch.randn(2, 2, 24, 4, generator=g).to(dtype).transpose(-1, -2)
    w2 = torch.randn(4, 24, generator=g)
    layernorm.rms_norm(x4, (4, 24), w2, eps=1e-6, backend=backend).backward(dy4)
    rows = x4.detach().reshape(4, 96)
    assert _wrong(x4.grad, rows, dy4.reshape(4, 96), w2.reshape(96), None, 1e-6, True) == 0

    x = (torch.randn(5, 80, generator=g) + 7).to(dtype).requires_grad_()
    r = torch.randn(5, 80, generator=g).to(dtype).requires_grad_()
    dy, dh = (torch.randn(5, 80, generator=g).to(dtype) for _ in range(2))
    y, h = layernorm.add_layer_norm(x, r, 80, w[:80], None, backend=backend)
    torch.autograd.backward((y, h), (dy, dh))
    assert torch.equal(x.grad, r.grad)
    assert _wrong(x.grad, h.detach(), dy, w[:80], dh, 1e-5, False) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_size_inputs(backend):
    for shape in [(0, 16), (2, 0, 16)]:
        x = torch.zeros(shape, requires_grad=True)
        w = torch.ones(16, requires_grad=True)
        layernorm.layer_norm(x, 16, w, backend=backend).sum().backward()
        assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros(16))


# The dx pass's row test (docs/contract.md §3, "The row test"): driven directly, with
# constants that make y = weight exactly (dy = 1, z = 0, m1 = delta = 0, rstd = 1,
# c2 = -0.0, k = 0) and E = k_0 per element (k_t1 = k_c = 0), so that y and E are any
# values a test picks; a_0 >= E is the row's bound the row test reads.
_PRECISION = {torch.bfloat16: 8, torch.float16: 11}
_RAW = {torch.bfloat16: np.uint16, torch.float16: np.int16}


@njit
def _dx_of_weights(dy, z, dx, weight, k_0, a_0):
    partial = np.zeros(weight.shape[0])
    return _numba_kernels._dx_row_checked(
        dy, z, None, dx, weight, partial, partial,
        0.0, 0.0, 1.0, -0.0, 0.0, 0.0, 0.0, k_0, a_0, 0.0, 1.0, 0.0,
    )  # fmt: skip


def _nearest_boundary(value: float, dtype: torch.dtype) -> Fraction:
    """The distance from the positive ``value`` (in ``dtype``'s normal range, well below
    its overflow threshold) to the nearest midpoint of two neighbours in ``dtype``."""
    v = Fraction(value)
    e = math.frexp(value)[1] - 1  # 2^e <= value < 2^(e+1)
    ulp = Fraction(2) ** (e - _PRECISION[dtype] + 1)
    low = (v // ulp) * ulp
    below = low - (ulp / 4 if low == Fraction(2) ** e else ulp / 2)
    return min(abs(v - m) for m in (below, low + ulp / 2, low + 3 * ulp / 2))


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (exactly: one that is no midpoint)."""
    v = Fraction(value)
    e = math.frexp(value)[1] - 1
    ulp = Fraction(2) ** (e - _PRECISION[dtype] + 1)
    low = (v // ulp) * ulp
    return float(low if v - low < ulp / 2 else low + ulp)


def _row_test_cases(dtype: torch.dtype):
    """``(y, E, a_0)``: y at and near a boundary of ``dtype``, and small next to a_0."""
    rng = np.random.default_rng(21)
    cases = []
    for scale in (2.0**-9, 0.75, 3.0, 600.0):
        y = float(np.float32(scale * (1 + rng.random())))
        step = 2.0 ** (math.frexp(y)[1] - _PRECISION[dtype])  # half a unit: a boundary
        midpoint = float(Fraction(_rounded(y, dtype)) + Fraction(step) / 2)
        for e in (y * 2.0**-40, y * 2.0**-30):
            for offset in (0.0, e / 2, -e / 2, 2 * e, -2 * e, 3e3 * e):
                cases.append((midpoint + offset, e, e))  # a_0 = E: near a boundary
            cases.append((y, step, step))  # E of a unit: a boundary within it
            cases.append((y, e, 2.0**30 * y))  # |y| below tiny, decided by E alone
    return cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_row_test_leaves_small_and_boundary_values_open(dtype):
    # Each y in a row of its own (two vectors and a tail), with E = a_0, a_0 > E, or
    # a_0 much larger than |y| (the half types' row test then leaves y to the test
    # per element): a y within E of a boundary must leave the row open, a y with no
    # boundary within 2E and E far below its unit must be decided and stored rounded.
    n = 17
    dy = torch.ones(n, dtype=dtype).view(BITS[dtype]).numpy().view(_RAW[dtype])
    z = np.zeros(n, _RAW[dtype])
    dx = np.zeros(n, _RAW[dtype])
    for y, e, a_0 in _row_test_cases(dtype):
        opened = _dx_of_weights(dy, z, dx, np.full(n, y), e, a_0)
        distance = _nearest_boundary(y, dtype)
        if distance <= Fraction(e):
            assert opened == 1, (y, e, a_0)
        elif distance > 2 * Fraction(e) and e < y * 2.0**-30:
            assert opened == 0, (y, e, a_0)
            values = torch.from_numpy(dx.view(np.int16)).view(dtype).double()
            assert values.tolist() == [_rounded(y, dtype)] * n, (y, e, a_0)
    # an exact zero: decided where a_0 = 0 (then E = 0), stored +0.0; open where not
    assert _dx_of_weights(dy, z, dx, np.zeros(n), 0.0, 0.0) == 0
    assert (dx.view(np.uint8) == 0).all()
    assert _dx_of_weights(dy, z, dx, np.zeros(n), 2.0**-60, 2.0**-60) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_near_midpoints_reach_the_exact_stage_and_others_do_not(dtype, monkeypatch):
    # test_midpoints_without_a_residual's rows: dz lies 2**-(k+1) (relative) below a
    # midpoint. At k = 56, far inside any E of the kernel's (a few u), the row must reach
    # the host's exact fallback; at k = 26 every element is decided in the kernel (the
    # half types: RN32(dz) is the midpoint itself, a vector the row test leaves to the
    # test per element). Both come out rounded to 1 + ulp.
    reached: list[int] = []
    fix = numba_._fix_backward_rows

    def recording(dx, dweight, dy, z, w, mean, dresidual_out, eps, rms, flags):
        reached.append(int(flags.sum()))
        fix(dx, dweight, dy, z, w, mean, dresidual_out, eps, rms, flags)

    monkeypatch.setattr(numba_, "_fix_backward_rows", recording)
    ulp = _ulp_one(dtype)
    n = 68
    z = torch.tensor([[1.0, -1.0] * (n // 2)] * 3).to(dtype)
    dy = torch.tensor([[1.0 + ulp, 1.0 + 2 * ulp] * (n // 2)] * 3).to(dtype)
    for k, rows in ((56, [3]), (26, [])):
        reached.clear()
        dx = _assert_correctly_rounded("numba", dy, z, None, None, 2.0**-k, True)
        assert dx.double().unique().tolist() == [1.0 + ulp], k
        assert reached == rows, k
