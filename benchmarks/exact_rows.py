"""The host's exact fallback, one row at a time: what a flagged row costs.

    PYTHONPATH=src python benchmarks/exact_rows.py [--widths 768,1024,4096,32768]

Times ``_exact.fix_forward_row``, ``_exact.fix_backward_row`` (layer_norm, float32) and
``_exact.weight_scalars`` on one random float32 row of each width (z N(0, 3) + 100, dy and
gamma N(0, 1)), medians of 9 calls, milliseconds. Run it in two source trees for a before
and after (benchmarks/RESULTS.md, "The exact fallback's sums").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from layernorm.backends import _exact


def _median_ms(call: Callable[[], object], rounds: int = 9) -> float:
    spent = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="768,1024,4096,32768")
    args = parser.parse_args()
    print("| N | fix_forward_row | fix_backward_row | weight_scalars |")
    print("|---:|---:|---:|---:|")
    for n in (int(w) for w in args.widths.split(",")):
        g = torch.Generator().manual_seed(n)
        z = (torch.randn(n, generator=g) * 3 + 100).double().numpy()
        dy, gamma = (torch.randn(n, generator=g).double().numpy() for _ in range(2))
        beta, rho = np.zeros(n), np.full(n, -0.0)
        calls = (
            lambda z=z, g=gamma, b=beta: _exact.fix_forward_row(
                z, g, b, 1e-5, False, torch.float32
            ),
            lambda z=z, gh=dy * gamma, r=rho: _exact.fix_backward_row(
                z, gh, r, 1e-5, False, torch.float32
            ),
            lambda z=z: _exact.weight_scalars(z, 1e-5, False),
        )
        times = [_median_ms(call) for call in calls]
        print(f"| {n} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
