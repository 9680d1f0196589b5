"""The library in production processes (issue 22): fork, threads, the on-disk kernel cache.

- fork and spawn: after serial and threaded calls, forked children (``os.fork``, a
  ``multiprocessing`` pool, DataLoader workers) and spawned ones compute the parent's bits;
- threads: torch's thread settings and the environment are left alone, the kernels follow
  ``torch.get_num_threads()`` at call time, concurrent callers never get more kernel
  threads than CPUs, the compiled dispatch's threaded calls run on torch's own OpenMP
  workers, and results are the same bits under all of it;
- the cache: eight processes starting together on a cold cache never crash or corrupt it,
  it goes somewhere writable when the package and the home directory are not, the first
  cold compile says so once, and after the set-up (``numba_.build``, which the test
  session runs as ``layernorm build`` does) no first call compiles.

Children compare with the parent's results computed before the fork, bit for bit, and
the parent's results are checked against the float64 reference. (A forked child calls
only layernorm's kernels on large tensors: torch's own OpenMP kernels hang in a child
forked after they ran, layernorm or not.)
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import layernorm
from layernorm import cli, compiled, reference
from layernorm.backends import _host_memory, _numba_cache, _threads, numba_

#: Python 3.12+ warns on every fork of a process with threads (layernorm's helpers are
#: threads): forking such a process safely is what these tests check
pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
)
SRC = Path(__file__).resolve().parents[1] / "src"
#: (rows, N): one call in the calling thread, one over the threads (past SERIAL_NUMEL)
SHAPES = ((4, 64), (256, 1024))
assert SHAPES[0][0] * SHAPES[0][1] < numba_.SERIAL_NUMEL <= SHAPES[1][0] * SHAPES[1][1]


def _inputs(m: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(m * 7919 + n)
    x = torch.randn(m, n, generator=g) * 3 + 1
    dy, w, b = (
        torch.randn(m, n, generator=g),
        torch.rand(n, generator=g),
        torch.randn(n, generator=g),
    )
    return x, dy, w + 0.5, b


#: made before any fork: a forked child must not run torch's own (OpenMP) kernels
_INPUTS = {shape: _inputs(*shape) for shape in SHAPES}


def _compute(m: int, n: int) -> list[np.ndarray]:
    """Forward (public function and kernel) and backward (kernel) of one seeded input,
    as NumPy arrays (nothing but layernorm's kernels touches the large tensors)."""
    x, dy, w, b = _INPUTS[m, n]
    y = layernorm.layer_norm(x, n, w, b)
    y2, _, mean, rstd = numba_.forward(x, None, w, b, 1e-5, False)
    dx, dw, db = numba_.backward(dy, x, w, mean, rstd, None, False, True, True, 1e-5)
    return [t.numpy() for t in (y, y2, dx, dw, db)]


def _expected() -> list[list[np.ndarray]]:
    return [_compute(m, n) for m, n in SHAPES]


def _same(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> bool:
    return all(
        np.array_equal(p, q) for u, v in zip(a, b, strict=True) for p, q in zip(u, v, strict=True)
    )


def test_the_parents_results_match_the_float64_reference():
    for (m, n), (y, y2, dx, dw, db) in zip(SHAPES, _expected(), strict=True):
        x, dy, w, b = (t.double().numpy() for t in _INPUTS[m, n])
        ref_y = reference.layer_norm(x, n, w, b, 1e-5)[0]
        ref_dx, ref_dw, ref_db = reference.layer_norm_backward(dy, x, n, w, 1e-5)
        for ours, ref in ((y, ref_y), (y2, ref_y), (dx, ref_dx), (dw, ref_dw), (db, ref_db)):
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def _wait(pid: int, timeout: float = 120) -> int:
    """The exit code of child ``pid``, killing it if it is still running at ``timeout``
    (a child that hangs fails the test instead of hanging the suite)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -signal.SIGKILL


def test_a_forked_child_computes_the_parents_bits():
    expected = _expected()  # serial and threaded calls, forward and backward, before the fork
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only for the same bits
        code = 1
        try:
            code = 0 if _same(_expected(), expected) else 3
        finally:
            os._exit(code)
    assert _wait(pid) == 0
    assert _same(_expected(), expected)  # and the parent still computes after the fork


def test_a_child_forked_while_a_thread_holds_the_host_cache_lock():
    """Outputs of 32 MiB and more come from the host cache (``_host_memory``), whose lock
    another thread may hold at the fork: the child starts with a fresh one."""
    x = torch.randn(2048, 4096)
    assert x.nbytes >= _host_memory.MIN_BYTES
    expected = layernorm.layer_norm(x, 4096).numpy()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _host_memory._lock:
            held.set()
            release.wait(120)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(60)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if np.array_equal(layernorm.layer_norm(x, 4096).numpy(), expected) else 3
            finally:
                os._exit(code)
        assert _wait(pid, timeout=60) == 0
    finally:
        release.set()
        holder.join()


def _in_worker(shape: tuple[int, int]) -> list[np.ndarray]:
    return _compute(*shape)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_workers_compute_the_parents_bits(method):
    expected = _expected()
    with multiprocessing.get_context(method).Pool(2) as pool:
        results = pool.map_async(_in_worker, SHAPES * 2).get(timeout=180)
    assert _same(results, expected * 2)


class _Normalized(torch.utils.data.Dataset):
    """Item ``i``: the layer norm (and its kernel backward) of input shape ``SHAPES[i % 2]``."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> list[np.ndarray]:
        return _compute(*SHAPES[i % 2])


def test_dataloader_workers_compute_the_parents_bits():
    expected = _expected()
    loader = torch.utils.data.DataLoader(
        _Normalized(),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=120,
    )
    items = [[t.numpy() for t in item] for item in loader]
    assert _same(items, expected * 2)


_THREADS_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    before = torch.get_num_threads(), dict(os.environ)
    import layernorm
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for shape in ((4, 64), (256, 1024)):
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            layernorm.rms_norm(x, shape[1]).sum().backward()
            layernorm.layer_norm(x.detach(), shape[1])
    import numba.np.ufunc.parallel as parallel
    after = torch.get_num_threads(), dict(os.environ)
    print(before == after, before[0], parallel._is_initialized)
    """
)


def _printed(script: str, **env: str) -> list[str]:
    """The words ``script`` prints, run in a new Python process with the library on its
    path and ``env`` added to this environment (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(SRC), **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_importing_process_keeps_its_threads_and_environment():
    # same torch threads (1) and environment; numba's threading layer never started
    assert _printed(_THREADS_SCRIPT, OMP_NUM_THREADS="1") == ["True", "1", "False"]


_WORKERS_SCRIPT = textwrap.dedent(
    """
    import os, torch, layernorm
    from layernorm import compiled
    torch.set_num_threads(2)
    x = torch.randn(256, 1024)
    threads = lambda: len(os.listdir("/proc/self/task"))
    with torch.no_grad():
        layernorm.layer_norm(x, 1024)  # threaded, by the compiled dispatch
        ours = threads()
        (x * 2).sum()  # torch's own threaded kernel
    print(compiled.unavailable_reason(), ours, threads())
    """
)


@pytest.mark.skipif(_threads.cpus() < 2, reason="a threaded call needs two CPUs")
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_threaded_calls_run_on_torchs_own_workers():
    """The compiled dispatch's threaded calls run on torch's OpenMP workers: after one, a
    threaded torch kernel finds its workers started and starts no thread (threads of
    layernorm's own would leave torch to start its workers then)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the compiled dispatch")
    reason, ours, after_torch = _printed(_WORKERS_SCRIPT)
    assert reason == "None"  # the compiled dispatch ran the call
    assert after_torch == ours


@pytest.fixture
def lending(monkeypatch):
    """Records ``(wanted, lent)`` for each threaded call, on a pool that may use 4 CPUs
    (so that what is lent depends on the call and the other calls, not on this machine)."""
    calls: list[tuple[int, int]] = []
    pool = _threads._Pool()
    pool.cpus = 4
    borrow = pool.borrow

    def recording(wanted: int, *start: bool) -> int:
        lent = borrow(wanted, *start)
        calls.append((wanted, lent))
        return lent

    monkeypatch.setattr(pool, "borrow", recording)
    monkeypatch.setattr(_threads, "_pool", pool)
    return calls, pool


def test_kernel_threads_follow_torch_at_call_time(lending):
    calls, pool = lending
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 3, 2):
            torch.set_num_threads(count)
            calls.clear()
            results.append(_expected())
            # the threaded calls (two forwards, a backward) each want count - 1 helpers
            assert calls == ([(count - 1, count - 1)] * 3 if count > 1 else [])
    finally:
        torch.set_num_threads(threads)
    assert _same(results[0], results[1]) and _same(results[0], results[2])
    assert pool.running == pool.lent == 0 and pool.started == 2


def test_concurrent_callers_never_oversubscribe_and_agree(lending):
    """Six Python threads calling at once: each call gets the same bits as alone, and the
    pool never lends more helpers than CPUs left over (at most cpus - 1 at any time)."""
    calls, pool = lending
    expected = _expected()
    calls.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    failures: list[str] = []
    peak = [0]

    def work() -> None:
        for _ in range(6):
            if not _same(_expected(), expected):
                failures.append("different bits")
            peak[0] = max(peak[0], pool.lent)

    try:
        workers = [threading.Thread(target=work) for _ in range(6)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=240)
    finally:
        torch.set_num_threads(threads)
    assert failures == [] and not any(worker.is_alive() for worker in workers)
    assert len(calls) == 6 * 6 * 3 and all(wanted == 3 for wanted, _ in calls)
    assert peak[0] <= 3 and pool.started <= 3
    assert pool.running == pool.lent == 0
    assert sum(lent == 0 for _, lent in calls) > 0  # some calls found every CPU taken


def test_an_error_in_a_span_reaches_the_caller_after_every_helper_ended(lending):
    _, pool = lending
    ran: list[int] = []

    def span(start: int, stop: int) -> None:
        ran.extend(range(start, stop))
        if start == 0:
            raise ValueError("span 0 failed")

    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with pytest.raises(ValueError, match="span 0 failed"):
            _threads.run(span, 64, _threads.GRAIN)
    finally:
        torch.set_num_threads(threads)
    assert pool.running == pool.lent == 0
    assert len(ran) == len(set(ran))  # no block twice


# ---------------------------------------------------------------------------------------
# The on-disk cache


# The numba backward kernel on its own: a compile of a few seconds (the forward's takes
# about a minute), with the same cache, index files and locks as every kernel's.
_CACHE_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys, torch
    from layernorm.backends import numba_
    for name in sys.argv[1:]:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(6, 96, generator=g).to(getattr(torch, name))
        w = torch.rand(96, generator=g).to(x.dtype)
        dy = torch.randn(6, 96, generator=g).to(x.dtype)
        z = x.float()
        mean, rstd = z.mean(-1), (z.var(-1, unbiased=False) + 1e-5).rsqrt()
        dx, dw, db = numba_.backward(dy, x, w, mean, rstd, None, False, True, True, 1e-5)
        out = torch.cat([dx.float().flatten(), dw.float(), db.float()])
        print(hashlib.sha256(out.numpy().tobytes()).hexdigest())
    """
)
_ANNOUNCEMENT = "layernorm: compiling the numba kernels"


def _digest_here(name: str) -> str:
    namespace: dict = {}
    code = _CACHE_SCRIPT.replace("sys.argv[1:]", repr([name])).replace("print(", "digest = (")
    exec(code, namespace)
    return namespace["digest"]


def _start(env: dict[str, str], *dtypes: str) -> subprocess.Popen:
    unset = ("NUMBA_CACHE_DIR", "LAYERNORM_CACHE_DIR")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.Popen(
        [sys.executable, "-c", _CACHE_SCRIPT, *dtypes],
        env={**base, "PYTHONPATH": str(SRC), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen) -> tuple[list[str], str]:
    out, err = process.communicate(timeout=400)
    assert process.returncode == 0, err
    return out.split(), err


def test_eight_processes_on_a_cold_cache(tmp_path):
    """As ``torchrun --nproc-per-node 8`` starts them: all at once, one fresh cache folder,
    half of them float32 and half bfloat16 (numba's cache numbers a function's compiled
    signatures in one index per function: two processes compiling different ones at once
    is what could corrupt it). Every one computes the bits of this process; the cache they
    leave is complete and sound (a ninth process compiles nothing and gets the same bits
    for both)."""
    env = {"LAYERNORM_CACHE_DIR": str(tmp_path / "cache")}
    dtypes = ["float32", "bfloat16"] * 4
    processes = [_start(env, name) for name in dtypes]
    results = [_finish(p) for p in processes]
    digests = {name: _digest_here(name) for name in ("float32", "bfloat16")}
    assert [out for out, _ in results] == [[digests[name]] for name in dtypes]
    # each kernel compiled once in all: one process per dtype, while the others waited on
    # the cache's lock and then loaded what it wrote (each compile says so, once)
    announcements = [err.count(_ANNOUNCEMENT) for _, err in results]
    assert sorted(announcements) == [0] * 6 + [1, 1]
    ninth, err = _finish(_start(env, "float32", "bfloat16"))
    assert ninth == [digests["float32"], digests["bfloat16"]] and _ANNOUNCEMENT not in err
    cache = tmp_path / "cache" / "numba"
    assert list(cache.rglob("*.nbi")) and not list(cache.rglob("*.tmp.*"))


def test_read_only_package_and_home_cache_in_the_temporary_directory(tmp_path):
    """A container running as another user: the package and the home are not writable
    (stand-ins: a ``__pycache__`` that is a file, a home that is a file), so the cache goes
    to the temporary directory, and the library says where."""
    site = tmp_path / "site"
    shutil.copytree(
        SRC / "layernorm", site / "layernorm", ignore=shutil.ignore_patterns("__pycache__")
    )
    (site / "layernorm" / "backends" / "__pycache__").write_text("not a directory\n")
    before = sorted(p.relative_to(site) for p in site.rglob("*"))
    home = tmp_path / "home-file"
    home.write_text("")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    script = (  # the backward kernel (rows of ones, eps 1: rstd 1, dx 0): a compile of seconds
        "import torch\n"
        "from layernorm.backends import numba_\n"
        "x, dy = torch.ones(2, 8, dtype=torch.float64), torch.ones(2, 8, dtype=torch.float64)\n"
        "stats = torch.ones(2, dtype=torch.float64)\n"
        "dx, _, _ = numba_.backward(dy, x, None, stats, stats, None, False, False, False, 1.0)\n"
        "print(bool((dx == 0).all()), numba_.cache_location())\n"
    )
    unset = ("NUMBA_CACHE_DIR", "LAYERNORM_CACHE_DIR", "XDG_CACHE_HOME")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={
            **env,
            "PYTHONPATH": str(site),
            "HOME": str(home),
            "TMPDIR": str(temporary),
            "PYTHONDONTWRITEBYTECODE": "1",
            "LAYERNORM_COMPILED": "0",
        },
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    where = temporary / f"layernorm-{os.getuid()}" / "numba"
    assert done.stdout.split() == ["True", "cached", "in", str(where)]
    assert list(where.rglob("*.nbi"))
    assert sorted(p.relative_to(site) for p in site.rglob("*")) == before  # nothing written
    assert f"cached in {where}" in done.stderr  # the compile said where


def test_after_the_set_up_no_first_call_compiles():
    """The test session ran ``numba_.build()`` (conftest, as ``layernorm build`` does):
    a new process's first call of every op and dtype, serial and threaded, forward and
    backward, of float32 from a 16-bit input (the pairs it builds) and, through the
    compiled front door, of ``fused_norm`` with dropout and with ``x1`` (and with dropout
    into a float32 stream of 16-bit inputs), loads its kernels from the cache."""
    script = textwrap.dedent(
        """
        import torch, layernorm
        from layernorm import compiled
        layernorm.layer_norm(torch.ones(1, 2), 2)  # (loads the compiled dispatch)
        front_door = compiled.unavailable_reason() is None
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            if front_door:  # (the Python path's dropout compiles on its first use)
                x, x1, r = (torch.randn(4, 64, dtype=dtype, requires_grad=True) for _ in range(3))
                out = layernorm.fused_norm(x, 64, residual=r, dropout_p=0.1, seed=1)
                out.y.sum().backward()
                with torch.no_grad():
                    layernorm.fused_norm(x, 64, residual=r, x1=x1)
                if dtype in (torch.float16, torch.bfloat16):  # a float32 stream
                    stream = r.detach().float().requires_grad_()
                    out = layernorm.fused_norm(x, 64, residual=stream, dropout_p=0.1, seed=1)
                    (out.y.float().sum() + out.residual_out.sum()).backward()
            for shape in ((3, 40), (128, 512)):
                x, r = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(2))
                w = torch.ones(shape[1], dtype=dtype, requires_grad=True)
                y, h = layernorm.add_layer_norm(x, r, shape[1], w, w)
                (y.sum() + h.sum()).backward()
                layernorm.rms_norm(x, shape[1], w).sum().backward()
                with torch.no_grad():
                    layernorm.layer_norm(x, shape[1])
                    if dtype in (torch.float16, torch.bfloat16):
                        y = layernorm.layer_norm(x, shape[1], w.float(), out_dtype=torch.float32)
                        assert y.dtype == torch.float32
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"] and _ANNOUNCEMENT not in done.stderr


def test_the_first_cold_compile_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(_numba_cache, "_announced", False)
    with caplog.at_level("WARNING", logger="layernorm"):
        _numba_cache.announce_compile("float32 forward_serial")
        _numba_cache.announce_compile("float32 backward_serial")
    (record,) = caplog.records
    assert "float32 forward_serial" in record.getMessage()
    assert "layernorm build" in record.getMessage()
    assert _numba_cache.location() in record.getMessage()


def test_build_compiles_every_entry_and_says_where(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compiled, "build", lambda **kwargs: tmp_path / "x.so")
    assert cli.main(["build"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"built {tmp_path / 'x.so'} in ")
    assert out[1].startswith("numba kernels (float16 ") and out[1].endswith(
        f") {numba_.cache_location()}"
    )
    for dtype in numba_._DTYPES:
        for name in (*numba_.ENTRIES, "column_sums"):
            assert (dtype, name) in numba_._entries
    for x, y in numba_.BUILT_PAIRS:
        for name in ("forward_serial", "forward_parallel"):
            assert (x, name, y) in numba_._entries
    for dtype in numba_._DTYPES:
        for name in numba_.DROPOUT_ENTRIES:
            assert (dtype, name) in numba_._entries
    for x, stream in numba_.STREAM_PAIRS:
        for name in numba_.DROPOUT_ENTRIES:
            assert (x, name, stream) in numba_._entries
