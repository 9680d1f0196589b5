"""Correct rounding (docs/contract.md §3): every forward output of a float32, float16 or
bfloat16 input is the exact result rounded once, the same bits on every backend.

The oracle (layernorm/report/oracle.py, re-exported as tests/_oracle) shares no code
with the kernels: integers, mpmath and squares of rationals. Inputs: random rows at offsets up to 1e6 and widths up to 2**20,
rows whose exact result is a rounding midpoint or within 2**-40 (relative) of one, rows
over float32's whole range (1e-38 to 3e38), and 10**7 random elements per dtype compared
bitwise between the numba and torch backends.
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch

import _oracle
import layernorm
from layernorm.backends import _exact, torch_

pytest.importorskip("numba")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
MASK = {torch.float32: 0xFFFFFFFF, torch.bfloat16: 0xFFFF, torch.float16: 0xFFFF}
BACKENDS = ["numba", "torch"]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(BITS[t.dtype]).numpy().astype(np.int64) & MASK[t.dtype]


def _norm(x, w, b, eps, rms, backend):
    n = x.shape[-1]
    if rms:
        return layernorm.rms_norm(x, (n,), w, eps=eps, backend=backend)
    return layernorm.layer_norm(x, (n,), w, b, eps=eps, backend=backend)


def _assert_correctly_rounded(x, w, b, eps, rms, backend):
    """Every element of the backend's output is the oracle's, bit for bit (the sign of
    an exactly zero result is a convention, checked between backends elsewhere)."""
    y = _norm(x, w, b, eps, rms, backend)
    got = _bits(y).reshape(-1, x.shape[-1])
    n = x.shape[-1]
    gamma = np.ones(n) if w is None else w.double().numpy()
    beta = np.zeros(n) if (b is None or rms) else b.double().numpy()
    rows = x.reshape(-1, n).double().numpy()
    wrong = 0
    for i, z in enumerate(rows):
        want, zero = _oracle.forward(z, gamma, beta, eps, rms, NAMES[x.dtype])
        wrong += int(((want != got[i]) & ~zero).sum())
    assert wrong == 0, f"{wrong} of {x.numel()} elements not correctly rounded ({backend})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_random_rows_are_correctly_rounded(backend, dtype, rms):
    g = torch.Generator().manual_seed(1)
    for offset, shape in [(0.0, (3, 768)), (100.0, (2, 1000)), (1e4, (2, 513)), (1e6, (1, 4096))]:
        if dtype != torch.float32 and offset > 1e4:
            offset = 300.0  # the halves cannot hold a unit spread at 1e6
        x = (torch.randn(shape, generator=g) * 3 + offset).to(dtype)
        w = torch.randn(shape[1], generator=g)
        b = torch.randn(shape[1], generator=g)
        _assert_correctly_rounded(x, w, b, 1e-5, rms, backend)
        _assert_correctly_rounded(x, None, None, 1e-5, rms, backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_wide_row_is_correctly_rounded(dtype):
    n = (1 << 20) if dtype == torch.float32 else (1 << 17)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1, n, generator=g) + 1e3).to(dtype)
    w = torch.rand(n, generator=g) + 0.5
    _assert_correctly_rounded(x, w, None, 1e-5, False, "numba")


def _ulp_one(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_midpoints_round_to_even(backend, dtype):
    # z = (0, 1, 0, 1, ...) with eps = 0.75: mean 1/2, q = 1/4, rstd = 1 exactly, u = ±1/2.
    # gamma = ulp(1), beta = 1: y = 1 + ulp/2 (a tie: 1, even) and 1 - ulp/2 (exact);
    # beta = 1 + ulp: 1 + 3ulp/2 (a tie: 1 + 2ulp, even), 1 + ulp/2 (a tie: 1).
    ulp = _ulp_one(dtype)
    x = torch.tensor([[0.0, 1.0] * 4] * 2).to(dtype)
    w = torch.full((8,), ulp)
    b = torch.tensor([[1.0] * 8, [1.0 + ulp] * 8])
    for row, beta in enumerate(b):
        y = layernorm.layer_norm(x[row : row + 1], 8, w, beta, eps=0.75, backend=backend)
        want = [1.0 - ulp / 2, 1.0] if row == 0 else [1.0, 1.0 + 2 * ulp]
        assert y[0].double().tolist() == want * 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_within_2_to_the_minus_40_of_a_midpoint(backend, dtype):
    # eps = 0.75 + t moves rstd = 1/sqrt(1 + t) off 1 by about t/2: the result sits
    # ulp * t / 4 from the midpoint 1 + ulp/2, on either side, for t = ±2**-20 ... ±2**-50.
    ulp = _ulp_one(dtype)
    x = torch.tensor([[0.0, 1.0] * 4]).to(dtype)
    w = torch.full((8,), ulp)
    b = torch.ones(8)
    for k in range(20, 51, 3):
        for t in (2.0**-k, -(2.0**-k)):
            _assert_correctly_rounded(x, w, b, 0.75 + t, False, backend)
            y = layernorm.layer_norm(x, 8, w, b, eps=0.75 + t, backend=backend)
            assert y[0, 1].item() == (1.0 if t > 0 else 1.0 + ulp)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_parameters_in_the_input_s_dtype(backend, dtype, rms):
    # 16-bit weight and bias in x's dtype, which the numba kernels read as they are and
    # widen inside: random rows, either parameter alone, and results within 2**-50 of a
    # midpoint (the exact fallback, which gets those parameters too)
    g = torch.Generator().manual_seed(4)
    for offset, shape in [(0.0, (3, 768)), (300.0, (2, 513))]:
        x = (torch.randn(shape, generator=g) * 3 + offset).to(dtype)
        w = torch.randn(shape[1], generator=g).to(dtype)
        b = torch.randn(shape[1], generator=g).to(dtype)
        for params in [(w, b), (w, None), (None, b)]:
            _assert_correctly_rounded(x, *params, 1e-5, rms, backend)
    ulp = _ulp_one(dtype)
    x = torch.tensor([[0.0, 1.0] * 4]).to(dtype)
    w, b = torch.full((8,), ulp, dtype=dtype), torch.ones(8, dtype=dtype)
    for t in (2.0**-50, -(2.0**-50)):
        _assert_correctly_rounded(x, w, b, 0.75 + t, False, backend)
        y = layernorm.layer_norm(x, 8, w, b, eps=0.75 + t, backend=backend)
        assert y[0, 1].item() == (1.0 if t > 0 else 1.0 + ulp)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_float32_rows_over_the_whole_range(backend, rms):
    g = torch.Generator().manual_seed(3)
    for scale in (1e-38, 1e-30, 1e-10, 1e10, 1e20, 1e30, 1e37, 3e38 / 4):
        x = (torch.randn(2, 256, generator=g, dtype=torch.float64) * scale).clamp(-3e38, 3e38)
        x = x.to(torch.float32)
        for eps in (1e-5, 0.0):
            _assert_correctly_rounded(x, None, None, eps, rms, backend)


@pytest.mark.parametrize("backend", [None, *BACKENDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_infinite_and_nan_parameters_give_ieee_s_values(backend, dtype, rms):
    """An element whose gain or bias is ±inf or NaN (a weight that overflowed, an offset
    past float32's range) is IEEE's ``beta + gamma · v / sqrt(s)`` for the sign of the
    exact ``v`` (inf·0 and inf - inf: NaN), without a warning (pytest turns warnings into
    errors); every other element is unchanged: the correctly rounded one of its own
    gamma and beta (rows of 3-D inputs, the exact fallback of every backend)."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[[0.5, -1.0, 2.0, 0.0, 3.0, -2.0, 1.0, 0.25]] * 2] * 2).to(dtype)
    x[1, 1] = torch.tensor([1.0, -1.0] * 4)  # mean 0: v = 0 exactly at no element
    x[0, 1, 3] = 0.5  # v = 0 exactly at one element (layer_norm: the mean is 0.5)
    x[0, 1, 0] = 0.25
    gamma = torch.tensor([inf, -inf, 1.5, inf, nan, 2.0, -inf, 0.5])
    beta = torch.tensor([0.0, 1.0, -inf, 2.0, 0.0, nan, inf, inf])
    if rms:
        beta = torch.zeros(8)  # (rms_norm has no bias)
    special = ~(gamma.isfinite() & beta.isfinite())
    y = _norm(x, gamma.to(dtype), beta.to(dtype), 1e-5, rms, backend)
    finite = _norm(
        x, torch.where(special, 1.0, gamma).to(dtype), torch.where(special, 0.0, beta).to(dtype),
        1e-5, rms, backend,
    )  # fmt: skip
    assert torch.equal(_bits_t(y[..., ~special]), _bits_t(finite[..., ~special]))
    z = x.double()
    v = z if rms else z - z.mean(-1, keepdim=True)  # exact here: dyadic rows of 8
    want = torch.where(gamma.isfinite(), 0.0, gamma.double() * v.sign()) + beta.double()
    assert torch.equal(y[..., special].double().isnan(), want[..., special].isnan())
    assert torch.equal(y[..., special].double().nan_to_num(), want[..., special].nan_to_num())


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_fix_forward_row_with_infinite_and_nan_parameters(rms):
    """The exact fallback itself (every backend's rows reach it when their kernels leave
    such an element open), float32 storage: IEEE's values where a parameter is not finite,
    the row's correctly rounded values elsewhere."""
    inf, nan = float("inf"), float("nan")
    z = np.array([0.5, -1.0, 2.0, 0.5, 3.0, -2.0, 0.0, 1.0])  # mean 0.5: v = 0 at 0 and 3
    gamma = np.array([inf, -inf, nan, inf, 1.5, 2.0, inf, 0.5])
    beta = np.array([0.0, 1.0, 0.0, 2.0, -inf, nan, inf, 1.0])
    got = _exact.fix_forward_row(z, gamma, beta, 1e-5, rms, torch.float32)
    finite = np.isfinite(gamma) & np.isfinite(beta)
    plain = _exact.fix_forward_row(
        z, np.where(finite, gamma, 1.0), np.where(finite, beta, 0.0), 1e-5, rms, torch.float32
    )
    assert np.array_equal(got[finite], plain[finite])
    v = z if rms else z - 0.5
    with np.errstate(invalid="ignore"):
        want = np.where(np.isfinite(gamma), 0.0, gamma * np.sign(v)) + beta
    np.testing.assert_array_equal(got[~finite].astype(np.float64), want[~finite])


def _bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


def _random_batch(dtype, g, m, n):
    x = torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g) * 10
    x = x + torch.randn(m, 1, generator=g) * 100
    return x.to(dtype), torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numba_and_torch_agree_bitwise_on_ten_million_elements(dtype):
    g = torch.Generator().manual_seed(4)
    total = 0
    for rms in (False, True):
        for m, n in [(4000, 768), (600, 4096), (40, 32768)]:
            x, w, b = _random_batch(dtype, g, m, n)
            a = _bits(_norm(x, w, b, 1e-5, rms, "numba"))
            c = _bits(_norm(x, w, b, 1e-5, rms, "torch"))
            assert (a == c).all(), f"{int((a != c).sum())} elements differ"
            total += x.numel()
    assert total >= 10**7


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_once_is_one_rounding(dtype):
    # float64 values next to midpoints of dtype: rounding through float32 to nearest
    # gets some wrong; one rounding gets all right (the oracle decides).
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3000, generator=g, dtype=torch.float64).to(dtype).double()
    half = base.abs() * _ulp_one(dtype) / 2
    nudge = torch.randn(3000, generator=g, dtype=torch.float64).sign() * half * 2.0**-30
    values = base + half + nudge
    want = np.array([_oracle_round(v, dtype) for v in values.tolist()])
    ours = _bits(torch_.round_once(values, dtype))
    stored = _exact.round_once(values.numpy(), dtype)
    shared = stored.view(np.int32 if dtype == torch.float32 else np.int16).astype(np.int64)
    shared &= MASK[dtype]
    assert (ours == want).all() and (shared == want).all()


