"""The keyword options of the four functions (``layernorm.options``, ``docs/contract.md``
§2 "Options"): offset, casting_mode, out_dtype, out= / residual_out=.

Oracles: the exact oracle (``_oracle.forward``: the correctly rounded norm of a row for a
given gain) where an option promises correct rounding, and a float64 reference of the same
composition, rounded where the composition rounds (:func:`rn`, one rounding of a float64
value, exact by construction), compared bit for bit. Then every PyTorch mechanism of §6
on each option, against the eager call.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.func import grad, jvp, vmap
from torch.testing import assert_close

import _oracle
import layernorm
from layernorm import options

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch\\.jit\\.[a-z_]+` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]

HALF_AND_SINGLE = [torch.float32, torch.bfloat16, torch.float16]
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
MASK = {torch.float32: 0xFFFFFFFF, torch.bfloat16: 0xFFFF, torch.float16: 0xFFFF}
#: (significand bits, exponent of the smallest normal) per dtype
FORMAT = {torch.float32: (24, -126), torch.bfloat16: (8, -126), torch.float16: (11, -14),
          torch.float64: (53, -1022)}  # fmt: skip
BACKENDS = [None, "numba", "torch"]


def rn_exact(v: Fraction, dtype: torch.dtype) -> float:
    """The exact ``v`` rounded once to nearest-even in ``dtype`` (normal and subnormal
    range): a Fraction oracle, with no float64 rounding before it."""
    if v == 0:
        return 0.0
    p, emin = FORMAT[dtype]
    e = math.frexp(float(abs(v)))[1] - 1
    if Fraction(2) ** e > abs(v):  # float() rounded up into the next binade
        e -= 1
    ulp = Fraction(2) ** (max(e, emin) - (p - 1))
    return float(round(v / ulp) * ulp)  # round(): ties to even


def rn(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``v`` (float64) rounded once to nearest-even in ``dtype``, as float64: the value
    divided by its unit in the last place (a power of two: exact) and rounded by
    ``np.rint`` (ties to even). Normal and subnormal range; no overflow in the tests."""
    p, emin = FORMAT[dtype]
    v = np.asarray(v, np.float64)
    _, e = np.frexp(v)
    ulp = np.ldexp(1.0, np.maximum(e - 1, emin) - (p - 1))
    return np.rint(v / ulp) * ulp


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(BITS[t.dtype]).numpy().astype(np.int64) & MASK[t.dtype]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _assert_correctly_rounded(y, z, gamma, beta, eps, rms):
    """Every element of ``y`` is the oracle's correctly rounded norm of the float64 rows
    ``z`` (of ``len(gamma)`` elements) with ``gamma``, ``beta``, bit for bit (an exact
    zero's sign aside)."""
    n = len(gamma)
    got = _bits(y).reshape(-1, n)
    gamma = np.asarray(gamma, np.float64)
    beta = np.zeros(n) if beta is None else np.asarray(beta, np.float64)
    wrong = 0
    for i, row in enumerate(z.reshape(-1, n)):
        want, zero = _oracle.forward(row, gamma, beta, eps, rms, NAMES[y.dtype])
        wrong += int(((want != got[i]) & ~zero).sum())
    assert wrong == 0, f"{wrong} of {y.numel()} elements not correctly rounded"


# ---------------------------------------------------------------------------------------
# offset


def test_offset_gain_is_the_exact_sum_rounded_once():
    """float32, bfloat16 and float16 weights over every binade (subnormals and zeros
    too) with float32 offsets: the gain is the exact sum rounded once to float32, and
    the float64 route (the sum formed in float64, then rounded) gives the same bits
    (:func:`layernorm.options.offset_gain`'s argument), though below 2^-29 that float64
    sum itself is not exact."""
    g = torch.Generator().manual_seed(0)
    for dtype in HALF_AND_SINGLE:
        low = -24 if dtype == torch.float16 else -149
        top = 15 if dtype == torch.float16 else 30
        exps = torch.randint(low, top, (4000,), generator=g).double()
        w = (torch.rand(4000, generator=g, dtype=torch.float64) + 1) * torch.pow(2.0, exps)
        w = (w * torch.where(torch.rand(4000, generator=g) < 0.5, -1.0, 1.0)).to(dtype)
        w = torch.cat([w, torch.tensor([0.0, -0.0], dtype=dtype)])
        for offset in (1.0, -1.0, 0.5, -3.0, 2.0**-20):
            gain = options.offset_gain(w, offset, w.dtype)
            assert gain.dtype == torch.float32
            assert torch.equal(gain, (w.double() + offset).float())  # the float64 route
            for wi, gi in zip(w.double().tolist(), gain.double().tolist(), strict=True):
                exact = Fraction(wi) + Fraction(offset)
                assert gi == rn_exact(exact, torch.float32)
    tiny = torch.tensor([2.0**-30 * (1 + 2.0**-23)], dtype=torch.float32)
    assert Fraction(float(tiny) + 1.0) != Fraction(float(tiny)) + 1


