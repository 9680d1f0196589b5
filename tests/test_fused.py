"""``layernorm.fused_norm`` (docs/contract.md §2 "fused_norm"): the composition of the
dropout-add (``h``, bit for bit the torch dropout-add, which tests/test_dropout_add.py
holds against exact rationals) and the public norms on ``h`` (``y``, ``y1`` bit for bit
``layer_norm(h)`` / ``rms_norm(h)``, which are correctly rounded, and within rounding of
a float64 reference); masks; gradients (gradcheck in float64, the forward's masks in the
backward); every PyTorch mechanism of §6; seeds; every error before any work."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jvp, vjp, vmap
from torch.testing import assert_close

import layernorm
from layernorm import fused_norm
from layernorm.backends import _dropout_add as da
from layernorm.backends import _philox
from test_dropout_add import exact_round

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch\\.jit\\.[a-z_]+` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPES = [F32, BF16, F16, F64]
#: (input shape, normalized_shape): 1-D to 4-D, one and two normalized dims
SHAPES = [((16,), 16), ((5, 16), (16,)), ((2, 3, 16), (3, 16)), ((2, 2, 3, 8), (3, 8))]
#: which of residual, x1, weight1 (+bias1), rowscale a call has
FEATURES = [
    (),
    ("residual",),
    ("residual", "x1", "weight1"),
    ("rowscale", "residual"),
    ("x1", "rowscale", "weight1"),
]
#: a float64 reference's tolerance for an output correctly rounded in each dtype
TOL = {F32: 2e-6, BF16: 1e-2, F16: 2e-3, F64: 1e-12}


def _leading(shape, nshape) -> tuple[int, ...]:
    k = 1 if isinstance(nshape, int) else len(nshape)
    return tuple(shape[: len(shape) - k])


def _make(shape, nshape, dtype, features, seed=0, rdtype=None):
    gen = torch.Generator().manual_seed(seed)
    ns = (nshape,) if isinstance(nshape, int) else tuple(nshape)
    lead = _leading(shape, nshape)

    def rand(*s, dt=dtype):
        return torch.randn(*s, generator=gen, dtype=F64).to(dt)

    kw = {}
    x = rand(*shape)
    weight, bias = rand(*ns), rand(*ns)
    if "residual" in features:
        kw["residual"] = rand(*shape, dt=rdtype or dtype)
    if "x1" in features:
        kw["x1"] = rand(*shape)
    if "weight1" in features:
        kw["weight1"], kw["bias1"] = rand(*ns), rand(*ns)
    if "rowscale" in features:
        kw["rowscale"] = torch.rand(lead, generator=gen, dtype=F64).to(dtype) + 0.5
    return x, weight, bias, kw


def _rows(t, n):
    return None if t is None else t.reshape(-1, n)


def _expected_h(x, nshape, kw, p, seed, rdtype):
    n = math.prod((nshape,) if isinstance(nshape, int) else nshape)
    rs = kw.get("rowscale")
    h, k0, k1 = da.dropout_add(
        _rows(x, n), _rows(kw.get("x1"), n), _rows(kw.get("residual"), n),
        None if rs is None else rs.reshape(-1), seed, p, rdtype, True,
    )  # fmt: skip
    return h.view(x.shape), k0.view(x.shape), None if k1 is None else k1.view(x.shape)


def _float64_layer_norm(h, nshape, w, b, eps):
    ns = (nshape,) if isinstance(nshape, int) else tuple(nshape)
    return F.layer_norm(h.double(), ns, w.double(), None if b is None else b.double(), eps)


@pytest.mark.parametrize("p", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "+".join(f) or "plain")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: f"{len(s[0])}d")
def test_fused_norm_is_the_composition(shapes, dtype, features, p):
    """h is the dropout-add (bits), y and y1 are the public layer_norm of h (bits) and
    within rounding of a float64 layer norm of h; the masks are Philox's; residual_out is
    None exactly when h would be x."""
    shape, nshape = shapes
    x, w, b, kw = _make(shape, nshape, dtype, features, seed=len(shape))
    seed = 4321
    out = fused_norm(x, nshape, w, b, dropout_p=p, seed=seed, return_dropout_mask=True, **kw)
    h, k0, k1 = _expected_h(x, nshape, kw, p, seed, dtype)
    plain = not any(k in kw for k in ("residual", "x1", "rowscale"))
    if plain and p == 0.0:
        assert out.residual_out is None
        assert torch.equal(h, x)
    else:
        assert out.residual_out.dtype == dtype and torch.equal(out.residual_out, h)
    assert torch.equal(out.dropout_mask, k0)
    assert (out.dropout_mask1 is None) == ("x1" not in kw)
    if k1 is not None:
        assert torch.equal(out.dropout_mask1, k1)
    assert out.y.dtype == dtype and out.y.shape == x.shape
    assert torch.equal(out.y, layernorm.layer_norm(h, nshape, w, b, 1e-5))
    assert_close(
        out.y.double(),
        _float64_layer_norm(h, nshape, w, b, 1e-5),
        rtol=TOL[dtype],
        atol=TOL[dtype] * 4,
    )
    if "weight1" in kw:
        assert torch.equal(
            out.y1, layernorm.layer_norm(h, nshape, kw["weight1"], kw["bias1"], 1e-5)
        )
    else:
        assert out.y1 is None
    # without masks asked for: the same outputs, no masks
    again = fused_norm(x, nshape, w, b, dropout_p=p, seed=seed, **kw)
    assert again.dropout_mask is None and again.dropout_mask1 is None
    assert torch.equal(again.y, out.y)
    assert (again.residual_out is None) == (out.residual_out is None)
    if out.residual_out is not None:  # (p = 0 with a residual alone: the add_* kernel)
        assert torch.equal(again.residual_out, out.residual_out)
    if out.y1 is not None:
        assert torch.equal(again.y1, out.y1)


@pytest.mark.parametrize("masks", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize(
    "dtype, rdtype", [(F32, F32), (BF16, BF16), (F16, F16), (F64, F64), (BF16, F32), (F16, F32)]
)
def test_a_residual_alone_is_the_add_call(dtype, rdtype, rms, masks):
    """With a residual alone at p = 0, fused_norm is add_layer_norm / add_rms_norm (with
    ``residual_dtype`` for a wider residual stream): the same y, residual_out and
    gradients, bit for bit, masks asked for or not; and h, y are the general path's (the
    dropout-add's h, the norm of h)."""
    x, w, b, kw = _make((2, 3, 64), 64, dtype, ("residual",), seed=7, rdtype=rdtype)
    x.requires_grad_(True)
    r = kw["residual"].requires_grad_(True)
    b = None if rms else b
    gy = torch.randn_like(x, dtype=F64).to(dtype)
    gh = torch.randn_like(x, dtype=F64).to(rdtype)
    out = fused_norm(x, 64, w, b, 1e-5, rms=rms, residual=r, return_dropout_mask=masks)
    wide = {} if rdtype == dtype else {"residual_dtype": rdtype}
    if rms:
        y, h = layernorm.add_rms_norm(x, r, 64, w, 1e-5, **wide)
    else:
        y, h = layernorm.add_layer_norm(x, r, 64, w, b, 1e-5, **wide)
    assert torch.equal(out.y, y) and torch.equal(out.residual_out, h)
    expected_h = _expected_h(x.detach(), 64, {"residual": r.detach()}, 0.0, 0, rdtype)[0]
    assert torch.equal(h, expected_h)
    norm = layernorm.rms_norm if rms else layernorm.layer_norm
    bias = {} if rms else {"bias": b}
    assert torch.equal(y, norm(expected_h, 64, w, eps=1e-5, out_dtype=dtype, **bias))
    ours = torch.autograd.grad((out.y * gy).sum() + (out.residual_out * gh).sum(), (x, r))
    theirs = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), (x, r))
    assert all(torch.equal(a, c) for a, c in zip(ours, theirs, strict=True))
    if masks:
        assert out.dropout_mask.dtype == torch.bool and bool(out.dropout_mask.all())
        assert out.dropout_mask.shape == x.shape and out.dropout_mask1 is None


