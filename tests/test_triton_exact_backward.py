"""The triton backend's backward is correctly rounded (docs/contract.md §3, "Correct
rounding of the backward"), in Triton's interpreter (TRITON_INTERPRET=1): every element
of ``dx`` (``+ dresidual_out``) of a float32, bfloat16 or float16 input is the exact
result rounded once, so the numba and torch backends' bits.

The oracle (layernorm/report/oracle.py, as tests/_oracle) shares no code with the
kernels. Inputs: random rows at offsets up to 1e6, with and without weight and residual
gradient, layer norm and RMSNorm; the tie rows and the rows within 2**-40 of a midpoint of
tests/test_exact_backward.py; float32 rows over the whole range; exact zeros; non-finite
rows. Each runs on both backward paths: ``fused`` (one program holds a row) and ``wide``
(chunks over programs, shrunk here to 64-column chunks so that 300 columns take it).

Budget: the interpreter runs about 1.5e4 (layer norm, rows of 768) to 4.5e4 (RMSNorm,
rows of 1024) elements a second, so the bitwise comparison with numba covers
:data:`RANDOM_ELEMENTS` random elements per dtype, not the 10**7 of
test_exact_backward.py (numba against torch): 22 s for the three dtypes and 70 s for
the whole file on a 2-core machine (35-45 s and about 90 s when shared at a load of 6;
plus numba's compile on a cold cache).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import layernorm
from _triton_interpreter import HAS_TRITON, import_for_the_interpreter
from layernorm import backends
from test_exact_backward import _bits, _random_batch, _tie_row, _ulp_one, _wrong

import_for_the_interpreter()
pytest.importorskip("numba")

if HAS_TRITON:
    from layernorm.backends import numba_, torch_, triton_

INTERPRETED = HAS_TRITON and triton_._triton_interprets()
pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    pytest.mark.skipif(
        HAS_TRITON and not INTERPRETED,
        reason="triton was imported compiled: run TRITON_INTERPRET=1 pytest " + __file__,
    ),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: random elements per dtype whose dx is compared bit for bit with the numba backend
RANDOM_ELEMENTS = 300_000
WIDE_N = 300  # several 64-column chunks under the ``wide`` path, the last one partial


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backends.forget("triton")
    yield
    backends.forget("triton")


@pytest.fixture(params=["fused", "wide"])
def path(request, monkeypatch):
    """Runs a test on each backward path (programs looping over several rows); returns
    a width that takes it."""
    monkeypatch.setattr(triton_, "MAX_PROGRAMS", 3)
    if request.param == "wide":
        monkeypatch.setattr(triton_, "FUSED_BACKWARD_N", 128)
        monkeypatch.setattr(triton_, "BACKWARD_CHUNK_N", 64)
        assert not triton_.uses_fused_backward(WIDE_N, torch.float32)
        return WIDE_N
    assert triton_.uses_fused_backward(WIDE_N, torch.float32)
    return WIDE_N


def _dx(backend, dy, z, w, rho, eps, rms):
    """``dx`` of a backend's backward on (M, N) rows, from its own forward's statistics
    (``mean`` only shifts the sums)."""
    kernels = {"triton": triton_, "numba": numba_, "torch": torch_}[backend]
    _, _, mean, rstd = kernels.forward(z, None, w, None, eps, rms)
    return kernels.backward(dy, z, w, mean, rstd, rho, rms, False, False, eps)[0]


def _assert_correctly_rounded(dy, z, w, rho, eps, rms):
    """The triton dx is the oracle's, bit for bit, and numba's."""
    dx = _dx("triton", dy, z, w, rho, eps, rms)
    wrong = _wrong(dx, z, dy, w, rho, eps, rms)
    assert wrong == 0, f"{wrong} of {dx.numel()} elements not correctly rounded"
    assert (_bits(dx) == _bits(_dx("numba", dy, z, w, rho, eps, rms))).all()
    return dx


def _flags(dy, z, w, rho, eps, rms):
    """The kernel's row flags (0: stage 1 settled the row, 2: stage 2, 1: left for the
    host), no host work."""
    kernels = triton_._kernels()
    mean = triton_.forward(z, None, w, None, eps, rms)[2]  # as _dx's
    with triton_._quiet(kernels):
        out = triton_._backward(kernels, dy, z, w, mean, rho, rms, False, False, eps)
    return out[-1].tolist()


# ---------------------------------------------------------------------------------------
# Random rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_elements_are_numbas_bits(dtype):
    # both paths at their default limits: rows of 512 fused, 1024 and 5000 over chunks
    # (one and three)
    g = torch.Generator().manual_seed(21)
    assert triton_.uses_fused_backward(512, dtype)
    assert not triton_.uses_fused_backward(1024, dtype)
    total = 0
    for rms in (False, True):
        for m, n in [(96, 512), (48, 1024), (12, 5000)]:
            z, dy, w, rho = _random_batch(dtype, g, m, n)
            res = rho if n == 1024 else None
            ours = _bits(_dx("triton", dy, z, w, res, 1e-5, rms))
            theirs = _bits(_dx("numba", dy, z, w, res, 1e-5, rms))
            assert (ours == theirs).all(), f"{int((ours != theirs).sum())} elements differ"
            total += z.numel()
    assert total >= RANDOM_ELEMENTS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_random_rows_are_correctly_rounded(path, dtype, rms):
    g = torch.Generator().manual_seed(22)
    for offset in (0.0, 100.0, 1e4, 1e6):
        if dtype != torch.float32 and offset > 1e4:
            offset = 300.0  # the halves cannot hold a unit spread at 1e6
        z = (torch.randn(2, path, generator=g) * 3 + offset).to(dtype)
        dy = (torch.randn(2, path, generator=g) * 2 + 0.5).to(dtype)
        rho = torch.randn(2, path, generator=g).to(dtype)
        w = torch.randn(path, generator=g)
        _assert_correctly_rounded(dy, z, w, None, 1e-5, rms)
        _assert_correctly_rounded(dy, z, None, rho, 1e-5, rms)


# ---------------------------------------------------------------------------------------
# Ties, near-ties, the whole range, zeros, non-finite rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_midpoints_round_to_even(path, dtype):
    z, dy, rho, want = _tie_row(dtype, path)
    dx = _assert_correctly_rounded(dy, z, None, rho, 0.75, False)
    assert dx[0].double().tolist() == want
    # RMSNorm: z = (1, -1, ...), eps = 0, dy = (ulp, 0, ...): dx = 1 + ulp/2, to 1
    zr = torch.tensor([[1.0, -1.0] * (path // 2)]).to(dtype)
    dyr = torch.tensor([[_ulp_one(dtype), 0.0] * (path // 2)]).to(dtype)
    dx = _assert_correctly_rounded(dyr, zr, None, rho, 0.0, True)
    assert dx[0].double().tolist() == [1.0] * path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_within_2_to_the_minus_40_of_a_midpoint(path, dtype):
    # eps = 0.75 + t moves the tie 1 + 3 ulp/2 by about 3 ulp t / 2, to either side
    z, dy, rho, _ = _tie_row(dtype, path)
    ulp = _ulp_one(dtype)
    for k in range(20, 51, 6):
        for t in (2.0**-k, -(2.0**-k)):
            dx = _assert_correctly_rounded(dy, z, None, rho, 0.75 + t, False)
            assert dx[0, 0].item() == (1.0 + ulp if t > 0 else 1.0 + 2 * ulp)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_float32_rows_over_the_whole_range(path, rms):
    g = torch.Generator().manual_seed(23)
    for scale in (1e-38, 1e-20, 1e20, 1e37, 3e38 / 4):
        z = (torch.randn(2, path, generator=g, dtype=torch.float64) * scale).clamp(-3e38, 3e38)
        dy = torch.randn(2, path, generator=g)
        for eps in (1e-5, 0.0):
            _assert_correctly_rounded(dy, z.float(), None, None, eps, rms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_exact_zero_is_positive(path, dtype):
    # a constant gradient: gh - mean(gh) = 0 and mean(gh v) = 0, so dz = 0 exactly
    g = torch.Generator().manual_seed(24)
    z = torch.randn(3, path, generator=g).to(dtype)
    dy = torch.full((3, path), -0.5).to(dtype)
    for rho in (None, torch.full((3, path), -0.0).to(dtype)):
        assert (_bits(_dx("triton", dy, z, None, rho, 1e-5, False)) == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_rows_stay_in_their_row(path, dtype):
    # a NaN, an infinity in z and in dy, each in its own row among a tie row (rewritten
    # by the host) and random rows: the others are numba's bits, the bad rows non-finite
    g = torch.Generator().manual_seed(25)
    z, dy, _, _ = _random_batch(dtype, g, 5, path)
    tie_z, tie_dy, _, _ = _tie_row(dtype, path)
    z[4], dy[4] = tie_z, tie_dy
    z[0, 3] = float("nan")
    z[1, 5] = float("inf")
    dy[2, 7] = float("-inf")
    for rms in (False, True):
        ours = _dx("triton", dy, z, None, None, 0.75, rms)
        theirs = _dx("numba", dy, z, None, None, 0.75, rms)
        assert (_bits(ours[3:]) == _bits(theirs[3:])).all()
        assert not ours[:3].isfinite().all(1).any()


# ---------------------------------------------------------------------------------------
# Where each row is settled: the kernel or the host


def test_each_stage_settles_the_rows_it_can():
    # fused rows: eps = 0.75 ± 2**-k moves the bfloat16 tie of _tie_row off its
    # midpoint: stage 1 settles the far ones (flag 0), stage 2 (the sums again by
    # extraction) one nearer (2), the host the rest (1); all correctly rounded
    z, dy, rho, _ = _tie_row(torch.bfloat16, WIDE_N)
    assert triton_.uses_fused_backward(WIDE_N, torch.bfloat16)
    flags = set()
    for k in (40, 42, 44):
        for t in (2.0**-k, -(2.0**-k)):
            flags.update(_flags(dy, z, None, rho, 0.75 + t, False))
            _assert_correctly_rounded(dy, z, None, rho, 0.75 + t, False)
    assert flags == {0, 1, 2}


@pytest.mark.parametrize("chunk", [None, 256], ids=["fused", "wide"])
def test_stage_2_settles_a_random_row_stage_1_leaves_open(chunk, monkeypatch):
    # row 21 of this batch (found by search): stage 1's bound straddles a boundary,
    # stage 2's does not, in one program (fused) and over chunks (backward_precise_kernel)
    g = torch.Generator().manual_seed(5)
    z = torch.randn(96, 1000, generator=g)[21:22] * 3
    dy = torch.randn(96, 1000, generator=g)[21:22]
    w = torch.randn(1000, generator=g)
    # one program holds the row (at 1024 columns, the limit before Triton 3.6 spilled
    # there), or chunks do
    monkeypatch.setattr(triton_, "FUSED_BACKWARD_N", 128 if chunk else 1024)
    if chunk:
        monkeypatch.setattr(triton_, "BACKWARD_CHUNK_N", chunk)
    assert triton_.uses_fused_backward(1000, torch.float32) == (chunk is None)
    assert _flags(dy, z, w, None, 1e-5, False) == [2]
    _assert_correctly_rounded(dy, z, w, None, 1e-5, False)


def test_only_open_rows_go_to_the_host(path, monkeypatch):
    # tie rows 1 and 3 among random rows: the kernel flags exactly them, the host
    # rewrites exactly them (torch_._fix_backward_rows, the shared _exact fallback)
    g = torch.Generator().manual_seed(26)
    z, dy, _, rho = _random_batch(torch.float32, g, 4, path)
    tie_z, tie_dy, tie_rho, want = _tie_row(torch.float32, path)
    for i in (1, 3):
        z[i], dy[i], rho[i] = tie_z, tie_dy, tie_rho
    assert [f == 1 for f in _flags(dy, z, None, rho, 0.75, False)] == [
        False,
        True,
        False,
        True,
    ]
    rewritten = []
    fix = torch_._fix_backward_rows
    monkeypatch.setattr(
        torch_,
        "_fix_backward_rows",
        lambda *args: rewritten.append(args[1].shape[0]) or fix(*args),
    )
    dx = _dx("triton", dy, z, None, rho, 0.75, False)
    assert rewritten == [2]
    assert dx[1].tolist() == dx[3].tolist() == want


def test_gpu_open_rows_counts_the_rows_each_stage_settles(path):
    # benchmarks/gpu_open_rows.py (what a GPU session runs to see where the host's time
    # goes) counts the kernels' flags: the two tie rows open, the random ones settled
    spec = importlib.util.spec_from_file_location(
        "gpu_open_rows", Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_open_rows.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    g = torch.Generator().manual_seed(26)
    z, dy, _, rho = _random_batch(torch.float32, g, 4, path)
    tie_z, tie_dy, tie_rho, _ = _tie_row(torch.float32, path)
    for i in (1, 3):
        z[i], dy[i], rho[i] = tie_z, tie_dy, tie_rho
    counts = module.count_rows(z, dy, None, None, 0.75, False, rho)
    assert counts["rows"] == 4 and counts["backward host (dx rows)"] == 2
    assert counts["backward host (dweight scalars)"] == 0  # no weight: no scalars
    random = module.count(torch.float32, 3, path, "cpu")
    assert random["rows"] == 3 and random["forward host"] == random["backward host (dx rows)"] == 0


def test_random_rows_reach_the_host_only_when_flagged(path, monkeypatch):
    # random float32 rows: the host rewrites exactly the rows the kernel leaves open
    # (flag 1: docs/contract.md §3 has the rates), numba's bits
    g = torch.Generator().manual_seed(27)
    z, dy, w, rho = _random_batch(torch.float32, g, 8, path)
    rewritten = []
    fix = torch_._fix_backward_rows
    monkeypatch.setattr(
        torch_,
        "_fix_backward_rows",
        lambda *args: rewritten.append(args[1].shape[0]) or fix(*args),
    )
    for rms in (False, True):
        flagged = sum(1 for f in _flags(dy, z, w, rho, 1e-5, rms) if f == 1)
        rewritten.clear()
        ours = _bits(_dx("triton", dy, z, w, rho, 1e-5, rms))
        assert sum(rewritten) == flagged
        assert (ours == _bits(_dx("numba", dy, z, w, rho, 1e-5, rms))).all()


def test_a_captured_graph_reads_no_flags(monkeypatch):
    # docs/contract.md §3: during a CUDA graph capture an open row keeps the kernel's
    # float64 rounding and nothing is read
    z, dy, rho, _ = _tie_row(torch.float32, 8)
    calls = []
    monkeypatch.setattr(torch_, "_fix_backward_rows", lambda *args: calls.append(args))
    monkeypatch.setattr(triton_, "_capturing", lambda: True)
    dx = _dx("triton", dy, z, None, rho, 0.75, False)
    assert not calls
    kernels = triton_._kernels()
    mean = triton_.forward(z, None, None, None, 0.75, False)[2]
    with triton_._quiet(kernels):
        kernel_dx, *_, flags = triton_._backward(
            kernels, dy, z, None, mean, rho, False, False, False, 0.75
        )
    assert flags.tolist() == [1] and torch.equal(dx, kernel_dx)
    monkeypatch.setattr(triton_, "_capturing", lambda: False)
    _dx("triton", dy, z, None, rho, 0.75, False)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------
# Through the public functions; dweight and dbias


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_autograd_3d_4d_and_strided_gradients(dtype):
    g = torch.Generator().manual_seed(28)
    x3 = (torch.randn(2, 3, 96, generator=g) * 2 + 50).to(dtype).requires_grad_()
    w = torch.randn(96, generator=g)
    dy3 = torch.randn(2, 96, 3, generator=g).to(dtype).transpose(1, 2)  # non-contiguous
    layernorm.layer_norm(x3, 96, w, None, backend="triton").backward(dy3)
    assert _wrong(x3.grad, x3.detach(), dy3, w, None, 1e-5, False) == 0

    x4 = (torch.randn(2, 2, 4, 24, generator=g) + 3).to(dtype).requires_grad_()
    dy4 = torch.randn(2, 2, 24, 4, generator=g).to(dtype).transpose(-1, -2)
    w2 = torch.randn(4, 24, generator=g)
    layernorm.rms_norm(x4, (4, 24), w2, eps=1e-6, backend="triton").backward(dy4)
    rows = x4.detach().reshape(4, 96)
    assert _wrong(x4.grad, rows, dy4.reshape(4, 96), w2.reshape(96), None, 1e-6, True) == 0

    x = (torch.randn(5, 80, generator=g) + 7).to(dtype).requires_grad_()
    r = torch.randn(5, 80, generator=g).to(dtype).requires_grad_()
    dy, dh = (torch.randn(5, 80, generator=g).to(dtype) for _ in range(2))
    y, h = layernorm.add_layer_norm(x, r, 80, w[:80], None, backend="triton")
    torch.autograd.backward((y, h), (dy, dh))
    assert torch.equal(x.grad, r.grad)
    assert _wrong(x.grad, h.detach(), dy, w[:80], dh, 1e-5, False) == 0


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_dweight_and_dbias_are_the_other_backends_bits(path, rms):
    # docs/contract.md §3, "dweight and dbias": the terms of _weight_terms in its order,
    # the torch backend's bits (tests/test_weight_terms.py: the oracle's): 130 rows are 5
    # blocks of 32 over 3 programs (MAX_PROGRAMS), and a constant row with eps = 0, whose
    # scalars no float test settles (the host's exact fallback), makes every column NaN
    # (on the first 40 rows: two blocks, over two programs). (The interpreter runs the
    # programs one after the other, so a second call could not show an order effect.)
    g = torch.Generator().manual_seed(29)
    z, dy, w, _ = _random_batch(torch.bfloat16, g, 130, path)
    for eps in (1e-5, 0.0):
        if eps == 0.0:
            z, dy = z[:40].clone(), dy[:40]
            z[30] = 0.0
        _, _, mean, rstd = triton_.forward(z, None, w, None, eps, rms)
        got = triton_.backward(dy, z, w, mean, rstd, None, rms, True, True, eps)
        expected = torch_.backward(dy, z, w, mean, rstd, None, rms, True, True, eps)
        assert torch.equal(got[2], expected[2])
        if eps == 0.0:
            assert got[1].isnan().all() and expected[1].isnan().all()
            continue
        assert torch.equal(got[1], expected[1])


def test_zero_size_inputs():
    for shape in [(0, 16), (2, 0, 16)]:
        x = torch.zeros(shape, requires_grad=True)
        w = torch.ones(16, requires_grad=True)
        layernorm.layer_norm(x, 16, w, backend="triton").sum().backward()
        assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros(16))


def test_near_ties_of_dweights_scalars_settle_on_the_device(path, monkeypatch):
    # rows whose exact r or t lies within 2^-50 of a midpoint (beyond float64's tests:
    # tests/test_weight_terms.py::_near_ties): the double-double step settles them in the
    # kernel, the host's dweight fallback never runs, and dweight is the numba backend's
    # (the oracle's bits: tests/test_weight_terms.py)
    from test_weight_terms import _near_ties

    def no_host(*args):
        raise AssertionError("dweight went to the host")

    n = path
    cases = {}
    for row, eps, rms in _near_ties():
        if len(row) == 64:  # stretched to the path's width: the same statistics
            cases.setdefault((eps, rms), []).append(torch.from_numpy(row).float().repeat(5)[:n])
    got = {}
    for (eps, rms), rows in cases.items():
        z = torch.stack(rows)
        dy = torch.randn(z.shape, generator=torch.Generator().manual_seed(len(rows)))
        w = torch.ones(n)
        _, _, mean, rstd = numba_.forward(z, None, w, None, eps, rms)
        expected = numba_.backward(dy, z, w, mean, rstd, None, rms, True, False, eps)[1]
        with monkeypatch.context() as patched:
            patched.setattr(torch_, "weight_gradient", no_host)
            _, _, mean, rstd = triton_.forward(z, None, w, None, eps, rms)
            got = triton_.backward(dy, z, w, mean, rstd, None, rms, True, False, eps)[1]
        assert torch.equal(got, expected), (eps, rms)


_KERNELS = None


def _interpreted(fn):
    """``triton.jit(fn)`` for the interpreter (decided as it is decorated)."""
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        return triton.jit(fn)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @_interpreted
    def _settle_kernel(
        Z, OUT, N, eps_bits, depth, num_chunks, RMS: tl.constexpr, CHUNKED: tl.constexpr,
        ROWS: tl.constexpr, COLS: tl.constexpr,
    ):  # fmt: skip
        # (r, t, open) of each row by the kernels' double-double step alone (_KERNELS:
        # the interpreted kernel module, set by _settled_rows; the interpreter runs this
        # body as Python)
        row = tl.program_id(0).to(tl.int64)
        n = N.to(tl.float64)
        eps = _KERNELS._eps(eps_bits)
        g = _KERNELS._gamma(depth)
        a = _KERNELS._weight_shift(Z, row, N, RMS)
        if CHUNKED:
            r, t, open_ = _KERNELS._dd_scalars_chunked(
                Z, row, N, N, n, a, eps, g, num_chunks, RMS, ROWS, COLS
            )
        else:
            cols = _KERNELS._tile(ROWS, COLS)
            mask = cols < N
            z = _KERNELS._load_row(Z, row, N, cols, mask)
            r, t, open_ = _KERNELS._dd_scalars_tile(z, mask, a, n, eps, g, RMS)
        tl.store(OUT + 3 * row, r)
        tl.store(OUT + 3 * row + 1, t)
        tl.store(OUT + 3 * row + 2, open_.to(tl.float64))


def _settled_rows(rows: torch.Tensor, eps: float, rms: bool, chunked: bool) -> torch.Tensor:
    """(r, t, open) per row from the kernels' double-double step alone
    (``_dd_scalars_tile``, or ``_dd_scalars_chunked`` over 16-column chunks)."""
    import struct

    global _KERNELS
    _KERNELS = triton_._kernels()
    m, n = rows.shape
    out = torch.empty(m, 3, dtype=torch.float64)
    cols = 16 if chunked else triton_._next_power_of_2(n)
    bits = struct.unpack("<q", struct.pack("<d", eps))[0]
    _settle_kernel[(m,)](rows, out, n, bits, cols + 2 * m, -(-n // cols), rms, chunked, 1, cols)
    return out


@pytest.mark.parametrize("chunked", [False, True], ids=["tile", "chunked"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_the_double_double_step_gives_the_exact_scalars(chunked, rms):
    # random float32 rows at offsets to 1e6 and scales 1e-30 to 1e30, and the near ties:
    # settled, each the oracle's (r, t) (mpmath; tests/test_weight_terms.py)
    import numpy as np

    from test_weight_terms import _near_ties, _oracle_scalars

    rng = np.random.default_rng(5 + rms + 2 * chunked)
    cases = [(row, eps) for row, eps, r in _near_ties() if r == rms and len(row) == 64]
    for k in range(24):
        offset = (0.0, 1.0, -7.0, 1e2, 1e4, 1e6)[k % 6]
        scale = 10.0 ** rng.uniform(-30, 30)
        row = ((rng.standard_normal(48) * 3 + offset) * scale).astype(np.float32)
        cases.append((row.astype(np.float64), (1e-5, 0.0, 0.75)[k % 3]))
    for row, eps in cases:
        got = _settled_rows(torch.from_numpy(row).float()[None], eps, rms, chunked)[0]
        _, r, t = _oracle_scalars(row, eps, rms)
        assert got.tolist() == [r, t, 0.0], (row[:3], eps)