def test_offset_gain_of_other_offsets_is_formed_in_float64():
    # an offset that is no float32 value, or a float64 weight of a float32 computation:
    # the sum formed in float64, then rounded once; float64 computations add in float64
    w = torch.randn(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(options.offset_gain(w, 0.1, torch.float32), (w.double() + 0.1).float())
    w64 = w.double() * (1 + 2.0**-40)
    assert torch.equal(options.offset_gain(w64, 1.0, torch.float32), (w64 + 1.0).float())
    assert torch.equal(options.offset_gain(w, 0.1, torch.float64), w.double() + 0.1)
    big = options.offset_gain(w, 1e300, torch.float32)  # past float32's range: Inf
    assert torch.equal(big, (w.double() + 1e300).float()) and big.isinf().all()


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_offset_output_is_correctly_rounded_for_the_gain(op, dtype, backend):
    """With ``offset=1.0`` and a zero-centred weight, every element is the correctly
    rounded norm for the gain ``offset_gain(w, 1.0)``, the same bits as the plain call
    given that gain."""
    g = torch.Generator().manual_seed(1)
    n = 96
    x = (torch.randn(2, 5, n, generator=g) * 2 + 1).to(dtype)
    r = torch.randn(2, 5, n, generator=g).to(dtype)
    w = (torch.randn(n, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    rms = "rms" in op
    fn = getattr(layernorm, op)
    args = (x, r) if op.startswith("add") else (x,)
    extra = () if rms else (b,)
    got = fn(*args, n, w, *extra, backend=backend, offset=1.0)
    gain = options.offset_gain(w, 1.0, dtype)
    plain = fn(*args, n, gain, *extra, backend=backend)
    y, h = (got[0], got[1]) if op.startswith("add") else (got, x)
    assert torch.equal(_bits_t(y), _bits_t(plain[0] if op.startswith("add") else plain))
    if op.startswith("add"):
        assert torch.equal(h, plain[1])
    beta = None if rms else _np(b.float())
    _assert_correctly_rounded(y, _np(h), _np(gain), beta, 1e-5 if not rms else
                              layernorm._op.default_eps(dtype), rms)  # fmt: skip


def _bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS.get(t.dtype, torch.int64))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_offset_gradients(op):
    """float64 gradcheck through the offset (gradients of x, residual, weight, bias), and
    in float32 the gradient of ``weight`` is the gain's, bit for bit."""
    fn = getattr(layernorm, op)
    rms = "rms" in op
    add = op.startswith("add")
    shape = (2, 3, 4)
    x = torch.randn(3, *shape, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, *shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(shape, dtype=torch.float64, requires_grad=True)

    def f(*t):
        args = t[:2] if add else t[:1]
        params = t[2:] if add else t[1:]
        out = fn(*args, shape, *params, offset=0.5)
        return out

    inputs = (x, r, w) if add else (x, w)
    inputs = inputs if rms else (*inputs, b)
    assert torch.autograd.gradcheck(f, inputs)

    x32 = torch.randn(5, 16)
    w32 = torch.randn(16, requires_grad=True)
    gain = (w32.detach().double() + 1.0).float().requires_grad_()
    norm = layernorm.rms_norm if rms else layernorm.layer_norm
    (norm(x32, 16, w32, offset=1.0) * x32).sum().backward()
    (norm(x32, 16, gain) * x32).sum().backward()
    assert torch.equal(w32.grad, gain.grad)


def test_offset_checks():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="needs a weight"):
        layernorm.layer_norm(x, 4, offset=1.0)
    with pytest.raises(ValueError, match="finite"):
        layernorm.rms_norm(x, 4, torch.ones(4), offset=float("nan"))
    with pytest.raises(TypeError, match="offset must be a float"):
        layernorm.rms_norm(x, 4, torch.ones(4), offset="1")
    with pytest.raises(RuntimeError, match="same shape as normalized_shape"):
        layernorm.layer_norm(x, 4, torch.ones(3), offset=1.0)


# ---------------------------------------------------------------------------------------
# casting modes


def reference_cast_rms_norm(h, w, eps, offset, mode):
    """The float64 reference of :func:`layernorm.options.cast_rms_norm`: each rounding
    where the mode's family rounds, exact (or float64, for ``"none"``'s rstd) between."""
    x_dtype = h.dtype
    n = h.shape[-1]
    z = _np(h).reshape(-1, n)
    wide = torch.promote_types(x_dtype, torch.float32)
    if mode == "gemma":
        gain = None if w is None else rn(rn(_np(w), wide) + rn(np.float64(offset), wide), wide)
        gamma = np.ones(n) if gain is None else gain
        rows = [_oracle.forward(row, gamma, np.zeros(n), eps, True, NAMES[x_dtype])[0]
                for row in z]  # fmt: skip
        bits = np.stack(rows).astype(np.int64)
        return torch.from_numpy(bits).to(BITS[x_dtype]).view(x_dtype).reshape(h.shape)
    if mode == "llama":
        rows = [_oracle.forward(row, np.ones(n), np.zeros(n), eps, True, NAMES[x_dtype])[0]
                for row in z]  # fmt: skip
        u_bits = torch.from_numpy(np.stack(rows).astype(np.int64)).to(BITS[x_dtype])
        u = _np(u_bits.view(x_dtype))
        scale = wide
    else:
        e = float(torch.tensor(eps, dtype=torch.float64).to(x_dtype))
        ms = np.mean(z * z, axis=1, keepdims=True)
        r = _np(torch.from_numpy(1.0 / np.sqrt(ms + e)).to(x_dtype))
        u = rn(z * r, x_dtype)  # the product of two values of <= 24 bits: exact in float64
        scale = x_dtype
    if w is None:
        y = u
    else:
        p = torch.promote_types(w.dtype, scale)
        gain = rn(_np(w) + rn(rn(np.float64(offset), scale), p), p) if offset else rn(_np(w), p)
        q = torch.promote_types(x_dtype, p)
        y = rn(rn(u * gain, q), x_dtype)
    return torch.from_numpy(y).to(x_dtype).reshape(h.shape)


@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("wdtype", ["same", "float32", "float64", None], ids=lambda d: f"w-{d}")
@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "python"])
def test_casting_modes_are_their_float64_references(monkeypatch, mode, dtype, wdtype, add, fast):
    """Each mode's bits, through the compiled front door where it takes the call and
    through ``options.cast_rms_norm`` (fast paths off), whose product goes into ``u``."""
    from layernorm import ops

    monkeypatch.setattr(ops, "FAST_PATHS", fast)
    g = torch.Generator().manual_seed(2)
    n = 80
    x = (torch.randn(3, 4, n, generator=g) * 3).to(dtype)
    res = torch.randn(3, 4, n, generator=g).to(dtype)
    w = None
    if wdtype is not None:
        w = (torch.randn(n, generator=g) * 0.5).to(
            dtype if wdtype == "same" else getattr(torch, wdtype)
        )
    eps = 1e-6
    for offset in (0.0, 1.0):
        if w is None and offset:
            continue
        if add:
            y, h = layernorm.add_rms_norm(x, res, n, w, eps, casting_mode=mode, offset=offset)
            assert torch.equal(h, layernorm.add_rms_norm(x, res, n)[1])
        else:
            h = x
            y = layernorm.rms_norm(x, n, w, eps, casting_mode=mode, offset=offset)
        want = reference_cast_rms_norm(h, w, eps, offset, mode)
        assert y.dtype == dtype
        assert torch.equal(_bits_t(y), _bits_t(want)), (mode, offset)


@pytest.mark.parametrize("mode", ["llama", "none"])
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "python"])
def test_casting_mode_vmap_over_the_weight_alone(monkeypatch, mode, dtype, fast):
    """vmap over the weight only (``u`` unbatched, the gain batched): the product is not
    written into ``u`` under a transform, and each sample is the eager call's bits."""
    from layernorm import ops

    monkeypatch.setattr(ops, "FAST_PATHS", fast)
    x = torch.randn(2, 3, 8).to(dtype)
    weights = torch.randn(5, 8)
    batched = vmap(lambda w: layernorm.rms_norm(x, 8, w, casting_mode=mode, offset=1.0))(weights)
    for w, y in zip(weights, batched, strict=True):
        want = layernorm.rms_norm(x, 8, w, casting_mode=mode, offset=1.0)
        assert torch.equal(_bits_t(y), _bits_t(want))


@pytest.mark.parametrize("mode", ["llama", "gemma", "none"])
def test_casting_modes_gradients(mode):
    """float64 input computes every mode in float64: gradcheck through each."""
    shape = (3, 4)
    x = torch.randn(2, 3, *shape, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 3, *shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: layernorm.rms_norm(x, shape, w, casting_mode=mode, offset=1.0), (x, w)
    )
    assert torch.autograd.gradcheck(
        lambda x, r, w: layernorm.add_rms_norm(x, r, shape, w, casting_mode=mode), (x, r, w)
    )