@pytest.mark.parametrize("masks", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_a_wider_stream_alone_is_x_widened(dtype, masks):
    """No residual, p = 0 and a wider residual_dtype (flash-attn's first block with
    residual_in_fp32): h is x converted exactly, y the norm of h in x's dtype, and the
    gradients those of that composition (dx = dh rounded once, as the dropout-add's)."""
    x, w, b, _ = _make((2, 3, 64), 64, dtype, (), seed=8)
    x.requires_grad_(True)
    gy = torch.randn_like(x, dtype=F64).to(dtype)
    gh = torch.randn_like(x, dtype=F64)
    out = fused_norm(x, 64, w, b, residual_dtype=F64, return_dropout_mask=masks)
    h = x.double()
    y = layernorm.layer_norm(h, 64, w, b, out_dtype=dtype)
    assert out.residual_out.dtype == F64 and torch.equal(out.residual_out, h)
    assert torch.equal(out.residual_out, _expected_h(x.detach(), 64, {}, 0.0, 0, F64)[0])
    assert out.y.dtype == dtype and torch.equal(out.y, y)
    (ours,) = torch.autograd.grad((out.y * gy).sum() + (out.residual_out * gh).sum(), x)
    (theirs,) = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), x)
    assert torch.equal(ours, theirs)
    if masks:
        assert bool(out.dropout_mask.all()) and out.dropout_mask1 is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_and_options_are_the_public_functions_on_h(dtype):
    """rms=True is rms_norm of h (eps=None: rms_norm's rule for x's dtype); offset and
    out_dtype (wider or narrower) are those options of the public functions, on h."""
    shape, nshape = (3, 4, 16), 16
    x, w, _, kw = _make(shape, nshape, dtype, ("residual", "x1", "weight1"), seed=9)
    kw.pop("bias1")
    h, _, _ = _expected_h(x, nshape, kw, 0.2, 5, dtype)
    out = fused_norm(x, nshape, w, rms=True, dropout_p=0.2, seed=5, **kw)
    assert torch.equal(out.y, layernorm.rms_norm(h, nshape, w))
    assert torch.equal(out.y1, layernorm.rms_norm(h, nshape, kw["weight1"]))
    out = fused_norm(x, nshape, w, eps=1e-3, rms=True, offset=1.0, dropout_p=0.2, seed=5, **kw)
    assert torch.equal(out.y, layernorm.rms_norm(h, nshape, w, 1e-3, offset=1.0))
    # out_dtype wider or narrower than h's: the public functions' out_dtype on h
    other = F64 if dtype != F64 else F32
    for out_dtype in (other, BF16 if dtype != BF16 else F16):
        out = fused_norm(x, nshape, w, dropout_p=0.2, seed=5, out_dtype=out_dtype, **kw)
        assert out.y.dtype == out_dtype and out.residual_out.dtype == dtype
        assert torch.equal(out.y, layernorm.layer_norm(h, nshape, w, out_dtype=out_dtype))
        assert torch.equal(
            out.y1, layernorm.layer_norm(h, nshape, kw["weight1"], out_dtype=out_dtype)
        )


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_residual_dtype_keeps_the_residual_stream_wide(dtype):
    """residual_dtype=float32 with half inputs (flash-attn's residual_in_fp32): h is the
    dropout-add rounded once to float32, y the norm of that h."""
    shape, nshape = (4, 32), 32
    x, w, b, kw = _make(shape, nshape, dtype, ("x1",), seed=3)
    kw["residual"] = torch.randn(shape, dtype=F32)
    out = fused_norm(
        x, nshape, w, b, dropout_p=0.1, seed=2, residual_dtype=F32, out_dtype=F32, **kw
    )
    h, _, _ = _expected_h(x, nshape, kw, 0.1, 2, F32)
    assert out.residual_out.dtype == F32 and torch.equal(out.residual_out, h)
    assert torch.equal(out.y, layernorm.layer_norm(h, nshape, w, b))
    # y in x's dtype (the default), narrower than h's: the norm of h rounded once to it
    out = fused_norm(x, nshape, w, b, dropout_p=0.1, seed=2, residual_dtype=F32, **kw)
    assert out.residual_out.dtype == F32 and torch.equal(out.residual_out, h)
    assert out.y.dtype == dtype
    assert torch.equal(out.y, layernorm.layer_norm(h, nshape, w, b, out_dtype=dtype))
    # a change of dtype alone makes h: x, exactly, in the wider dtype
    out = fused_norm(x, nshape, w, b, residual_dtype=F32, out_dtype=F32)
    assert torch.equal(out.residual_out, x.float())


