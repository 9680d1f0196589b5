"""A narrower ``out_dtype`` on the triton backend, in Triton's interpreter: the numba
backend's bits (which ``tests/test_out_dtype.py`` checks against the exact oracle), values
and gradients, on the fused (one program per row) and wide (chunked) forward paths, with
and without a residual; rows placed on the output dtype's rounding boundaries included.
"""

from __future__ import annotations

import pytest
import torch

import layernorm
from _triton_interpreter import HAS_TRITON, import_for_the_interpreter
from layernorm import backends

import_for_the_interpreter()
pytest.importorskip("numba")

if HAS_TRITON:
    from layernorm.backends import triton_

INTERPRETED = HAS_TRITON and triton_._triton_interprets()
pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    pytest.mark.skipif(
        HAS_TRITON and not INTERPRETED,
        reason="triton was imported compiled: run TRITON_INTERPRET=1 pytest " + __file__,
    ),
]

#: the pairs triton takes (it has no float64 input)
PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float16),
    (torch.float16, torch.bfloat16),
]
PAIR_IDS = [f"{str(a)[6:]}-to-{str(b)[6:]}" for a, b in PAIRS]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backends.forget("triton")
    yield
    backends.forget("triton")


def _run(op, x, r, w, b, ydtype, backend, dy):
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    fn = getattr(layernorm, op)
    args = leaves[:2] if op.startswith("add") else leaves[:1]
    extra = () if "rms" in op else (leaves[3],)
    n = x.shape[-1]
    out = fn(*args, n, leaves[2], *extra, backend=backend, out_dtype=ydtype)
    outs = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(outs[0], leaves, dy, allow_unused=True, materialize_grads=True)
    return outs, grads


@pytest.mark.parametrize("n", [96, triton_.FUSED_FORWARD_N + 40] if HAS_TRITON else [96])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize(("xdtype", "ydtype"), PAIRS, ids=PAIR_IDS)
def test_triton_is_numbas_bits(xdtype, ydtype, op, n):
    g = torch.Generator().manual_seed(31)
    x = (torch.randn(3, n, generator=g) * 2 + 5).to(xdtype)
    r = torch.randn(3, n, generator=g).to(xdtype)
    w = (torch.rand(n, generator=g) + 0.5).to(xdtype)
    base = layernorm.layer_norm(x.double(), n, w.double(), eps=1e-5)
    # the last row's bias puts each of its elements next to a rounding boundary of y
    near = base[2].to(ydtype).double()
    half = near.abs().clamp_min(2.0**-6) * float(torch.finfo(ydtype).eps) / 2
    b = (near + half - base[2]).to(xdtype)
    dy = torch.randn(3, n, generator=g).to(ydtype)
    (outs_n, grads_n), (outs_t, grads_t) = (
        _run(op, x, r, w, b, ydtype, backend, dy) for backend in ("numba", "triton")
    )
    assert outs_t[0].dtype == ydtype
    for a, e in zip(outs_t + grads_t, outs_n + grads_n, strict=True):
        assert a.dtype == e.dtype and torch.equal(a, e)
