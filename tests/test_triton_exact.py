"""The triton backend's forward is correctly rounded (docs/contract.md §3), in Triton's
interpreter (TRITON_INTERPRET=1): every element the exact result rounded once, so the
numba backend's bits.

The oracle (layernorm/report/oracle.py, as tests/_oracle) shares no code with the
kernels. Inputs: random rows at offsets up to 1e6, with and without weight, bias and
residual, strided; rows whose exact result is a rounding midpoint or within 2**-40
(relative) of one; float32 rows over the whole range; non-finite rows; exact zeros.
Each runs on both forward paths: ``fused`` (one program per row) and ``wide`` (chunks over
programs, shrunk here to 64-column chunks so that a few hundred columns take it).

Budget: the interpreter runs 3e4 (rows of 768) to 1e5 (rows of 4096) elements a second,
so the bitwise comparison with numba covers :data:`RANDOM_ELEMENTS` random elements per
dtype (about 15 s in all), not the 10**7 of ``test_exact.py`` (numba against torch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import _oracle
import layernorm
from _triton_interpreter import HAS_TRITON, import_for_the_interpreter
from layernorm import backends

import_for_the_interpreter()
pytest.importorskip("numba")

if HAS_TRITON:
    from layernorm.backends import torch_, triton_

INTERPRETED = HAS_TRITON and triton_._triton_interprets()
pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    pytest.mark.skipif(
        HAS_TRITON and not INTERPRETED,
        reason="triton was imported compiled: run TRITON_INTERPRET=1 pytest " + __file__,
    ),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
MASK = {torch.float32: 0xFFFFFFFF, torch.bfloat16: 0xFFFF, torch.float16: 0xFFFF}
#: random elements per dtype compared bit for bit with the numba backend
RANDOM_ELEMENTS = 480_000
WIDE_N = 300  # several 64-column chunks under the ``wide`` path, the last one partial


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backends.forget("triton")
    yield
    backends.forget("triton")


@pytest.fixture(params=["fused", "wide"])
def path(request, monkeypatch):
    """Runs a test on each forward path; returns a width that takes it."""
    if request.param == "wide":
        monkeypatch.setattr(triton_, "FUSED_FORWARD_N", 128)
        monkeypatch.setattr(triton_, "CHUNK_N", 64)
        assert triton_.forward_path(WIDE_N, torch.float32) == "wide"
        return WIDE_N
    assert triton_.forward_path(WIDE_N, torch.float32) == "fused"
    return WIDE_N


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(BITS[t.dtype]).numpy().astype(np.int64) & MASK[t.dtype]


def _norm(x, w, b, eps, rms, backend):
    n = x.shape[-1]
    if rms:
        return layernorm.rms_norm(x, (n,), w, eps=eps, backend=backend)
    return layernorm.layer_norm(x, (n,), w, b, eps=eps, backend=backend)


def _assert_correctly_rounded(x, w, b, eps, rms):
    """Every element of the triton output is the oracle's, bit for bit (the sign of an
    exact zero is a convention: checked against numba in test_signed_zeros_...)."""
    y = _norm(x, w, b, eps, rms, "triton")
    n = x.shape[-1]
    got = _bits(y).reshape(-1, n)
    gamma = np.ones(n) if w is None else w.float().double().numpy()
    beta = np.zeros(n) if (b is None or rms) else b.float().double().numpy()
    wrong = 0
    for i, z in enumerate(x.reshape(-1, n).double().numpy()):
        want, zero = _oracle.forward(z, gamma, beta, eps, rms, NAMES[x.dtype])
        wrong += int(((want != got[i]) & ~zero).sum())
    assert wrong == 0, f"{wrong} of {x.numel()} elements not correctly rounded"
    return y


def _assert_numba_bits(x, w, b, eps, rms):
    ours = _bits(_norm(x, w, b, eps, rms, "triton"))
    theirs = _bits(_norm(x, w, b, eps, rms, "numba"))
    assert (ours == theirs).all(), f"{int((ours != theirs).sum())} elements differ"


# ---------------------------------------------------------------------------------------
# Random rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_elements_are_numbas_bits(dtype):
    # both paths at their default limits: rows of 768 and 4096 fused, 20000 wide
    g = torch.Generator().manual_seed(11)
    total = 0
    for rms in (False, True):
        for m, n in [(32, 768), (30, 4096), (5, 20_000)]:
            x = torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g) * 10
            x = (x + torch.randn(m, 1, generator=g) * 100).to(dtype)
            w, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g)
            _assert_numba_bits(x, w, b, 1e-5, rms)
            total += x.numel()
    assert triton_.forward_path(20_000, dtype) == "wide"
    assert total >= RANDOM_ELEMENTS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_random_rows_are_correctly_rounded(path, dtype, rms):
    g = torch.Generator().manual_seed(12)
    for offset in (0.0, 100.0, 1e4, 1e6):
        if dtype != torch.float32 and offset > 1e4:
            offset = 300.0  # the halves cannot hold a unit spread at 1e6
        x = (torch.randn(3, path, generator=g) * 3 + offset).to(dtype)
        w, b = torch.randn(path, generator=g), torch.randn(path, generator=g)
        _assert_correctly_rounded(x, w, b, 1e-5, rms)
        _assert_correctly_rounded(x, None, None, 1e-5, rms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_and_strided_rows(path, dtype):
    # add_*: y is the norm of the rounded x + residual, read through a row stride
    g = torch.Generator().manual_seed(13)
    n = path
    wide = (torch.randn(4, n + 50, generator=g) * 2 + 30).to(dtype)
    x, r = wide[:, 7 : 7 + n], torch.randn(4, n, generator=g).to(dtype)
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    y, h = layernorm.add_layer_norm(x, r, n, w, b, backend="triton")
    assert torch.equal(h, x + r)
    _assert_correctly_rounded(h, w, b, 1e-5, False)
    y_numba, _ = layernorm.add_layer_norm(x, r, n, w, b, backend="numba")
    assert (_bits(y) == _bits(y_numba)).all()
    ys, hs = layernorm.add_rms_norm(x, r, n, w, backend="triton")
    ys_numba, _ = layernorm.add_rms_norm(x, r, n, w, backend="numba")
    assert torch.equal(hs, h) and (_bits(ys) == _bits(ys_numba)).all()
    y3 = layernorm.layer_norm(h.reshape(2, 2, n), n, w, b, backend="triton")
    assert (_bits(y3.reshape(4, n)) == _bits(y)).all()


def test_a_float64_weight_is_rounded_to_float32_first():
    # docs/contract.md §3: gamma and beta as rounded to the accumulation dtype
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g, dtype=torch.float64) * (1 + 2.0**-40)
    b = torch.randn(64, generator=g, dtype=torch.float64)
    _assert_numba_bits(x, w, b, 1e-5, False)
    y = _norm(x, w, b, 1e-5, False, "triton")
    assert torch.equal(y, _norm(x, w.float(), b.float(), 1e-5, False, "triton"))


# ---------------------------------------------------------------------------------------
# Adversarial rows


def _ulp_one(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_midpoints_round_to_even(path, dtype):
    # z = (0, 1, 0, 1, ...) with eps = 0.75: mean 1/2, q = 1/4, rstd = 1 exactly, u = ±1/2.
    # gamma = ulp(1), beta = 1: y = 1 + ulp/2 (a tie: 1, even) and 1 - ulp/2 (exact);
    # beta = 1 + ulp: 1 + 3ulp/2 (a tie: 1 + 2ulp, even), 1 + ulp/2 (a tie: 1).
    ulp = _ulp_one(dtype)
    n = path - path % 2
    x = torch.tensor([[0.0, 1.0] * (n // 2)] * 2).to(dtype)
    w = torch.full((n,), ulp)
    for row, beta in enumerate((1.0, 1.0 + ulp)):
        y = layernorm.layer_norm(x[row : row + 1], n, w, torch.full((n,), beta), eps=0.75,
                                 backend="triton")  # fmt: skip
        want = [1.0 - ulp / 2, 1.0] if row == 0 else [1.0, 1.0 + 2 * ulp]
        assert y[0].double().tolist() == want * (n // 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_within_2_to_the_minus_40_of_a_midpoint(path, dtype):
    # eps = 0.75 + t moves rstd = 1/sqrt(1 + t) off 1 by about t/2: the result sits
    # ulp * t / 4 from the midpoint 1 + ulp/2, on either side, for t = ±2**-20 ... ±2**-50.
    ulp = _ulp_one(dtype)
    n = path - path % 2
    x = torch.tensor([[0.0, 1.0] * (n // 2)]).to(dtype)
    w, b = torch.full((n,), ulp), torch.ones(n)
    for k in range(20, 51, 3):
        for t in (2.0**-k, -(2.0**-k)):
            y = _assert_correctly_rounded(x, w, b, 0.75 + t, False)
            assert y[0, 1].item() == (1.0 if t > 0 else 1.0 + ulp)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_float32_rows_over_the_whole_range(path, rms):
    g = torch.Generator().manual_seed(15)
    for scale in (1e-38, 1e-20, 1e20, 1e37, 3e38 / 4):
        x = (torch.randn(2, path, generator=g, dtype=torch.float64) * scale).clamp(-3e38, 3e38)
        for eps in (1e-5, 0.0):
            _assert_correctly_rounded(x.float(), None, None, eps, rms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_signed_zeros_are_numbas(path, dtype):
    # exact zeros: a constant row without bias, zero elements of RMSNorm, gamma = 0
    n = path
    g = torch.Generator().manual_seed(16)
    x = torch.randn(4, n, generator=g).to(dtype)
    x[0] = 3.0
    x[1, ::3] = 0.0
    x[2, 1::4] = -0.0
    w = torch.randn(n, generator=g)
    w[::5] = 0.0
    w[1::7] = -0.0
    for rms in (False, True):
        for weight in (w, -w, None):
            _assert_numba_bits(x, weight, None, 1e-5, rms)
            _assert_numba_bits(x, weight, torch.zeros(n), 1e-5, rms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_rows_stay_in_their_row(path, dtype):
    n = path
    g = torch.Generator().manual_seed(17)
    x = torch.randn(4, n, generator=g).to(dtype)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    for rms in (False, True):
        ours = _norm(x, None, None, 1e-5, rms, "triton")
        theirs = _norm(x, None, None, 1e-5, rms, "numba")
        assert ours[1:3].isnan().all() and theirs[1:3].isnan().all()
        keep = [0, 3]
        assert (_bits(ours[keep]) == _bits(theirs[keep])).all()


# ---------------------------------------------------------------------------------------
# Where each row is settled: stage 1, stage 2 (in the kernel) or the host


def _flags(x, w, b, eps, rms):
    kernels = triton_._kernels()
    n = x.shape[-1]
    with triton_._quiet(kernels):
        out = triton_._launch_forward(kernels, x.reshape(-1, n), None, w, b, eps, rms)
    return out[-1].tolist()


def test_each_stage_settles_the_rows_it_can(path, monkeypatch):
    # z = (0, 1, 1, 1, ...), eps = 1/16: u = -3/2 or 1/2, and gamma = 1 + ulp puts
    # -3/2·gamma on a midpoint; eps = 1/16 + 2**-k moves it about 2**-(k-1) away. Stage 1
    # settles the far ones (flag 0), stage 2 in the kernel the nearer (2), the host the
    # nearest (1), and every one is correctly rounded, numba's bits.
    ulp = _ulp_one(torch.float32)
    n = path - path % 4
    x = torch.tensor([[0.0, 1.0, 1.0, 1.0] * (n // 4)])
    w = torch.full((n,), 1 + ulp)
    flags = set()
    for k in range(44, 56):
        flags.update(_flags(x, w, None, 1 / 16 + 2.0**-k, False))
        _assert_correctly_rounded(x, w, None, 1 / 16 + 2.0**-k, False)
        _assert_numba_bits(x, w, None, 1 / 16 + 2.0**-k, False)
    assert flags == {0, 1, 2}


def test_random_rows_never_reach_the_host(path, monkeypatch):
    # the host's fallback is for near-ties: random rows at offset 1e4 never call it
    g = torch.Generator().manual_seed(18)
    x = torch.randn(32, path, generator=g) + 1e4
    assert 1 not in _flags(x, None, None, 1e-5, False)
    calls = []
    monkeypatch.setattr(torch_, "_fix_rows", lambda *args: calls.append(args))
    y = layernorm.layer_norm(x, path, backend="triton")
    assert not calls
    assert (_bits(y) == _bits(layernorm.layer_norm(x, path, backend="numba"))).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["triton", "numba"])
def test_an_exact_zero_keeps_its_sign_in_a_row_the_host_rewrites(path, dtype, backend):
    # element 0: v = -1/2, gamma = +0, beta = -0.0: IEEE gives -0.0. In a row with ties
    # (beta = 1 elsewhere) the host rewrites the row, and must keep it (_exact skips the
    # elements whose bound is 0: their value is exact).
    ulp = _ulp_one(dtype)
    n = path - path % 2
    x = torch.tensor([[0.0, 1.0] * (n // 2)]).to(dtype)
    w = torch.full((n,), ulp)
    w[0] = 0.0
    signs = []
    for beta in (1.0, 5.0):  # a row of ties (rewritten), and one without
        b = torch.full((n,), beta)
        b[0] = -0.0
        y = layernorm.layer_norm(x, n, w, b, eps=0.75, backend=backend)
        signs.append(torch.signbit(y[0, 0]).item() and y[0, 0].item() == 0)
    assert signs == [True, True]


def test_only_undecidable_rows_go_to_the_host(path, monkeypatch):
    # an exact tie (row 1) and a value 2**-50 from one (row 3) among ordinary rows: the
    # kernel leaves those two open (flag 1) and the host rewrites exactly them
    n = path - path % 2
    ulp = _ulp_one(torch.float32)
    tie = torch.tensor([0.0, 1.0] * (n // 2))
    x = torch.randn(4, n)
    x[1] = tie
    x[3] = tie
    w, b = torch.full((n,), ulp), torch.ones(n)
    for eps, expect in ((0.75, [1]), (0.75 + 2.0**-50, [1])):
        flags = _flags(x[1:2], w, b, eps, False)
        assert flags == expect
    flagged = []
    fix = torch_._fix_rows
    monkeypatch.setattr(
        torch_,
        "_fix_rows",
        lambda *args: flagged.append(args[-1].nonzero()[:, 0].tolist()) or fix(*args),
    )
    y = layernorm.layer_norm(x, n, w, b, eps=0.75, backend="triton")
    assert flagged == [[1, 3]]
    assert y[1, 1].item() == y[3, 1].item() == 1.0  # the tie 1 + ulp/2, to even


def test_a_captured_graph_reads_no_flags(monkeypatch):
    # docs/contract.md §3: while a CUDA graph is captured the host cannot read the flags;
    # an open row (an exact tie) keeps the kernel's rounding and nothing is read
    n = 8
    ulp = _ulp_one(torch.float32)
    x = torch.tensor([[0.0, 1.0] * (n // 2)])
    w, b = torch.full((n,), ulp), torch.ones(n)
    calls = []
    monkeypatch.setattr(torch_, "_fix_rows", lambda *args: calls.append(args))
    monkeypatch.setattr(triton_, "_capturing", lambda: True)
    y = layernorm.layer_norm(x, n, w, b, eps=0.75, backend="triton")
    assert not calls
    kernels = triton_._kernels()
    with triton_._quiet(kernels):
        kernel_y, *_, flags = triton_._launch_forward(kernels, x, None, w, b, 0.75, False)
    assert flags.tolist() == [1] and torch.equal(y, kernel_y)
    monkeypatch.setattr(triton_, "_capturing", lambda: False)
    layernorm.layer_norm(x, n, w, b, eps=0.75, backend="triton")
    assert len(calls) == 1