def test_strided_inputs_give_the_contiguous_bits():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(16, 6, generator=gen).t()  # (6, 16) non-contiguous
    x1 = torch.randn(6, 32, generator=gen)[:, ::2]
    res = torch.randn(16, 6, generator=gen).t()
    rs = torch.rand(12, generator=gen)[::2]
    w = torch.randn(16, generator=gen)
    kw = dict(dropout_p=0.3, seed=8, weight1=w, return_dropout_mask=True)
    got = fused_norm(x, 16, w, residual=res, x1=x1, rowscale=rs, **kw)
    want = fused_norm(
        x.contiguous(), 16, w, residual=res.contiguous(), x1=x1.contiguous(),
        rowscale=rs.contiguous(), **kw,
    )  # fmt: skip
    for a, e in zip(got, want, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_zero_size(shape):
    x = torch.empty(shape)
    lead = shape[:-1]
    out = fused_norm(
        x, 8, torch.ones(8), residual=x, x1=x, weight1=torch.ones(8), rowscale=torch.ones(lead),
        dropout_p=0.5, seed=1, return_dropout_mask=True,
    )  # fmt: skip
    for t in out:
        assert t.shape == shape


def _masks_in_shape(shape, n, seed, p):
    m = math.prod(shape) // n
    off = _philox.offsets(m, n)
    return (
        _philox.keep(seed, off, p, stream=0).view(shape),
        _philox.keep(seed, off, p, stream=1).view(shape),
    )


def test_backward_uses_the_forwards_masks():
    """d residual_out / dx is k0·s·rowscale, d/dx1 is k1·s, d/dresidual is 1, with the
    masks the forward returned (regenerated from the seed, not stored)."""
    shape, n, p = (3, 5, 16), 16, 0.4
    x = torch.randn(shape, requires_grad=True)
    x1 = torch.randn(shape, requires_grad=True)
    res = torch.randn(shape, requires_grad=True)
    rs = torch.rand(3, 5) + 0.5
    out = fused_norm(
        x, n, residual=res, x1=x1, rowscale=rs, dropout_p=p, seed=77, return_dropout_mask=True
    )
    out.residual_out.backward(torch.ones(shape))
    s = _philox.dropout_scale(p)
    k0, k1 = out.dropout_mask, out.dropout_mask1
    assert torch.equal(k0, _masks_in_shape(shape, n, 77, p)[0])
    scaled = [exact_round(Fraction(s) * Fraction(v), F32) for v in rs.reshape(-1).tolist()]
    want0 = torch.where(k0, torch.tensor(scaled).view(3, 5, 1), 0.0)  # s·rs rounded once
    assert torch.equal(x.grad, want0)
    assert torch.equal(x1.grad, torch.where(k1, s, 0.0).float())
    assert torch.equal(res.grad, torch.ones(shape))


@pytest.mark.parametrize("rms", [False, True])
def test_gradcheck_float64(rms):
    """Every differentiable input's gradient against finite differences (float64, a
    fixed seed), through y, y1 and residual_out; and the second order."""
    shape, nshape = (2, 3, 8), (3, 8)
    gen = torch.Generator().manual_seed(1)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=F64, requires_grad=True)

    x, x1, res = r(*shape), r(*shape), r(*shape)
    w, b, w1, b1 = r(3, 8), r(3, 8), r(3, 8), r(3, 8)
    rs = torch.rand(2, generator=gen, dtype=F64) + 0.5
    if rms:
        b = b1 = None

    def f(x, x1, res, w, b, w1, b1):
        out = fused_norm(
            x, nshape, w, b, rms=rms, residual=res, x1=x1, weight1=w1, bias1=b1,
            rowscale=rs, dropout_p=0.3, seed=11,
        )  # fmt: skip
        return out.y, out.y1, out.residual_out

    inputs = (x, x1, res, w, b, w1, b1)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_the_backward_of_the_backward_is_the_dropout_add():
    """The dropout-add's backward is linear; its transpose (the double backward's d dh) is
    the dropout-add of the incoming gradients."""
    shape, p = (4, 8), 0.25
    x = torch.randn(shape, dtype=F64, requires_grad=True)
    x1 = torch.randn(shape, dtype=F64, requires_grad=True)
    res = torch.randn(shape, dtype=F64, requires_grad=True)
    rs = torch.rand(4, dtype=F64)
    h = fused_norm(x, 8, residual=res, x1=x1, rowscale=rs, dropout_p=p, seed=3).residual_out
    dh = torch.randn(shape, dtype=F64, requires_grad=True)
    gx, gx1, gr = torch.autograd.grad(h, (x, x1, res), dh, create_graph=True)
    a, b, c = (
        torch.randn(shape, dtype=F64),
        torch.randn(shape, dtype=F64),
        torch.randn(shape, dtype=F64),
    )
    (ddh,) = torch.autograd.grad((gx * a).sum() + (gx1 * b).sum() + (gr * c).sum(), dh)
    want, _, _ = da.dropout_add(a, b, c, rs, 3, p, F64, False)
    assert torch.equal(ddh, want)


