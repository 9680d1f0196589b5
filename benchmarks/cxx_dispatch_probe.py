"""Probe, not part of the package: the numba kernel behind a compiled (C++) call.

    pip install ninja   # and a C++ compiler; torch.utils.cpp_extension builds the probe
    PYTHONPATH=src python benchmarks/cxx_dispatch_probe.py

Measures what the Python around a small call costs, by taking it away: the float32
serial forward kernel of the numba backend is wrapped in a numba ``cfunc`` (a C function
pointer), and a few lines of C++ (built with ``torch.utils.cpp_extension.load_inline``)
check the arguments, allocate the outputs and call that pointer; with autograd, a C++
``torch::autograd::Function`` does the same for the forward and, through the float32
serial backward kernel, the backward (dx, dweight, dbias). Weight and bias required,
no residual: the common call only. Prints the build time, then microseconds a call for
torch's ``F.layer_norm``, our public ``layer_norm`` and the C++ call, interleaved round by
round (medians of 31 rounds), for inference, the forward with grad, and forward plus
backward (``torch.autograd.grad``), after checking that the C++ call gives our bits.
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
FORWARD = types.void(*[types.int64] * 7, types.float32, types.boolean)
BACKWARD = types.void(*[types.int64] * 10)


@cfunc(FORWARD)
def forward_f32(x, w, b, y, mean, rstd, m_and_n, eps, stats):  # (M << 32) | N in one
    m, n = m_and_n >> 32, m_and_n & 0xFFFFFFFF
    _numba_kernels.forward_serial(
        F32, F32, x, n, x, 0, False, x, w, b, y, mean, rstd, m, n, eps, False, False, stats
    )


@cfunc(BACKWARD)
def backward_f32(dy, x, dro, w, mean, rstd, dx, dweight, dbias, m_and_n):
    m, n = m_and_n >> 32, m_and_n & 0xFFFFFFFF
    _numba_kernels.backward_serial(
        F32, F32, dy, n, x, n, dro, 0, w, mean, rstd, dx, dweight, dbias, m, n, False, False
    )


SOURCE = r"""
#include <torch/extension.h>
typedef void (*forward_t)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          bool);
typedef void (*backward_t)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t);
static forward_t forward_kernel = nullptr;
static backward_t backward_kernel = nullptr;
#define ADDRESS(t) ((int64_t)(t).data_ptr())

void set_kernels(int64_t forward, int64_t backward) {
    forward_kernel = (forward_t)forward;
    backward_kernel = (backward_t)backward;
}

static void check(const torch::Tensor& t, int64_t n, bool row) {
    TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                t.dim() > 0 && t.size(-1) == n && (!row || t.dim() == 1), "not the common call");
}

static torch::Tensor run_forward(const torch::Tensor& x, const torch::Tensor& w,
                                 const torch::Tensor& b, double eps, torch::Tensor* mean,
                                 torch::Tensor* rstd) {
    const int64_t n = x.size(-1), m = x.numel() / n;
    auto y = torch::empty_like(x);
    int64_t mean_address = ADDRESS(x), rstd_address = ADDRESS(x);
    if (mean != nullptr) {
        *mean = torch::empty({m}, x.options());
        *rstd = torch::empty({m}, x.options());
        mean_address = ADDRESS(*mean);
        rstd_address = ADDRESS(*rstd);
    }
    forward_kernel(ADDRESS(x), ADDRESS(w), ADDRESS(b), ADDRESS(y), mean_address, rstd_address,
                   (m << 32) | n, (float)eps, mean != nullptr);
    return y;
}

struct LayerNorm : public torch::autograd::Function<LayerNorm> {
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                 const torch::Tensor& w, const torch::Tensor& b, double eps) {
        torch::Tensor mean, rstd;
        auto y = run_forward(x, w, b, eps, &mean, &rstd);
        ctx->save_for_backward({x, w, mean, rstd});
        return y;
    }
    static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::tensor_list grads) {
        auto saved = ctx->get_saved_variables();
        const auto &x = saved[0], &w = saved[1], &mean = saved[2], &rstd = saved[3];
        auto dy = grads[0].contiguous();
        const int64_t n = x.size(-1), m = x.numel() / n;
        auto dx = torch::empty_like(x);
        auto dweight = torch::empty({n}, w.options()), dbias = torch::empty({n}, w.options());
        auto dro = torch::full({n}, -0.0, x.options());  // no residual gradient: adds -0.0
        backward_kernel(ADDRESS(dy), ADDRESS(x), ADDRESS(dro), ADDRESS(w), ADDRESS(mean),
                        ADDRESS(rstd), ADDRESS(dx), ADDRESS(dweight), ADDRESS(dbias),
                        (m << 32) | n);
        return {dx, dweight, dbias, torch::Tensor()};
    }
};

torch::Tensor layer_norm(const torch::Tensor& x, int64_t n, const torch::Tensor& w,
                         const torch::Tensor& b, double eps) {
    check(x, n, false); check(w, n, true); check(b, n, true);
    TORCH_CHECK(eps >= 0, "eps must be non-negative");
    if (torch::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() ||
                                          b.requires_grad())) {
        return LayerNorm::apply(x, w, b, eps);
    }
    return run_forward(x, w, b, eps, nullptr, nullptr);
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
        functions=["set_kernels", "layer_norm"],
        extra_cflags=["-O2"],
    )
    print(f"C++ build (or load from torch's extension cache): {time.perf_counter() - start:.1f} s")
    probe.set_kernels(forward_f32.address, backward_f32.address)
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
        print(f"{shape} inference: " + _line(t))
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
        dy = torch.randn_like(x)
        ours = torch.autograd.grad(layernorm.layer_norm(xg, n, wg, bg), (xg, wg, bg), dy)
        theirs = torch.autograd.grad(probe.layer_norm(xg, n, wg, bg, 1e-5), (xg, wg, bg), dy)
        assert all(torch.equal(a, c) for a, c in zip(ours, theirs, strict=True))
        calls = _grad_calls(probe, xg, wg, bg)
        print(f"{shape} forward with grad: " + _line(median_times(calls, inner=1000)))
        both = {
            k: lambda f=f, p=(xg, wg, bg), dy=dy: torch.autograd.grad(f(), p, dy)
            for k, f in calls.items()
        }
        print(f"{shape} forward and backward: " + _line(median_times(both, inner=300)))


def _grad_calls(probe, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict:
    n = x.shape[-1]
    return {
        "torch": lambda: F.layer_norm(x, (n,), w, b),
        "ours": lambda: layernorm.layer_norm(x, (n,), w, b),
        "ours via C++": lambda: probe.layer_norm(x, n, w, b, 1e-5),
    }


def _line(t: dict[str, float]) -> str:
    return (
        f"torch {t['torch']:.2f}, ours {t['ours']:.2f}, ours via C++ {t['ours via C++']:.2f} us "
        f"(torch / C++: {t['torch'] / t['ours via C++']:.2f}x)"
    )


if __name__ == "__main__":
    main()
