"""How many rows the triton kernels leave for each stage, per dtype and width.

The forward and backward flag each row: settled by stage 1 (float64 and the bound), by
stage 2 (the sums again by extraction, on the device), or left open for the host's exact
fallback (``triton_._settle``, ``triton_._settle_backward``); the backward flags open
``_weight_terms`` scalars apart (``dweight`` recomputed by ``torch_.weight_gradient``).
On an H200 the float32 backward of rows of 128K-256K columns spent over a second a call
on the host (benchmarks/RESULTS.md, "The triton backend on an H200"): this counts which
stage and which path cost it. One call of each kernel per case, no host work::

    python benchmarks/gpu_open_rows.py                    # on a GPU, gpu_bench.py's shapes
    TRITON_INTERPRET=1 python benchmarks/gpu_open_rows.py --elements 4096 --widths 64 300

Rows are N(3, 1) in the dtype, as gpu_bench.py's; ``dy`` N(0, 1), weight N(1, 0.1).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from layernorm.backends import triton_

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WIDTHS = tuple(1024 << k for k in range(9))  # 1K .. 256K, gpu_bench.py's


def count(dtype: torch.dtype, m: int, n: int, device: str, rms: bool = False) -> dict:
    """Row counts of one forward and one backward of random rows (dx, dweight and dbias
    asked for)."""
    g = torch.Generator(device=device).manual_seed(n)
    x = (torch.randn(m, n, generator=g, device=device) + 3).to(dtype)
    dy = torch.randn(m, n, generator=g, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)
    b = None if rms else torch.zeros(n, device=device, dtype=dtype)
    return count_rows(x, dy, w, b, 1e-5, rms)


def count_rows(
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    dresidual: torch.Tensor | None = None,
) -> dict:
    """Row counts of one forward and one backward of ``(M, N)`` rows by the kernels'
    flags, no host work; ``dweight`` (and ``dbias`` with a bias) asked for."""
    kernels = triton_._kernels()
    with triton_._quiet(kernels):
        _, _, mean, _, flags = triton_._launch_forward(kernels, x, None, weight, bias, eps, rms)
        back = triton_._backward(
            kernels, dy, x, weight, mean, dresidual, rms, True, bias is not None, eps
        )[-1]
    forward = Counter(flags.tolist())
    return {
        "rows": x.shape[0],
        "forward stage 2": forward[2],
        "forward host": forward[1],
        "backward stage 2": int(((back & 3) == 2).sum()),
        "backward host (dx rows)": int(((back & 3) == 1).sum()),
        "backward host (dweight scalars)": int((back >= 4).sum()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--elements", type=int, default=1 << 28, help="M·N of each case")
    parser.add_argument("--rms", action="store_true", help="RMSNorm instead of layer norm")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if reason := triton_.cannot_run(torch.empty(0, device=device)):
        sys.exit(f"gpu_open_rows.py: {reason}")
    header = None
    for name in args.dtypes:
        for n in args.widths:
            counts = count(DTYPES[name], max(1, args.elements // n), n, device, args.rms)
            if header is None:
                header = ["dtype", "N", *counts]
                print("| " + " | ".join(header) + " |")
                print("|" + "---|" * len(header))
            print("| " + " | ".join([name, str(n), *map(str, counts.values())]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
