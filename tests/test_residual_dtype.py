"""The residual stream in a dtype of its own (``residual_dtype`` of add_layer_norm and
add_rms_norm, quack's; a residual wider than ``x``, flash-attn's ``residual_in_fp32``;
docs/contract.md §2, §3): ``residual_out`` is the exact ``x + residual`` rounded once into
the stream's dtype, ``y`` the norm of it rounded once into ``x``'s dtype (or
``out_dtype``), against the exact oracle; the stream's gradient is correctly rounded and
``dx`` is it rounded to ``x``'s dtype; every mechanism of §6 runs it.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.func import grad, jvp, vmap
from torch.testing import assert_close

import _oracle
import layernorm

pytest.importorskip("numba")

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
MASK = {torch.float32: 0xFFFFFFFF, torch.bfloat16: 0xFFFF, torch.float16: 0xFFFF}
#: (x's dtype, the residual's dtype, residual_dtype): the stream's dtype is the last, or
#: the residual's
CASES = [
    (torch.bfloat16, torch.float32, None),
    (torch.float16, torch.float32, None),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.float16, torch.float32, torch.float32),
    (torch.float32, torch.float64, None),
    (torch.float32, torch.float32, torch.float64),
]
CASE_IDS = [f"{str(a)[6:]}+{str(b)[6:]}-{str(c)[6:]}" for a, b, c in CASES]
OPS = ["add_layer_norm", "add_rms_norm"]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(BITS[t.dtype]).numpy().astype(np.int64) & MASK[t.dtype]


def _call(op, x, r, shape, w, b, **kw):
    extra = () if "rms" in op else (b,)
    return getattr(layernorm, op)(x, r, shape, w, *extra, **kw)


def _kw(rdtype):
    return {} if rdtype is None else {"residual_dtype": rdtype}


def _round_fraction(q: Fraction, dtype: torch.dtype) -> float:
    """The exact ``q`` rounded to nearest-even in float32 or float64 (no double rounding:
    the nearest of the candidates around the float64 guess, by exact distances)."""
    if dtype == torch.float64:
        return float(q)  # Fraction's conversion is correctly rounded
    guess = np.float32(float(q))
    inf = np.float32(np.inf)
    best = None
    for c in (np.nextafter(guess, -inf), guess, np.nextafter(guess, inf)):
        key = (abs(Fraction(float(c)) - q), int(np.array(c).view(np.uint32)) & 1)
        best = (key, c) if best is None or key < best[0] else best
    return float(best[1])


def _inputs(g, xdtype, residual_dtype, shape, spread=False):
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(xdtype)
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    if spread:  # residual elements over a wide range of exponents: sums that round
        r = r * torch.exp2(torch.randint(-30, 30, shape, generator=g).double())
    return x, r.to(residual_dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("xdtype", "residual_dtype", "rdtype"), CASES, ids=CASE_IDS)
def test_residual_out_is_the_exact_sum_rounded_once(xdtype, residual_dtype, rdtype, op):
    g = torch.Generator().manual_seed(41)
    x, r = _inputs(g, xdtype, residual_dtype, (4, 64), spread=True)
    stream = rdtype or residual_dtype
    _, h = _call(op, x, r, 64, None, None, **_kw(rdtype))
    assert h.dtype == stream
    want = [
        _round_fraction(Fraction(float(a)) + Fraction(float(c)), stream)
        for a, c in zip(x.double().flatten().tolist(), r.double().flatten().tolist(), strict=True)
    ]
    assert h.flatten().double().tolist() == want


@pytest.mark.parametrize("backend", [None, "numba", "torch"], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("xdtype", "residual_dtype", "rdtype"), CASES, ids=CASE_IDS)
def test_y_is_the_streams_norm_rounded_once(xdtype, residual_dtype, rdtype, op, backend):
    """y is the exact norm of the rounded stream ``residual_out`` (in its dtype, with
    the parameters as its accumulation dtype holds them) rounded once into x's dtype,
    and is the unfused call on that stream with ``out_dtype=x.dtype``, bit for bit."""
    g = torch.Generator().manual_seed(43)
    rms = "rms" in op
    n = 48 if torch.float64 in (residual_dtype, rdtype) else 128
    x, r = _inputs(g, xdtype, residual_dtype, (3, n))
    x = x + 20
    w = torch.randn(n, generator=g).to(xdtype)
    b = torch.randn(n, generator=g).to(xdtype)
    y, h = _call(op, x, r, n, w, b, eps=1e-5, backend=backend, **_kw(rdtype))
    assert y.dtype == xdtype
    unfused = (layernorm.rms_norm(h, n, w, eps=1e-5, backend=backend, out_dtype=xdtype) if rms
               else layernorm.layer_norm(h, n, w, b, eps=1e-5, backend=backend, out_dtype=xdtype))  # fmt: skip
    assert torch.equal(y, unfused)
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    gamma, beta = w.to(acc).double().numpy(), b.to(acc).double().numpy()
    got = _bits(y).reshape(-1, n)
    for i, row in enumerate(h.double().numpy()):
        if h.dtype == torch.float64:
            from test_out_dtype import _forward64

            want, zero = _forward64(row, gamma, beta * (not rms), 1e-5, rms, NAMES[xdtype])
        else:
            want, zero = _oracle.forward(row, gamma, beta * (not rms), 1e-5, rms, NAMES[xdtype])
        assert ((want == got[i]) | zero).all()


@pytest.mark.parametrize("backend", [None, "numba", "torch"], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("xdtype", "residual_dtype", "rdtype"), CASES[:4], ids=CASE_IDS[:4])
def test_the_streams_gradient_is_correctly_rounded(xdtype, residual_dtype, rdtype, op, backend):
    """The stream's gradient ``dh = dz + d residual_out`` (the residual's, in float32)
    is the exact value rounded once (the oracle); ``dx`` is it rounded to x's dtype (the
    second rounding docs/contract.md §3 states); dweight, dbias are the unfused call's."""
    g = torch.Generator().manual_seed(47)
    n = 96
    x, r = _inputs(g, xdtype, residual_dtype, (3, n))
    w, b = (torch.randn(n, generator=g) * 0.5 + 1).to(xdtype), torch.randn(n, generator=g)
    dy = torch.randn(3, n, generator=g).to(xdtype)
    dres = torch.randn(3, n, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    y, h = _call(op, *leaves[:2], n, *leaves[2:], eps=1e-5, backend=backend, **_kw(rdtype))
    dx, dr, dw, db = torch.autograd.grad((y, h), leaves, (dy, dres), allow_unused=True)
    assert dx.dtype == xdtype and dr.dtype == residual_dtype
    stream = h.detach()
    gamma = w.float().double().numpy()
    rows = []
    for i in range(3):
        want, zero = _oracle.backward(stream[i].double().numpy(), dy[i].double().numpy(), gamma,
                                      dres[i].double().numpy(), 1e-5, "rms" in op, "float32")  # fmt: skip
        rows.append(np.where(zero, 0, want))
    # the stream's gradient, correctly rounded in float32 (an exact zero is +0.0)
    dh = torch.from_numpy(np.array(rows, np.int64).astype(np.uint32).view(np.int32)).view(
        torch.float32
    )
    # dresidual: dh in the residual's dtype (itself for a float32 residual); dx: dh
    # rounded to x's dtype
    assert torch.equal(dr, dh.to(residual_dtype))
    assert torch.equal(dx, dh.to(xdtype))
    # dweight, dbias: the unfused call's on the stream
    hl, wl, bl = (t.clone().requires_grad_() for t in (stream, w, b))
    yu = (layernorm.rms_norm(hl, n, wl, eps=1e-5, backend=backend, out_dtype=xdtype) if "rms" in op
          else layernorm.layer_norm(hl, n, wl, bl, eps=1e-5, backend=backend, out_dtype=xdtype))  # fmt: skip
    want = torch.autograd.grad(yu, (wl, bl), dy, allow_unused=True)
    assert torch.equal(dw, want[0])
    if db is not None:
        assert torch.equal(db, want[1])


LAYOUTS = [
    ("1d", (8,), (8,)),
    ("2d", (5, 8), (8,)),
    ("3d-2dims", (2, 3, 8), (3, 8)),
    ("4d-2dims", (2, 2, 3, 4), (3, 4)),
]


@pytest.mark.parametrize("op", OPS)
def test_every_layout_gives_the_rows_bits(op):
    """1-D to 4-D inputs, two-dim normalized shapes, a transposed input and zero-size
    inputs: shapes, dtypes and the bits of the same rows as a contiguous matrix."""
    g = torch.Generator().manual_seed(53)
    cases = [(torch.randn(s, generator=g).bfloat16(), ns) for _, s, ns in LAYOUTS]
    cases.append((torch.randn(8, 5, generator=g).bfloat16().t(), (8,)))
    cases += [(torch.randn(0, 8).bfloat16(), (8,)), (torch.randn(3, 0, 8).bfloat16(), (8,))]
    for x, ns in cases:
        n = int(np.prod(ns))
        r = torch.randn(x.shape, generator=g)
        w, b = torch.randn(ns, generator=g), torch.randn(ns, generator=g)
        y, h = _call(op, x, r, ns, w, b)
        assert y.shape == h.shape == x.shape
        assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
        fy, fh = _call(op, x.reshape(-1, n), r.reshape(-1, n), (n,), w.reshape(n), b.reshape(n))
        assert torch.equal(y.reshape(-1, n), fy) and torch.equal(h.reshape(-1, n), fh)


def test_out_dtype_and_preallocated_outputs():
    g = torch.Generator().manual_seed(59)
    x, r = torch.randn(3, 16, generator=g).bfloat16(), torch.randn(3, 16, generator=g)
    y, h = layernorm.add_layer_norm(x, r, 16, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, layernorm.layer_norm(h, 16))
    out, stream = torch.empty(3, 16, dtype=torch.bfloat16), torch.empty(3, 16)
    got = layernorm.add_rms_norm(x, r, 16, out=out, residual_out=stream)
    assert got[0] is out and got[1] is stream
    want = layernorm.add_rms_norm(x, r, 16)
    assert torch.equal(out, want[0]) and torch.equal(stream, want[1])


def test_checks():
    x = torch.randn(2, 4)
    with pytest.raises(layernorm.NormalizedShapeError, match="residual must match input"):
        layernorm.add_layer_norm(x, x.bfloat16(), 4)  # a residual narrower than x
    with pytest.raises(layernorm.NormalizedShapeError, match="residual must match input"):
        layernorm.add_layer_norm(x.bfloat16(), torch.randn(2, 3, 4), 4)
    with pytest.raises(TypeError, match=r"residual_dtype must be a floating torch\.dtype"):
        layernorm.add_rms_norm(x, x, 4, residual_dtype=torch.int32)
    with pytest.raises(ValueError, match="must hold every value of the input"):
        layernorm.add_rms_norm(x, x, 4, residual_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not combine with a residual stream"):
        layernorm.add_rms_norm(x.bfloat16(), x, 4, casting_mode="llama")
    with pytest.raises(RuntimeError, match="Expected residual_out tensor to have dtype float"):
        layernorm.add_rms_norm(x.bfloat16(), x, 4, residual_out=torch.empty(2, 4).bfloat16())
    with pytest.raises(TypeError, match="unexpected keyword argument 'residual_dtype'"):
        layernorm.layer_norm(x, 4, residual_dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# mechanisms (docs/contract.md §6)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("shape", "ns"), [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_vmap_and_grad(shape, ns, op):
    g = torch.Generator().manual_seed(61)
    x, r = torch.randn((4, *shape), generator=g).bfloat16(), torch.randn((4, *shape), generator=g)
    w, b = torch.randn(ns, generator=g), torch.randn(ns, generator=g)
    batched = vmap(lambda x, r: _call(op, x, r, ns, w, b))(x, r)
    for i in range(4):
        for got, want in zip(batched, _call(op, x[i], r[i], ns, w, b), strict=True):
            assert got.dtype == want.dtype and torch.equal(got[i], want)
    c = torch.randn(shape, generator=g)

    def loss(x, r, w, b):
        y, h = _call(op, x, r, ns, w, b)
        return (y.double() * c).sum() + (h.double() * c).sum() / 3

    got = grad(loss, argnums=(0, 1, 2, 3))(x[0], r[0], w, b)
    leaves = [t.clone().requires_grad_() for t in (x[0], r[0], w, b)]
    want = torch.autograd.grad(loss(*leaves), leaves, allow_unused=True, materialize_grads=True)
    for a, e in zip(got, want, strict=True):  # (grad's backward is the composite one)
        assert a.dtype == e.dtype
        assert_close(a, e)


@pytest.mark.parametrize("op", OPS)
def test_jvp_and_forward_ad(op):
    """jvp with a float32 input and a float64 stream: J·t of the float64 composition
    (float32 output: within float32's rounding)."""
    g = torch.Generator().manual_seed(67)
    shape, ns = (2, 3, 8), (3, 8)
    x = torch.randn(shape, generator=g)
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    w, b = torch.randn(ns, generator=g), torch.randn(ns, generator=g)
    primals = (x, r, w, b)
    tangents = tuple(torch.randn_like(t) for t in primals)

    def f(x, r, w, b):
        return _call(op, x, r, ns, w, b)[0]

    _, got = jvp(f, primals, tangents)
    wide = tuple(t.double() for t in primals)

    def g64(x, r, w, b):
        return _call(op, x, r, ns, w, b)[0]

    _, want = jvp(g64, wide, tuple(t.double() for t in tangents))
    unit = float(torch.finfo(torch.float32).eps)
    assert got.dtype == torch.float32
    assert_close(got.double(), want, rtol=4 * unit, atol=4 * unit)


@pytest.mark.parametrize("op", OPS)
def test_compile_fullgraph(op):
    g = torch.Generator().manual_seed(71)
    shape, ns = (2, 3, 8), (3, 8)
    x, r = torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g)
    w, b = torch.randn(ns, generator=g), torch.randn(ns, generator=g)
    torch._dynamo.reset()

    def f(*t):
        return _call(op, t[0], t[1], ns, t[2], t[3])

    results = []
    for run in (torch.compile(f, fullgraph=True), f):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        outs = run(*leaves)
        total = sum((o.double() * (k + 1)).sum() for k, o in enumerate(outs))
        grads = torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)
        results.append((tuple(outs), grads))
    for a, e in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert a.dtype == e.dtype and torch.equal(a, e)


class _Module(torch.nn.Module):
    def __init__(self, op, ns, w, b):
        super().__init__()
        self.op, self.ns = op, ns
        self.w, self.b = torch.nn.Parameter(w), torch.nn.Parameter(b)

    def forward(self, x, r):
        return _call(self.op, x, r, self.ns, self.w, self.b)


@pytest.mark.parametrize("op", OPS)
def test_export_and_jit_trace_run_on_new_inputs(op):
    """Export and tracing record the sum and the decomposition: ``residual_out`` exact,
    ``y`` within one unit of bfloat16 of the eager call."""
    g = torch.Generator().manual_seed(73)
    shape, ns = (2, 3, 8), (3, 8)
    x, x2 = (torch.randn(shape, generator=g).bfloat16() for _ in range(2))
    r, r2 = (torch.randn(shape, generator=g) for _ in range(2))
    module = _Module(op, ns, torch.randn(ns, generator=g), torch.randn(ns, generator=g))
    with torch.no_grad():
        want = module(x2, r2)
        program = torch.export.export(module, (x, r), strict=False)
        traced = torch.jit.trace(module, (x, r), check_trace=False)
        for got in (program.module()(x2, r2), traced(x2, r2)):
            assert torch.equal(got[1], want[1])
            unit = float(torch.finfo(torch.bfloat16).eps)
            assert got[0].dtype == torch.bfloat16
            assert_close(got[0].double(), want[0].double(), rtol=unit, atol=unit)
