"""An output narrower than the normalized input (``out_dtype``, docs/contract.md §2, §3):
every element of ``y`` is the exact result of §1 rounded ONCE to ``y``'s dtype (never
through the input's dtype first), on the numba and torch backends and the automatic
choice, against the exact oracle, for every pair of a dtype and a narrower one; the
gradients are the plain call's with ``dy`` widened (exactly) to the input's dtype; every
mechanism of §6 runs it. The triton backend's bits: ``tests/test_out_dtype_triton.py``.
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch
from torch.func import grad, jvp, vmap
from torch.testing import assert_close

import _oracle
import layernorm
from layernorm.backends import numba_

pytest.importorskip("numba")

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
MASK = {torch.float32: 0xFFFFFFFF, torch.bfloat16: 0xFFFF, torch.float16: 0xFFFF}
#: (z's dtype, y's narrower dtype): every pair the kernels round into
PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.float64, torch.float32),
    (torch.float64, torch.bfloat16),
    (torch.float64, torch.float16),
]
PAIR_IDS = [f"{str(a)[6:]}-to-{str(b)[6:]}" for a, b in PAIRS]
OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(BITS[t.dtype]).numpy().astype(np.int64) & MASK[t.dtype]


def _call(op, x, r, shape, w, b, **kw):
    fn = getattr(layernorm, op)
    args = (x, r) if op.startswith("add") else (x,)
    extra = () if "rms" in op else (b,)
    out = fn(*args, shape, w, *extra, **kw)
    return out if op.startswith("add") else (out, None)


def _forward64(z, gamma, beta, eps, rms, fmt):
    """The exact oracle on a float64 row (``_oracle.forward`` takes float32 rows): exact
    rational statistics, then ``_oracle.round_value`` per element."""
    zs = [Fraction(float(v)) for v in z]
    n = len(zs)
    mean = Fraction(0) if rms else sum(zs, Fraction(0)) / n
    q = sum(((v - mean) ** 2 for v in zs), Fraction(0)) / n
    s = q + Fraction(eps)
    mpmath.mp.prec = 320
    rsqrt = 1 / mpmath.sqrt(mpmath.mpf(s.numerator) / s.denominator)
    out = np.zeros(n, np.int64)
    zeros = np.zeros(n, bool)
    for i, v in enumerate(zs):
        w = Fraction(float(gamma[i])) * (v - mean)
        out[i], zeros[i] = _oracle.round_value(Fraction(float(beta[i])), w, s, rsqrt, fmt)
    return out, zeros


def _assert_correctly_rounded(y, z, w, b, eps, rms):
    """Every element of ``y`` is the oracle's rounding into ``y``'s dtype of the exact
    result on ``z`` (the normalized input), ``w`` and ``b`` as the accumulation dtype
    holds them (the sign of an exactly zero result is a convention)."""
    n = z.shape[-1]
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    gamma = np.ones(n) if w is None else w.to(acc).double().numpy()
    beta = np.zeros(n) if (b is None or rms) else b.to(acc).double().numpy()
    rows = z.reshape(-1, n).double().numpy()
    got = _bits(y).reshape(-1, n)
    fmt = NAMES[y.dtype]
    wrong = 0
    for i, row in enumerate(rows):
        if z.dtype == torch.float64:
            want, zero = _forward64(row, gamma, beta, eps, rms, fmt)
        else:
            want, zero = _oracle.forward(row, gamma, beta, eps, rms, fmt)
        wrong += int(((want != got[i]) & ~zero).sum())
    assert wrong == 0, f"{wrong} of {z.numel()} elements not correctly rounded"


def _offsets(dtype):
    return {torch.float32: (0.0, 100.0, 1e4), torch.float64: (0.0, 1e4, 1e8)}.get(
        dtype, (0.0, 30.0)
    )


@pytest.mark.parametrize("backend", [None, "numba", "torch"], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("xdtype", "ydtype"), PAIRS, ids=PAIR_IDS)
def test_a_narrower_output_is_correctly_rounded(xdtype, ydtype, op, backend):
    g = torch.Generator().manual_seed(3)
    rms = "rms" in op
    n = 48 if xdtype == torch.float64 else 160
    for offset in _offsets(xdtype):
        x = (torch.randn(3, n, generator=g, dtype=torch.float64) * 3 + offset).to(xdtype)
        r = torch.randn(3, n, generator=g, dtype=torch.float64).to(xdtype)
        for w, b in [
            (torch.randn(n, generator=g, dtype=torch.float64).to(xdtype),
             torch.randn(n, generator=g, dtype=torch.float64).to(xdtype)),
            (None, None),
        ]:  # fmt: skip
            y, h = _call(op, x, r, n, w, b, eps=1e-5, backend=backend, out_dtype=ydtype)
            assert y.dtype == ydtype
            z = x if h is None else h
            if h is not None:  # residual_out keeps the input's dtype and the plain call's bits
                assert h.dtype == xdtype
                assert torch.equal(h, _call(op, x, r, n, w, b, eps=1e-5, backend=backend)[1])
            _assert_correctly_rounded(y, z, w, b, 1e-5, rms)


def _ulp_one(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize(("xdtype", "ydtype"), PAIRS, ids=PAIR_IDS)
def test_midpoints_of_the_output_dtype_round_to_even(xdtype, ydtype, backend):
    """z = (0, 1, ...) with eps = 3/4: u = ±1/2 exactly, so gamma = ulp_y(1), beta = 1
    give y = 1 ± ulp_y/2: a tie of y's dtype (to even: 1), which rounding through z's
    dtype first would not keep for a wider z; eps = 3/4 ± 2^-k moves it 2^-k·ulp/4 off
    the tie, to either side."""
    ulp = _ulp_one(ydtype)
    x = torch.tensor([[0.0, 1.0] * 4], dtype=xdtype)
    w = torch.full((8,), ulp, dtype=xdtype)
    b = torch.ones(8, dtype=xdtype)
    y = layernorm.layer_norm(x, 8, w, b, eps=0.75, backend=backend, out_dtype=ydtype)
    assert y[0].double().tolist() == [1.0 - ulp / 2, 1.0] * 4
    for k in range(20, 51, 6):
        for t in (2.0**-k, -(2.0**-k)):
            y = layernorm.layer_norm(x, 8, w, b, eps=0.75 + t, backend=backend, out_dtype=ydtype)
            assert y[0, 1].item() == (1.0 if t > 0 else 1.0 + ulp)
            _assert_correctly_rounded(y, x, w, b, 0.75 + t, False)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize(("xdtype", "ydtype"), PAIRS, ids=PAIR_IDS)
def test_rows_placed_on_the_outputs_rounding_boundaries(xdtype, ydtype, backend):
    """Random rows whose bias puts every element within one unit of z's dtype of a
    rounding boundary (a midpoint) of y's dtype: the cases a test against the wrong
    dtype's boundaries, or a double rounding, would get wrong (the float32 lanes of a
    16-bit output included)."""
    g = torch.Generator().manual_seed(5)
    n = 40 if xdtype == torch.float64 else 256
    for rms in (False, True):
        x = torch.randn(4, n, generator=g, dtype=torch.float64).to(xdtype)
        w = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(xdtype)
        base = layernorm.layer_norm(x.double(), n, w.double(), eps=1e-5) if not rms else (
            layernorm.rms_norm(x.double(), n, w.double(), eps=1e-5))  # fmt: skip
        # a boundary near each element of the first row: y's value there plus half a unit
        near = base[0].to(ydtype).double()
        half = near.abs().clamp_min(2.0**-6) * _ulp_one(ydtype) / 2
        b = (near + half - base[0]).to(xdtype)
        y = _call("rms_norm" if rms else "layer_norm", x, None, n, w, b, eps=1e-5,
                  backend=backend, out_dtype=ydtype)[0]  # fmt: skip
        _assert_correctly_rounded(y, x, w, None if rms else b, 1e-5, rms)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("ydtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_float64_rows_over_a_wide_range(ydtype, backend):
    """float64 rows at magnitudes 1e-150 to 1e150 (statistics within float64's range:
    docs/contract.md §2 says where this stops) are correctly rounded into y's dtype."""
    g = torch.Generator().manual_seed(37)
    for scale in (1e-150, 1e-100, 1e-30, 1e30, 1e100, 1e150):
        x = torch.randn(2, 40, generator=g, dtype=torch.float64) * scale + 3 * scale
        w = torch.randn(40, generator=g, dtype=torch.float64)
        for rms in (False, True):
            y = _call("rms_norm" if rms else "layer_norm", x, None, 40, w, None, eps=1e-5,
                      backend=backend, out_dtype=ydtype)[0]  # fmt: skip
            _assert_correctly_rounded(y, x, w, None, 1e-5, rms)


