"""How often the correctly rounded backward needs its exact fallback, and what it costs.

    PYTHONPATH=src python benchmarks/backward_fallback_rate.py [--rows 4096] [--calls 90]

For random rows (z N(offset, 3) at offsets 0, 1e2, 1e4; dy N(0, 1); gamma in [0.5, 1.5))
counts the rows the numba kernel flags for the host's exact fallback (docs/contract.md
§3, "Correct rounding of the backward"), and times the exact fallback of one row
(``_exact.fix_backward_row``) at a few widths. For dweight's per-row scalars
(``_weight_terms``): the rows whose float64 test the numba kernel's fast sums leave
open (those are settled in double-double before their terms are added), the rows that
leaves open too (the host's fallback: the call's dweight again), the rows the torch
backend sends to ``_exact.weight_scalars`` (it has no double-double step), and the time
of ``_exact.weight_scalars`` for one row. Last, ``--calls`` random float32 layer_norm
backward calls of 4096x1024 (offsets 0, 1e2, 1e4 in turn) through ``numba_.backward``:
how many sent their dweight to the host (``torch_.weight_gradient``), and the time of the
calls with and without those.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from numba import njit

from layernorm.backends import _exact, _numba_kernels, numba_, torch_


def flagged_rows(dtype: torch.dtype, m: int, n: int, offset: float, rms: bool) -> int:
    z = (torch.randn(m, n) * 3 + offset).to(dtype)
    dy = torch.randn(m, n).to(dtype)
    types = numba_._TYPES[dtype]
    w = (torch.rand(n) + 0.5).to(types.acc_dtype)
    _, _, mean, rstd = numba_.forward(z, None, w, None, 1e-5, rms)
    mean = rstd if mean is None else mean
    dres = numba_._constant(n, dtype, -0.0)
    dx = torch.empty_like(z)
    flags = np.zeros(m + 1, np.uint8)
    run = numba_.entry(dtype, "backward_parallel")
    run(
        dy.data_ptr(), n, z.data_ptr(), n, dres.data_ptr(), 0, w.data_ptr(), False,
        mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), 0, 0, m, n, rms, False, 1e-5,
        flags.ctypes.data,
    )  # fmt: skip
    return int(flags[:m].sum())


@njit
def _open_scalars(dy, z, w, mean, eps, rms):  # pragma: no cover - compiled
    """Rows of (M, N) float64 arrays whose scalars the kernel's first test leaves open,
    and of those, the rows its double-double step leaves open too."""
    m, n = z.shape
    factors = _numba_kernels._backward_factors(n, _numba_kernels._fast_gamma(n))
    count = still = 0
    for i in range(m):
        m1 = 0.0 if rms else mean[i]
        s_d, s_dd, s_g, s_gg, s_gd = _numba_kernels._chunked_backward_sums(dy[i], z[i], w, m1, n)
        constants = _numba_kernels._backward_constants(
            s_d, s_dd, s_g, s_gg, s_gd, factors, n, eps, rms, True, False
        )
        scalars = _numba_kernels._weight_scalars(
            m1, z[i, 0], constants[0], constants[9], constants[1], constants[10],
            np.float64(constants[8]), rms,
        )  # fmt: skip
        if scalars[2] != 0.0:
            count += 1
            a = 0.0 if rms else z[i, 0]
            still += int(_numba_kernels._settled_weight_scalars(z[i], n, eps, rms, a)[2])
    return count, still


def open_scalars(
    dtype: torch.dtype, m: int, n: int, offset: float, rms: bool
) -> tuple[int, int, int]:
    """(numba rows settled in double-double, of those left open, torch backend rows sent
    to _exact) for one random batch."""
    z = (torch.randn(m, n) * 3 + offset).to(dtype)
    dy = torch.randn(m, n).to(dtype)
    w = torch.rand(n, dtype=torch.float64) + 0.5
    _, _, mean, _ = numba_.forward(z, None, None, None, 1e-5, rms)
    mean64 = np.zeros(m) if mean is None else mean.double().numpy()
    retried, still = _open_scalars(
        dy.double().numpy(), z.double().numpy(), w.numpy(), mean64, 1e-5, rms
    )
    calls = []
    exact = _exact.weight_scalars

    def counting(row, eps, rms_):
        calls.append(1)
        return exact(row, eps, rms_)

    _exact.weight_scalars = counting
    try:
        torch_.weight_gradient(dy, z, mean, 1e-5, rms)
    finally:
        _exact.weight_scalars = exact
    return int(retried), int(still), len(calls)


def host_fallback_calls(calls: int, m: int = 4096, n: int = 1024) -> tuple[int, float, float]:
    """(calls whose dweight went to the host, seconds of all the backward calls, seconds
    of the host's part) over ``calls`` random calls."""
    spent: list[float] = []
    weight_gradient = torch_.weight_gradient

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = weight_gradient(*args, **kwargs)
        spent.append(time.perf_counter() - start)
        return result

    torch_.weight_gradient = timed
    total = 0.0
    try:
        for k in range(calls):
            z = torch.randn(m, n) * 3 + (0.0, 1e2, 1e4)[k % 3]
            dy = torch.randn(m, n)
            w = torch.rand(n) + 0.5
            _, _, mean, rstd = numba_.forward(z, None, w, None, 1e-5, False)
            start = time.perf_counter()
            numba_.backward(dy, z, w, mean, rstd, None, False, True, True, 1e-5)
            total += time.perf_counter() - start
    finally:
        torch_.weight_gradient = weight_gradient
    return len(spent), total, sum(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=90, help="backward calls of 4096x1024")
    options = parser.parse_args()
    torch.manual_seed(0)
    print("| dtype | op | M x N | offset | rows to the host | elements |")
    print("|---|---|---|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rms in (False, True):
            for n in (768, 4096):
                for offset in (0.0, 1e2, 1e4):
                    if dtype == torch.float16 and offset > 1e2:
                        continue  # float16 holds no unit spread at 1e4
                    m = options.rows
                    rows = flagged_rows(dtype, m, n, offset, rms)
                    op = "rms_norm" if rms else "layer_norm"
                    name = str(dtype).removeprefix("torch.")
                    print(f"| {name} | {op} | {m}x{n} | {offset:g} | {rows} | {m * n:,} |")
    print()
    print(
        "| dweight's scalars | op | M x N | offset | numba rows settled in double-double "
        "| of those to the host | torch rows to _exact |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for rms in (False, True):
        for n in (768, 4096):
            for offset in (0.0, 1e2, 1e4):
                m = options.rows
                retried, still, exact = open_scalars(torch.float32, m, n, offset, rms)
                op = "rms_norm" if rms else "layer_norm"
                row = f"| float32 | {op} | {m}x{n} | {offset:g} | {retried} | {still} | {exact} |"
                print(row)
    print()
    for n in (768, 4096, 32768):
        z = (np.random.randn(n) * 3 + 100).astype(np.float32).astype(np.float64)
        start = time.perf_counter()
        _exact.weight_scalars(z, 1e-5, False)
        print(f"_exact.weight_scalars, one row of {n}: {time.perf_counter() - start:.4f} s")
    print()
    print("| exact fallback of one float32 row | N | seconds |")
    print("|---|---:|---:|")
    for n in (768, 4096, 32768):
        z = (np.random.randn(n) * 3 + 100).astype(np.float32).astype(np.float64)
        gh = np.random.randn(n).astype(np.float32).astype(np.float64)
        rho = np.full(n, -0.0)
        start = time.perf_counter()
        _exact.fix_backward_row(z, gh, rho, 1e-5, False, torch.float32)
        print(f"| layer_norm | {n} | {time.perf_counter() - start:.4f} |")
    print()
    warm = torch.randn(8, 1024)  # the entry compiled or loaded before the timing
    numba_.backward(warm, warm, None, None, torch.ones(8), None, False, True, True, 1e-5)
    host, total, spent = host_fallback_calls(options.calls)
    print(
        f"{options.calls} random backward calls of 4096x1024 float32: {host} sent dweight "
        f"to the host; {total:.2f} s in all, {spent:.2f} s of it the host's"
    )


if __name__ == "__main__":
    main()