def test_rowscale_gets_no_gradient():
    x = torch.randn(2, 8)
    rs = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"rowscale gets no gradient .*rowscale\.detach\(\)"):
        fused_norm(x, 8, rowscale=rs)
    with torch.no_grad():
        assert fused_norm(x, 8, rowscale=rs).residual_out is not None


# --- mechanisms ---------------------------------------------------------------------------


def _call(x, res, x1, w, b, w1, seed=7, p=0.2):
    out = fused_norm(x, (3, 8), w, b, residual=res, x1=x1, weight1=w1, dropout_p=p, seed=seed)
    return out.y, out.y1, out.residual_out


def _mech_inputs(dtype=F32, batch=()):
    gen = torch.Generator().manual_seed(12)
    shape = (*batch, 2, 3, 8)
    t = [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]
    p = [torch.randn(3, 8, generator=gen).to(dtype) for _ in range(3)]
    return (*t, *p)


def test_compile_fullgraph():
    args = _mech_inputs()
    torch._dynamo.reset()
    got = torch.compile(_call, fullgraph=True)(*args)
    want = _call(*args)
    assert torch.equal(got[2], want[2])
    for a, e in zip(got, want, strict=True):
        assert_close(a, e, rtol=1e-6, atol=1e-6)


def test_compile_draws_the_eager_seed():
    """seed=None under torch.compile: the compiled graph's draw is eager's, so
    torch.manual_seed gives the eager masks."""
    x = torch.randn(4, 64)

    def f(x):
        return fused_norm(x, 64, dropout_p=0.5, return_dropout_mask=True).dropout_mask

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    torch.manual_seed(3)
    eager = f(x)
    torch.manual_seed(3)
    assert torch.equal(compiled(x), eager)
    assert not torch.equal(compiled(x), eager)  # the generator moved on


