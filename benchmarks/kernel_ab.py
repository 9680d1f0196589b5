"""Two versions of the numba kernels, timed side by side in one process.

    PYTHONPATH=src python benchmarks/kernel_ab.py --base b4819f1
    PYTHONPATH=src python benchmarks/kernel_ab.py --base HEAD~1 --dtype bfloat16 \\
        --directions bwd --shapes 1024x64,1024x768

The kernel modules of git revision ``--base`` (``src/layernorm/backends/_numba_*.py``)
and of the working tree are loaded as two separate packages and their entry points
called directly (tensor addresses in: no Python dispatch, no allocation), the two
interleaved round by round with torch's own function. Prints the median microseconds a
call of each, ``new / base``, and whether the two versions give the same bits. On this
shared machine separate runs move by ±30 %; interleaved in one process, differences of a
few percent show; ``--clock cpu --threads 1`` steadies them further. Both versions must
take the entry points' current arguments (``_kernel_abi``), in the same order, except
that a forward taking ``flags`` (the fallback flags) gets them.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numba
import torch
import torch.nn.functional as F

from layernorm.backends import numba_

ROOT = Path(__file__).resolve().parents[1]
MODULES = "src/layernorm/backends"
STREAM_BYTES = numba_.STREAM_BYTES
#: the modules besides ``_numba_*.py`` that the kernels import (where a revision has them)
SHARED = ("_kernel_abi.py", "_weight_terms.py")
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}


def load(revision: str | None, where: Path) -> ModuleType:
    """The ``_numba_kernels`` module of ``revision`` (None: the working tree), imported
    as ``<package>._numba_kernels`` from a copy under ``where``."""
    name = "ab_" + ("tree" if revision is None else revision.replace("~", "_").replace("^", "_"))
    package = where / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    if revision is None:
        files = [*sorted((ROOT / MODULES).glob("_numba_*.py"))]
        files += [ROOT / MODULES / name for name in SHARED]
        sources = {f.name: f.read_text() for f in files}
    else:
        listing = subprocess.run(
            ["git", "ls-tree", "--name-only", revision, MODULES + "/"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        sources = {
            Path(p).name: subprocess.run(
                ["git", "show", f"{revision}:{p}"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for p in listing
            if Path(p).name.startswith("_numba_") or Path(p).name in SHARED
        }
    for filename, text in sources.items():
        (package / filename).write_text(text)
    sys.path.insert(0, str(where))
    return importlib.import_module(f"{name}._numba_kernels")


def _median_times(
    calls: dict[str, Callable[[], object]],
    rounds: int,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> dict[str, float]:
    """Median microseconds a call, each timed in ~2 ms batches, round-robin, on ``clock``
    (nanoseconds)."""
    batch = {}
    for name, call in calls.items():
        for _ in range(5):
            call()
        start = time.perf_counter()
        call()
        batch[name] = max(1, int(2e-3 / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = clock()
            for _ in range(batch[name]):
                call()
            samples[name].append((clock() - start) / batch[name] / 1000)
    return {name: statistics.median(v) for name, v in samples.items()}


def compare(
    kernels: dict[str, ModuleType],
    direction: str,
    m: int,
    n: int,
    dtype,
    rounds: int,
    clock: Callable[[], int] = time.perf_counter_ns,
):
    types = numba_._TYPES[dtype]
    x, dy = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
    w, b = torch.randn(n, dtype=types.acc_dtype), torch.randn(n, dtype=types.acc_dtype)
    _, _, mean, rstd = numba_.forward(x, None, w, b, 1e-5, False)
    nbytes = m * n * x.element_size()
    parallel = m * n >= numba_.SERIAL_NUMEL
    outputs: dict[str, list[torch.Tensor]] = {}
    alive: list[torch.Tensor] = []  # every tensor whose address a call holds
    calls: dict[str, Callable[[], object]] = {}
    for label, module in kernels.items():
        y, dx = torch.empty_like(x), torch.empty_like(x)
        dw, db = torch.empty(n, dtype=types.acc_dtype), torch.empty(n, dtype=types.acc_dtype)
        dro = torch.full((n,), -0.0, dtype=dtype)
        alive += [y, dx, dw, db, dro]
        flags = torch.zeros(m + 1, dtype=torch.uint8)  # fallback flags (m + 1), if taken
        alive.append(flags)
        # every argument either version's entry may take, by name: each version's entry
        # takes those its signature names, in its order
        values = {
            "storage_tag": types.storage,
            "acc_tag": types.acc,
            "y_tag": types.storage,  # y in x's dtype (the forward's third tag, if it has one)
            "x": x.data_ptr(),
            "x_stride": n,
            "residual": x.data_ptr(),
            "residual_stride": 0,
            "has_residual": False,
            "residual_out": x.data_ptr(),
            "weight": w.data_ptr(),
            "bias": b.data_ptr(),
            "params_x_dtype": False,
            "y": y.data_ptr(),
            "m": m,
            "n": n,
            "eps": 1e-5,
            "rms": False,
            "stream": nbytes >= STREAM_BYTES,
            "store_stats": False,
            "flags": flags.data_ptr(),
            "dy": dy.data_ptr(),
            "dy_stride": n,
            "dresidual_out": dro.data_ptr(),
            "dresidual_out_stride": 0,
            "dx": dx.data_ptr(),
            "dweight": dw.data_ptr(),
            "dbias": db.data_ptr(),
        }
        if direction == "fwd":
            run = module.forward_parallel if parallel else module.forward_serial
            values |= {"mean": x.data_ptr(), "rstd": x.data_ptr()}
            outputs[label] = [y]
        else:
            # (backward_parallel is one span of a threaded call now: its dweight/dbias
            # take the span's block partials, not the column sums)
            run = module.backward_serial
            values |= {"mean": mean.data_ptr(), "rstd": rstd.data_ptr()}
            outputs[label] = [dx, dw, db]
        args = tuple(values[name] for name in inspect.signature(run.py_func).parameters)
        calls[label] = lambda run=run, args=args: run(*args)
    xt, wt, bt = x, w.to(dtype), b.to(dtype)
    if direction == "fwd":
        calls["torch"] = lambda: F.layer_norm(xt, (n,), wt, bt)
    else:
        xg = x.clone().requires_grad_()
        wg, bg = wt.clone().requires_grad_(), bt.clone().requires_grad_()
        yt = F.layer_norm(xg, (n,), wg, bg)
        calls["torch"] = lambda: torch.autograd.grad(yt, (xg, wg, bg), dy, retain_graph=True)
    times = _median_times(calls, rounds, clock)
    base, new = outputs["base"], outputs["new"]
    same = all(
        torch.equal(a.view(torch.uint8), c.view(torch.uint8))
        for a, c in zip(base, new, strict=True)
    )
    return times, same


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"]
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--directions", default="fwd,bwd")
    parser.add_argument(
        "--shapes", default="64x64,1024x64,128x768,1024x768,256x1024,512x4096,8192x4096"
    )
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall time, or the CPU time of the whole process (steadier on a busy machine"
        " with --threads 1: time spent waiting for a core does not count)",
    )
    options = parser.parse_args(argv)
    numba.set_num_threads(options.threads)
    torch.set_num_threads(options.threads)
    dtype = getattr(torch, options.dtype)
    with tempfile.TemporaryDirectory() as where:
        kernels = {"base": load(options.base, Path(where)), "new": load(None, Path(where))}
        print(
            f"base {options.base} vs the working tree, {options.dtype}, {options.threads} threads;"
            f" median microseconds a call ({options.clock} clock)"
        )
        for direction in options.directions.split(","):
            for shape in options.shapes.split(","):
                m, n = map(int, shape.split("x"))
                times, same = compare(
                    kernels, direction, m, n, dtype, options.rounds, CLOCKS[options.clock]
                )
                print(
                    f"{direction} {m}x{n}: base {times['base']:.1f}  new {times['new']:.1f}"
                    f"  torch {times['torch']:.1f}  new/base {times['new'] / times['base']:.2f}"
                    f"  same bits: {'yes' if same else 'no'}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
