"""Dropout keep-masks on the CPU: the Philox generator of docs/contract.md §7 (numba and
torch) against torch's own generators, timed side by side in one process.

    PYTHONPATH=src python benchmarks/dropout_masks.py --threads 2 --repeat 15

Providers, each writing a keep-mask of the shape into a preallocated tensor where it can:

- ``numba philox``: ``_numba_philox.keep_rows`` (numba's threads);
- ``torch philox``: ``_philox.keep_mask`` (the same bits in torch int64 operations);
- ``torch.rand > p``: ``torch.rand(out=...) > p`` (torch's CPU Mersenne twister);
- ``bernoulli_``: ``empty.bernoulli_(1 - p)``, what ``F.dropout`` draws on the CPU.

Providers are interleaved round by round and the median of each is printed with its
ratio to ``torch.rand > p`` (above 1: faster). Absolute times on the shared machine move
by ±30 %; ratios within one run are steadier. ``--json`` saves the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numba
import numpy as np
import torch

from layernorm.backends import _numba_philox, _philox


def providers(n_rows: int, n_cols: int, p: float) -> dict[str, Callable[[], object]]:
    seed = 1234
    k0, k1 = _philox.seed_key(seed)
    p32 = np.float32(_philox.threshold(p))
    mask = np.empty((n_rows, n_cols), np.bool_)
    floats = torch.empty(n_rows, n_cols)
    return {
        "numba philox": lambda: _numba_philox.keep_rows(k0, k1, 0, p32, mask),
        "torch philox": lambda: _philox.keep_mask(seed, n_rows, n_cols, p),
        "torch.rand > p": lambda: torch.rand(n_rows, n_cols, out=floats) > p,
        "bernoulli_": lambda: floats.bernoulli_(1 - p),
    }


def measure(n_rows: int, n_cols: int, p: float, repeat: int) -> dict[str, float]:
    """Median seconds per call of each provider, interleaved ``repeat`` rounds."""
    calls = providers(n_rows, n_cols, p)
    for call in calls.values():  # compile, warm the caches
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x1024,1024x4096", help="MxN,MxN,...")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", help="write the medians to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    results = []
    for shape in args.shapes.split(","):
        n_rows, n_cols = (int(v) for v in shape.split("x"))
        medians = measure(n_rows, n_cols, args.p, args.repeat)
        base = medians["torch.rand > p"]
        print(f"{n_rows}x{n_cols}, p={args.p}, {args.threads} threads")
        for name, seconds in medians.items():
            ns = seconds / (n_rows * n_cols) * 1e9
            print(
                f"  {name:16s} {seconds * 1e3:9.3f} ms  {ns:6.2f} ns/elem  x{base / seconds:5.2f}"
            )
        results.append({"shape": [n_rows, n_cols], "p": args.p, "seconds": medians})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "repeat": args.repeat, "results": results}, f)


if __name__ == "__main__":
    main()
