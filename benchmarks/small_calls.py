"""Per-call cost of small layer_norm calls against torch's, in one process.

    PYTHONPATH=src python benchmarks/small_calls.py

Inference (no grad) and with grad (inputs require grad; the forward only), for a few
small shapes: the median over 31 rounds of the mean of 2000 (1000) calls, the two
providers interleaved round by round. Prints microseconds a call and torch's time over
ours. (The harness times such calls in ~1 ms batches, whose medians move more.)
"""

import statistics
import time

import numba
import torch
import torch.nn.functional as F

import layernorm


def rr(fs, rounds=31, inner=2000):
    """Median microseconds a call of each callable, round-robin over ``rounds`` rounds."""
    names = list(fs)
    res = {k: [] for k in names}
    for f in fs.values():
        for _ in range(300):
            f()
    for _ in range(rounds):
        for k in names:
            f = fs[k]
            t = time.perf_counter_ns()
            for _ in range(inner):
                f()
            res[k].append((time.perf_counter_ns() - t) / inner / 1000)
    return {k: statistics.median(v) for k, v in res.items()}


def measure(shape: tuple[int, ...]) -> str:
    n = shape[-1]
    x, w, b = torch.randn(*shape), torch.randn(n), torch.randn(n)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    with torch.no_grad():
        r = rr(
            {
                "torch": lambda: F.layer_norm(x, (n,), w, b),
                "ours": lambda: layernorm.layer_norm(x, (n,), w, b),
            }
        )
    g = rr(
        {
            "torch": lambda: F.layer_norm(xg, (n,), wg, bg),
            "ours": lambda: layernorm.layer_norm(xg, (n,), wg, bg),
        },
        inner=1000,
    )
    return (
        f"{shape}: inference torch {r['torch']:.1f} ours {r['ours']:.1f} us "
        f"({r['torch'] / r['ours']:.2f}x) | with grad torch {g['torch']:.1f} "
        f"ours {g['ours']:.1f} us ({g['torch'] / g['ours']:.2f}x)"
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    numba.set_num_threads(2)
    for shape in [(4, 64), (1, 1, 768), (8, 128, 64)]:
        print(measure(shape))
