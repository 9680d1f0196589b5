"""CPU benchmarks: layernorm against torch eager (and torch.compile), side by side.

Forward, backward and both, for ``layer_norm``, ``rms_norm`` and ``add_layer_norm``, over a
shape sweep. Every provider of one configuration runs in the same process, interleaved
round by round (so drift hits all of them alike); each sample is the mean of enough calls
to last about a millisecond, and the reported time is the median of ``repeat`` samples
after warm-up. Throughput is in GB/s from stated byte counts (the tensors the operation
must move; parameters and statistics are ignored), with ``E = M * N * itemsize``:

=================  =======  ========  ========
op                 forward  backward  both
=================  =======  ========  ========
layer_norm         2E       3E        5E
rms_norm           2E       3E        5E
add_layer_norm     4E       4E        8E
=================  =======  ========  ========

(forward reads x and writes y; backward reads x and dy and writes dx; add_layer_norm also
reads the residual, writes residual_out and reads its gradient.) ``copy`` is
``out.copy_(x)`` on the same tensor (2E), the practical roofline on a CPU; ``of copy`` is a
provider's GB/s over copy's.

Used by ``layernorm bench``, ``layernorm report`` and the scripts in ``benchmarks/``.

Example::

    layernorm bench --quick
    layernorm bench --shapes 8192x4096,32768x768 --threads 2 --json out.json --out bench/
"""

from __future__ import annotations

import argparse
import html
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import _extras

__all__ = [
    "ISSUE_SHAPES",
    "Result",
    "add_parser",
    "format_table",
    "machine_info",
    "plot",
    "report_section",
    "run",
]

#: the shapes of the CPU performance issue (float32, 2 threads)
ISSUE_SHAPES: tuple[tuple[int, int], ...] = (
    (8192, 4096),
    (32768, 768),
    (1024, 16384),
    (16384, 1024),
    (4096, 12288),
)
QUICK_SHAPES: tuple[tuple[int, int], ...] = ((256, 1024), (2048, 1024), (512, 4096))
#: the report's full benchmark section: one small shape and two of the issue's
REPORT_SHAPES: tuple[tuple[int, int], ...] = ((2048, 1024), (8192, 4096), (32768, 768))
OPS = ("layer_norm", "rms_norm", "add_layer_norm")
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
#: bytes moved per element of one (M, N) tensor, in units of its itemsize
TENSORS_MOVED = {
    ("layer_norm", "fwd"): 2,
    ("layer_norm", "bwd"): 3,
    ("layer_norm", "fwdbwd"): 5,
    ("rms_norm", "fwd"): 2,
    ("rms_norm", "bwd"): 3,
    ("rms_norm", "fwdbwd"): 5,
    ("add_layer_norm", "fwd"): 4,
    ("add_layer_norm", "bwd"): 4,
    ("add_layer_norm", "fwdbwd"): 8,
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
DTYPES.update(float16=torch.float16, bfloat16=torch.bfloat16)
EPS = 1e-5


@dataclass
class Result:
    """One provider on one configuration."""

    op: str
    direction: str
    dtype: str
    M: int
    N: int
    provider: str
    ms: float  # median
    min_ms: float
    q25_ms: float
    q75_ms: float
    bytes: int
    gbps: float
    vs_torch: float | None  # torch's time / this time (> 1: faster than torch)
    of_copy: float | None  # this GB/s / copy's GB/s
    error: str | None = None


# ---------------------------------------------------------------------------------------
# The operations, per provider


def _torch_op(op: str) -> Callable:
    if op == "layer_norm":
        return lambda x, r, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS)
    if op == "rms_norm":
        return lambda x, r, w, b: F.rms_norm(x, (x.shape[-1],), w, EPS)

    def add_layer_norm(x, r, w, b):
        h = x + r
        return F.layer_norm(h, (x.shape[-1],), w, b, EPS), h

    return add_layer_norm


def _layernorm_op(op: str, backend: str | None) -> Callable:
    import layernorm

    if op == "layer_norm":
        return lambda x, r, w, b: layernorm.layer_norm(x, x.shape[-1], w, b, EPS, backend=backend)
    if op == "rms_norm":
        return lambda x, r, w, b: layernorm.rms_norm(x, x.shape[-1], w, EPS, backend=backend)
    return lambda x, r, w, b: layernorm.add_layer_norm(
        x, r, x.shape[-1], w, b, EPS, backend=backend
    )


