"""The numba CPU backend's own paths (the contract itself is tests/test_contract.py).

Compiling dominates the run time: every test reuses the same eight kernels (forward and
backward for float32, float64, float16 and bfloat16), which numba caches on disk.
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import layernorm
from layernorm import backends, reference

pytest.importorskip("numba")
from layernorm.backends import numba_

SRC = Path(layernorm.__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _max_err(a: torch.Tensor, ref: np.ndarray) -> float:
    return float(np.abs(_f64(a) - ref).max())


# ---------------------------------------------------------------------------------------
# Parity


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


# ---------------------------------------------------------------------------------------
# docs/contract.md §3 facts


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_streaming_stores_give_the_same_bits(dtype, monkeypatch):
    x, r = torch.randn(37, 1001).to(dtype), torch.randn(37, 1001).to(dtype)
    w, b = torch.randn(1001), torch.randn(1001)
    dy = torch.randn(37, 1001).to(dtype)
    runs = []
    for stream_bytes in (1 << 62, 0):  # nothing streams, then every output streams
        monkeypatch.setattr(numba_, "STREAM_BYTES", stream_bytes)
        y, h, mean, rstd = numba_.forward(x, r, w, b, 1e-5, False)
        grads = numba_.backward(dy, h, w, mean, rstd, dy, False, True, True, 1e-5)
        # one broadcast gradient row (stride 0), no residual gradient: the streaming
        # backward also loads each next row, here the same row again
        expanded = numba_.backward(
            dy[:1].expand(37, 1001), h, w, mean, rstd, None, False, True, True, 1e-5
        )
        runs.append((y, h, mean, rstd, *grads, *expanded))
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))
    assert torch.equal(numba_.forward(x[5:6], None, w, None, 1e-5, True)[0],
                       numba_.forward(x, None, w, None, 1e-5, True)[0][5:6])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("m, n", [(19, 1), (19, 7), (19, 64), (19, 256), (19, 257),
                                  (19, 1024), (19, 1025), (263, 1000)], ids=str)  # fmt: skip
def test_rows_in_batches_give_the_bits_of_each_row_alone(dtype, rms, m, n, monkeypatch):
    """Short rows (``_numba_kernels.BATCHED_N`` or fewer elements, or up to 4 times as
    many in a call of at most ``BATCHED_NUMEL`` elements) take the forward in batches of
    8 rows, their constants computed together across the rows, and the backward's dx
    pass takes two rows at once: 19 rows (two whole batches, a part one, an odd row
    left) and 263 (1025 and 263x1000, in one span: one row at a time, pipelined, against
    each row in a batch of one) give y, residual_out, the statistics and dx of each row alone, with a
    residual and a residual gradient and without, from strided x rows; and dbias takes
    every row's dy once: the exact column sum (exact in float64 here) rounded once."""
    from layernorm.backends import _numba_kernels

    k = _numba_kernels
    assert 1 <= k.BATCHED_N < 257 and 4 * k.BATCHED_N == 1024 and k.BATCHED_NUMEL >= 19 * 1024
    assert k.BATCHED_NUMEL < 263 * 1000
    monkeypatch.setattr(numba_, "SERIAL_NUMEL", 1 << 62)  # one span: the call's m rows
    g = torch.Generator().manual_seed(n)
    x, r, dy, dro = ((torch.randn(m, 2 * n, generator=g) * 3 + 1).to(dtype) for _ in range(4))
    x, r, dy, dro = x[:, :n], r[:, :n].contiguous(), dy[:, :n].contiguous(), dro[:, :n]
    dro = dro.contiguous()
    w, b = torch.randn(n, generator=g) + 1, None if rms else torch.randn(n, generator=g)
    for residual, dres in [(None, None), (r, dro)]:
        y, h, mean, rstd = numba_.forward(x, residual, w, b, 1e-5, rms)
        z = x if h is None else h
        dx, _, dbias = numba_.backward(dy, z, w, mean, rstd, dres, rms, True, not rms, 1e-5)
        if dbias is not None and dtype != torch.float64:
            exact = [math.fsum(column) for column in dy.double().T.tolist()]
            assert torch.equal(dbias, torch.tensor(exact, dtype=torch.float64).float())
        for i in range(m):
            one = slice(i, i + 1)
            r_i = None if residual is None else residual[one]
            y_i, h_i, mean_i, rstd_i = numba_.forward(x[one], r_i, w, b, 1e-5, rms)
            assert torch.equal(y_i, y[one]), i
            assert h_i is None or torch.equal(h_i, h[one]), i
            assert torch.equal(rstd_i, rstd[one]), i
            assert rms or torch.equal(mean_i, mean[one]), i
            d_i = None if dres is None else dres[one]
            z_i = z[one]
            dx_i = numba_.backward(dy[one], z_i, w, mean_i, rstd_i, d_i, rms, False, False, 1e-5)
            assert torch.equal(dx_i[0], dx[one]), i


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (40, 1001), (65, 64)], ids=str)
def test_serial_and_parallel_kernels_give_the_same_bits(dtype, rms, shape, monkeypatch):
    # Small inputs run in the calling thread, large ones in spans over threads: a row must
    # come out the same either way (batch invariance across the switch).
    x, r, dy, dro = (torch.randn(shape).to(dtype) + 2 for _ in range(4))
    w, b = torch.randn(shape[1]), torch.randn(shape[1])
    runs = []
    for serial_numel in (0, 1 << 62):  # everything parallel, then everything serial
        monkeypatch.setattr(numba_, "SERIAL_NUMEL", serial_numel)
        y, h, mean, rstd = numba_.forward(x, r, w, None if rms else b, 1e-5, rms)
        grads = numba_.backward(dy, h, w, mean, rstd, dro, rms, True, not rms, 1e-5)
        runs.append([t for t in (y, h, mean, rstd, *grads) if t is not None])
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (40, 1001), (300, 1024)], ids=str)
def test_16_bit_parameters_give_the_bits_of_their_float32_values(dtype, rms, shape):
    """Parameters in x's 16-bit dtype are read as they are (``params_x_dtype``: widened
    inside the kernels, once per call) and give the bits of the same values passed in
    float32 (the accumulation dtype, read directly): y, residual_out, the statistics, dx
    and dweight/dbias (in float32 either way); with either parameter absent too, and with
    a strided x. (300, 1024) runs the parallel entries."""
    g = torch.Generator().manual_seed(1)
    x, r, dy, dro = ((torch.randn(shape, generator=g) * 2 + 1).to(dtype) for _ in range(4))
    x = torch.cat([x, x], 1)[:, : shape[1]]  # strided rows, read in place
    n = shape[-1]
    w16 = (torch.randn(n, generator=g) + 1).to(dtype)
    b16 = None if rms else torch.randn(n, generator=g).to(dtype)
    for w, b in [(w16, b16), (w16, None), (None, b16)]:
        runs = []
        for param_dtype in (dtype, torch.float32):
            wp, bp = (None if p is None else p.to(param_dtype) for p in (w, b))
            y, h, mean, rstd = numba_.forward(x, r, wp, bp, 1e-5, rms)
            grads = numba_.backward(dy, h, wp, mean, rstd, dro, rms, wp is not None, True, 1e-5)
            runs.append([t for t in (y, h, mean, rstd, *grads) if t is not None])
        assert len(runs[0]) == len(runs[1])
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
            grads = numba_.backward(dy, x, w, mean, rstd, None, rms, True, False, 1e-5)
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
    dx, dw, db = numba_.backward(dy, x, w, mean, rstd, None, False, True, True, 1e-5)
    h = hashlib.sha256()
    for t in (y, mean, rstd, dx, dw, db):
        h.update(t.numpy().tobytes())
    digest = h.hexdigest()
    """
)
_THREADS_SCRIPT = _DIGEST_CODE + "print(torch.get_num_threads(), digest)\n"


def _run(code: str, env: dict[str, str], timeout: float = 240) -> str:
    full_env = {**os.environ, "PYTHONPATH": str(SRC), **env}
    done = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_results_do_not_depend_on_the_thread_count():
    # the kernels run torch.get_num_threads() threads (layernorm.backends._threads)
    one = _run(_THREADS_SCRIPT, {"OMP_NUM_THREADS": "1"}).split()
    two = _run(_THREADS_SCRIPT, {"OMP_NUM_THREADS": "2"}).split()
    assert one[0] == "1" and two[0] == "2"
    assert one[1] == two[1]
    # and the same numbers in this process, whatever its thread count
    namespace: dict = {}
    exec(_DIGEST_CODE, namespace)
    assert namespace["digest"] == one[1]


_OWNERS_CODE = textwrap.dedent(
    """
    import hashlib, torch
    from layernorm.backends import numba_
    g = torch.Generator().manual_seed(2)
    h = hashlib.sha256()
    # the kernels' own arrays that per-row code borrows (_numba_kernels._borrowed): the
    # float64 copies of weight and bias (batched rows of 1024, pipelined rows), the
    # widened 16-bit parameters (short rows), the backward's weight, partials, scratch
    for m, n, dtype in ((64, 1024, torch.float32), (300, 1024, torch.float32),
                        (1024, 64, torch.bfloat16), (40, 640, torch.float32)):
        x = (torch.randn(m, n, generator=g) + 3).to(dtype)
        dy = torch.randn(m, n, generator=g).to(dtype)
        w, b = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
        y, _, mean, rstd = numba_.forward(x, None, w, b, 1e-5, False)
        dx, dw, db = numba_.backward(dy, x, w, mean, rstd, None, False, True, True, 1e-5)
        for t in (y, mean, rstd, dx, dw, db):
            h.update(t.view(torch.uint8).numpy().tobytes())
    digest = h.hexdigest()
    """
)


def test_borrowed_arrays_outlive_their_views():
    # glibc fills freed memory with MALLOC_PERTURB_'s byte: a view read after its owner
    # was freed would read that instead of the values, and change the bits
    namespace: dict = {}
    exec(_OWNERS_CODE, namespace)
    scribbled = _run(_OWNERS_CODE + "print(digest)\n", {"MALLOC_PERTURB_": "165"}).split()
    assert scribbled == [namespace["digest"]]


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


# The numba backward kernel against torch's gradient: its compile takes a few seconds
# (the forward's about a minute) and uses the same cache as every kernel.
_CACHE_SCRIPT = textwrap.dedent(
    """
    import torch
    from layernorm.backends import numba_
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 10, dtype=torch.float64)
    torch.nn.functional.layer_norm(x, (10,)).backward(dy)
    z = x.detach()
    mean, rstd = z.mean(-1), (z.var(-1, unbiased=False) + 1e-5).rsqrt()
    dx, _, _ = numba_.backward(dy, z, None, mean, rstd, None, False, False, False, 1e-5)
    assert torch.allclose(dx, x.grad), (dx, x.grad)
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
    """Runs ``_CACHE_SCRIPT`` against the package copy under ``root``, with no
    NUMBA_CACHE_DIR or LAYERNORM_CACHE_DIR but those in ``env``."""
    unset = ("NUMBA_CACHE_DIR", "LAYERNORM_CACHE_DIR")
    base = {k: v for k, v in os.environ.items() if k not in unset}
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
    # (an unwritable default would fall back to the temporary directory: compiled.cache_dir)
    out = _run_isolated(_copy_package(tmp_path), {"LAYERNORM_CACHE_DIR": str(blocker / "cache")})
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
        tags = 3 if direction == "forward" else 2  # (the forward's third: y's dtype)
        for parallel in ("serial", "parallel"):
            kernel = getattr(_numba_kernels, f"{direction}_{parallel}").py_func
            assert tuple(inspect.signature(kernel).parameters)[tags:] == names
        assert len(_numba_kernels.entry_type(direction).args) == len(names)
    with pytest.raises(TypeError, match=r"the forward entry"):
        _numba_kernels._check_parameters(lambda x, y: None, "forward")


