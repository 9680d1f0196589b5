"""GPU benchmark: layer norm (or RMSNorm) forward, backward and forward+backward.

One command, under 5 minutes on one GPU::

    python benchmarks/gpu_bench.py                      # layer_norm, bf16 and fp32, N = 1K..256K
    python benchmarks/gpu_bench.py --op rms_norm
    python benchmarks/gpu_bench.py --dry-run            # the plan only; needs no GPU

For each dtype and width N (1K to 256K, M·N = 2^28 elements) it times, side by side in
one process, this library's triton backend, torch eager, torch.compile, and
liger-kernel / quack-kernels when they are installed, and a device-to-device copy of
the same tensor (``y.copy_(x)``), the practical roofline. Bandwidth counts the bytes a
perfect kernel must move: forward reads x and writes y (2·M·N elements), backward reads
x and dy and writes dx (3·M·N), forward+backward 5·M·N; weights and per-row statistics
are ignored. Each figure is reported in GB/s and as a fraction of the copy's GB/s.

Our forward is correctly rounded (float64 arithmetic, docs/contract.md §3) and reads one
value per call from the device (whether a row is left for the host's exact fallback), so
its timings include that synchronization.

Times are medians of CUDA-event timings after warm-up. Providers run in order of
importance: ours and torch eager on every shape first, then liger, quack and
torch.compile (whose per-shape compilation is the slow part) shape by shape; when
``--budget-s`` runs out, the remaining cells are reported as skipped instead of running
past the limit. Results: a Markdown table on
stdout and JSON in ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import layernorm

TOTAL_ELEMENTS = 1 << 28
WIDTHS = tuple(1024 << k for k in range(9))  # 1K .. 256K
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("forward", "backward", "fwd+bwd")
#: elements moved per element of x by a perfect kernel (x, y | x, dy, dx | both)
PASSES = {"forward": 2, "backward": 3, "fwd+bwd": 5, "copy": 2}
PROVIDERS = ("layernorm", "torch", "torch.compile", "liger", "quack")
EPS = 1e-5
#: limits of the triton backend that --set may override (tuning runs)
TUNABLE = (
    "FUSED_FORWARD_N",
    "FUSED_BACKWARD_N",
    "CHUNK_N",
    "BACKWARD_CHUNK_N",
    "PARTIAL_ELEMENTS",
    "MIN_PROGRAMS",
    "MAX_PROGRAMS",
)


@dataclass
class Case:
    """One shape: M rows of width N in one dtype."""

    dtype_name: str
    n: int
    m: int = field(init=False)

    def __post_init__(self) -> None:
        self.m = max(1, TOTAL_ELEMENTS // self.n)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    def bytes_moved(self, mode: str) -> int:
        """Bytes a perfect kernel moves in ``mode`` ("forward", "backward", ..., "copy")."""
        return PASSES[mode] * self.m * self.n * self.dtype.itemsize


def plan(dtypes: list[str], widths: list[int]) -> list[Case]:
    return [Case(d, n) for d in dtypes for n in widths]


def installed(provider: str) -> bool:
    """Whether a provider's package is importable (without importing it)."""
    package = {"liger": "liger_kernel", "quack": "quack", "layernorm": "triton"}.get(provider)
    return package is None or importlib.util.find_spec(package) is not None


# ---------------------------------------------------------------------------------------
# Providers: each returns f(x, w, b) -> y for the op, with autograd.


def _provider_fn(provider: str, op: str) -> Callable:
    rms = op == "rms_norm"
    if provider == "layernorm":
        if rms:
            return lambda x, w, b: layernorm.rms_norm(x, x.shape[-1:], w, EPS, backend="triton")
        return lambda x, w, b: layernorm.layer_norm(x, x.shape[-1:], w, b, EPS, backend="triton")
    if provider in ("torch", "torch.compile"):
        if rms:
            fn = lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, EPS)  # noqa: E731
        else:
            fn = lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS)  # noqa: E731
        return fn if provider == "torch" else torch.compile(fn, dynamic=False)
    if provider == "liger":
        if rms:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w, b: LigerRMSNormFunction.apply(x, w, EPS)
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
    if provider == "quack":
        if rms:
            from quack.rmsnorm import rmsnorm

            return lambda x, w, b: rmsnorm(x, w, eps=EPS)
        import quack.layernorm as quack_layernorm

        if hasattr(quack_layernorm, "layernorm"):
            return lambda x, w, b: quack_layernorm.layernorm(x, w, eps=EPS)
        # older quack: a forward-only function taking a float32 weight, no bias
        return lambda x, w, b: quack_layernorm._layernorm_fwd(x, w.float(), EPS)
    raise ValueError(f"unknown provider {provider!r}")


