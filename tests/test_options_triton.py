"""The options of ``layernorm.options`` on the triton backend, in Triton's interpreter:
each gives the numba backend's bits (values and gradients), since every option is a
composition around the op and the backends agree bit for bit (``docs/contract.md`` §3).
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


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backends.forget("triton")
    yield
    backends.forget("triton")


#: (function, keyword options)
CALLS = [
    ("layer_norm", {"offset": 1.0}),
    ("add_rms_norm", {"offset": 1.0}),
    ("rms_norm", {"casting_mode": "llama", "offset": 1.0}),
    ("add_rms_norm", {"casting_mode": "gemma", "offset": 1.0}),
    ("rms_norm", {"casting_mode": "none"}),
    ("layer_norm", {"out_dtype": torch.float32}),
    ("add_layer_norm", {"out_dtype": torch.float32}),
    ("layer_norm", {"memory_efficient": True}),
    ("rms_norm", {"memory_efficient": True}),
]


@pytest.mark.parametrize(("name", "kw"), CALLS, ids=lambda v: str(v))
def test_options_on_triton_are_numbas_bits(name, kw):
    g = torch.Generator().manual_seed(11)
    shape, nshape = (2, 3, 16), (3, 16)
    x = torch.randn(shape, generator=g).to(torch.bfloat16)
    r = torch.randn(shape, generator=g).to(torch.bfloat16)
    w = (torch.randn(nshape, generator=g) * 0.2 + 1).to(torch.bfloat16)
    b = torch.randn(nshape, generator=g).to(torch.bfloat16)
    fn = getattr(layernorm, name)
    results = []
    for backend in ("numba", "triton"):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        args = leaves[:2] if name.startswith("add") else leaves[:1]
        extra = () if "rms" in name else (leaves[3],)
        out = fn(*args, nshape, leaves[2], *extra, backend=backend, **kw)
        outs = out if isinstance(out, tuple) else (out,)
        total = sum((o.double() * (i + 1)).sum() for i, o in enumerate(outs))
        grads = torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)
        results.append((outs, grads))
    (outs_n, grads_n), (outs_t, grads_t) = results
    for a, e in zip(outs_t, outs_n, strict=True):
        assert torch.equal(a, e)
    for a, e in zip(grads_t, grads_n, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_float32_from_half_without_a_gradient_on_triton_is_numbas(name, dtype):
    """``out_dtype=float32`` of a 16-bit input without a gradient: the kernels of the
    pair (``options._rounds_into``), triton's bits those of numba's."""
    g = torch.Generator().manual_seed(13)
    shape, nshape = (2, 3, 16), (3, 16)
    x = (torch.randn(shape, generator=g) * 4 + 2).to(dtype)
    w, b = torch.randn(nshape, generator=g), torch.randn(nshape, generator=g)
    fn = getattr(layernorm, name)
    extra = () if "rms" in name else (b,)
    with torch.no_grad():
        got = fn(x, nshape, w, *extra, backend="triton", out_dtype=torch.float32)
        want = fn(x, nshape, w, *extra, backend="numba", out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_layer_norm_linear_on_triton_is_numbas():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 32, generator=g)
    w, b, lw = (
        torch.randn(32, generator=g),
        torch.randn(32, generator=g),
        torch.randn(8, 32, generator=g),
    )
    results = []
    for backend in ("numba", "triton"):
        leaves = [t.clone().requires_grad_() for t in (x, w, b, lw)]
        out = layernorm.layer_norm_linear(leaves[0], 32, *leaves[1:], backend=backend)
        results.append((out, torch.autograd.grad(out.sum(), leaves)))
    assert torch.equal(results[0][0], results[1][0])
    for a, e in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, e)