LAYOUTS = [
    ("1d", (8,), (8,)),
    ("2d", (5, 8), (8,)),
    ("3d-2dims", (2, 3, 8), (3, 8)),
    ("4d-2dims", (2, 2, 3, 4), (3, 4)),
]


@pytest.mark.parametrize("backend", [None, "numba", "torch"], ids=str)
@pytest.mark.parametrize(
    ("xdtype", "ydtype"), PAIRS[:1] + PAIRS[-1:], ids=PAIR_IDS[:1] + PAIR_IDS[-1:]
)
@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_every_layout_gives_the_rows_bits(op, xdtype, ydtype, backend):
    """1-D to 4-D inputs, normalized shapes of two dims, a transposed (non-contiguous)
    input and zero-size inputs: the shape and dtype of the outputs, and the bits of the
    same rows normalized as a contiguous (M, N) matrix."""
    g = torch.Generator().manual_seed(7)
    cases = [
        (name, torch.randn(shape, generator=g, dtype=xdtype), ns) for name, shape, ns in LAYOUTS
    ]
    cases.append(("transposed", torch.randn(8, 5, generator=g, dtype=xdtype).t(), (8,)))
    cases.append(("zero-rows", torch.randn(0, 8, dtype=xdtype), (8,)))
    cases.append(("zero-inner", torch.randn(3, 0, 8, dtype=xdtype), (8,)))
    for _, x, ns in cases:
        n = int(np.prod(ns))
        w = torch.randn(ns, generator=g, dtype=xdtype)
        b = torch.randn(ns, generator=g, dtype=xdtype)
        r = torch.randn(x.shape, generator=g, dtype=xdtype)
        y, h = _call(op, x, r, ns, w, b, backend=backend, out_dtype=ydtype)
        assert y.shape == x.shape and y.dtype == ydtype
        flat, flat_h = _call(op, x.reshape(-1, n).contiguous(), r.reshape(-1, n), (n,),
                             w.reshape(n), b.reshape(n), backend=backend, out_dtype=ydtype)  # fmt: skip
        assert torch.equal(y.reshape(-1, n), flat)
        if h is not None:
            assert h.dtype == xdtype and torch.equal(h.reshape(-1, n), flat_h)