# ---------------------------------------------------------------------------------------
# Timing


def time_ms(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    reps = max(5, min(200, int(rep_ms / estimate)))
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for begin, finish in events:
        begin.record()
        fn()
        finish.record()
    torch.cuda.synchronize()
    return statistics.median(b.elapsed_time(f) for b, f in events)


def measure_case(
    case: Case,
    op: str,
    provider: str,
    tensors: dict[str, torch.Tensor],
    timer: Callable[[Callable[[], object]], float] = time_ms,
) -> dict[str, float | str]:
    """Milliseconds per mode for one provider on one shape, or an error string."""
    x, w, b, dy = tensors["x"], tensors["w"], tensors["b"], tensors["dy"]
    fn = _provider_fn(provider, op)
    params = [w] if op == "rms_norm" else [w, b]
    inputs = [x, *params]
    out: dict[str, float | str] = {}
    with torch.no_grad():
        out["forward"] = timer(lambda: fn(x, w, b))
    y = fn(x, w, b)
    if not y.requires_grad:
        out["backward"] = out["fwd+bwd"] = "no backward"
        return out
    out["backward"] = timer(lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True))
    out["fwd+bwd"] = timer(lambda: torch.autograd.grad(fn(x, w, b), inputs, dy))
    return out


def run(
    args: argparse.Namespace,
    device: str = "cuda",
    timer: Callable[[Callable[[], object]], float] = time_ms,
) -> list[dict]:
    """Measures every (provider, shape) cell; ``device`` and ``timer`` exist for tests."""
    from layernorm.backends import triton_

    for name, value in args.overrides.items():
        setattr(triton_, name, value)
    deadline = time.monotonic() + args.budget_s
    import torch._dynamo as dynamo

    dynamo.config.cache_size_limit = 256  # one static compile per shape
    if hasattr(dynamo.config, "recompile_limit"):
        dynamo.config.recompile_limit = 256
    cases = plan(args.dtypes, args.widths)
    rows = {(c.dtype_name, c.n): {"case": c, "ms": {}} for c in cases}
    ready = [p for p in args.providers if installed(p)]
    for p in sorted(set(args.providers) - set(ready)):
        print(f"# {p}: not installed, skipped", file=sys.stderr)
    # ours and torch eager on every shape first, then the others shape by shape
    first = [p for p in ready if p in ("layernorm", "torch")]
    rest = [p for p in ready if p not in first]
    order = [(p, c) for p in first for c in cases] + [(p, c) for c in cases for p in rest]
    for provider, case in order:
        row = rows[(case.dtype_name, case.n)]
        if time.monotonic() > deadline:
            row["ms"][provider] = dict.fromkeys(MODES, "skipped (time budget)")
            continue
        tensors = _tensors(case, device)
        if "copy" not in row["ms"]:
            y = torch.empty_like(tensors["x"])
            row["ms"]["copy"] = timer(lambda y=y, x=tensors["x"]: y.copy_(x))
            del y
        try:
            row["ms"][provider] = measure_case(case, args.op, provider, tensors, timer)
        except Exception as error:  # a provider that refuses a shape or a dtype
            message = f"error: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
            row["ms"][provider] = dict.fromkeys(MODES, message)
        del tensors
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"# {provider} {case.dtype_name} N={case.n}: {row['ms'][provider]}", file=sys.stderr)
    return [_result(args, row["case"], row["ms"]) for row in rows.values()]


def _tensors(case: Case, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (case.m, case.n)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, device=device, generator=gen)

    # parameters in the input dtype, as in a bf16 model
    return {
        "x": randn(*shape).to(case.dtype).requires_grad_(True),
        "w": (1 + 0.1 * randn(case.n)).to(case.dtype).requires_grad_(True),
        "b": (0.1 * randn(case.n)).to(case.dtype).requires_grad_(True),
        "dy": randn(*shape).to(case.dtype),
    }


