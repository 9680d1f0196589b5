"""Per-call cost of small calls against torch's, in one process.

    PYTHONPATH=src python benchmarks/small_calls.py [--breakdown] [--dtype bfloat16] [--rounds R]
        [--ops layer_norm,rms_norm,add_layer_norm,add_rms_norm] [--threads T]
        [--shapes 4x64,1x1x768,8x128x64,64x1024] [--clock cpu]

For each op on a few small shapes: inference (no grad), the forward with grad (inputs
require grad), and forward plus backward (``torch.autograd.grad`` of every leaf). Torch's
side of ``add_*`` is ``h = x + r`` then its norm. Each is the median over 31 rounds of the
mean of a batch of calls, the providers interleaved round by round: torch, ours (through
the C++ front door when the C++ part is built: ``layernorm build``), and ours "via the
op" (the front door switched off for the batch: Python's checks, then the op through
torch's dispatcher, whose C++ kernels run it where built). Prints microseconds a call and
torch's time over ours. (A process with ``LAYERNORM_COMPILED=0`` measures the op's
Python kernels and autograd instead.)

``--dtype`` picks the inputs' and parameters' dtype (float32 by default; bfloat16 and
float16 work the same); ``--rounds`` the rounds per median (31 by default); ``--threads``
torch's (and so the kernels') thread count (2 by default); ``--shapes`` the input shapes;
``--clock cpu`` times on the process's CPU clock (on a machine shared with other work)
instead of the wall clock.
``--breakdown`` also times, interleaved with those, the parts of an inference call
through Python: the numba backend's ``forward`` alone, and the allocation plus the kernel
call alone; and single tensor attribute reads.
"""

import argparse
import contextlib
import statistics
import time

import numba
import torch
import torch.nn.functional as F

import layernorm
from layernorm import compiled


def rr(fs, rounds=31, inner=2000, clock=time.perf_counter_ns):
    """Median microseconds a call of each callable, round-robin over ``rounds`` rounds,
    on ``clock`` (nanoseconds; ``time.process_time_ns`` for CPU time). A name ending in
    "via the op" runs with the C++ front door switched off."""
    names = list(fs)
    res = {k: [] for k in names}
    for k in names:
        with _python_only(k.endswith("via the op")):
            for _ in range(300):
                fs[k]()
    for _ in range(rounds):
        for k in names:
            f = fs[k]
            with _python_only(k.endswith("via the op")):
                t = clock()
                for _ in range(inner):
                    f()
                res[k].append((clock() - t) / inner / 1000)
    return {k: statistics.median(v) for k, v in res.items()}


@contextlib.contextmanager
def _python_only(python: bool):
    saved = compiled.norm
    if python:
        compiled.norm = lambda *args: None
    try:
        yield
    finally:
        compiled.norm = saved


def _calls(op: str, n: int, x, r, w, b):
    """(torch's call, ours, the leaves a gradient is asked of) for ``op`` on these
    tensors; torch's fused add is ``x + r`` then its norm."""
    if op == "layer_norm":
        return (
            (lambda: F.layer_norm(x, (n,), w, b)),
            (lambda: layernorm.layer_norm(x, (n,), w, b)),
            (x, w, b),
        )
    if op == "rms_norm":
        return (lambda: F.rms_norm(x, (n,), w)), (lambda: layernorm.rms_norm(x, (n,), w)), (x, w)
    if op == "add_layer_norm":

        def theirs():
            h = x + r
            return F.layer_norm(h, (n,), w, b), h

        return theirs, (lambda: layernorm.add_layer_norm(x, r, (n,), w, b)), (x, r, w, b)

    def theirs_rms():
        h = x + r
        return F.rms_norm(h, (n,), w), h

    return theirs_rms, (lambda: layernorm.add_rms_norm(x, r, (n,), w)), (x, r, w)


def measure(
    shape: tuple[int, ...],
    op: str,
    rounds: int = 31,
    dtype: torch.dtype = torch.float32,
    clock=time.perf_counter_ns,
) -> str:
    n = shape[-1]
    x, r, w, b = (torch.randn(*s).to(dtype) for s in (shape, shape, (n,), (n,)))
    xg, rg, wg, bg = (t.clone().requires_grad_() for t in (x, r, w, b))
    theirs, ours, _ = _calls(op, n, x, r, w, b)
    theirs_g, ours_g, leaves = _calls(op, n, xg, rg, wg, bg)
    with torch.no_grad():
        t_inf = rr({"torch": theirs, "ours": ours, "ours via the op": ours}, rounds, clock=clock)
    t_grad = rr(
        {"torch": theirs_g, "ours": ours_g, "ours via the op": ours_g},
        rounds,
        inner=1000,
        clock=clock,
    )

    def both(f):
        def run():
            out = f()
            outputs = out if isinstance(out, tuple) else (out,)
            return torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs])

        return run

    fb = rr(
        {"torch": both(theirs_g), "ours": both(ours_g), "ours via the op": both(ours_g)},
        rounds,
        inner=300,
        clock=clock,
    )
    return f"{op} {shape}: " + " | ".join(
        f"{part} torch {t['torch']:.1f}, ours {t['ours']:.1f} ({t['torch'] / t['ours']:.2f}x), "
        f"via the op {t['ours via the op']:.1f} ({t['torch'] / t['ours via the op']:.2f}x) us"
        for part, t in (("inference", t_inf), ("with grad", t_grad), ("forward+backward", fb))
    )  # fmt: skip


def breakdown(shape: tuple[int, ...]) -> str:
    from layernorm.backends import numba_

    n = shape[-1]
    x, w, b = torch.randn(*shape), torch.randn(n), torch.randn(n)
    m, kernel = x.numel() // n, numba_.entry(torch.float32, "forward_serial")
    flags = torch.empty(m + 1, dtype=torch.uint8)

    def kernel_call():  # the allocation and the kernel on addresses, nothing else
        y = torch.empty_like(x)
        a = x.data_ptr()
        kernel(
            a, n, a, 0, False, a, w.data_ptr(), b.data_ptr(), False, y.data_ptr(), a, a, m, n,
            1e-5, False, False, False, flags.data_ptr(),
        )  # fmt: skip
        return y

    with torch.no_grad():
        r = rr(
            {
                "torch": lambda: F.layer_norm(x, (n,), w, b),
                "ours": lambda: layernorm.layer_norm(x, (n,), w, b),
                "ours via the op": lambda: layernorm.layer_norm(x, (n,), w, b),
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=31, help="rounds per median")
    parser.add_argument("--threads", type=int, default=2, help="torch's and the kernels'")
    parser.add_argument("--ops", default="layer_norm,rms_norm,add_layer_norm,add_rms_norm")
    parser.add_argument("--shapes", default="4x64,1x1x768,8x128x64,64x1024")
    parser.add_argument("--breakdown", action="store_true", help="also time a call's parts")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    clock = time.process_time_ns if args.clock == "cpu" else time.perf_counter_ns
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    print(f"compiled dispatch: {compiled.unavailable_reason() or 'in use'}")
    layernorm.layer_norm(torch.ones(1, 2), 2)  # (loads the compiled dispatch if built)
    print(f"compiled dispatch: {compiled.unavailable_reason() or 'in use'}; dtype {dtype}")
    shapes = [tuple(int(size) for size in shape.split("x")) for shape in args.shapes.split(",")]
    for op in args.ops.split(","):
        for shape in shapes:
            print(measure(shape, op, args.rounds, dtype, clock), flush=True)
    if args.breakdown:
        for shape in [(4, 64), (1, 1, 768)]:
            print(breakdown(shape))
        print(attributes())
