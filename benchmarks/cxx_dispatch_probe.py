"""Probe, not part of the package: the numba kernel behind a compiled (C++) call.

    pip install ninja   # and a C++ compiler; torch.utils.cpp_extension builds the probe
    PYTHONPATH=src python benchmarks/cxx_dispatch_probe.py

Measures what the Python around a small call costs, by taking it away: the float32
serial forward kernel of the numba backend is wrapped in a numba ``cfunc`` (a C function
pointer), and a few lines of C++ (built with ``torch.utils.cpp_extension.load_inline``)
check the arguments, allocate ``y`` and call that pointer. No autograd, weight and bias
required: only the inference of the common call. Prints the build time, then
microseconds a call for torch's ``F.layer_norm``, our public ``layer_norm`` and the C++
call, interleaved round by round (medians of 31 rounds of 3000 calls), after checking
that the C++ call gives our bits.
"""

from __future__ import annotations

import statistics
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba import cfunc, types
from torch.utils.cpp_extension import load_inline

import layernorm
from layernorm.backends import _numba_kernels

F32 = np.empty(0, np.float32)
SIGNATURE = types.void(*[types.int64] * 7, types.float32)


@cfunc(SIGNATURE)
def forward_f32(x, w, b, y, mean, rstd, m_and_n, eps):  # (M << 32) | N in one argument
    m, n = m_and_n >> 32, m_and_n & 0xFFFFFFFF
    _numba_kernels.forward_serial(
        F32, F32, x, n, x, 0, False, x, w, b, y, mean, rstd, m, n, eps, False, False, False
    )


SOURCE = r"""
#include <torch/extension.h>
typedef void (*forward_t)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float);
static forward_t forward = nullptr;
void set_kernel(int64_t address) { forward = (forward_t)address; }
static void check(const torch::Tensor& t, int64_t n, bool row) {
    TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                t.dim() > 0 && t.size(-1) == n && (!row || t.dim() == 1), "not the common call");
}
torch::Tensor layer_norm(const torch::Tensor& x, int64_t n, const torch::Tensor& w,
                         const torch::Tensor& b, double eps) {
    check(x, n, false); check(w, n, true); check(b, n, true);
    TORCH_CHECK(eps >= 0, "eps must be non-negative");
    auto y = torch::empty_like(x);
    const int64_t m = x.numel() / n, address = (int64_t)x.data_ptr();
    forward(address, (int64_t)w.data_ptr(), (int64_t)b.data_ptr(), (int64_t)y.data_ptr(),
            address, address, (m << 32) | n, (float)eps);
    return y;
}
"""


def median_times(calls: dict, rounds: int = 31, inner: int = 3000) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(300):
            call()
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter_ns()
            for _ in range(inner):
                call()
            times[name].append((time.perf_counter_ns() - start) / inner / 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    torch.set_num_threads(2)
    numba.set_num_threads(2)
    start = time.perf_counter()
    probe = load_inline(  # (without -O2 the C++ side costs ~5 us more a call)
        "layernorm_dispatch_probe",
        cpp_sources=SOURCE,
        functions=["set_kernel", "layer_norm"],
        extra_cflags=["-O2"],
    )
    print(f"C++ build (or load from torch's extension cache): {time.perf_counter() - start:.1f} s")
    probe.set_kernel(forward_f32.address)
    for shape in [(4, 64), (1, 1, 768), (16, 256), (64, 1024)]:
        n = shape[-1]
        x, w, b = torch.randn(*shape), torch.randn(n), torch.randn(n)
        with torch.no_grad():
            assert torch.equal(probe.layer_norm(x, n, w, b, 1e-5), layernorm.layer_norm(x, n, w, b))
            t = median_times(
                {
                    "torch": lambda x=x, n=n, w=w, b=b: F.layer_norm(x, (n,), w, b),
                    "ours": lambda x=x, n=n, w=w, b=b: layernorm.layer_norm(x, (n,), w, b),
                    "ours via C++": lambda x=x, n=n, w=w, b=b: probe.layer_norm(x, n, w, b, 1e-5),
                }
            )
        print(
            f"{shape}: torch {t['torch']:.2f}, ours {t['ours']:.2f}, ours via C++ "
            f"{t['ours via C++']:.2f} us (torch / C++: {t['torch'] / t['ours via C++']:.2f}x)"
        )


if __name__ == "__main__":
    main()