def test_casting_mode_checks():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="casting_mode must be one of"):
        layernorm.rms_norm(x, 4, casting_mode="llama3")
    with pytest.raises(ValueError, match="does not combine with out_dtype"):
        layernorm.rms_norm(x.half(), 4, casting_mode="gemma", out_dtype=torch.float32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'casting_mode'"):
        layernorm.layer_norm(x, 4, casting_mode="gemma")


# ---------------------------------------------------------------------------------------
# out_dtype


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_out_dtype_float32_from_half_is_correctly_rounded(op, dtype, backend):
    """apex's MixedFused case: half input, float32 parameters, float32 output, correctly
    rounded in float32; ``residual_out`` keeps the input's dtype and bits."""
    g = torch.Generator().manual_seed(3)
    shape = (4, 6)
    x = torch.randn(2, 3, *shape, generator=g).to(dtype)
    r = torch.randn(2, 3, *shape, generator=g).to(dtype)
    w = torch.randn(shape, generator=g)
    b = torch.randn(shape, generator=g)
    rms = "rms" in op
    add = op.startswith("add")
    fn = getattr(layernorm, op)
    args = (x, r) if add else (x,)
    extra = () if rms else (b,)
    got = fn(*args, shape, w, *extra, backend=backend, out_dtype=torch.float32)
    y, h = got if add else (got, x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    if add:
        assert torch.equal(h, fn(x, r, shape, w, *extra, backend=backend)[1])
    eps = layernorm._op.default_eps(dtype) if rms else 1e-5
    _assert_correctly_rounded(y, _np(h), _np(w).reshape(-1), None if rms else _np(b).reshape(-1),
                              eps, rms)  # fmt: skip


#: (input shape, normalized_shape) of the wider out_dtype's pair tests: 1-D to 4-D,
#: multi-dim normalized shapes, zero rows, and rows of the Python path (inputs of
#: ``numba_.STREAM_BYTES`` or more, whose inference the compiled front door leaves to it)
PAIR_SHAPES = [((64,), (64,)), ((3, 50), (50,)), ((2, 3, 40), (3, 40)), ((2, 2, 3, 16), (3, 16)),
               ((0, 24), (24,)), ((2049, 4096), (4096,))]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_out_dtype_float32_from_half_is_the_upcast_call_s_bits(monkeypatch, op, dtype, backend):
    """float32 from a 16-bit input without a gradient comes from the kernels of the pair
    (``options._rounds_into``: no converted copy of the input), bit for bit the call on
    the input converted first (each element the exact value rounded once), on every
    shape, a non-contiguous input, with ``offset`` and into ``out=``; with a gradient,
    the input is converted first (its backward is that composition's)."""
    from layernorm import ops

    pairs: list[bool] = []
    rounds_into = options._rounds_into
    monkeypatch.setattr(
        options, "_rounds_into", lambda *a, **k: pairs.append(rounds_into(*a, **k)) or pairs[-1]
    )
    fn = getattr(layernorm, op)
    eps = layernorm._op.default_eps(dtype) if "rms" in op else 1e-5  # (the input's rule)
    g = torch.Generator().manual_seed(5)
    for (shape, nshape), extra, fast in itertools.product(
        PAIR_SHAPES, [{}, {"offset": 1.0}, {"out": True}], [True, False]
    ):
        monkeypatch.setattr(ops, "FAST_PATHS", fast)
        if math.prod(shape) > 1 << 20 and (extra or not fast or backend == "torch"):
            continue  # (the Python path's rows once, for time)
        x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
        if len(shape) > 1 and shape[0] > 1:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
        w = torch.randn(nshape, generator=g)
        b = () if "rms" in op else (torch.randn(nshape, generator=g),)
        kw = dict(extra)
        if "out" in kw:
            kw["out"] = torch.full(shape, float("nan"))
        del pairs[:]
        got = fn(x, nshape, w, *b, backend=backend, out_dtype=torch.float32, **kw)
        assert pairs and all(pairs), (shape, extra)  # the kernels of the pair ran it
        assert got is kw.pop("out", got)
        want = fn(x.float(), nshape, w, *b, eps, backend=backend, **kw)
        assert got.dtype == torch.float32 and torch.equal(_bits32(got), _bits32(want)), (
            shape, extra, fast,
        )  # fmt: skip
    monkeypatch.setattr(ops, "FAST_PATHS", True)
    x = torch.randn(3, 2, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(16, generator=g, requires_grad=True)
    del pairs[:]
    y = fn(x, (16,), w, backend=backend, out_dtype=torch.float32)
    assert not any(pairs)  # a gradient: the input converted first
    dy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, (x, w), dy)
    xc, wc = x.detach().requires_grad_(), w.detach().requires_grad_()
    want_y = fn(xc.float(), (16,), wc, *([None] if "rms" not in op else []), eps,
                backend=backend)  # fmt: skip
    want = torch.autograd.grad(want_y, (xc, wc), dy)
    assert torch.equal(y, want_y)
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype and torch.equal(a, e)
    # converted once: where C++ leaves the call to Python (a backend named, or the C++ part
    # not in use), norm goes on with the copy
    cpp = backend is None and layernorm.compiled.unavailable_reason() is None
    seen = []
    norm = options.norm
    monkeypatch.setattr(
        options, "norm", lambda op, x, *a, **k: seen.append(x.dtype) or norm(op, x, *a, **k)
    )
    y = fn(x, (16,), w, backend=backend, out_dtype=torch.float32)
    assert torch.equal(y, want_y) and seen == ([] if cpp else [torch.float32])


def _bits32(t: torch.Tensor) -> torch.Tensor:
    """float32 values as their patterns (NaNs and zeros' signs compared too)."""
    return t.contiguous().view(torch.int32)


def test_out_dtype_keeps_the_inputs_eps_and_equals_the_upcast_call():
    x = torch.randn(3, 10)
    w = torch.randn(10)
    got = layernorm.rms_norm(x, 10, w, out_dtype=torch.float64)
    want = layernorm.rms_norm(x.double(), 10, w, eps=torch.finfo(torch.float32).eps)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    same = layernorm.layer_norm(x, 10, w, out_dtype=torch.float32)
    assert torch.equal(same, layernorm.layer_norm(x, 10, w))


def test_out_dtype_checks():
    """A narrower out_dtype is rounded into by the kernels (``tests/test_out_dtype.py``);
    a dtype they do not write raises ValueError, a non-floating one TypeError."""
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"output dtypes are float64, float32, bfloat16"):
        layernorm.layer_norm(x, 4, out_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="memory_efficient=True takes an out_dtype"):
        layernorm.rms_norm(x.half(), 4, out_dtype=torch.bfloat16, memory_efficient=True)
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        layernorm.add_rms_norm(x, x, 4, out_dtype=torch.int32)


def test_out_dtype_gradients():
    x = torch.randn(3, 2, 5, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    y = layernorm.layer_norm(x, (2, 5), w, b, out_dtype=torch.float64)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), dy)
    xd = x.detach().double().requires_grad_()
    want = torch.autograd.grad(layernorm.layer_norm(xd, (2, 5), w, b, eps=1e-5), (xd, w, b), dy)
    assert got[0].dtype == torch.float32
    for a, e in zip(got, want, strict=True):
        assert torch.equal(a, e.to(a.dtype))


# ---------------------------------------------------------------------------------------
# out= and residual_out=


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_out_is_filled_and_returned(op):
    fn = getattr(layernorm, op)
    add = op.startswith("add")
    x = torch.randn(2, 3, 8)
    r = torch.randn(2, 3, 8)
    args = (x, r) if add else (x,)
    want = fn(*args, 8)
    out = torch.full_like(x, float("nan"))
    if add:
        h_out = torch.empty(0)
        y, h = fn(*args, 8, out=out, residual_out=h_out)
        assert y is out and h is h_out
        assert torch.equal(y, want[0]) and torch.equal(h, want[1])
    else:
        assert fn(x, 8, out=out) is out
        assert torch.equal(out, want)