def _result(args: argparse.Namespace, case: Case, ms: dict) -> dict:
    copy_ms = ms.get("copy")
    copy_gbs = case.bytes_moved("copy") / copy_ms / 1e6 if isinstance(copy_ms, float) else None
    cells = {}
    for provider, modes in ms.items():
        if provider == "copy":
            continue
        for mode, value in modes.items():
            if isinstance(value, float):
                gbs = case.bytes_moved(mode) / value / 1e6
                frac = gbs / copy_gbs if copy_gbs else None
                cells[f"{provider}/{mode}"] = {"ms": value, "GB/s": gbs, "of_copy": frac}
            else:
                cells[f"{provider}/{mode}"] = {"note": value}
    return {
        "op": args.op,
        "dtype": case.dtype_name,
        "N": case.n,
        "M": case.m,
        "copy_GB/s": copy_gbs,
        "cells": cells,
    }


# ---------------------------------------------------------------------------------------
# Output


def markdown(results: list[dict], providers: list[str]) -> str:
    lines = []
    for mode in MODES:
        lines.append(f"\n### {mode}: GB/s (fraction of copy)\n")
        versus = "layernorm" in providers and "torch" in providers
        header = ["dtype", "N", "M", "copy GB/s", *providers] + (["vs torch"] if versus else [])
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for r in results:
            row = [r["dtype"], str(r["N"]), str(r["M"]), _fmt(r["copy_GB/s"])]
            for p in providers:
                cell = r["cells"].get(f"{p}/{mode}")
                if cell is None:
                    row.append("n/a")
                elif "note" in cell:
                    row.append(cell["note"])
                else:
                    frac = f" ({cell['of_copy']:.0%})" if cell["of_copy"] else ""
                    row.append(f"{cell['GB/s']:.0f}{frac}")
            if versus:
                ours, theirs = (r["cells"].get(f"{p}/{mode}", {}) for p in ("layernorm", "torch"))
                ratio = theirs.get("ms", 0) / ours["ms"] if "ms" in ours else 0
                row.append(f"{ratio:.2f}x" if ratio else "n/a")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def print_plan(args: argparse.Namespace) -> None:
    cases = plan(args.dtypes, args.widths)
    print(f"op: {args.op}; modes: {', '.join(MODES)}; time budget: {args.budget_s:.0f} s")
    print("providers: " + ", ".join(
        f"{p}{'' if installed(p) else ' (not installed: skipped)'}" for p in args.providers
    ))  # fmt: skip
    if args.overrides:
        print("triton_ overrides: " + ", ".join(f"{k}={v}" for k, v in args.overrides.items()))
    print(f"{'dtype':>5} {'N':>7} {'M':>7} {'M*N':>10} {'x MiB':>7} "
          f"{'fwd MB':>8} {'bwd MB':>8} {'copy MB':>8}")  # fmt: skip
    for c in cases:
        print(
            f"{c.dtype_name:>5} {c.n:>7} {c.m:>7} {c.m * c.n:>10} "
            f"{c.m * c.n * c.dtype.itemsize / 2**20:>7.0f} "
            f"{c.bytes_moved('forward') / 1e6:>8.0f} {c.bytes_moved('backward') / 1e6:>8.0f} "
            f"{c.bytes_moved('copy') / 1e6:>8.0f}"
        )
    peak = max(c.m * c.n * c.dtype.itemsize for c in cases) if cases else 0
    print(f"peak device memory: about {8 * peak / 2**30:.1f} GiB (x, dy, y, dx, copies)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=["layer_norm", "rms_norm"], default="layer_norm")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="stop starting new measurements after this many seconds")  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("gpu_bench.json"))
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="override a limit of layernorm.backends.triton_ (e.g. FUSED_BACKWARD_N=16384)",
    )
    args = parser.parse_args(argv)
    args.overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in TUNABLE or not value.lstrip("-").isdigit():
            parser.error(f"--set takes NAME=INT with NAME in {', '.join(TUNABLE)}; got {item!r}")
        args.overrides[name] = int(value)
    if any(n < 1 or n > TOTAL_ELEMENTS for n in args.widths):
        parser.error(f"widths must be between 1 and {TOTAL_ELEMENTS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print_plan(args)
        return 0
    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py needs a CUDA device (use --dry-run to see the plan)")
    started = time.monotonic()
    results = run(args)
    table = markdown(results, [p for p in args.providers if installed(p)])
    device = torch.cuda.get_device_name()
    header = (
        f"## {args.op} on {device} (torch {torch.__version__}, "
        f"{time.monotonic() - started:.0f} s)\n"
    )
    print(header + table)
    meta = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "overrides": args.overrides,
    }
    for name in ("triton", "liger_kernel", "quack"):
        if importlib.util.find_spec(name) is not None:
            module = __import__(name)
            meta[name] = getattr(module, "__version__", "?")
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\nJSON: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