@pytest.mark.parametrize(("xdtype", "ydtype"), [PAIRS[0], PAIRS[4]], ids=[PAIR_IDS[0], PAIR_IDS[4]])
def test_the_threaded_entry_gives_the_serial_bits(xdtype, ydtype):
    """A call past ``numba_.SERIAL_NUMEL`` runs the parallel entries over spans of rows
    (y's row step in y's dtype): the bits of the torch backend's one rounding. Two pairs
    (a 16-bit y in float32 lanes, a float32 y from float64): each pair's parallel entry
    is a compile of its own, and the span logic does not depend on the dtypes."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(numba_.SERIAL_NUMEL // 256 + 37, 256, generator=g, dtype=torch.float64)
    x = (x * 2 + 3).to(xdtype)
    w = torch.randn(256, generator=g, dtype=torch.float64).to(xdtype)
    got = layernorm.layer_norm(x, 256, w, backend="numba", out_dtype=ydtype)
    want = layernorm.layer_norm(x, 256, w, backend="torch", out_dtype=ydtype)
    assert torch.equal(got.view(BITS[ydtype]), want.view(BITS[ydtype]))


@pytest.mark.parametrize("backend", [None, "numba", "torch"], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("xdtype", "ydtype"), PAIRS, ids=PAIR_IDS)
def test_gradients_are_the_plain_calls_with_dy_widened(xdtype, ydtype, op, backend):
    """``dy`` arrives in y's dtype and is widened to z's exactly: dx (dresidual),
    dweight and dbias are the plain call's for that ``dy``, bit for bit, in the input's
    and parameters' dtypes."""
    g = torch.Generator().manual_seed(13)
    shape, ns = (2, 3, 16), (3, 16)
    x, r = (torch.randn(shape, generator=g, dtype=torch.float64).to(xdtype) for _ in range(2))
    w, b = (torch.randn(ns, generator=g, dtype=torch.float64).to(xdtype) for _ in range(2))
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(ydtype)
    results = []
    for kw, grad_y in (({"out_dtype": ydtype}, dy), ({}, dy.to(xdtype))):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        y, _ = _call(op, *leaves[:2], ns, *leaves[2:], backend=backend, **kw)
        assert y.dtype == grad_y.dtype
        results.append(torch.autograd.grad(y, leaves, grad_y, allow_unused=True))
    for got, want in zip(*results, strict=True):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype == xdtype
        assert torch.equal(got, want)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    ("shape", "ns"), [lay[1:] for lay in LAYOUTS], ids=[lay[0] for lay in LAYOUTS]
)
def test_eager_training_is_the_ops_gradients(monkeypatch, shape, ns, op):
    """An eager call with grad that no mechanism sees runs the kernels without the custom
    op: the compiled front door's node (``layernorm::NormBackward``, contiguous rows of
    one dim) or :class:`layernorm._op.EagerNorm`; with the fast paths off,
    ``layernorm::forward_to``.
    The same outputs and gradients, bit for bit, and the same second derivatives
    (``create_graph``: both run the differentiable composite backward)."""
    from layernorm import ops

    g = torch.Generator().manual_seed(21)
    x, r, w, b = (torch.randn(s, generator=g) for s in (shape, shape, ns, ns))
    dy = torch.randn(shape, generator=g).to(torch.bfloat16)

    def run(fast: bool):
        monkeypatch.setattr(ops, "FAST_PATHS", fast)
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        y, _ = _call(op, *leaves[:2], ns, *leaves[2:], out_dtype=torch.bfloat16)
        first = torch.autograd.grad(y, leaves, dy, create_graph=True, allow_unused=True)
        used = [(leaf, d) for leaf, d in zip(leaves, first, strict=True) if d is not None]
        total = sum((d.double() ** 2).sum() for _, d in used)
        second = torch.autograd.grad(total, [leaf for leaf, _ in used], allow_unused=True)
        fn = y.grad_fn
        while "View" in type(fn).__name__:  # y is a view of the op's rows
            fn = fn.next_functions[0][0]
        return fn.name(), y, first, second

    fast, slow = run(True), run(False)
    assert fast[0] in ("EagerNormBackward", "layernorm::NormBackward"), fast[0]
    assert "forward_to" in slow[0], slow[0]
    assert torch.equal(fast[1], slow[1])
    for a, c in zip((*fast[2], *fast[3]), (*slow[2], *slow[3]), strict=True):
        assert (a is None) == (c is None)
        if a is not None:
            assert torch.equal(a, c)