def test_out_may_alias_the_input():
    x = torch.randn(4, 16)
    want = layernorm.layer_norm(x, 16)
    assert layernorm.layer_norm(x, 16, out=x) is x
    assert torch.equal(x, want)


#: (function, keyword options, input dtype): the calls whose outputs the kernels write
WRITTEN = [
    ("layer_norm", {}, torch.float32),
    ("rms_norm", {"offset": 1.0}, torch.bfloat16),
    ("layer_norm", {"out_dtype": torch.bfloat16}, torch.float32),
    ("add_layer_norm", {}, torch.float16),
    ("add_rms_norm", {"out_dtype": torch.float16}, torch.float32),
]


@pytest.mark.parametrize(
    ("op", "kw", "dtype", "which"),
    [(*case, which) for case in WRITTEN
     for which in (("out", "residual_out", "both") if case[0].startswith("add") else ("out",))],
    ids=str,
)  # fmt: skip
def test_out_is_written_by_the_kernels_in_place(op, kw, dtype, which, monkeypatch):
    """On the numba backend ``out`` and ``residual_out`` are written directly (nothing is
    copied in: ``store`` never runs), keep their storage, get their version bumped, and
    hold the bits of the call without them."""
    add = op.startswith("add")
    fn = getattr(layernorm, op)
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(2, 5, 64, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=g).to(dtype)
    args = (x, r) if add else (x,)
    want = fn(*args, 64, w, backend="numba", **kw)
    want_y, want_h = want if add else (want, None)
    y_dtype = kw.get("out_dtype", dtype)
    given = {}
    if which in ("out", "both"):
        given["out"] = torch.full(x.shape, float("nan"), dtype=y_dtype)
    if which in ("residual_out", "both"):
        given["residual_out"] = torch.full_like(x, float("nan"))
    pointers = {k: t.data_ptr() for k, t in given.items()}
    versions = {k: t._version for k, t in given.items()}
    monkeypatch.setattr(options, "WRITE_INTO_BYTES", 0)  # (these are small)
    monkeypatch.setattr(options, "store", _no_copy)
    got = fn(*args, 64, w, backend="numba", **kw, **given)
    got_y, got_h = got if add else (got, None)
    for k, t in given.items():
        assert t.data_ptr() == pointers[k] and t._version > versions[k]
    assert got_y is given.get("out", got_y) and got_h is given.get("residual_out", got_h)
    assert got_y.dtype == y_dtype and np.array_equal(_bits(got_y), _bits(want_y))
    if add:
        assert np.array_equal(_bits(got_h), _bits(want_h))