def _oracle_round(v: float, dtype) -> int:
    one = mpmath.mpf(1)
    return _oracle.round_value(Fraction(v), Fraction(0), Fraction(1), one, NAMES[dtype])[0]


def test_the_decomposition_is_the_float32_portable_forward():
    # What tracing, scripting, export and ONNX record (docs/contract.md §3, §6): the
    # float32 corrected two-pass of torch_.portable_forward, bit for bit, within the
    # contract's 4e-6 of the exact result, and not correctly rounded.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 768, generator=g) + 100
    traced = torch.jit.trace(lambda t: layernorm.layer_norm(t, 768), (x,), check_trace=False)
    y = traced(x)
    assert torch.equal(y, torch_.portable_forward(x, None, None, None, 1e-5, False)[0])
    exact = layernorm.layer_norm(x, 768, backend="numba")
    assert (y - exact).abs().max() < 4e-6
    assert not torch.equal(y, exact)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_residual_and_layouts_give_the_same_bits(backend, dtype):
    # add_*: y is the norm of the rounded x + residual; strided rows, 3-D inputs, one row
    # alone or in a batch: the same correctly rounded bits.
    g = torch.Generator().manual_seed(7)
    wide = (torch.randn(6, 700, generator=g) * 2 + 30).to(dtype)
    x = wide[:, :512]  # rows with stride 700
    r = torch.randn(6, 512, generator=g).to(dtype)
    w, b = torch.randn(512, generator=g), torch.randn(512, generator=g)
    y, h = layernorm.add_layer_norm(x, r, 512, w, b, backend=backend)
    assert torch.equal(h, x + r)
    _assert_correctly_rounded(h, w, b, 1e-5, False, backend)
    plain = layernorm.layer_norm(h.contiguous(), 512, w, b, backend=backend)
    assert (_bits(y) == _bits(plain)).all()
    y3 = layernorm.layer_norm(h.reshape(2, 3, 512), 512, w, b, backend=backend)
    assert (_bits(y3.reshape(6, 512)) == _bits(plain)).all()
    alone = layernorm.layer_norm(h[4:5].contiguous(), 512, w, b, backend=backend)
    assert (_bits(alone) == _bits(plain[4:5])).all()
    ys, hs = layernorm.add_rms_norm(x, r, 512, w, backend=backend)
    _assert_correctly_rounded(hs, w, None, torch.finfo(torch.float32).eps, True, backend)
    assert (_bits(ys) == _bits(layernorm.rms_norm(hs, 512, w, backend=backend))).all()
