"""How often the correctly rounded forward needs its fallbacks, and what they cost.

    PYTHONPATH=src python benchmarks/fallback_rate.py

For random rows (N(offset, 3) at offsets 0, 1e2, 1e4; gamma in [0.5, 1.5), beta N(0, 1))
counts the rows the numba kernel sends to the host's exact fallback (stage 3, flags left
set after the kernel's own stage 2; docs/contract.md §3), and times the exact fallback
of one row (``_exact.fix_forward_row``) at a few widths. ``--stages`` first counts, for
each dtype, the output segments the cheap test leaves open (redone with the bound per
element) and the rows that then go to the compensated statistics (stage 2), by running
the kernel's own row functions step by step (``stage_counts``).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from layernorm.backends import _exact, numba_


def stage_counts(dtype: torch.dtype, m: int, n: int, offset: float, rms: bool):
    """``(segments, open segments, rows to stage 2)`` for random rows: the steps of
    ``_numba_kernels._forward_row`` (no streaming) with the float64 cheap pass, counted
    (16-bit rows now run the float32 lanes instead, ``normalize_row_fast_single``,
    whose open vectors this does not count)."""
    from numba import njit

    from layernorm.backends import _numba_kernels as kernels
    from layernorm.backends._numba_vectors import normalize_row_checked, normalize_row_fast

    @njit(error_model="numpy")
    def count(x, w, b, y, m, n, rms, out32):
        unused = np.empty(1, w.dtype)
        segments = opened = precise = 0
        weight_max, bias_max = kernels._largest_parameters(w, b)
        for i in range(m):
            row = kernels._row_constants(
                i, x, n, x, 0, False, x, unused, unused, n, 1e-5, rms, False, weight_max,
                bias_max, False, out32,
            )  # fmt: skip
            z, m1, delta, rstd_i, a, b_, k_y, shift, bound_a, bound_b, tiny, flag, _ = row
            checked = 0
            y_i = y[i * n : (i + 1) * n]
            for start in range(0, n, kernels.SEGMENT):
                stop = min(n, start + kernels.SEGMENT)
                segments += 1
                z_s, y_s, w_s, b_s = z[start:stop], y_i[start:stop], w[start:stop], b[start:stop]
                if normalize_row_fast(
                    z_s, y_s, m1, delta, rstd_i, shift, w_s, b_s, bound_a, bound_b, tiny
                ):
                    opened += 1
                    checked |= normalize_row_checked(
                        z_s, y_s, m1, delta, rstd_i, w_s, b_s, a, b_, k_y
                    )
            precise += (flag | checked) != 0
        return segments, opened, precise

    x = (torch.randn(m, n) * 3 + offset).to(dtype)
    types = numba_._TYPES[dtype]
    storage = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}.get(dtype, dtype)
    w = (torch.rand(n) + 0.5).to(types.acc_dtype).numpy()
    b = torch.randn(n).to(types.acc_dtype).numpy()
    xs = x.view(storage).numpy()
    return count(xs, w, b, np.empty_like(xs), m, n, rms, dtype == torch.float32)


def flagged_rows(dtype: torch.dtype, m: int, n: int, offset: float, rms: bool) -> int:
    x = (torch.randn(m, n) * 3 + offset).to(dtype)
    types = numba_._TYPES[dtype]
    w = (torch.rand(n) + 0.5).to(types.acc_dtype)
    b = torch.randn(n).to(types.acc_dtype)
    y = torch.empty_like(x)
    flags = np.zeros(m + 1, np.uint8)
    run = numba_.entry(dtype, "forward_parallel")
    run(
        x.data_ptr(), n, x.data_ptr(), 0, False, x.data_ptr(), w.data_ptr(), b.data_ptr(),
        False, y.data_ptr(), x.data_ptr(), x.data_ptr(), m, n, 1e-5, rms, False, False,
        flags.ctypes.data,
    )  # fmt: skip
    return int(flags[:m].sum())


def main() -> None:
    torch.manual_seed(0)
    if "--stages" in sys.argv[1:]:
        print(
            "| dtype | op | M x N | offset | segments the cheap test leaves open | rows to stage 2 |"
        )
        print("|---|---|---|---:|---:|---:|")
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for rms in (False, True):
                for m, n in ((4096, 1024), (1024, 4096)):
                    for offset in (0.0, 1e2):
                        segments, opened, precise = stage_counts(dtype, m, n, offset, rms)
                        op = "rms_norm" if rms else "layer_norm"
                        print(
                            f"| {dtype} | {op} | {m}x{n} | {offset:g} | {opened} of {segments}"
                            f" ({opened / segments:.2%}) | {precise} of {m} |"
                        )
        print()
    print("| dtype | op | M x N | offset | rows to the host | elements |")
    print("|---|---|---|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rms in (False, True):
            for m, n in ((16384, 1024), (2048, 8192)):
                for offset in (0.0, 1e2, 1e4):
                    k = flagged_rows(dtype, m, n, offset, rms)
                    op = "rms_norm" if rms else "layer_norm"
                    print(f"| {dtype} | {op} | {m}x{n} | {offset:g} | {k} of {m} | {m * n} |")
    print()
    print("| N | exact fallback of one row, ms |")
    print("|---:|---:|")
    for n in (768, 4096, 32768):
        z = (torch.randn(n) * 3 + 100).to(torch.float32).double().numpy()
        gamma, beta = np.ones(n), np.zeros(n)
        start = time.perf_counter()
        for _ in range(5):
            _exact.fix_forward_row(z, gamma, beta, 1e-5, False, torch.float32)
        print(f"| {n} | {(time.perf_counter() - start) / 5 * 1e3:.2f} |")


if __name__ == "__main__":
    main()
