"""A new process's first calls: what a server or a job waits for before its first step.

    PYTHONPATH=src python benchmarks/cold_start.py [--torch] [--quiet]

In one fresh process: for float32, bfloat16, float16 and float64, the first forward and
the first backward (``torch.autograd.grad``) of layer_norm, rms_norm and add_layer_norm
on a model-sized input (8x128x768: the threaded kernels) and a small one (2x768: the
serial kernels), each timed on its own, then the same call again (warm). Prints one line
per call: seconds for the first call and for the second. ``--torch`` runs torch's own
functions instead (``F.layer_norm``, ``F.rms_norm``, ``F.layer_norm(x + r)``).

Time the whole process from outside (``/usr/bin/time -v``) for the total; run it with
``LAYERNORM_CACHE_DIR`` set to an empty folder for a cold cache, without it after
``layernorm build`` for a warm one.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SHAPES = ((8, 128, 768), (2, 768))


def _calls(use_torch: bool):
    if use_torch:
        return {
            "layer_norm": lambda x, r, w, b: F.layer_norm(x, (768,), w, b),
            "rms_norm": lambda x, r, w, b: F.rms_norm(x, (768,), w),
            "add_layer_norm": lambda x, r, w, b: F.layer_norm(x + r, (768,), w, b),
        }
    import layernorm

    return {
        "layer_norm": lambda x, r, w, b: layernorm.layer_norm(x, 768, w, b),
        "rms_norm": lambda x, r, w, b: layernorm.rms_norm(x, 768, w),
        "add_layer_norm": lambda x, r, w, b: layernorm.add_layer_norm(x, r, 768, w, b)[0],
    }


def main(argv: list[str]) -> int:
    use_torch = "--torch" in argv
    quiet = "--quiet" in argv
    start = time.perf_counter()
    calls = _calls(use_torch)
    worst = 0.0
    for dtype in DTYPES:
        for name, call in calls.items():
            for shape in SHAPES:
                x, r = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(2))
                w = torch.ones(768, dtype=dtype, requires_grad=True)
                b = torch.zeros(768, dtype=dtype, requires_grad=True)
                times = []
                for direction in ("forward", "backward"):
                    for _ in range(2):  # first, then warm
                        t0 = time.perf_counter()
                        with torch.no_grad() if direction == "forward" else torch.enable_grad():
                            y = call(x, r, w, b)
                        if direction == "backward":
                            torch.autograd.grad(y, (x, w), torch.ones_like(y))
                        times.append(time.perf_counter() - t0)
                worst = max(worst, times[0] - times[1], times[2] - times[3])
                if not quiet:
                    print(
                        f"{str(dtype)[6:]:<9} {name:<15} {'x'.join(map(str, shape)):<9} "
                        f"forward {times[0]:.3f} s (warm {times[1]:.4f} s)  "
                        f"backward {times[2]:.3f} s (warm {times[3]:.4f} s)"
                    )
    print(
        f"first calls: {time.perf_counter() - start:.2f} s in all; the worst first call "
        f"cost {worst:.2f} s more than a warm one"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
