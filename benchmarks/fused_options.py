"""Each option of issue 23 against the unfused composition of torch ops it replaces.

    PYTHONPATH=src python benchmarks/fused_options.py [--dtype bfloat16] [--threads 1]
        [--clock cpu] [--rounds R] [--shapes 64x1024,4096x1024] [--cases offset,out_dtype,...]

For every case: torch's composition (what a user writes without this library: for
example ``F.rms_norm(x, (n,), w + 1.0)`` for ``offset=1.0``), and ours (the option), timed
round-robin in one process (``small_calls.rr``: the median over the rounds of the mean of
a batch of calls), in inference (no grad) and, where the option has a backward, forward
plus backward (``torch.autograd.grad`` of every leaf). Prints microseconds a call and
torch's time over ours: above 1 means the option is faster than the composition.
``--clock cpu`` times the process's CPU time instead of the wall clock (steadier on a
shared machine; with ``--threads 1`` every thread's work is the call's).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numba
import torch
import torch.nn.functional as F
from small_calls import rr

import layernorm
from layernorm.compat import apex, flash_attn, liger, quack

#: a case: (x, r, w, b, n) -> (torch's call, ours, the leaves a gradient is asked of,
#: whether it has a backward)
Case = Callable[..., tuple[Callable[[], object], Callable[[], object], tuple, bool]]


def _gemma(x, w, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def _llama(x, w, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def offset(x, r, w, b, n):
    return (
        lambda: F.rms_norm(x, (n,), w + 1.0, 1e-6),
        lambda: layernorm.rms_norm(x, (n,), w, 1e-6, offset=1.0),
        (x, w),
        True,
    )


def casting_gemma(x, r, w, b, n):
    return (
        lambda: _gemma(x, w, 1e-6),
        lambda: layernorm.rms_norm(x, (n,), w, 1e-6, offset=1.0, casting_mode="gemma"),
        (x, w),
        True,
    )


def casting_llama(x, r, w, b, n):
    return (
        lambda: _llama(x, w, 1e-6),
        lambda: layernorm.rms_norm(x, (n,), w, 1e-6, casting_mode="llama"),
        (x, w),
        True,
    )


def out_dtype_float32(x, r, w, b, n):
    w32, b32 = w.detach().float().requires_grad_(w.requires_grad), b.detach().float()
    return (
        lambda: F.layer_norm(x.float(), (n,), w32, b32),
        lambda: layernorm.layer_norm(x, (n,), w32, b32, out_dtype=torch.float32),
        (x, w32),
        True,
    )


def out(x, r, w, b, n):
    buffer = torch.empty_like(x)
    return (
        lambda: buffer.copy_(F.layer_norm(x, (n,), w, b)),
        lambda: layernorm.layer_norm(x, (n,), w, b, out=buffer),
        (),
        False,
    )


def memory_efficient(x, r, w, b, n):
    return (
        lambda: F.layer_norm(x, (n,), w, b),
        lambda: layernorm.layer_norm(x, (n,), w, b, memory_efficient=True),
        (x, w, b),
        True,
    )


def norm_linear(x, r, w, b, n):
    lw = torch.randn(n, n, dtype=x.dtype) / n**0.5
    return (
        lambda: F.linear(F.layer_norm(x, (n,), w, b), lw),
        lambda: layernorm.layer_norm_linear(x, (n,), w, b, lw),
        (x, w, b),
        True,
    )


def out_dtype_narrower(x, r, w, b, n):
    x32, w32, b32 = (v.detach().float().requires_grad_(v.requires_grad) for v in (x, w, b))
    return (
        lambda: F.layer_norm(x32, (n,), w32, b32).to(torch.bfloat16),
        lambda: layernorm.layer_norm(x32, (n,), w32, b32, out_dtype=torch.bfloat16),
        (x32, w32, b32),
        True,
    )


def _stream(x, r32, w, b, n):
    """Torch's composition of an add into a float32 stream and its layer norm in x's
    dtype: ``(y, h)``."""
    h = x.float() + r32
    return F.layer_norm(h, (n,), w.float(), b.float()).to(x.dtype), h


def residual_dtype(x, r, w, b, n):
    r32 = r.detach().float().requires_grad_(r.requires_grad)
    return (
        lambda: _stream(x, r32, w, b, n),
        lambda: layernorm.add_layer_norm(x, r32, (n,), w, b, residual_dtype=torch.float32),
        (x, r32, w, b),
        True,
    )


def dropout(x, r, w, b, n):
    def theirs():
        h = F.dropout(x, 0.1) + r
        return F.layer_norm(h, (n,), w, b), h

    def ours():
        out = layernorm.fused_norm(x, (n,), w, b, residual=r, dropout_p=0.1)
        return out.y, out.residual_out

    return theirs, ours, (x, r, w, b), True


def dropout_stream(x, r, w, b, n):
    """Dropout into a float32 residual stream (flash-attn's ``residual_in_fp32=True``)."""
    r32 = r.detach().float().requires_grad_(r.requires_grad)

    def theirs():
        h = F.dropout(x.float(), 0.1) + r32
        return F.layer_norm(h.to(x.dtype), (n,), w, b), h

    def ours():
        out = layernorm.fused_norm(
            x, (n,), w, b, residual=r32, dropout_p=0.1, residual_dtype=torch.float32
        )
        return out.y, out.residual_out

    return theirs, ours, (x, r32, w, b), True


def two_weights(x, r, w, b, n):
    x1, w1, b1 = (v.detach().clone().requires_grad_(v.requires_grad) for v in (x, w, b))

    def theirs():
        h = x + x1 + r
        return F.layer_norm(h, (n,), w, b), F.layer_norm(h, (n,), w1, b1), h

    def ours():
        out = layernorm.fused_norm(x, (n,), w, b, residual=r, x1=x1, weight1=w1, bias1=b1)
        return out.y, out.y1, out.residual_out

    return theirs, ours, (x, x1, r, w, b, w1, b1), True


def rowscale(x, r, w, b, n):
    """flash-attn's drop-path: ``x`` scaled per row, then dropped out, then added."""
    rs = torch.rand(x.shape[:-1], dtype=x.dtype) + 0.5

    def theirs():
        h = F.dropout(x * rs.unsqueeze(-1), 0.1) + r
        return F.layer_norm(h, (n,), w, b), h

    def ours():
        out = layernorm.fused_norm(x, (n,), w, b, residual=r, dropout_p=0.1, rowscale=rs)
        return out.y, out.residual_out

    return theirs, ours, (x, r, w, b), True


def generator(x, r, w, b, n):
    """Dropout drawn from a ``torch.Generator`` of the user's."""
    g0, g1 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)

    def theirs():
        keep = torch.empty_like(x).bernoulli_(0.9, generator=g0)
        h = x * keep / 0.9 + r
        return F.layer_norm(h, (n,), w, b), h

    def ours():
        out = layernorm.fused_norm(x, (n,), w, b, residual=r, dropout_p=0.1, generator=g1)
        return out.y, out.residual_out

    return theirs, ours, (x, r, w, b), True