def _inference_empty(*shape: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.empty(shape)


def _no_copy(*args):
    raise AssertionError("the result was copied into out")


@pytest.mark.parametrize(
    "case", ["alias", "transposed", "empty", "torch-backend", "grad-out", "inference-out"]
)
def test_out_the_kernels_cannot_write_is_copied_with_the_same_bits(case, monkeypatch):
    """Where the kernels cannot write ``out`` directly (it overlaps the input, is not
    contiguous, must be resized, another backend runs the call, or it requires grad) the
    result is computed and copied in (``store``): the same bits."""
    copies = []
    store = options.store
    monkeypatch.setattr(options, "store", lambda *a: copies.append(a[1]) or store(*a))
    monkeypatch.setattr(options, "WRITE_INTO_BYTES", 0)  # (this input is small)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 32, generator=g)
    w = torch.randn(32, generator=g)
    backend = "torch" if case == "torch-backend" else None
    want = layernorm.rms_norm(x, 32, w)
    out = {
        "alias": x,
        "transposed": torch.empty(32, 6).t(),
        "empty": torch.empty(0),
        "torch-backend": torch.empty(6, 32),
        "grad-out": torch.empty(6, 32, requires_grad=True),
        "inference-out": _inference_empty(6, 32),
    }[case]
    if case == "grad-out":  # torch's rule for an in-place write into a leaf
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            layernorm.rms_norm(x, 32, w, out=out)
        with torch.no_grad():
            assert layernorm.rms_norm(x, 32, w, out=out) is out
    elif case == "inference-out":  # torch's rule for an inference tensor
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            layernorm.rms_norm(x, 32, w, out=out)
        with torch.inference_mode():
            assert layernorm.rms_norm(x, 32, w, out=out) is out
    else:
        assert layernorm.rms_norm(x, 32, w, out=out, backend=backend) is out
    assert copies == ["out"] * (2 if case == "grad-out" else 1)  # inference mode: written
    assert out.shape == x.shape and np.array_equal(_bits(out.detach()), _bits(want))


@pytest.mark.parametrize("shape", [(4, 64), (2, 5, 64), (4096, 64)], ids=str)
def test_out_below_write_into_bytes_is_copied_above_written(shape, monkeypatch):
    """Inputs below ``options.WRITE_INTO_BYTES`` are computed and copied into ``out``
    (cheaper there), larger ones written by the kernels; the same bits either way."""
    copies = []
    store = options.store
    monkeypatch.setattr(options, "store", lambda *a: copies.append(a[1]) or store(*a))
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    w = torch.randn(64, generator=g)
    want_y, want_h = layernorm.add_layer_norm(x, r, 64, w, backend="numba")
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    got = layernorm.add_layer_norm(x, r, 64, w, backend="numba", out=out, residual_out=residual_out)
    assert got[0] is out and got[1] is residual_out
    small = x.numel() * x.element_size() < options.WRITE_INTO_BYTES
    assert copies == (["out", "residual_out"] if small else [])
    assert np.array_equal(_bits(out), _bits(want_y))
    assert np.array_equal(_bits(residual_out), _bits(want_h))


def test_out_resize_rules():
    """torch's: a 0-element out is resized silently, another one with its warning."""
    x = torch.randn(3, 8)
    out = torch.empty(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layernorm.rms_norm(x, 8, out=out)
    assert out.shape == x.shape
    out = torch.empty(5)
    with pytest.warns(UserWarning, match="An output with one or more elements was resized"):
        layernorm.rms_norm(x, 8, out=out)
    assert out.shape == x.shape and torch.equal(out, layernorm.rms_norm(x, 8))


def test_out_checks_as_torch():
    x = torch.randn(3, 8)
    with pytest.raises(
        RuntimeError, match="Expected out tensor to have dtype float, but got double"
    ):
        layernorm.layer_norm(x, 8, out=torch.empty(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="Expected out tensor to have device cpu, but got meta"):
        layernorm.layer_norm(x, 8, out=torch.empty(3, 8, device="meta"))
    with pytest.raises(RuntimeError, match="Expected residual_out tensor to have dtype"):
        layernorm.add_rms_norm(x, x, 8, residual_out=torch.empty(3, 8, dtype=torch.float16))
    y_out = torch.empty(3, 8, dtype=torch.float32)
    layernorm.rms_norm(x.half(), 8, out_dtype=torch.float32, out=y_out)
    assert torch.equal(y_out, layernorm.rms_norm(x.half(), 8, out_dtype=torch.float32))


def test_out_refuses_autograd_as_torch_does():
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"out=\.\.\. arguments don't support automatic diff"):
        torch.add(x, 1, out=torch.empty(3, 8))  # torch's own message, which ours matches
    pattern = r"layer_norm\(\): functions with out=\.\.\. arguments don't support automatic differentiation, but one of the arguments requires grad\."
    with pytest.raises(RuntimeError, match=pattern):
        layernorm.layer_norm(x, 8, out=torch.empty(3, 8))
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        layernorm.add_rms_norm(x.detach(), x.detach(), 8, w, residual_out=torch.empty(3, 8))
    with torch.no_grad():
        layernorm.layer_norm(x, 8, out=torch.empty(3, 8))
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        grad(lambda t: layernorm.rms_norm(t, 8, out=torch.empty(3, 8)).sum())(x.detach())


# ---------------------------------------------------------------------------------------
# PyTorch mechanisms, per option


#: (id, function name, keyword options, dtype)
OPTIONS = [
    ("offset-layer", "layer_norm", {"offset": 1.0}, torch.float32),
    ("offset-rms", "rms_norm", {"offset": 1.0}, torch.float32),
    ("offset-add-layer", "add_layer_norm", {"offset": -1.0}, torch.float32),
    ("offset-add-rms", "add_rms_norm", {"offset": 1.0}, torch.float32),
    ("llama", "rms_norm", {"casting_mode": "llama", "offset": 1.0}, torch.float32),
    ("gemma", "rms_norm", {"casting_mode": "gemma", "offset": 1.0}, torch.float32),
    ("none", "rms_norm", {"casting_mode": "none"}, torch.float32),
    ("llama-add", "add_rms_norm", {"casting_mode": "llama"}, torch.float32),
    ("out_dtype-layer", "layer_norm", {"out_dtype": torch.float64}, torch.float32),
    ("out_dtype-add-rms", "add_rms_norm", {"out_dtype": torch.float64}, torch.float32),
    ("memory_efficient-layer", "layer_norm", {"memory_efficient": True}, torch.float32),
    ("memory_efficient-rms", "rms_norm", {"memory_efficient": True}, torch.float32),
]
OPTION_IDS = [o[0] for o in OPTIONS]
#: (input shape, normalized_shape): 1-D to 4-D, multi-dim normalized shapes
SHAPES = [((8,), (8,)), ((3, 8), (8,)), ((2, 3, 8), (3, 8)), ((2, 2, 3, 4), (3, 4))]
SHAPE_IDS = ["1d", "2d", "3d-2dims", "4d-2dims"]


def _call(name, kw, shape, x, r, w, b):
    fn = getattr(layernorm, name)
    args = (x, r) if name.startswith("add") else (x,)
    extra = () if "rms" in name else (b,)
    out = fn(*args, shape, w, *extra, **kw)
    return out if name.startswith("add") else (out,)


def _inputs(shape, nshape, dtype):
    return (torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype),
            torch.randn(nshape, dtype=dtype) * 0.2, torch.randn(nshape, dtype=dtype))  # fmt: skip


@pytest.mark.parametrize("shapes", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
def test_vmap_and_grad(option, shapes):
    """vmap over a leading batch is the eager call per sample; torch.func.grad is eager
    autograd's gradient (float64 for the gradients)."""
    _, name, kw, dtype = option
    shape, nshape = shapes
    x, r, w, b = _inputs((5, *shape), nshape, dtype)
    batched = vmap(lambda x, r: _call(name, kw, nshape, x, r, w, b))(x, r)
    for i in range(5):
        for got, want in zip(batched, _call(name, kw, nshape, x[i], r[i], w, b), strict=True):
            assert_close(got[i], want, rtol=0, atol=0)

    x, r, w, b = (t.double() for t in _inputs(shape, nshape, dtype))
    kw = {k: v for k, v in kw.items() if k != "out_dtype"}  # float64 has no wider dtype
    c = torch.randn(shape, dtype=torch.float64)

    def loss(x, r, w, b):
        return sum((y * c).sum() for y in _call(name, kw, nshape, x, r, w, b))

    got = grad(loss, argnums=(0, 1, 2, 3))(x, r, w, b)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    want = torch.autograd.grad(loss(*leaves), leaves, allow_unused=True, materialize_grads=True)
    for a, e in zip(got, want, strict=True):
        assert_close(a, e)


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
def test_jvp_and_forward_ad(option):
    """torch.func.jvp is J·t from reverse mode's Jacobian (float64)."""
    _, name, kw, _ = option
    kw = {k: v for k, v in kw.items() if k != "out_dtype"}
    shape, nshape = (2, 3, 8), (3, 8)
    x, r, w, b = (t.double() for t in _inputs(shape, nshape, torch.float64))
    tangents = tuple(torch.randn_like(t) for t in (x, r, w, b))

    def f(x, r, w, b):
        return torch.cat([y.reshape(-1) for y in _call(name, kw, nshape, x, r, w, b)])

    _, got = jvp(f, (x, r, w, b), tangents)
    jac = torch.autograd.functional.jacobian(f, (x, r, w, b))
    want = sum(
        j.reshape(got.numel(), -1) @ t.reshape(-1) for j, t in zip(jac, tangents, strict=True)
    )
    assert_close(got, want)


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
def test_compile_fullgraph(option):
    _, name, kw, dtype = option
    shape, nshape = (2, 3, 8), (3, 8)
    x, r, w, b = _inputs(shape, nshape, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: _call(name, kw, nshape, *t), fullgraph=True)
    got = compiled(x, r, w, b)
    for a, e in zip(got, _call(name, kw, nshape, x, r, w, b), strict=True):
        assert a.dtype == e.dtype
        assert_close(a, e, rtol=1e-6, atol=1e-6)


class _Module(torch.nn.Module):
    def __init__(self, name, kw, nshape, w, b):
        super().__init__()
        self.name, self.kw, self.nshape = name, kw, nshape
        self.w = torch.nn.Parameter(w)
        self.b = torch.nn.Parameter(b)

    def forward(self, x, r):
        return _call(self.name, self.kw, self.nshape, x, r, self.w, self.b)


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
def test_export_and_jit_trace_run_on_new_inputs(option):
    """torch.export (non-strict) and jit.trace record the composition, which runs on
    other inputs as the eager call (the recorded norm is the decomposition: within 1e-5)."""
    _, name, kw, dtype = option
    shape, nshape = (2, 3, 8), (3, 8)
    x, r, w, b = _inputs(shape, nshape, dtype)
    module = _Module(name, kw, nshape, w, b)
    x2, r2 = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    with torch.no_grad():
        want = module(x2, r2)
        program = torch.export.export(module, (x, r), strict=False)
        traced = torch.jit.trace(module, (x, r), check_trace=False)
        for got in (program.module()(x2, r2), traced(x2, r2)):
            for a, e in zip(got, want, strict=True):
                assert a.dtype == e.dtype
                assert_close(a, e, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# modules


def test_module_attributes_are_the_functions_options():
    """``offset``, ``out_dtype`` (and ``casting_mode`` on RMSNorm) set on a module give
    the function's result with those options; torch's state_dict and repr are unchanged;
    a module with options set scripts to a forward that raises (TorchScript runs the
    plain norm); deep copies keep the options; unset, the module is the plain one."""
    x = torch.randn(2, 3, 4, 8, dtype=torch.bfloat16)
    ln = layernorm.LayerNorm((4, 8))
    rms = layernorm.RMSNorm((4, 8))
    with torch.no_grad():
        ln.weight.normal_()
        rms.weight.normal_()
    keys, text = list(ln.state_dict()), repr(ln)
    ln.offset, ln.out_dtype = 1.0, torch.float32
    rms.offset, rms.casting_mode = 1.0, "gemma"
    assert list(ln.state_dict()) == keys and repr(ln) == text
    want = layernorm.layer_norm(x, (4, 8), ln.weight, ln.bias, offset=1.0, out_dtype=torch.float32)
    assert ln(x).dtype == torch.float32 and torch.equal(ln(x), want)
    want = layernorm.rms_norm(x, (4, 8), rms.weight, None, offset=1.0, casting_mode="gemma")
    assert torch.equal(rms(x), want)
    scripted = torch.jit.script(rms)
    # TorchScript raises torch.jit.Error or, where it has the Python class of the
    # exception at hand (state torch keeps per thread), the RuntimeError itself
    with pytest.raises((torch.jit.Error, RuntimeError), match="has no scripted forward"):
        scripted(x)
    copied = copy.deepcopy(ln)  # the copy's options route its own forward
    assert copied.offset == 1.0 and torch.equal(copied(x), ln(x))
    rms.offset, rms.casting_mode = 0.0, None  # back to the plain module
    assert "_eager" not in rms.__dict__ and torch.equal(
        rms(x), layernorm.rms_norm(x, (4, 8), rms.weight)
    )
    torch.jit.script(rms)(x)


# ---------------------------------------------------------------------------------------
# memory_efficient

UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """A unit in the last place of each element of ``t`` (as float64) in its dtype."""
    p, emin = FORMAT[t.dtype]
    _, e = np.frexp(_np(t))
    return torch.from_numpy(np.ldexp(1.0, np.maximum(e - 1, emin) - (p - 1)))


@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize(("shape", "nshape"), [((7, 64), (64,)), ((2, 3, 4, 16), (4, 16))])
@pytest.mark.parametrize("backend", [None, "torch"], ids=["numba-kernel", "torch-ops"])
def test_memory_efficient_dx_is_within_its_stated_bound(
    dtype, rms, affine, shape, nshape, backend, monkeypatch
):
    """``dx``, ``dweight``, ``dbias`` of ``memory_efficient=True`` against the float64
    reference, within the bounds of :mod:`layernorm.recompute`, by the numba kernel
    (``backends._numba_recompute``, the automatic backend) and by the torch operations
    (the torch backend); and autograd kept the output, not the input."""
    from layernorm.backends import _numba_recompute

    kernel_calls = []
    kernel = _numba_recompute.backward
    monkeypatch.setattr(_numba_recompute, "backward",
                        lambda *a: kernel_calls.append(1) or kernel(*a))  # fmt: skip
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.randn(nshape, generator=g) + 2).to(dtype).requires_grad_() if affine else None
    b = torch.randn(nshape, generator=g).to(dtype).requires_grad_() if affine and not rms else None
    dy = torch.randn(shape, generator=g)
    if not affine:  # rows of dy (= gh) with mean 0: c2 cancels, its sum's error does not
        n = int(np.prod(nshape))
        dy = (dy.reshape(-1, n) - dy.reshape(-1, n).mean(1, keepdim=True)).reshape(shape)
    dy = dy.to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if rms:
            y = layernorm.rms_norm(x, nshape, w, memory_efficient=True, backend=backend)
        else:
            y = layernorm.layer_norm(x, nshape, w, b, memory_efficient=True, backend=backend)
    assert any(t is y or (t.data_ptr() == y.data_ptr() and t.shape == y.shape) for t in saved)
    assert not any(t.data_ptr() == x.data_ptr() for t in saved)
    assert torch.equal(y, (layernorm.rms_norm(x, nshape, w) if rms else
                           layernorm.layer_norm(x, nshape, w, b)))  # fmt: skip
    leaves = [t for t in (x, w, b) if t is not None]
    # the numba kernel: called by Python's MemoryEfficientNorm, or as its C entry by the
    # compiled front door's node (the same bits: tests/test_compiled.py)
    entry = y.grad_fn.name() == "layernorm::MemoryEfficientBackward"
    grads = torch.autograd.grad(y, leaves, dy)
    assert (len(kernel_calls) == 1 or entry) == (backend is None)

    n = int(np.prod(nshape))
    z = _np(x).reshape(-1, n)
    gam = np.ones(n) if w is None else _np(w).reshape(-1)
    bet = np.zeros(n) if b is None else _np(b).reshape(-1)
    mean = 0.0 if rms else z.mean(1, keepdims=True)
    v = z - mean
    q = (v * v).mean(1, keepdims=True)
    rstd = 1 / np.sqrt(q + layernorm._op.default_eps(dtype) if rms else q + 1e-5)
    u = v * rstd
    gg = _np(dy).reshape(-1, n)
    gh = gg * gam
    c1 = (gh * u).mean(1, keepdims=True)
    c2 = 0.0 if rms else gh.mean(1, keepdims=True)
    dx_ref = rstd * (gh - c2 - u * c1)
    e, p = 2.0**-24, UNIT[dtype]
    yy = _np(y).reshape(-1, n)
    delta = (p * np.abs(yy) + 2 * e * np.abs(yy - bet)) / np.abs(gam) + e * np.abs(u)
    log_n = np.log2(n)
    bound = (rstd * (np.abs(c1) * delta + np.abs(u) * (np.abs(gh) * delta).mean(1, keepdims=True))
             + rstd * (np.abs(gh) + (0.0 if rms else np.abs(gh).mean(1, keepdims=True))
                       + np.abs(u) * np.abs(gh * u).mean(1, keepdims=True)) * (log_n + 8) * e
             + _np(_ulp(grads[0])).reshape(-1, n) / 2)  # fmt: skip
    err = np.abs(_np(grads[0]).reshape(-1, n) - dx_ref)
    assert (err <= bound).all(), float((err / bound).max())
    if affine:
        m = z.shape[0]
        dw_ref = (gg * u).sum(0)
        dw_bound = (np.abs(gg) * delta).sum(0) + (np.log2(m) + 4) * e * np.abs(gg * u).sum(0)
        assert (
            np.abs(_np(grads[1]).reshape(-1) - dw_ref) <= dw_bound + _np(_ulp(grads[1])).reshape(-1)
        ).all()
        if not rms:
            db_ref = gg.sum(0)
            db_bound = (np.log2(m) + 4) * e * np.abs(gg).sum(0) + _np(_ulp(grads[2])).reshape(-1)
            assert (np.abs(_np(grads[2]).reshape(-1) - db_ref) <= db_bound).all()


def test_memory_efficient_kernel_is_thread_invariant_and_tracks_the_torch_ops():
    """Many blocks of rows over the threads (above the serial size): the numba kernel's
    ``dx``, ``dweight``, ``dbias`` have the same bits at 1 and 2 threads, and lie within
    a few float32 units of the torch operations' (both within the stated bound)."""
    from layernorm.backends import _numba_recompute

    g = torch.Generator().manual_seed(6)
    m, n = 300, 1024  # 5 blocks, 307200 elements
    assert m * n >= layernorm.backends.numba_.SERIAL_NUMEL and m > 4 * _numba_recompute.BLOCK
    x = torch.randn(m, n, generator=g).requires_grad_()
    w = (torch.randn(n, generator=g) + 2).requires_grad_()
    b = torch.randn(n, generator=g).requires_grad_()
    dy = torch.randn(m, n, generator=g)
    results = {}
    threads = torch.get_num_threads()
    try:
        for backend, count in ((None, 1), (None, 2), ("torch", 1)):
            torch.set_num_threads(count)
            y = layernorm.layer_norm(x, n, w, b, memory_efficient=True, backend=backend)
            results[backend, count] = torch.autograd.grad(y, (x, w, b), dy)
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(results[None, 1], results[None, 2], strict=True):
        assert torch.equal(one, two)
    for ours, ops_ in zip(results[None, 1], results["torch", 1], strict=True):
        assert_close(ours, ops_, rtol=2e-5, atol=2e-5)


def test_memory_efficient_kernels_record_the_code_they_inline():
    # numba's cache sees only _numba_recompute.py: see DEPENDS_SHA256 there
    from layernorm.backends import _numba_recompute

    digest = _numba_recompute.depends_digest()
    assert digest == _numba_recompute.DEPENDS_SHA256, (
        f"inlined numba code changed: set DEPENDS_SHA256 in _numba_recompute.py to {digest!r}"
    )


def test_memory_efficient_kernel_reads_and_writes_bfloat16_rows_as_float32_would():
    """The numba kernel on bfloat16 rows gives the bits of the float32 rows it widens
    to, with ``dx`` rounded to bfloat16 as torch rounds (NaN a NaN)."""
    from layernorm.backends import _numba_recompute

    g = torch.Generator().manual_seed(8)
    m, n = 70, 96
    dy, y = (torch.randn(m, n, generator=g).bfloat16() for _ in range(2))
    dy = dy[:, :80]  # strided rows of dy
    y = y[:, :80].contiguous()
    w, b = torch.randn(80, generator=g).bfloat16() + 2, torch.randn(80, generator=g).bfloat16()
    dy[3, 5] = float("nan")
    rstd = torch.rand(m, generator=g) + 0.5
    for rms in (False, True):
        got = _numba_recompute.backward(dy, y, w, b, rstd, rms, True, True)
        want = _numba_recompute.backward(dy.float(), y.float(), w, b, rstd, rms, True, True)
        assert got[0].dtype == torch.bfloat16
        assert torch.equal(got[0].isnan(), want[0].isnan())
        finite = ~got[0].isnan()
        assert torch.equal(got[0][finite], want[0].bfloat16()[finite])
        for a, e in zip(got[1:], want[1:], strict=True):
            assert torch.equal(a.nan_to_num(), e.nan_to_num())


def test_memory_efficient_is_the_plain_call_where_it_does_not_apply():
    """A zero in gamma, no gradient, torch.func, compile: the plain call, the same bits
    (gradients included); double backward through a memory-efficient node raises."""
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8).index_fill_(0, torch.tensor([2]), 0.0).requires_grad_()
    y = layernorm.layer_norm(x, 8, w, memory_efficient=True)
    assert "MemoryEfficient" not in type(y.grad_fn).__name__
    plain = layernorm.layer_norm(x, 8, w)
    assert torch.equal(y, plain)
    dy = torch.randn(3, 8)
    for a, e in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(plain, (x, w), dy),
                    strict=True):  # fmt: skip
        assert torch.equal(a, e)
    with torch.no_grad():
        assert layernorm.rms_norm(x, 8, memory_efficient=True).grad_fn is None
    w1 = torch.randn(8)

    def loss(x, memory_efficient):
        return (layernorm.rms_norm(x, 8, w1, memory_efficient=memory_efficient) * dy).sum()

    assert torch.equal(grad(loss)(x.detach(), True), grad(loss)(x.detach(), False))
    compiled = torch.compile(lambda t: layernorm.rms_norm(t, 8, w1, memory_efficient=True),
                             fullgraph=True)  # fmt: skip
    assert_close(compiled(x), layernorm.rms_norm(x, 8, w1), rtol=1e-6, atol=1e-6)
    y = layernorm.rms_norm(x, 8, w1, memory_efficient=True)
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    assert not gx.requires_grad  # once_differentiable: no graph for a second order
    with pytest.raises(RuntimeError, match="does not require grad"):
        gx.sum().backward()
    with pytest.raises(ValueError, match="does not combine"):
        layernorm.rms_norm(x, 8, w1, memory_efficient=True, offset=1.0)