def test_calls_pass_the_abi_arguments_in_order(monkeypatch):
    from layernorm.backends import _kernel_abi

    calls = []
    monkeypatch.setattr(
        numba_, "entry", lambda dtype, name, y_dtype=None: lambda *args: calls.append(args)
    )
    m, n = 3, 5
    x, residual = torch.randn(m, n), torch.randn(m, 8)[:, :n]
    weight, bias = torch.randn(n), torch.randn(n)
    y, residual_out, mean, rstd = numba_.forward(x, residual, weight, bias, 1e-3, False)
    args = dict(zip(_kernel_abi.names("forward"), calls.pop(), strict=True))
    flags = args.pop("flags")  # the address of m + 1 fallback flags, made per call
    assert isinstance(flags, int) and flags not in (0, x.data_ptr(), y.data_ptr())
    assert args == {
        "x": x.data_ptr(), "x_stride": n, "residual": residual.data_ptr(),
        "residual_stride": 8, "has_residual": True, "residual_out": residual_out.data_ptr(),
        "weight": weight.data_ptr(), "bias": bias.data_ptr(), "params_x_dtype": False,
        "y": y.data_ptr(), "mean": mean.data_ptr(), "rstd": rstd.data_ptr(), "m": m, "n": n,
        "eps": 1e-3, "rms": False, "stream": False, "store_stats": True,
    }  # fmt: skip
    dy, dresidual_out = torch.randn(m, 7)[:, :n], torch.randn(m, n)
    dx, dweight, dbias = numba_.backward(
        dy, x, weight, mean, rstd, dresidual_out, True, True, True, 1e-3
    )
    args = dict(zip(_kernel_abi.names("backward"), calls.pop(), strict=True))
    flags = args.pop("flags")  # the address of m + 1 fallback flags, made per call
    assert isinstance(flags, int) and flags not in (0, x.data_ptr(), dx.data_ptr())
    assert args == {
        "dy": dy.data_ptr(), "dy_stride": 7, "x": x.data_ptr(), "x_stride": n,
        "dresidual_out": dresidual_out.data_ptr(), "dresidual_out_stride": n,
        "weight": weight.data_ptr(), "params_x_dtype": False, "mean": mean.data_ptr(),
        "rstd": rstd.data_ptr(), "dx": dx.data_ptr(), "dweight": dweight.data_ptr(),
        "dbias": dbias.data_ptr(), "m": m, "n": n, "rms": True, "stream": False, "eps": 1e-3,
    }  # fmt: skip
    # parameters in x's 16-bit dtype are passed as they are, not converted per call; with
    # one in another dtype, both are converted to the accumulation dtype
    x16, w16, b16 = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
    for w, b, as_x in [(w16, b16, True), (w16, None, True), (None, b16, True), (w16, bias, False)]:
        numba_.forward(x16, None, w, b, 1e-3, False)
        args = dict(zip(_kernel_abi.names("forward"), calls.pop(), strict=True))
        assert args["params_x_dtype"] is as_x
        passed = torch.bfloat16 if as_x else torch.float32  # what is passed as it is
        for p, name in [(w, "weight"), (b, "bias")]:
            assert p is None or (args[name] == p.data_ptr()) is (p.dtype == passed)
        numba_.backward(dy.bfloat16(), x16, w, mean, rstd, None, False, w is not None, True, 1e-3)
        args = dict(zip(_kernel_abi.names("backward"), calls.pop(), strict=True))
        assert args["params_x_dtype"] is (w is not None)
        assert w is None or args["weight"] == w.data_ptr()
