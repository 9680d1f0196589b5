"""The numba CPU backend against the float64 reference, torch and the docs/contract.md §3 facts.

Compiling dominates the run time: every test reuses the same eight kernels (forward and
backward for float32, float64, float16 and bfloat16), which numba caches on disk.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import layernorm
from layernorm import backends, reference

pytest.importorskip("numba")
from layernorm.backends import numba_

SRC = Path(layernorm.__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
#: absolute slack on top of twice torch's own error, per dtype (outputs are O(1..10))
ATOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SHAPES = [(1, 1), (1, 7), (13, 97), (5, 1000), (3, 4099), (64, 129)]


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _max_err(a: torch.Tensor, ref: np.ndarray) -> float:
    return float(np.abs(_f64(a) - ref).max())


def _params(n: int, dtype: torch.dtype, affine: bool):
    if not affine:
        return None, None
    return torch.randn(n).to(dtype), torch.randn(n).to(dtype)


# ---------------------------------------------------------------------------------------
# Parity


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_layer_norm_forward_matches_reference(dtype, shape, affine):
    m, n = shape
    x = (torch.randn(m, n) * 2 + 0.5).to(dtype)
    w, b = _params(n, dtype, affine)
    y = layernorm.layer_norm(x, n, w, b, backend="numba")
    assert y.dtype == dtype and y.shape == x.shape
    ref, _, _ = reference.layer_norm(
        _f64(x), n, None if w is None else _f64(w), None if b is None else _f64(b)
    )
    torch_err = _max_err(F.layer_norm(x, (n,), w, b), ref)
    assert _max_err(y, ref) <= 2 * torch_err + ATOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (7, 257), (4, 4099)], ids=str)
def test_rms_norm_forward_matches_reference(dtype, shape):
    m, n = shape
    x = (torch.randn(m, n) * 2).to(dtype)
    w = torch.randn(n).to(dtype)
    y = layernorm.rms_norm(x, n, w, eps=1e-6, backend="numba")
    ref, _ = reference.rms_norm(_f64(x), n, _f64(w), eps=1e-6)
    torch_err = _max_err(F.rms_norm(x, (n,), w, eps=1e-6), ref)
    assert _max_err(y, ref) <= 2 * torch_err + ATOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_outputs_come_from_the_host_cache(dtype):
    m, n = 1100, 1024  # over 4 MiB of float32: a cached, huge-page-backed block
    x = torch.randn(m, n).to(dtype).requires_grad_()
    y = layernorm.layer_norm(x, n, backend="numba")
    assert y.dtype == dtype and y.shape == (m, n) and y.is_contiguous()
    ref, _, _ = reference.layer_norm(_f64(x), n)
    assert _max_err(y, ref) < (2e-6 if dtype == torch.float32 else 2e-2)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert dx.dtype == dtype and torch.isfinite(dx).all()


def test_multi_dim_normalized_shape():
    x = torch.randn(2, 3, 4, 5)
    w, b = torch.randn(4, 5), torch.randn(4, 5)
    y = layernorm.layer_norm(x, (4, 5), w, b, backend="numba")
    ref, _, _ = reference.layer_norm(_f64(x), (4, 5), _f64(w), _f64(b))
    assert y.shape == x.shape
    np.testing.assert_allclose(_f64(y), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_backward_matches_reference(dtype, rms, affine):
    m, n = 37, 301  # two partial-sum blocks, a ragged last one
    x = (torch.randn(m, n) + 1).to(dtype).requires_grad_()
    w, b = _params(n, dtype, affine)
    if affine:
        w.requires_grad_()
        b.requires_grad_()
    dy = torch.randn(m, n).to(dtype)
    if rms:
        y = layernorm.rms_norm(x, n, w, eps=1e-5, backend="numba")
        dx_ref, dw_ref = reference.rms_norm_backward(
            _f64(dy), _f64(x), n, None if w is None else _f64(w), eps=1e-5
        )
        db_ref = None
    else:
        y = layernorm.layer_norm(x, n, w, b, backend="numba")
        dx_ref, dw_ref, db_ref = reference.layer_norm_backward(
            _f64(dy), _f64(x), n, None if w is None else _f64(w)
        )
    y.backward(dy)
    scale = max(1.0, float(np.abs(dx_ref).max()))
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 4e-3, torch.bfloat16: 3e-2}
    assert x.grad.dtype == dtype
    assert _max_err(x.grad, dx_ref) <= tol[dtype] * scale
    if affine:
        # sums over M rows of float32 products (error grows with √M), then rounded once
        # to the parameter's dtype (up to one of its ulps)
        rel = (1e-13 if dtype == torch.float64 else 1e-6) * np.sqrt(m) * 10
        rel += 0.0 if dtype in (torch.float32, torch.float64) else torch.finfo(dtype).eps
        assert _max_err(w.grad, dw_ref) <= rel * max(1.0, np.abs(dw_ref).max())
        if not rms:
            assert _max_err(b.grad, db_ref) <= rel * max(1.0, np.abs(db_ref).max())
            assert b.grad.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["add_layer_norm", "add_rms_norm"])
def test_residual_forward_and_backward(dtype, rms):
    m, n = 40, 200
    x = torch.randn(m, n).to(dtype).requires_grad_()
    r = torch.randn(m, n).to(dtype).requires_grad_()
    w = torch.randn(n).to(dtype).requires_grad_()
    if rms:
        y, h = layernorm.add_rms_norm(x, r, n, w, eps=1e-5, backend="numba")
    else:
        y, h = layernorm.add_layer_norm(x, r, n, w, None, backend="numba")
    # residual_out is x + r rounded once to the dtype, and y normalizes that rounded sum
    assert torch.equal(h, (x.float() + r.float()).to(dtype))
    expected = (
        layernorm.rms_norm(h, n, w, eps=1e-5, backend="numba")
        if rms
        else layernorm.layer_norm(h, n, w, backend="numba")
    )
    assert torch.equal(y, expected)
    dy, dh = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
    torch.autograd.backward([y, h], [dy, dh])
    if rms:
        dz_ref, _ = reference.rms_norm_backward(_f64(dy), _f64(h), n, _f64(w), eps=1e-5)
    else:
        dz_ref, _, _ = reference.layer_norm_backward(_f64(dy), _f64(h), n, _f64(w))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    scale = float(np.abs(dz_ref + _f64(dh)).max())
    assert _max_err(x.grad, dz_ref + _f64(dh)) <= tol * scale
    assert torch.equal(x.grad, r.grad)


def test_kernel_outputs_follow_the_contract():
    x = torch.randn(10, 33, dtype=torch.bfloat16)
    y, residual_out, mean, rstd = numba_.forward(x, None, None, None, 1e-5, False)
    assert residual_out is None and mean.dtype == rstd.dtype == torch.float32
    assert y.is_contiguous() and y.dtype == torch.bfloat16
    y, _, mean, rstd = numba_.forward(x.double(), None, None, None, 1e-5, True)
    assert mean is None and rstd.dtype == torch.float64
    dx, dweight, dbias = numba_.backward(
        torch.randn(10, 33).double(), x.double(), None, None, rstd, None, True, False, False
    )
    assert dx.dtype == torch.float64 and dweight is None and dbias is None


# ---------------------------------------------------------------------------------------
# docs/contract.md §3 facts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_row_gives_exactly_beta(dtype):
    for value in [0.1, 3.7, -1e4, 12345.678]:
        for n in [1, 3, 768, 1000, 4097]:
            x = torch.full((2, n), value).to(dtype)
            w, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
            y = layernorm.layer_norm(x, n, w, b, backend="numba")
            assert torch.equal(y, b.expand(2, n)), (value, n)


def test_constant_row_with_zero_eps_is_nan():
    y = layernorm.layer_norm(torch.full((1, 8), 2.0), 8, eps=0.0, backend="numba")
    assert torch.isnan(y).all()


@pytest.mark.parametrize("offset", [0.0, 1e2, 1e4, 1e6])
def test_error_is_independent_of_the_offset(offset):
    n = 4099
    x = torch.randn(16, n) + offset
    u = layernorm.layer_norm(x, n, backend="numba")
    ref, _, _ = reference.layer_norm(_f64(x), n)
    assert _max_err(u, ref) < 4e-6


@pytest.mark.parametrize("offset", [0.0, 1e4, 1e6])
def test_gradient_error_is_independent_of_the_offset(offset):
    # The saved mean is float32: without re-centering, dx erred by 6e-4 (dweight by 2e-2,
    # relative) at offset 1e6.
    x = (torch.randn(32, 1000, dtype=torch.float64) + offset).float().requires_grad_()
    w = torch.randn(1000, requires_grad=True)
    dy = torch.randn(32, 1000)
    layernorm.layer_norm(x, 1000, w, backend="numba").backward(dy)
    dx, dw, _ = reference.layer_norm_backward(_f64(dy), _f64(x.detach()), 1000, _f64(w.detach()))
    assert _max_err(x.grad, dx) < 2e-5 * np.abs(dx).max()
    assert _max_err(w.grad, dw) < 2e-5 * np.abs(dw).max()


def test_nan_and_inf_stay_in_their_row():
    x = torch.randn(8, 300)
    clean = layernorm.layer_norm(x, 300, backend="numba")
    x[3, 17] = float("nan")
    x[5, 0] = float("inf")
    y = layernorm.layer_norm(x, 300, backend="numba")
    assert torch.isnan(y[3]).all() and torch.isnan(y[5]).all()
    keep = [0, 1, 2, 4, 6, 7]
    assert torch.equal(y[keep], clean[keep])


def test_strided_rows_are_read_in_place():
    base = torch.randn(64, 1500)
    x = base[:, 100:1100]
    assert numba_._stride(x, 1000) == 1500  # rows read in place, 1500 elements apart
    w, b = torch.randn(1000), torch.randn(1000)
    y = layernorm.layer_norm(x, 1000, w, b, backend="numba")
    assert torch.equal(y, layernorm.layer_norm(x.contiguous(), 1000, w, b, backend="numba"))
    r = torch.randn(64, 1200)[:, :1000]
    y2, h = layernorm.add_layer_norm(x, r, 1000, w, b, backend="numba")
    y3, h3 = layernorm.add_layer_norm(x.contiguous(), r.contiguous(), 1000, w, b, backend="numba")
    assert torch.equal(y2, y3) and torch.equal(h, h3)


def test_broadcast_rows_with_zero_row_stride():
    row = torch.randn(1, 300)
    x = row.expand(6, 300)  # stride (0, 1): six views of one row
    y = layernorm.layer_norm(x, 300, backend="numba")
    assert torch.equal(y, layernorm.layer_norm(row, 300, backend="numba").expand(6, 300))


# ---------------------------------------------------------------------------------------
# Determinism


def _forward_backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor):
    y, _, mean, rstd = numba_.forward(x, None, w, b, 1e-5, False)
    dx, dw, db = numba_.backward(dy, x, w, mean, rstd, None, False, True, True)
    return y, dx, dw, db


def test_bitwise_reproducible_run_to_run():
    x, dy = torch.randn(300, 513), torch.randn(300, 513)
    w, b = torch.randn(513), torch.randn(513)
    first = _forward_backward(x, w, b, dy)
    for _ in range(3):
        again = _forward_backward(x, w, b, dy)
        assert all(torch.equal(a, c) for a, c in zip(first, again, strict=True))


@given(
    m=st.integers(1, 70),
    n=st.sampled_from([1, 5, 64, 127, 1000]),
    row=st.integers(0, 69),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_row_alone_equals_the_row_in_a_batch(m, n, row, dtype):
    row = row % m
    x = torch.randn(m, n).to(dtype)
    dy = torch.randn(m, n).to(dtype)
    w, b = torch.randn(n), torch.randn(n)
    y, dx, _, _ = _forward_backward(x, w, b, dy)
    y1, dx1, _, _ = _forward_backward(x[row : row + 1].clone(), w, b, dy[row : row + 1].clone())
    assert torch.equal(y[row : row + 1], y1)
    assert torch.equal(dx[row : row + 1], dx1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_streaming_stores_give_the_same_bits(dtype, monkeypatch):
    x, r = torch.randn(37, 1001).to(dtype), torch.randn(37, 1001).to(dtype)
    w, b = torch.randn(1001), torch.randn(1001)
    dy = torch.randn(37, 1001).to(dtype)
    runs = []
    for stream_bytes in (1 << 62, 0):  # nothing streams, then every output streams
        monkeypatch.setattr(numba_, "STREAM_BYTES", stream_bytes)
        y, h, mean, rstd = numba_.forward(x, r, w, b, 1e-5, False)
        grads = numba_.backward(dy, h, w, mean, rstd, dy, False, True, True)
        # one broadcast gradient row (stride 0), no residual gradient: the streaming
        # backward also loads each next row, here the same row again
        expanded = numba_.backward(
            dy[:1].expand(37, 1001), h, w, mean, rstd, None, False, True, True
        )
        runs.append((y, h, mean, rstd, *grads, *expanded))
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))
    assert torch.equal(numba_.forward(x[5:6], None, w, None, 1e-5, True)[0],
                       numba_.forward(x, None, w, None, 1e-5, True)[0][5:6])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (40, 1001), (65, 64)], ids=str)
def test_serial_and_parallel_kernels_give_the_same_bits(dtype, rms, shape, monkeypatch):
    # Small inputs run in the calling thread, large ones over numba's threads: a row must
    # come out the same either way (batch invariance across the switch).
    x, r, dy, dro = (torch.randn(shape).to(dtype) + 2 for _ in range(4))
    w, b = torch.randn(shape[1]), torch.randn(shape[1])
    runs = []
    for serial_numel in (0, 1 << 62):  # everything parallel, then everything serial
        monkeypatch.setattr(numba_, "SERIAL_NUMEL", serial_numel)
        y, h, mean, rstd = numba_.forward(x, r, w, None if rms else b, 1e-5, rms)
        grads = numba_.backward(dy, h, w, mean, rstd, dro, rms, True, not rms)
        runs.append([t for t in (y, h, mean, rstd, *grads) if t is not None])
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@given(
    m=st.integers(1, 40),
    n=st.integers(1, 1100),
    dtype=st.sampled_from(DTYPES),
    rms=st.booleans(),
)
def test_serial_and_parallel_entries_agree_on_random_shapes(m, n, dtype, rms):
    x, dy = torch.randn(m, n).to(dtype) * 3 + 1, torch.randn(m, n).to(dtype)
    w = torch.randn(n)
    runs, saved = [], numba_.SERIAL_NUMEL  # (hypothesis cannot use monkeypatch)
    for serial_numel in (0, 1 << 62):
        numba_.SERIAL_NUMEL = serial_numel
        try:
            y, _, mean, rstd = numba_.forward(x, None, w, None, 1e-5, rms)
            grads = numba_.backward(dy, x, w, mean, rstd, None, rms, True, False)
        finally:
            numba_.SERIAL_NUMEL = saved
        runs.append([t for t in (y, rstd, *grads) if t is not None])
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_inference_may_skip_the_statistics(rms):
    x, w = torch.randn(9, 130), torch.randn(130)
    y, _, mean, rstd = numba_.forward(x, None, w, None, 1e-5, rms, stats=False)
    assert mean is None and rstd is None
    assert torch.equal(y, numba_.forward(x, None, w, None, 1e-5, rms)[0])


_DIGEST_CODE = textwrap.dedent(
    """
    import hashlib, torch
    from layernorm.backends import numba_
    g = torch.Generator().manual_seed(1)
    x = torch.randn(333, 517, generator=g) + 3
    dy = torch.randn(333, 517, generator=g)
    w, b = torch.randn(517, generator=g), torch.randn(517, generator=g)
    y, _, mean, rstd = numba_.forward(x, None, w, b, 1e-5, False)
    dx, dw, db = numba_.backward(dy, x, w, mean, rstd, None, False, True, True)
    h = hashlib.sha256()
    for t in (y, mean, rstd, dx, dw, db):
        h.update(t.numpy().tobytes())
    digest = h.hexdigest()
    """
)
_THREADS_SCRIPT = _DIGEST_CODE + "import numba; print(numba.get_num_threads(), digest)\n"


def _run(code: str, env: dict[str, str], timeout: float = 240) -> str:
    full_env = {**os.environ, "PYTHONPATH": str(SRC), **env}
    done = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_results_do_not_depend_on_the_thread_count():
    one = _run(_THREADS_SCRIPT, {"NUMBA_NUM_THREADS": "1"}).split()
    two = _run(_THREADS_SCRIPT, {"NUMBA_NUM_THREADS": "2"}).split()
    assert one[0] == "1" and two[0] == "2"
    assert one[1] == two[1]
    # and the same numbers in this process, whatever its thread count
    namespace: dict = {}
    exec(_DIGEST_CODE, namespace)
    assert namespace["digest"] == one[1]


# ---------------------------------------------------------------------------------------
# Registry, laziness, cache


def test_capabilities_and_automatic_choice():
    assert "numba" in layernorm.available_backends()
    assert numba_.cannot_run(torch.empty(2, 3)) is None
    assert "CPU" in numba_.cannot_run(torch.empty(2, 3, device="meta"))
    assert "float" in numba_.cannot_run(torch.empty(2, 3, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match="cannot run this input: the numba backend runs on CPU"):
        backends.choose(torch.empty(2, 3, device="meta"), "numba")
    for shape in [(1, 1), (64, 1000)]:
        x = torch.empty(shape)
        assert numba_.prefers(x) and backends.choose(x) in ("numba", "triton")
    assert not numba_.prefers(torch.empty(2, 3, device="meta"))


def test_importing_layernorm_compiles_nothing():
    out = _run(
        "import sys, layernorm\n"
        "layernorm.available_backends()\n"
        "print('layernorm.backends._numba_kernels' in sys.modules, 'numba' in sys.modules)",
        {},
    )
    assert out.split() == ["False", "False"]


_CACHE_SCRIPT = textwrap.dedent(
    """
    import torch, layernorm
    x = torch.randn(3, 10, dtype=torch.float64)
    y = layernorm.layer_norm(x, 10, backend="numba")
    ref = torch.nn.functional.layer_norm(x, (10,))
    assert torch.allclose(y, ref), (y, ref)
    print("ok")
    """
)


def _copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    shutil.copytree(SRC / "layernorm", root / "layernorm", ignore=shutil.ignore_patterns("*.nb*"))
    pycache = root / "layernorm" / "backends" / "__pycache__"
    shutil.rmtree(pycache, ignore_errors=True)
    pycache.write_text("not a directory: the package directory cannot hold a cache\n")
    return root


def _run_isolated(root: Path, env: dict[str, str]) -> str:
    """Runs ``_CACHE_SCRIPT`` against the package copy under ``root``, with no NUMBA_CACHE_DIR."""
    base = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", _CACHE_SCRIPT],
        env={**base, "PYTHONPATH": str(root), **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_unwritable_package_dir_uses_the_user_cache(tmp_path):
    cache = tmp_path / "xdg"
    out = _run_isolated(_copy_package(tmp_path), {"XDG_CACHE_HOME": str(cache)})
    assert out.split() == ["ok"]
    assert list(cache.rglob("*.nbi")), "numba wrote no cache index under XDG_CACHE_HOME"


def test_no_writable_cache_anywhere_still_runs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = _run_isolated(_copy_package(tmp_path), {"XDG_CACHE_HOME": str(blocker / "cache")})
    assert out.split() == ["ok"]


def test_numba_cache_dir_is_honoured(tmp_path):
    cache = tmp_path / "numba-cache"
    out = _run_isolated(_copy_package(tmp_path), {"NUMBA_CACHE_DIR": str(cache)})
    assert out.split() == ["ok"]
    assert list(cache.rglob("*.nbi"))


def test_default_rows_tell_minus_zero_from_zero():
    # -0.0 == 0.0, so a cache keyed on the value alone would hand one out for the other
    minus = numba_._constant(5, torch.float32, -0.0)
    plus = numba_._constant(5, torch.float32, 0.0)
    assert torch.signbit(minus).all() and not torch.signbit(plus).any()


# ---------------------------------------------------------------------------------------
# The kernel ABI (layernorm.backends._kernel_abi)


def test_the_entries_take_the_abi_arguments():
    from layernorm.backends import _kernel_abi, _numba_kernels

    for direction in ("forward", "backward"):
        names = _kernel_abi.names(direction)
        assert _kernel_abi.signature(direction).split(",") == [
            f"{name}:{kind}" for name, kind in _kernel_abi.KERNELS[direction]
        ]
        for parallel in ("serial", "parallel"):
            kernel = getattr(_numba_kernels, f"{direction}_{parallel}").py_func
            assert tuple(inspect.signature(kernel).parameters)[2:] == names
        assert len(_numba_kernels.entry_type(direction).args) == len(names)
    with pytest.raises(TypeError, match=r"the forward entry"):
        _numba_kernels._check_parameters(lambda x, y: None, "forward")


def test_calls_pass_the_abi_arguments_in_order(monkeypatch):
    from layernorm.backends import _kernel_abi

    calls = []
    monkeypatch.setattr(numba_, "entry", lambda dtype, name: lambda *args: calls.append(args))
    m, n = 3, 5
    x, residual = torch.randn(m, n), torch.randn(m, 8)[:, :n]
    weight, bias = torch.randn(n), torch.randn(n)
    y, residual_out, mean, rstd = numba_.forward(x, residual, weight, bias, 1e-3, False)
    args = dict(zip(_kernel_abi.names("forward"), calls.pop(), strict=True))
    assert args == {
        "x": x.data_ptr(), "x_stride": n, "residual": residual.data_ptr(),
        "residual_stride": 8, "has_residual": True, "residual_out": residual_out.data_ptr(),
        "weight": weight.data_ptr(), "bias": bias.data_ptr(), "y": y.data_ptr(),
        "mean": mean.data_ptr(), "rstd": rstd.data_ptr(), "m": m, "n": n, "eps": 1e-3,
        "rms": False, "stream": False, "store_stats": True,
    }  # fmt: skip
    dy, dresidual_out = torch.randn(m, 7)[:, :n], torch.randn(m, n)
    dx, dweight, dbias = numba_.backward(dy, x, weight, mean, rstd, dresidual_out, True, True, True)
    args = dict(zip(_kernel_abi.names("backward"), calls.pop(), strict=True))
    assert args == {
        "dy": dy.data_ptr(), "dy_stride": 7, "x": x.data_ptr(), "x_stride": n,
        "dresidual_out": dresidual_out.data_ptr(), "dresidual_out_stride": n,
        "weight": weight.data_ptr(), "mean": mean.data_ptr(), "rstd": rstd.data_ptr(),
        "dx": dx.data_ptr(), "dweight": dweight.data_ptr(), "dbias": dbias.data_ptr(),
        "m": m, "n": n, "rms": True, "stream": False,
    }  # fmt: skip
