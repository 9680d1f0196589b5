"""The two-input block's sum alone: ``dropout_add(x, x1, r)`` at ``p = 0`` (numba's entry,
``h = RN(x + x1 + r)`` rounded once) against torch's ``x + x1 + r`` (two roundings).

    PYTHONPATH=src python benchmarks/x1_sum.py [--rounds 7]

1 thread, the process's CPU clock, round-robin in one process (``small_calls.rr``).
"""

from __future__ import annotations

import argparse
import time

import numba
import torch
from small_calls import rr

from layernorm.backends import _numba_dropout


def measure(shape: tuple[int, int], dtype: torch.dtype, rounds: int) -> str:
    x, x1, r = (torch.randn(*shape).to(dtype) for _ in range(3))
    inner = max(3, min(200, 2_000_000 // (2 * x.numel())))
    t = rr(
        {
            "torch": lambda: x + x1 + r,
            "ours": lambda: _numba_dropout.dropout_add(x, x1, r, None, 0, 0.0, dtype, False),
        },
        rounds,
        inner=inner,
        clock=time.process_time_ns,
    )
    per = t["ours"] * 1e3 / x.numel()
    return (
        f"x + x1 + r {shape} {str(dtype)[6:]}: torch {t['torch']:.1f}, ours {t['ours']:.1f} us "
        f"({per:.2f} ns an element)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    for shape in ((64, 1024), (4096, 1024)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            print(measure(shape, dtype, args.rounds), flush=True)