def test_eager_training_under_a_mode_goes_through_the_op():
    # a TorchDispatchMode sees the call: layernorm::forward_to, not EagerNorm
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, requires_grad=True)
    with Recording():
        y = layernorm.layer_norm(x, 8, out_dtype=torch.bfloat16)
    assert "EagerNorm" not in type(y.grad_fn).__name__
    assert any("layernorm.forward_to" in name for name in seen), seen


# ---------------------------------------------------------------------------------------
# mechanisms (docs/contract.md §6)


def _unit(t: torch.Tensor) -> float:
    return float(torch.finfo(t.dtype).eps)


@pytest.mark.parametrize(("xdtype", "ydtype"), [PAIRS[0], PAIRS[4]], ids=[PAIR_IDS[0], PAIR_IDS[4]])
@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
@pytest.mark.parametrize(
    ("shape", "ns"), [lay[1:] for lay in LAYOUTS], ids=[lay[0] for lay in LAYOUTS]
)
def test_vmap_and_grad(shape, ns, op, xdtype, ydtype):
    """vmap over a leading batch is the eager call per sample, bit for bit;
    torch.func.grad is eager autograd's gradient (its backward is the differentiable
    composite one: within float32's rounding)."""
    g = torch.Generator().manual_seed(17)
    x, r = (torch.randn((5, *shape), generator=g, dtype=xdtype) for _ in range(2))
    w, b = (torch.randn(ns, generator=g, dtype=xdtype) for _ in range(2))

    def outputs(x, r):
        return tuple(t for t in _call(op, x, r, ns, w, b, out_dtype=ydtype) if t is not None)

    batched = vmap(outputs)(x, r)
    for i in range(5):
        for got, e in zip(batched, outputs(x[i], r[i]), strict=True):
            assert got.dtype == e.dtype and torch.equal(got[i], e)
    c = torch.randn(shape, generator=g, dtype=torch.float64).to(ydtype)

    def loss(x, r, w, b):
        return (_call(op, x, r, ns, w, b, out_dtype=ydtype)[0] * c).double().sum()

    got = grad(loss, argnums=(0, 1, 2, 3))(x[0], r[0], w, b)
    leaves = [t.clone().requires_grad_() for t in (x[0], r[0], w, b)]
    want = torch.autograd.grad(loss(*leaves), leaves, allow_unused=True, materialize_grads=True)
    for a, e in zip(got, want, strict=True):  # (grad's backward is the composite one)
        assert a.dtype == e.dtype
        assert_close(a, e)


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_jvp_and_forward_ad(op):
    """torch.func.jvp of a float64 input with a float32 output is J·t from reverse mode's
    Jacobian of the float64 call, within float32's rounding."""
    g = torch.Generator().manual_seed(19)
    shape, ns = (2, 3, 8), (3, 8)
    x, r = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    w, b = (torch.randn(ns, generator=g, dtype=torch.float64) for _ in range(2))
    primals = (x, r, w, b)
    tangents = tuple(torch.randn_like(t) for t in primals)

    def f(*t, **kw):
        return _call(op, t[0], t[1], ns, t[2], t[3], **kw)[0].reshape(-1)

    value, got = jvp(lambda *t: f(*t, out_dtype=torch.float32), primals, tangents)
    assert value.dtype == got.dtype == torch.float32
    assert torch.equal(value, f(*primals, out_dtype=torch.float32))
    jac = torch.autograd.functional.jacobian(f, primals)
    want = sum(
        j.reshape(got.numel(), -1) @ t.reshape(-1) for j, t in zip(jac, tangents, strict=True)
    )
    assert_close(got.double(), want, rtol=4 * _unit(got), atol=4 * _unit(got))


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_compile_fullgraph(op):
    """torch.compile (fullgraph) runs ``layernorm::forward_to``: the eager bits, values
    and gradients."""
    g = torch.Generator().manual_seed(23)
    shape, ns = (2, 3, 8), (3, 8)
    x, r = (torch.randn(shape, generator=g) for _ in range(2))
    w, b = (torch.randn(ns, generator=g) for _ in range(2))
    torch._dynamo.reset()

    def f(*t):
        y, h = _call(op, *t[:2], ns, *t[2:], out_dtype=torch.bfloat16)
        return y if h is None else (y, h)

    compiled = torch.compile(f, fullgraph=True)
    results = []
    for run in (compiled, f):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        out = run(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        total = sum((o.double() * (k + 1)).sum() for k, o in enumerate(outs))
        grads = torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)
        results.append((outs, grads))
    assert results[0][0][0].dtype == torch.bfloat16
    for a, e in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert a.dtype == e.dtype and torch.equal(a, e)