def flash_zero_centered(x, r, w, b, n):
    """flash-attn's ``layer_norm_fn`` with ``zero_centered_weight=True`` (the gain is
    ``1 + weight``) and dropout, into the residual stream."""

    def theirs():
        h = F.dropout(x, 0.1) + r
        return F.layer_norm(h, (n,), w + 1.0, b), h

    def ours():
        return flash_attn.layer_norm_fn(
            x, w, b, residual=r, dropout_p=0.1, zero_centered_weight=True, prenorm=True
        )

    return theirs, ours, (x, r, w, b), True


def flash_stream_start(x, r, w, b, n):
    """flash-attn's first block of a float32 stream: ``rms_norm_fn(x, w, None,
    prenorm=True, residual_in_fp32=True)``, no residual yet, no dropout."""

    def theirs():
        h = x.float()
        return F.rms_norm(h, (n,), w.float(), 1e-6).to(x.dtype), h

    return (
        theirs,
        lambda: flash_attn.rms_norm_fn(x, w, None, eps=1e-6, prenorm=True, residual_in_fp32=True),
        (x, w),
        True,
    )


def flash_stream(x, r, w, b, n):
    """flash-attn's later blocks: ``layer_norm_fn`` adding into the float32 stream."""
    r32 = r.detach().float().requires_grad_(r.requires_grad)
    return (
        lambda: _stream(x, r32, w, b, n),
        lambda: flash_attn.layer_norm_fn(
            x, w, b, residual=r32, prenorm=True, residual_in_fp32=True
        ),
        (x, r32, w, b),
        True,
    )