# ---------------------------------------------------------------------------------------
# layer_norm_linear


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("shape", "nshape"), SHAPES[1:], ids=SHAPE_IDS[1:])
def test_layer_norm_linear_is_the_composition(rms, dtype, shape, nshape):
    """The output is ``F.linear(norm(x))`` bit for bit, the gradients of every input are
    the composition's (``dx``, ``dweight``, ``dbias`` bit for bit: the same backward
    kernel on the same ``dy``; the linear's up to its summation order), and autograd
    keeps x, the norm's parameters, its ``mean`` and ``rstd`` (one value a row) and the
    linear weight, never the norm's output."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = torch.randn(nshape, generator=g).to(dtype).requires_grad_()
    b = None if rms else torch.randn(nshape, generator=g).to(dtype).requires_grad_()
    lw = torch.randn(5, shape[-1], generator=g).to(dtype).requires_grad_()
    lb = torch.randn(5, generator=g).to(dtype).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layernorm.layer_norm_linear(x, nshape, w, b, lw, lb, rms=rms)
    assert "NormLinear" in out.grad_fn.name()
    kept = {t.data_ptr() for t in (x, w, b, lw) if t is not None}
    m = x.numel() // w.numel()
    assert kept <= {t.data_ptr() for t in saved}
    assert all(t.data_ptr() in kept or t.numel() in (0, m) for t in saved)
    norm = layernorm.rms_norm(x, nshape, w) if rms else layernorm.layer_norm(x, nshape, w, b, 1e-5)
    want = torch.nn.functional.linear(norm, lw, lb)
    assert torch.equal(out, want)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    leaves = [t for t in (x, w, b, lw, lb) if t is not None]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    got, expected = torch.autograd.grad(out, leaves, dout), torch.autograd.grad(want, leaves, dout)
    for k, (a, e) in enumerate(zip(got, expected, strict=True)):
        if k < len(leaves) - 2:  # the norm's inputs
            assert a.dtype == e.dtype and torch.equal(a, e)
        else:
            assert_close(a, e, **tol)


@pytest.mark.parametrize("shape", [(8,), (4, 8), (2, 3, 8), (2, 2, 3, 8), (0, 8), (2, 0, 8)])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_layer_norm_linear_gradients_on_every_shape(shape, strided):
    """1-D to 4-D, strided and zero-size inputs: the output is the composition's bit for
    bit, its gradients the composition's (the norm's bit for bit), batched gradients
    (``is_grads_batched``: the op's vmap rule) too; the backward builds no graph (once
    differentiable)."""
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape[:-1], 16, generator=g)
    x = (x[..., ::2] if strided else x[..., :8].contiguous()).requires_grad_()
    w, b = (torch.randn(8, generator=g).requires_grad_() for _ in range(2))
    lw, lb = torch.randn(5, 8, generator=g).requires_grad_(), torch.randn(5, generator=g)
    lb.requires_grad_()
    leaves = (x, w, b, lw, lb)
    out = layernorm.layer_norm_linear(x, 8, w, b, lw, lb)
    want = torch.nn.functional.linear(layernorm.layer_norm(x, 8, w, b), lw, lb)
    assert "NormLinear" in out.grad_fn.name() and torch.equal(out, want)
    douts = torch.randn(3, *out.shape, generator=g)
    for batched, dout in ((False, douts[0]), (True, douts)):
        if batched and not x.numel():
            continue
        got = torch.autograd.grad(out, leaves, dout, retain_graph=True, is_grads_batched=batched)
        expected = torch.autograd.grad(want, leaves, dout, retain_graph=True,
                                       is_grads_batched=batched)  # fmt: skip
        for k, (a, e) in enumerate(zip(got, expected, strict=True)):
            assert a.shape == e.shape
            if k < 3:
                assert torch.equal(a, e), (k, batched)
            else:
                assert_close(a, e)
    (gx,) = torch.autograd.grad(out, x, douts[0], create_graph=True)
    assert not gx.requires_grad


def test_layer_norm_linear_under_transforms_is_the_composition():
    x = torch.randn(4, 8)
    w, lw = torch.randn(8), torch.randn(3, 8)

    def f(x, lw):
        return layernorm.layer_norm_linear(x, 8, w, None, lw, rms=True).sum()

    def composed(x, lw):
        return torch.nn.functional.linear(layernorm.rms_norm(x, 8, w), lw).sum()

    for a, e in zip(grad(f, (0, 1))(x, lw), grad(composed, (0, 1))(x, lw), strict=True):
        assert_close(a, e)
    compiled = torch.compile(
        lambda x: layernorm.layer_norm_linear(x, 8, w, None, lw), fullgraph=True
    )
    assert_close(compiled(x), torch.nn.functional.linear(layernorm.layer_norm(x, 8, w), lw),
                 rtol=1e-6, atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="takes no bias"):
        layernorm.layer_norm_linear(x, 8, w, w, lw, rms=True)


def test_out_is_checked_before_any_work(monkeypatch):
    """A wrong out= raises before the norm runs (the op is never called)."""
    from layernorm import ops

    def boom(*args, **kwargs):
        raise AssertionError("the norm ran")

    monkeypatch.setattr(ops, "_norm", boom)
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="Expected out tensor to have dtype"):
        layernorm.layer_norm(x, 8, out=torch.empty(3, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="Expected residual_out tensor to have device"):
        layernorm.add_layer_norm(x, x, 8, residual_out=torch.empty(3, 8, device="meta"))
    with pytest.raises(TypeError, match="argument 'out' must be Tensor"):
        layernorm.rms_norm(x, 8, out=[1.0])


def test_out_under_compile():
    x = torch.randn(3, 8)
    out = torch.empty(3, 8)
    compiled = torch.compile(lambda x, o: layernorm.rms_norm(x, 8, out=o), fullgraph=True)
    assert compiled(x, out) is out
    assert_close(out, layernorm.rms_norm(x, 8), rtol=1e-6, atol=1e-6)


def test_layer_norm_linear_under_every_mechanism():
    """vmap, jvp, export and jit.trace see the composition (float64 for the derivatives)."""
    x = torch.randn(5, 2, 3, 8, dtype=torch.float64)
    w, b = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    lw, lb = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, dtype=torch.float64)

    def ours(x):
        return layernorm.layer_norm_linear(x, (3, 8), w, b, lw, lb)

    def composed(x):
        return torch.nn.functional.linear(layernorm.layer_norm(x, (3, 8), w, b), lw, lb)

    assert_close(vmap(ours)(x), composed(x))
    t = torch.randn_like(x)
    for a, e in zip(jvp(ours, (x,), (t,)), jvp(composed, (x,), (t,)), strict=True):
        assert_close(a, e)

    class M(torch.nn.Module):
        def forward(self, x):
            return ours(x)

    x2 = torch.randn_like(x)
    program = torch.export.export(M(), (x,), strict=False)
    traced = torch.jit.trace(M(), (x,), check_trace=False)
    for got in (program.module()(x2), traced(x2)):
        assert_close(got, composed(x2))


def test_signatures_name_the_options():
    """``inspect.signature`` shows each function's options as keyword-only parameters with
    their defaults; a name a function does not take raises Python's TypeError."""
    import inspect

    want = {
        "layer_norm": {"offset": 0.0, "out_dtype": None, "out": None, "memory_efficient": False},
        "rms_norm": {"offset": 0.0, "casting_mode": None, "out_dtype": None, "out": None,
                     "memory_efficient": False},
        "add_layer_norm": {"offset": 0.0, "out_dtype": None, "out": None, "residual_out": None,
                           "residual_dtype": None},
        "add_rms_norm": {"offset": 0.0, "casting_mode": None, "out_dtype": None, "out": None,
                         "residual_out": None, "residual_dtype": None},
    }  # fmt: skip
    for name, names in want.items():
        params = inspect.signature(getattr(layernorm, name)).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
        got = {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
        assert got == {"backend": None, **names}
    x = torch.randn(2, 4)
    with pytest.raises(
        TypeError, match=r"layer_norm\(\) got an unexpected keyword argument 'casting_mode'"
    ):
        layernorm.layer_norm(x, 4, casting_mode="gemma")
    with pytest.raises(TypeError, match="unexpected keyword argument 'residual_out'"):
        layernorm.rms_norm(x, 4, residual_out=x)


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("layout", ["zero-rows", "zero-inner", "transposed"])
def test_zero_size_and_strided_inputs(option, layout):
    """Each option on zero-size inputs and on a transposed (non-contiguous) input: the
    shape and dtype of the outputs, and the values and gradients of the same call on a
    contiguous copy."""
    _, name, kw, dtype = option
    n = 8
    if layout == "zero-rows":
        x, r = torch.randn(0, n, dtype=dtype), torch.randn(0, n, dtype=dtype)
    elif layout == "zero-inner":
        x, r = torch.randn(3, 0, n, dtype=dtype), torch.randn(3, 0, n, dtype=dtype)
    else:
        x, r = torch.randn(n, 5, dtype=dtype).t(), torch.randn(n, 5, dtype=dtype).t()
    w, b = torch.randn(n, dtype=dtype) * 0.2, torch.randn(n, dtype=dtype)
    results = []
    for xi, ri in ((x, r), (x.contiguous(), r.contiguous())):
        leaves = [t.clone().requires_grad_() for t in (xi, ri, w, b)]
        outs = _call(name, kw, (n,), *leaves)
        total = sum((o.double() * (k + 1)).sum() for k, o in enumerate(outs))
        grads = torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)
        results.append((outs, grads))
    for o in results[0][0]:
        assert o.shape == x.shape
    for a, e in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert a.dtype == e.dtype
        assert_close(a, e, rtol=1e-6, atol=1e-6)