class _Module(torch.nn.Module):
    def __init__(self, op, ns, w, b, out_dtype):
        super().__init__()
        self.op, self.ns, self.out_dtype = op, ns, out_dtype
        self.w, self.b = torch.nn.Parameter(w), torch.nn.Parameter(b)

    def forward(self, x, r):
        y, h = _call(self.op, x, r, self.ns, self.w, self.b, out_dtype=self.out_dtype)
        return y if h is None else (y, h)


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_export_and_jit_trace_run_on_new_inputs(op):
    """torch.export (non-strict) and jit.trace record the decomposition (float32, then one
    conversion into y's dtype: not correctly rounded, within one unit of y's dtype of the
    eager call) and run it on other inputs; ``residual_out`` is exact."""
    g = torch.Generator().manual_seed(29)
    shape, ns = (2, 3, 8), (3, 8)
    x, r, x2, r2 = (torch.randn(shape, generator=g) for _ in range(4))
    w, b = (torch.randn(ns, generator=g) for _ in range(2))
    module = _Module(op, ns, w, b, torch.bfloat16)
    with torch.no_grad():
        want = module(x2, r2)
        want = want if isinstance(want, tuple) else (want,)
        program = torch.export.export(module, (x, r), strict=False)
        traced = torch.jit.trace(module, (x, r), check_trace=False)
        for got in (program.module()(x2, r2), traced(x2, r2)):
            got = got if isinstance(got, tuple) else (got,)
            for a, e in zip(got, want, strict=True):
                assert a.dtype == e.dtype
                unit = _unit(e)
                assert_close(a.double(), e.double(), rtol=unit, atol=unit)


