"""The ``layernorm`` command: explain, check, report, build, bench, experiment.

Thin by design: each subcommand parses its arguments and calls the library.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ._extras import MissingExtra

__all__ = ["main"]

# Subcommands that live beside the library's own modules: module -> its add_parser.
_PLUGINS = (
    "layernorm.report.benchmark",
    "layernorm.report.experiments",
    "layernorm.report.model_bench",
)


def _numbers(text: str) -> float:
    from .explain import parse_number

    try:
        return parse_number(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _explain(args: argparse.Namespace) -> int:
    from .explain import explain, format_explanation

    try:
        e = explain(args.z, args.eps, args.gamma, args.beta)
    except ValueError as error:
        print(f"layernorm explain: error: {error}", file=sys.stderr)
        return 2
    print(format_explanation(e))
    return 0


def _check(args: argparse.Namespace) -> int:
    from .checks import backends_to_check, run_checks

    names = args.backend or backends_to_check()
    results = run_checks(names, progress=sys.stderr.isatty())
    width = max(len(r.check) for r in results)
    bwidth = max(len(r.backend) for r in results)
    print(f"{'check':<{width}}  {'backend':<{bwidth}}  result  measured")
    for r in results:
        verdict = "pass" if r.passed else "FAIL"
        print(f"{r.check:<{width}}  {r.backend:<{bwidth}}  {verdict:<6}  {r.measured}")
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    path = write_report(
        Path(args.out),
        quick=args.quick,
        bench=not args.no_bench,
        experiments=not args.no_experiments,
    )
    print(f"wrote {path}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from .backends import numba_
    from .compiled import build

    # first: they are what a cold process waits for; on every core
    kernels = numba_.build(numba_.build_processes())
    kernel_line = f"numba kernels ({', '.join(kernels)}) {numba_.cache_location()}"
    start = time.perf_counter()
    try:
        path = build(verbose=args.verbose, progress=sys.stderr.isatty())
    except RuntimeError as error:
        print(kernel_line)
        print(f"layernorm build: error: {error}", file=sys.stderr)
        return 1
    print(f"built {path} in {time.perf_counter() - start:.0f} s")
    print(kernel_line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layernorm", description="Exact, fast and inspectable layer normalization."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain", help="layer norm of one vector, step by step")
    p.add_argument(
        "z", nargs="+", type=_numbers, help="the vector (decimals or fractions like 1/3)"
    )
    p.add_argument("--eps", type=_numbers, default=1e-5, help="stabilizer (default 1e-5)")
    p.add_argument("--gamma", nargs="+", type=_numbers, help="gain, one number per element")
    p.add_argument("--beta", nargs="+", type=_numbers, help="bias, one number per element")
    p.set_defaults(func=_explain)

    p = sub.add_parser("check", help="verify every backend against the reference and the seeds")
    p.add_argument("--backend", action="append", help="check only this backend (repeatable)")
    p.set_defaults(func=_check)

    p = sub.add_parser("report", help="write one self-contained HTML report")
    p.add_argument(
        "--out", default="layernorm-report", help="output folder (default layernorm-report)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a fast smoke version")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark section")
    p.add_argument("--no-experiments", action="store_true", help="skip the experiments section")
    p.set_defaults(func=_report)

    p = sub.add_parser(
        "build",
        help="compile the kernels and the compiled dispatch (once per machine)",
        description="Compiles every numba kernel of every dtype into the on-disk cache (so "
        "that no later process waits seconds for a first call's JIT), then builds "
        "layernorm's compiled dispatch, a small C++ extension that runs the common small "
        "call without Python in between (needs a C++ compiler and ninja: pip install "
        "'layernorm[build]'). Both go to LAYERNORM_CACHE_DIR (default ~/.cache/layernorm; "
        "the kernels to NUMBA_CACHE_DIR if set); every later process uses them. Safe to run "
        "while other processes start: they share the cache under a file lock.",
    )
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.set_defaults(func=_build)

    for module in _PLUGINS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except MissingExtra as error:
        print(f"layernorm {args.command}: error: {error}", file=sys.stderr)
        return 1
