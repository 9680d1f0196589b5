"""One layer_norm call in a loop, in a process of its own: microseconds per call.

    PYTHONPATH=src python benchmarks/call_loop.py 1024x768 200 [bwd]

Shape, number of timed calls (after 5 untimed ones), and ``bwd`` for a forward plus
``torch.autograd.grad`` (else an inference forward). For A/B runs of two source trees,
alternate the two processes and compare medians (benchmarks/RESULTS.md, "Threads").
"""

import sys
import time

import torch

import layernorm


def main(argv: list[str]) -> int:
    shape = tuple(int(v) for v in argv[0].split("x"))
    reps, backward = int(argv[1]), len(argv) > 2 and argv[2] == "bwd"
    n = shape[-1]
    x, w, b = (torch.randn(s, requires_grad=backward) for s in (shape, (n,), (n,)))
    dy = torch.randn(shape)

    def step() -> None:
        if backward:
            y = layernorm.layer_norm(x, n, w, b)
            torch.autograd.grad(y, (x, w, b), dy)
        else:
            with torch.no_grad():
                layernorm.layer_norm(x, n, w, b)

    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    print(f"{(time.perf_counter() - start) / reps * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
