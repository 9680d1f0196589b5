"""How often the correctly rounded forward needs its fallbacks, and what they cost.

    PYTHONPATH=src python benchmarks/fallback_rate.py

For random rows (N(offset, 3) at offsets 0, 1e2, 1e4; gamma in [0.5, 1.5), beta N(0, 1))
counts the rows the numba kernel sends to the host's exact fallback (stage 3, flags left
set after the kernel's own stage 2; docs/contract.md §3), and times the exact fallback
of one row (``_exact.fix_forward_row``) at a few widths.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from layernorm.backends import _exact, numba_


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
        y.data_ptr(), x.data_ptr(), x.data_ptr(), m, n, 1e-5, rms, False, False,
        flags.ctypes.data,
    )  # fmt: skip
    return int(flags[:m].sum())


def main() -> None:
    torch.manual_seed(0)
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
