"""The fused dropout-add on the CPU: the numba kernel (``_numba_dropout.dropout_add``, the
exact sum rounded once, both masks from one Philox call) against torch's unfused
``F.dropout(x, p) + residual`` (and the portable torch version, ``_dropout_add``, for
scale), timed side by side in one process.

    PYTHONPATH=src python benchmarks/dropout_add.py --threads 1 --repeat 15

Providers, for ``x`` and ``residual`` of one dtype and shape, ``h`` in that dtype:

- ``numba``: ``_numba_dropout.dropout_add(x, None, residual, None, seed, p, dtype, False)``;
- ``numba +masks``: the same, writing the keep-mask too;
- ``torch unfused``: ``F.dropout(x, p) + residual`` (two passes, torch's bernoulli mask,
  rounded twice for 16-bit dtypes);
- ``torch exact``: ``_dropout_add.dropout_add`` (the same bits as numba, in torch ops).

Providers are interleaved round by round; the median of each is printed with the ratio
of ``torch unfused`` to it (above 1: faster than torch). ``--json`` saves the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from layernorm.backends import _dropout_add, _numba_dropout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def providers(x: torch.Tensor, residual: torch.Tensor, p: float) -> dict[str, Callable[[], object]]:
    dtype = x.dtype
    calls: dict[str, Callable[[], object]] = {
        "numba": lambda: _numba_dropout.dropout_add(x, None, residual, None, 7, p, dtype, False),
        "numba +masks": lambda: _numba_dropout.dropout_add(
            x, None, residual, None, 7, p, dtype, True
        ),
        "torch unfused": lambda: F.dropout(x, p) + residual,
    }
    if x.numel() <= 1 << 16:  # the portable version is slow: small shapes only
        calls["torch exact"] = lambda: _dropout_add.dropout_add(
            x, None, residual, None, 7, p, dtype, False
        )
    return calls


def measure(shape: tuple[int, int], dtype: torch.dtype, p: float, repeat: int) -> dict[str, float]:
    """Median seconds per call of each provider, interleaved ``repeat`` rounds."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    calls = providers(x, residual, p)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--json", help="save the medians to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for rows in (4096, 64):
        for name, dtype in DTYPES.items():
            medians = measure((rows, 1024), dtype, args.p, args.repeat)
            base = medians["torch unfused"]
            print(f"({rows}, 1024) {name}, p={args.p}, {args.threads} thread(s):")
            for provider, seconds in medians.items():
                print(f"  {provider:14s} {seconds * 1e3:9.3f} ms   torch unfused / this: "
                      f"{base / seconds:5.2f}")  # fmt: skip
            results.append({"shape": [rows, 1024], "dtype": name, "p": args.p,
                            "threads": args.threads, "median_s": medians})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