def test_vmap_is_the_call_per_sample():
    """vmap over a leading batch: each sample is a call of its own (its rows 0..M-1, so
    its mask is what a call on it alone draws)."""
    args = _mech_inputs(batch=(4,))
    batched = vmap(_call, in_dims=(0, 0, 0, None, None, None))(*args)
    for i in range(4):
        want = _call(args[0][i], args[1][i], args[2][i], *args[3:])
        for a, e in zip(batched, want, strict=True):
            assert torch.equal(a[i], e)


def test_vmap_randomness_modes_are_torchs():
    """seed=None under vmap draws as torch's random ops do: "same" one seed for every
    sample (the same masks), "different" one per sample, "error" raises."""
    x = torch.randn(3, 4, 64)

    def f(x):
        return fused_norm(x, 64, dropout_p=0.5, return_dropout_mask=True).dropout_mask

    same = vmap(f, randomness="same")(x)
    assert torch.equal(same[0], same[1]) and torch.equal(same[1], same[2])
    different = vmap(f, randomness="different")(x)
    assert not torch.equal(different[0], different[1])
    with pytest.raises(RuntimeError, match="randomness error mode"):
        vmap(f)(x)


def test_func_grad_and_vjp_are_eager_autograd():
    args = [t.double() for t in _mech_inputs()]
    c = torch.randn(2, 3, 8, dtype=F64)

    def loss(*t):
        y, y1, h = _call(*t)
        return (y * c).sum() + (y1 * y1).sum() + (h * c).sum()

    got = grad(loss, argnums=tuple(range(6)))(*args)
    leaves = [t.clone().requires_grad_() for t in args]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for a, e in zip(got, want, strict=True):
        assert_close(a, e)
    # through h alone: the dropout-add's backward, bit for bit
    _, pullback = vjp(lambda x, r, x1: _call(x, r, x1, *args[3:])[2], *args[:3])
    dx, dr, dx1 = pullback(c)
    h = [t.clone().requires_grad_() for t in args[:3]]
    want = torch.autograd.grad(_call(*h, *args[3:])[2], h, c)
    for a, e in zip((dx, dr, dx1), want, strict=True):
        assert torch.equal(a, e)