def liger_add(x, r, w, b, n):
    """Liger's ``LigerFusedAddRMSNorm`` (llama casting) against its composition."""
    module = liger.LigerFusedAddRMSNorm(n)
    with torch.no_grad():
        module.weight.copy_(w)
    module.weight.requires_grad_(w.requires_grad)

    def theirs():
        h = x + r
        return _llama(h, module.weight, 1e-6), h

    return theirs, lambda: module(x, r), (x, r, module.weight), True


def quack_prenorm(x, r, w, b, n):
    """quack's ``rmsnorm(x, w, residual=r, prenorm=True)``."""

    def theirs():
        h = x + r
        return F.rms_norm(h, (n,), w, 1e-6), h

    return (
        theirs,
        lambda: quack.rmsnorm(x, w, residual=r, prenorm=True),
        (x, r, w),
        True,
    )


def apex_mixed(x, r, w, b, n):
    """apex's ``MixedFusedRMSNorm``: float32 parameters, the output in their dtype."""
    module = apex.MixedFusedRMSNorm(n, eps=1e-6).float()
    w32 = module.weight.requires_grad_(w.requires_grad)
    return (
        lambda: F.rms_norm(x.float(), (n,), w32, 1e-6),
        lambda: module(x),
        (x, w32),
        True,
    )


CASES: dict[str, Case] = {
    "offset": offset,
    "casting_gemma": casting_gemma,
    "casting_llama": casting_llama,
    "out_dtype_float32": out_dtype_float32,
    "out": out,
    "memory_efficient": memory_efficient,
    "norm_linear": norm_linear,
    "out_dtype_narrower": out_dtype_narrower,
    "residual_dtype": residual_dtype,
    "dropout": dropout,
    "dropout_stream": dropout_stream,
    "two_weights": two_weights,
    "rowscale": rowscale,
    "generator": generator,
    "flash_zero_centered": flash_zero_centered,
    "flash_stream_start": flash_stream_start,
    "flash_stream": flash_stream,
    "liger_add": liger_add,
    "quack_prenorm": quack_prenorm,
    "apex_mixed": apex_mixed,
}


#: the clocks ``--clock`` names (nanoseconds)
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}


def measure(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, rounds: int, clock: str = "wall"
) -> str:
    n = shape[-1]
    inner = max(3, min(1000, 2_000_000 // (2 * x_numel(shape))))
    x, r, w, b = (torch.randn(*s).to(dtype) for s in (shape, shape, (n,), (n,)))
    theirs, ours, _, has_backward = CASES[name](x, r, w, b, n)
    with torch.no_grad():
        t = rr({"torch": theirs, "ours": ours}, rounds, inner=inner, clock=CLOCKS[clock])
    line = f"{name} {shape} {str(dtype)[6:]}: inference {_ratio(t)}"
    if has_backward:
        xg, rg, wg, bg = (v.clone().requires_grad_() for v in (x, r, w, b))
        theirs_g, ours_g, leaves, _ = CASES[name](xg, rg, wg, bg, n)

        def both(f):
            def run():
                y = f()
                outputs = y if isinstance(y, tuple) else (y,)
                return torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs])

            return run

        t = rr(
            {"torch": both(theirs_g), "ours": both(ours_g)},
            rounds,
            inner=max(3, inner // 4),
            clock=CLOCKS[clock],
        )
        line += f" | forward+backward {_ratio(t)}"
    return line


def x_numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _ratio(t: dict[str, float]) -> str:
    return f"torch {t['torch']:.1f}, ours {t['ours']:.1f} us ({t['torch'] / t['ours']:.2f}x)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=15, help="rounds per median")
    parser.add_argument("--threads", type=int, default=1, help="torch's and the kernels'")
    parser.add_argument("--clock", default="wall", choices=list(CLOCKS), help="what is timed")
    parser.add_argument("--shapes", default="64x1024,4096x1024")
    parser.add_argument("--cases", default=",".join(CASES), help="a comma-separated subset")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    layernorm.layer_norm(torch.ones(1, 2), 2)  # loads the compiled dispatch if built
    dtype = getattr(torch, args.dtype)
    for shape_text in args.shapes.split(","):
        shape = tuple(int(v) for v in shape_text.split("x"))
        for name in args.cases.split(","):
            print(measure(name, shape, dtype, args.rounds, args.clock), flush=True)
