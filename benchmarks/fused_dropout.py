"""fused_norm's dropout-add-norm against torch's unfused composition, on the CPU.

    PYTHONPATH=src python benchmarks/fused_dropout.py [--repeats 30] [--threads 1] [--backward]

Per shape and dtype, interleaved in one process (A, B, A, B, ...), the median time of
``layernorm.fused_norm(x, N, w, b, residual=r, dropout_p=0.1, seed=...)`` (each
backend's dropout-add: ``backend=None`` is the automatic choice, numba on the CPU where
it has one; ``"torch"``, the portable one) and of ``F.layer_norm(F.dropout(x, 0.1) + r,
...)``; the ratio is torch's time over ours (> 1: fused_norm is faster). With
``--backward``: forward plus ``torch.autograd.grad`` of ``(y·g).sum()`` for x, r, w, b.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import layernorm


def _timer(fn):
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def cases(m: int, n: int, dtype: torch.dtype, backward: bool):
    x = torch.randn(m, n).to(dtype)
    r = torch.randn(m, n).to(dtype)
    w = torch.rand(n).to(dtype) + 0.5
    b = torch.randn(n).to(dtype)
    g = torch.randn(m, n).to(dtype)
    if backward:
        for t in (x, r, w, b):
            t.requires_grad_()

    def ours(backend):
        def call():
            out = layernorm.fused_norm(
                x, n, w, b, residual=r, dropout_p=0.1, seed=1, backend=backend
            )
            if backward:
                torch.autograd.grad((out.y * g).sum(), (x, r, w, b))

        return call

    def unfused():
        y = F.layer_norm(F.dropout(x, 0.1) + r, (n,), w, b)
        if backward:
            torch.autograd.grad((y * g).sum(), (x, r, w, b))

    with torch.set_grad_enabled(backward):
        yield "fused_norm (auto)", ours(None)
        yield "fused_norm (torch)", ours("torch")
        yield "F.dropout + add + F.layer_norm", unfused


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, backward {args.backward}, medians of {args.repeats}")
    for m, n in ((64, 1024), (4096, 1024)):
        for dtype in (torch.float32, torch.bfloat16):
            with torch.set_grad_enabled(args.backward):
                named = list(cases(m, n, dtype, args.backward))
                timers = [_timer(fn) for _, fn in named]
                for t in timers:  # warm-up (numba compiles, caches)
                    t()
                    t()
                times: list[list[float]] = [[] for _ in timers]
                for _ in range(args.repeats):
                    for i, t in enumerate(timers):
                        times[i].append(t())
            medians = [statistics.median(ts) for ts in times]
            base = medians[-1]
            row = ", ".join(
                f"{name} {1e3 * med:.3f} ms (x{base / med:.2f})"
                for (name, _), med in zip(named, medians, strict=True)
            )
            print(f"({m}, {n}) {str(dtype)[6:]}: {row}")


if __name__ == "__main__":
    main()