def test_checks():
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        layernorm.add_rms_norm(x, x, 4, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"output dtypes are float64, float32, bfloat16"):
        layernorm.layer_norm(x, 4, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"memory_efficient=True takes an out_dtype at least"):
        layernorm.layer_norm(x, 4, out_dtype=torch.bfloat16, memory_efficient=True)
    with pytest.raises(ValueError, match="does not combine with out_dtype"):
        layernorm.rms_norm(x, 4, out_dtype=torch.bfloat16, casting_mode="llama")
    with pytest.raises(RuntimeError, match="Expected out tensor to have dtype c10::BFloat16"):
        layernorm.layer_norm(x, 4, out_dtype=torch.bfloat16, out=torch.empty(2, 4))
    out = torch.empty(2, 4, dtype=torch.bfloat16)
    assert layernorm.layer_norm(x, 4, out_dtype=torch.bfloat16, out=out) is out
    assert torch.equal(out, layernorm.layer_norm(x, 4, out_dtype=torch.bfloat16))


def test_module_attribute():
    """``out_dtype`` set on a module instance is the option (a narrower one too)."""
    module = layernorm.LayerNorm(8)
    x = torch.randn(3, 8)
    module.out_dtype = torch.bfloat16
    got = module(x)
    want = layernorm.layer_norm(x, 8, module.weight, module.bias, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