def _provider_op(provider: str, op: str) -> Callable:
    """``torch``, ``compile`` (torch.compile of torch's), ``layernorm`` (automatic backend)
    or ``layernorm:NAME`` (one backend)."""
    if provider == "torch":
        return _torch_op(op)
    if provider == "compile":
        return torch.compile(_torch_op(op), dynamic=False)
    if provider == "layernorm":
        return _layernorm_op(op, None)
    if provider.startswith("layernorm:"):
        return _layernorm_op(op, provider.split(":", 1)[1])
    raise ValueError(f"unknown provider {provider!r}")


def _inputs(op: str, m: int, n: int, dtype: torch.dtype, grad: bool):
    x = torch.randn(m, n, dtype=dtype)
    r = torch.randn(m, n, dtype=dtype) if op == "add_layer_norm" else None
    w = torch.randn(n, dtype=dtype)
    b = None if op == "rms_norm" else torch.randn(n, dtype=dtype)
    if grad:
        for t in (x, r, w, b):
            if t is not None:
                t.requires_grad_()
    return x, r, w, b


def _closure(provider: str, op: str, direction: str, m: int, n: int, dtype: torch.dtype):
    fn = _provider_op(provider, op)
    x, r, w, b = _inputs(op, m, n, dtype, grad=direction != "fwd")
    if direction == "fwd":
        return lambda: fn(x, r, w, b)
    leaves = [t for t in (x, r, w, b) if t is not None]
    outputs = fn(x, r, w, b)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(o) for o in outputs]
    if direction == "bwd":
        return lambda: torch.autograd.grad(outputs, leaves, grads, retain_graph=True)

    def fwdbwd():
        out = fn(x, r, w, b)
        out = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(out, leaves, grads)

    return fwdbwd


def _copy_closure(m: int, n: int, dtype: torch.dtype):
    x = torch.randn(m, n, dtype=dtype)
    out = torch.empty_like(x)
    return lambda: out.copy_(x)


# ---------------------------------------------------------------------------------------
# Timing


def _calibrate(fn: Callable, target_s: float = 1e-3) -> int:
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    return max(1, min(1000, int(target_s / max(once, 1e-7))))


