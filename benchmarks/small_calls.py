"""Per-call cost of small layer_norm calls against torch's, in one process.

    PYTHONPATH=src python benchmarks/small_calls.py [--breakdown]

Inference (no grad) and with grad (inputs require grad; the forward only), for a few
small shapes: the median over 31 rounds of the mean of 2000 (1000) calls, the two
providers interleaved round by round. Prints microseconds a call and torch's time over
ours. (The harness times such calls in ~1 ms batches, whose medians move more.)

``--breakdown`` also times, interleaved with those, the parts of an inference call: the
argument checks (``ops._common_call``), the numba backend's ``forward`` alone, and the
allocation plus the kernel call alone; and single tensor attribute reads, which is what
the checks are made of.
"""

import statistics
import sys
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


def breakdown(shape: tuple[int, ...]) -> str:
    from layernorm import ops
    from layernorm.backends import _numba_kernels, numba_

    n = shape[-1]
    x, w, b = torch.randn(*shape), torch.randn(n), torch.randn(n)
    m, types = x.numel() // n, numba_._TYPES[torch.float32]

    def kernel_call():  # the allocation and the kernel on addresses, nothing else
        y = torch.empty_like(x)
        a = x.data_ptr()
        _numba_kernels.forward_serial(
            types.storage, types.acc, a, n, a, 0, False, a, w.data_ptr(), b.data_ptr(),
            y.data_ptr(), a, a, m, n, 1e-5, False, False, False,
        )  # fmt: skip
        return y

    with torch.no_grad():
        r = rr(
            {
                "torch": lambda: F.layer_norm(x, (n,), w, b),
                "ours": lambda: layernorm.layer_norm(x, (n,), w, b),
                "checks": lambda: ops._common_call(x, None, (n,), w, b, 1e-5, None),
                "backend": lambda: numba_.forward(x, None, w, b, 1e-5, False, stats=False),
                "kernel call": kernel_call,
            }
        )
    return f"{shape}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) + " us"


def attributes() -> str:
    x = torch.randn(4, 64)
    r = rr(
        {
            "x.shape": lambda: x.shape,
            "x.dtype": lambda: x.dtype,
            "x.is_cpu": lambda: x.is_cpu,
            "x.is_contiguous()": lambda: x.is_contiguous(),
            "x.is_floating_point()": lambda: x.is_floating_point(),
            "x.data_ptr()": lambda: x.data_ptr(),
            "torch.empty_like(x)": lambda: torch.empty_like(x),
            "(an empty lambda)": lambda: None,
        },
        inner=5000,
    )
    return "attribute reads: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) + " us"


if __name__ == "__main__":
    torch.set_num_threads(2)
    numba.set_num_threads(2)
    for shape in [(4, 64), (1, 1, 768), (8, 128, 64)]:
        print(measure(shape))
    if "--breakdown" in sys.argv[1:]:
        for shape in [(4, 64), (1, 1, 768)]:
            print(breakdown(shape))
        print(attributes())