def test_jvp_forward_ad():
    """h's tangent is the dropout-add of the tangents (it is linear); y's tangent matches
    the vjp's transpose (float64)."""
    args = [t.double() for t in _mech_inputs()]
    tangents = [torch.randn_like(t) for t in args[:3]]
    _, (_, _, h_t) = jvp(lambda *t: _call(*t, *args[3:]), tuple(args[:3]), tuple(tangents))
    x_t, r_t, x1_t = tangents
    want, _, _ = da.dropout_add(
        x_t.reshape(-1, 24), x1_t.reshape(-1, 24), r_t.reshape(-1, 24), None, 7, 0.2, F64, False
    )
    assert torch.equal(h_t, want.view(h_t.shape))
    (y, _, _), (y_t, _, _) = jvp(lambda *t: _call(*t, *args[3:]), tuple(args[:3]), tuple(tangents))
    _, pullback = vjp(lambda *t: _call(*t, *args[3:])[0], *args[:3])
    c = torch.randn_like(y)
    lhs = (y_t * c).sum()
    rhs = sum((g * t).sum() for g, t in zip(pullback(c), tangents, strict=True))
    assert_close(lhs, rhs)


class _Block(torch.nn.Module):
    def __init__(self, w, b, w1, seed):
        super().__init__()
        self.w, self.b, self.w1 = (torch.nn.Parameter(t) for t in (w, b, w1))
        self.seed = seed

    def forward(self, x, res, x1):
        return _call(x, res, x1, self.w, self.b, self.w1, seed=self.seed)


def test_export_and_jit_trace_run_on_new_inputs():
    """The dropout-add is recorded as the op (h bit for bit on new inputs); the norm as
    the public functions' decomposition (within 1e-5, as tests/test_options.py)."""
    x, r, x1, w, b, w1 = _mech_inputs()
    module = _Block(w, b, w1, seed=5)
    x2, r2, x12 = (torch.randn_like(t) for t in (x, r, x1))
    with torch.no_grad():
        want = module(x2, r2, x12)
        program = torch.export.export(module, (x, r, x1), strict=False)
        traced = torch.jit.trace(module, (x, r, x1), check_trace=False)
        for got in (program.module()(x2, r2, x12), traced(x2, r2, x12)):
            assert torch.equal(got[2], want[2])
            for a, e in zip(got, want, strict=True):
                assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_a_drawn_seed_is_drawn_at_each_call_of_a_traced_graph():
    """seed=None under jit.trace and export: the draw is recorded, not its value."""
    x = torch.randn(4, 64)

    def f(x):
        return fused_norm(x, 64, dropout_p=0.5, return_dropout_mask=True).dropout_mask

    traced = torch.jit.trace(f, (x,), check_trace=False)
    torch.manual_seed(0)
    first = traced(x)
    assert not torch.equal(first, traced(x))
    torch.manual_seed(0)
    assert torch.equal(first, traced(x))
    torch.manual_seed(0)
    assert torch.equal(first, f(x))  # the eager call's draw


# --- seeds and masks ----------------------------------------------------------------------