def _sample(fn: Callable, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def set_threads(threads: int | None) -> None:
    """Sets torch's and (if installed) numba's thread counts."""
    if threads is None:
        return
    torch.set_num_threads(threads)
    try:
        import numba
    except ImportError:
        return
    # (numba.config sets NUMBA_NUM_THREADS at import, from the environment: its types miss it)
    max_threads = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    numba.set_num_threads(min(threads, max_threads))


def run(
    shapes: Sequence[tuple[int, int]] = QUICK_SHAPES,
    ops: Sequence[str] = OPS,
    directions: Sequence[str] = DIRECTIONS,
    dtype: str = "float32",
    providers: Sequence[str] = ("torch", "layernorm"),
    repeat: int = 10,
    warmup: int = 3,
    progress: bool = True,
) -> list[Result]:
    """Benchmarks every (op, direction, shape) for every provider, plus ``copy``.

    Returns one :class:`Result` per provider and configuration (copy once per shape).
    A provider that fails (torch.compile where it cannot compile) gets ``error`` set.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    torch_dtype = DTYPES[dtype]
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    configs = [(op, d, s) for s in shapes for op in ops for d in directions]
    results: list[Result] = []
    copy_ms: dict[tuple[int, int], float] = {}
    bar = _extras.progress(configs, desc="bench", disable=not progress, leave=False)
    for op, direction, (m, n) in bar:
        elements = m * n * itemsize
        fns: dict[str, Callable] = {}
        errors: dict[str, str] = {}
        if (m, n) not in copy_ms:
            fns["copy"] = _copy_closure(m, n, torch_dtype)
        for provider in providers:
            try:
                fn = _closure(provider, op, direction, m, n, torch_dtype)
                for _ in range(warmup):
                    fn()
                fns[provider] = fn
            except Exception as error:  # torch.compile without a compiler, and the like
                errors[provider] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        numbers = {name: _calibrate(fn) for name, fn in fns.items()}
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(repeat):
            for name, fn in fns.items():  # interleaved: drift hits every provider alike
                samples[name].append(_sample(fn, numbers[name]))
        if "copy" in samples:
            copy_ms[(m, n)] = statistics.median(samples["copy"]) * 1e3
            copy_bytes = 2 * elements
            results.append(_result("copy", "fwd", dtype, m, n, "copy", samples["copy"], copy_bytes))
        moved = TENSORS_MOVED[(op, direction)] * elements
        for provider in providers:
            if provider in errors:
                results.append(
                    Result(
                        op,
                        direction,
                        dtype,
                        m,
                        n,
                        provider,
                        ms=float("nan"),
                        min_ms=float("nan"),
                        q25_ms=float("nan"),
                        q75_ms=float("nan"),
                        bytes=moved,
                        gbps=float("nan"),
                        vs_torch=None,
                        of_copy=None,
                        error=errors[provider],
                    )
                )
                continue
            results.append(_result(op, direction, dtype, m, n, provider, samples[provider], moved))
        _add_ratios(results, op, direction, m, n, copy_ms[(m, n)], 2 * elements)
    return results


def _result(op, direction, dtype, m, n, provider, samples, moved) -> Result:
    ms = [s * 1e3 for s in samples]
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    median = statistics.median(ms)
    return Result(
        op,
        direction,
        dtype,
        m,
        n,
        provider,
        median,
        min(ms),
        q[0],
        q[2],
        moved,
        moved / (median * 1e-3) / 1e9,
        None,
        None,
    )


def _add_ratios(results, op, direction, m, n, copy_ms, copy_bytes) -> None:
    mine = [r for r in results if (r.op, r.direction, r.M, r.N) == (op, direction, m, n)]
    torch_ms = next((r.ms for r in mine if r.provider == "torch" and r.error is None), None)
    copy_gbps = copy_bytes / (copy_ms * 1e-3) / 1e9
    for r in mine:
        if r.error is not None:
            continue
        r.vs_torch = None if torch_ms is None else torch_ms / r.ms
        r.of_copy = r.gbps / copy_gbps


# ---------------------------------------------------------------------------------------
# Output


def machine_info() -> dict[str, object]:
    """CPU model, core count, thread counts and package versions."""
    import numpy

    info: dict[str, object] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor()
    from .. import compiled

    info["compiled_dispatch"] = compiled.status()
    try:
        import numba

        info["numba"] = numba.__version__
        info["numba_threads"] = numba.get_num_threads()
    except ImportError:
        pass
    return info


def format_table(results: Sequence[Result]) -> str:
    """A fixed-width text table, one line per result."""
    head = f"{'op':<15}{'dir':<7}{'dtype':<9}{'M':>7}{'N':>7}  {'provider':<16}"
    head += f"{'ms':>9}{'min ms':>9}{'GB/s':>8}{'vs torch':>10}{'of copy':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.error is not None:
            lines.append(
                f"{r.op:<15}{r.direction:<7}{r.dtype:<9}{r.M:>7}{r.N:>7}  {r.provider:<16}"
                f"  failed: {r.error}"
            )
            continue
        vs = "" if r.vs_torch is None else f"{r.vs_torch:.2f}x"
        of = "" if r.of_copy is None else f"{r.of_copy:.2f}"
        lines.append(
            f"{r.op:<15}{r.direction:<7}{r.dtype:<9}{r.M:>7}{r.N:>7}  {r.provider:<16}"
            f"{r.ms:>9.3f}{r.min_ms:>9.3f}{r.gbps:>8.1f}{vs:>10}{of:>9}"
        )
    return "\n".join(lines)


def plot(results: Sequence[Result], path: Path) -> Path:
    """Bar charts of GB/s per shape (one panel per op and direction), copy as a line."""
    matplotlib = _extras.require("matplotlib", "report", "layernorm's benchmark plot")
    matplotlib.use("Agg")
    plt = _extras.require("matplotlib.pyplot", "report", "layernorm's benchmark plot")

    panels = sorted({(r.op, r.direction) for r in results if r.provider != "copy"})
    providers = sorted({r.provider for r in results if r.provider != "copy"})
    shapes = sorted({(r.M, r.N) for r in results}, key=lambda s: (s[0] * s[1], s))
    cols = min(3, max(1, len(panels)))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    width = 0.8 / max(1, len(providers))
    for ax, (op, direction) in zip(axes.flat, panels, strict=False):
        for k, provider in enumerate(providers):
            by_shape = {
                (r.M, r.N): r.gbps
                for r in results
                if (r.op, r.direction, r.provider) == (op, direction, provider) and r.error is None
            }
            xs = [i + k * width for i, s in enumerate(shapes) if s in by_shape]
            ax.bar(xs, [by_shape[s] for s in shapes if s in by_shape], width, label=provider)
        copy = {(r.M, r.N): r.gbps for r in results if r.provider == "copy"}
        ax.plot(
            [i + 0.4 - width / 2 for i, s in enumerate(shapes) if s in copy],
            [copy[s] for s in shapes if s in copy],
            "k_",
            markersize=18,
            label="copy",
        )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
        ax.set_xticklabels([f"{m}x{n}" for m, n in shapes], rotation=30, fontsize=7)
        ax.set_title(f"{op} {direction}", fontsize=9)
        ax.set_ylabel("GB/s")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------
# Command line and report


def _shape(text: str) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is MxN, like 8192x4096; got {text!r}") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"shape sizes must be positive, got {text!r}")
    return m, n


def _shapes(text: str) -> list[tuple[int, int]]:
    return [_shape(s) for s in text.split(",") if s]


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s for s in text.split(",") if s]
        bad = [s for s in items if s not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
        return items

    return parse


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``bench`` subcommand to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "bench",
        help="CPU benchmarks against torch (ms, GB/s, ratios to torch and to copy)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--shapes", type=_shapes, help="MxN,MxN,... (default: the issue's shapes)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--ops", type=_choices(OPS), default=list(OPS), help="comma-separated")
    p.add_argument(
        "--directions", type=_choices(DIRECTIONS), default=list(DIRECTIONS), help="fwd,bwd,fwdbwd"
    )
    p.add_argument(
        "--providers",
        default="torch,layernorm",
        help="comma-separated: torch, layernorm, layernorm:BACKEND, compile "
        "(default torch,layernorm)",
    )
    p.add_argument("--compile", action="store_true", help="also time torch.compile (slow here)")
    p.add_argument("--repeat", type=int, default=10, help="samples per median (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="calls before timing (default 3)")
    p.add_argument("--threads", type=int, help="torch and numba thread count")
    p.add_argument("--json", type=Path, help="write the results and the machine here")
    p.add_argument("--out", type=Path, help="folder for the PNG plot")
    p.add_argument("--quick", action="store_true", help="small shapes, a fast smoke run")
    p.set_defaults(func=_main)
    return p


def _main(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        print(f"layernorm bench: error: --repeat must be >= 1, got {args.repeat}", file=sys.stderr)
        return 2
    set_threads(args.threads)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else ISSUE_SHAPES)
    providers = [p for p in args.providers.split(",") if p]
    if args.compile and "compile" not in providers:
        providers.append("compile")
    results = run(
        shapes,
        args.ops,
        args.directions,
        args.dtype,
        providers,
        repeat=args.repeat,
        warmup=args.warmup,
        progress=sys.stderr.isatty(),
    )
    info = machine_info()
    print(", ".join(f"{k}={v}" for k, v in info.items()))
    print(format_table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "machine": info,
            "command": " ".join(sys.argv),
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")
    if args.out is not None:
        print(f"wrote {plot(results, args.out / 'bench.png')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``layernorm bench`` as a standalone program (used by ``benchmarks/harness.py``)."""
    parser = argparse.ArgumentParser(prog="layernorm")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


def report_section(out_dir: Path, quick: bool) -> str:
    """An HTML fragment for ``layernorm report``: a small benchmark table and its plot.

    ``quick`` runs two shapes, forward and backward of layer_norm only (seconds, plus the
    numba kernels' first compile); otherwise :data:`REPORT_SHAPES`, every op, forward and
    backward (about a minute).
    """
    from ._html import img_tag, table

    shapes: Sequence[tuple[int, int]]
    ops: Sequence[str]
    if quick:
        shapes, ops = ((512, 1024), (2048, 2048)), ("layer_norm",)
    else:
        shapes, ops = REPORT_SHAPES, OPS
    directions, repeat = ("fwd", "bwd"), 10
    results = run(shapes, ops, directions, "float32", ("torch", "layernorm"), repeat, 2, False)
    png = plot(results, Path(out_dir) / "bench.png")
    rows = [
        (
            r.op,
            r.direction,
            f"{r.M}x{r.N}",
            r.provider,
            f"{r.ms:.3f}",
            f"{r.gbps:.1f}",
            "" if r.vs_torch is None else f"{r.vs_torch:.2f}x",
            "" if r.of_copy is None else f"{r.of_copy:.2f}",
        )
        for r in results
        if r.error is None
    ]
    info = machine_info()
    return (
        "<p>float32 on this machine ("
        + f"{info.get('cpu', '?')}, {info['torch_threads']} torch threads"
        + "): median of 10 samples, side by side in one process. GB/s from stated byte "
        + "counts (forward 2 tensors, backward 3; add_layer_norm 4 and 4); compiled "
        + f"dispatch {html.escape(str(info['compiled_dispatch']))}; <em>vs torch</em> "
        + "is torch eager's time over ours, <em>of copy</em> our GB/s over "
        + "<code>out.copy_(x)</code>'s into a preallocated tensor. Every call returns new "
        + "tensors: torch's come from fresh pages (cleared by Linux on first touch), ours "
        + "from the memory of outputs that have died (layernorm's host cache, 1 MiB and up)."
        + "</p>"
        + table(["op", "dir", "M x N", "provider", "ms", "GB/s", "vs torch", "of copy"], rows)
        + img_tag(png, "benchmark plot")
    )


if __name__ == "__main__":
    raise SystemExit(main())