@pytest.mark.parametrize("features", [("x1",), ("residual", "rowscale"), ("x1", "weight1")])
def test_no_dropout_draws_nothing(features):
    """At dropout_p = 0 no seed is drawn: torch's default generator and a given one are
    where they were (torch's F.dropout and flash-attn's layer_norm_fn draw nothing
    there), and the masks, all True, are those of any seed."""
    x, w, b, kw = _make((3, 32), 32, F32, features, seed=9)
    generator = torch.Generator().manual_seed(1)
    state, given = torch.get_rng_state(), generator.get_state()
    out = fused_norm(x, 32, w, b, return_dropout_mask=True, **kw)
    also = fused_norm(x, 32, w, b, generator=generator, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(generator.get_state(), given)
    seeded = fused_norm(x, 32, w, b, seed=12345, return_dropout_mask=True, **kw)
    assert torch.equal(out.y, seeded.y) and torch.equal(out.y, also.y)
    assert bool(out.dropout_mask.all()) and torch.equal(out.dropout_mask, seeded.dropout_mask)
    # with dropout, one draw, as before
    fused_norm(x, 32, w, b, dropout_p=0.1, **kw)
    assert not torch.equal(torch.get_rng_state(), state)


def test_manual_seed_and_generator_reproduce_the_masks():
    x = torch.randn(8, 32)
    torch.manual_seed(123)
    a = fused_norm(x, 32, dropout_p=0.5, return_dropout_mask=True)
    torch.manual_seed(123)
    expected_seed = _philox.draw_seed()
    torch.manual_seed(123)
    b = fused_norm(x, 32, dropout_p=0.5, return_dropout_mask=True)
    assert torch.equal(a.dropout_mask, b.dropout_mask) and torch.equal(
        a.residual_out, b.residual_out
    )
    assert torch.equal(a.dropout_mask, _masks_in_shape((8, 32), 32, expected_seed, 0.5)[0])
    c = fused_norm(x, 32, dropout_p=0.5, return_dropout_mask=True)  # the generator moved on
    assert not torch.equal(a.dropout_mask, c.dropout_mask)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    d = fused_norm(x, 32, dropout_p=0.5, generator=g1, return_dropout_mask=True)
    e = fused_norm(x, 32, dropout_p=0.5, generator=g2, return_dropout_mask=True)
    assert torch.equal(d.dropout_mask, e.dropout_mask)
    # seeds past 2^63 are taken modulo 2^64, as Triton's
    f = fused_norm(x, 32, dropout_p=0.5, seed=2**64 - 1, return_dropout_mask=True)
    g = fused_norm(x, 32, dropout_p=0.5, seed=-1, return_dropout_mask=True)
    assert torch.equal(f.dropout_mask, g.dropout_mask)


def test_masks_are_batch_invariant():
    """A row's masks depend on its index and the seed, not on how many rows follow."""
    x = torch.randn(6, 4, 16)
    full = fused_norm(x, 16, x1=x, dropout_p=0.3, seed=31, return_dropout_mask=True)
    part = fused_norm(x[:2], 16, x1=x[:2], dropout_p=0.3, seed=31, return_dropout_mask=True)
    assert torch.equal(part.dropout_mask, full.dropout_mask[:2])
    assert torch.equal(part.dropout_mask1, full.dropout_mask1[:2])
    assert torch.equal(part.residual_out, full.residual_out[:2])


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_backends_give_the_same_bits(backend):
    x, w, b, kw = _make((3, 5, 32), 32, BF16, ("residual", "x1", "weight1", "rowscale"), seed=2)
    got = fused_norm(x, 32, w, b, dropout_p=0.1, seed=4, backend=backend, **kw)
    want = fused_norm(x, 32, w, b, dropout_p=0.1, seed=4, **kw)
    for a, e in zip(got, want, strict=True):
        assert (a is None and e is None) or torch.equal(a, e)


# --- errors -------------------------------------------------------------------------------


def test_errors_before_any_work():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(layernorm.NormalizedShapeError, match="expected input with shape"):
        fused_norm(x, 4)
    with pytest.raises(RuntimeError, match="x1 must have the input's shape"):
        fused_norm(x, 8, x1=torch.randn(3, 8))
    with pytest.raises(TypeError, match="floating-point residual"):
        fused_norm(x, 8, residual=torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="Expected weight1 to be of same shape"):
        fused_norm(x, 8, weight1=torch.ones(4))
    with pytest.raises(ValueError, match="bias1 needs weight1"):
        fused_norm(x, 8, bias1=w)
    with pytest.raises(ValueError, match="rms=True takes no bias"):
        fused_norm(x, 8, w, w, rms=True)
    with pytest.raises(
        ValueError, match=r"dropout probability has to be between 0 and 1, but got 1\.5"
    ):
        fused_norm(x, 8, dropout_p=1.5)
    with pytest.raises(ValueError, match="dropout seed must be in"):
        fused_norm(x, 8, seed=2**64)
    with pytest.raises(TypeError, match="dropout seed must be an int"):
        fused_norm(x, 8, seed=0.5)
    with pytest.raises(ValueError, match=r"rowscale must have shape \(2,\)"):
        fused_norm(x, 8, rowscale=torch.ones(3))
    with pytest.raises(TypeError, match="residual_dtype must be a floating dtype"):
        fused_norm(x, 8, residual_dtype=torch.int8)
    with pytest.raises(TypeError, match="out_dtype must be a floating dtype"):
        fused_norm(x, 8, out_dtype="float32")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        fused_norm(x, 8, backend="cuda")
    with pytest.raises(TypeError, match="offset must be a float"):
        fused_norm(x, 8, w, offset="1")
    # nothing was drawn by the failed calls: the default generator did not move
    torch.manual_seed(1)
    state = torch.get_rng_state()
    with pytest.raises(ValueError):
        fused_norm(x, 8, dropout_p=2.0)
    assert torch.equal(state, torch.get_rng_state())
