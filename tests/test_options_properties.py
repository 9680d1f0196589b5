"""Each option against its oracle on hypothesis-drawn calls (docs/contract.md §2, §3, §7).

The fixed grids of ``test_options.py``, ``test_out_dtype.py``, ``test_residual_dtype.py``
and ``test_fused.py`` pick their inputs. Here hypothesis draws the calls:
- 1-D to 5-D inputs with one to three normalized dimensions, contiguous or not;
- rows of any scale from 2^-8 to 2^8, centred on zero or offset far from it, and constant
  rows;
- the four functions and each option's values.

Every output is compared bit for bit with the oracles of those modules: the exact oracle
where the contract promises one rounding, and the float64 reference of the composition
where a casting mode rounds as its family does.
"""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import layernorm
from layernorm import ops, options

pytest.importorskip("numba")

from test_dropout_add import oracle as dropout_add_oracle
from test_options import _bits_t, reference_cast_rms_norm
from test_out_dtype import _assert_correctly_rounded
from test_residual_dtype import _round_fraction

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]
#: normalized shapes (one to three dimensions) and the dimensions before them
NORMALIZED = [(1,), (7,), (64,), (4, 8), (3, 2, 5)]
LEADING = [(), (1,), (3,), (2, 3), (2, 1, 2), (0, 2)]
#: examples per test: each takes milliseconds, and the options' combinations are many
EXAMPLES = settings(max_examples=150)
#: a fused_norm call's draws after the tensors: dropout_p, the seed, three switches
FUSED_DRAWS = (
    st.sampled_from([0.0, 0.1, 0.5]),
    st.integers(0, 2**63 - 1),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
#: the dtypes each input dtype's output may be rounded into (narrower, or float32)
OUT_DTYPES = {
    torch.float32: [torch.bfloat16, torch.float16],
    torch.bfloat16: [torch.float16, torch.float32],
    torch.float16: [torch.bfloat16, torch.float32],
}


class Call:
    """One drawn call's tensors: ``x`` and ``r`` (a residual) of ``lead + normalized``,
    ``w``, ``b``, ``w1`` and ``b1`` of ``normalized``, all of ``dtype``; ``fast``: whether
    it runs with the fast paths (:func:`fast_paths`)."""

    def __init__(self, dtype, lead, normalized, seed, scale, shift, constant, strided, fast):
        self.args = (dtype, lead, normalized, seed, scale, shift, constant, strided, fast)
        g = torch.Generator().manual_seed(seed)
        self.dtype, self.normalized, self.fast = dtype, normalized, fast
        self.n = math.prod(normalized)
        shape = lead + normalized

        def values(scale, shift):
            v = torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift
            return v.to(dtype)

        x = values(scale, shift)
        if constant and x.numel():
            x.view(-1, self.n)[0] = shift  # a constant row (its output is beta)
        if strided:  # every other element of rows twice as long
            wide = torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=dtype)
            wide[..., ::2] = x
            x = wide[..., ::2]
        self.x, self.r = x, values(scale, -shift / 2)
        self.w = (torch.randn(normalized, generator=g) * 0.5).to(dtype)
        self.b = torch.randn(normalized, generator=g).to(dtype)
        self.w1 = (torch.randn(normalized, generator=g) * 2).to(dtype)
        self.b1 = torch.randn(normalized, generator=g).to(dtype)

    def __repr__(self) -> str:
        return f"Call({self.args})"

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as rows of the normalized elements."""
        return t.reshape(-1, self.n)


@st.composite
def calls(draw, dtypes=DTYPES):
    return Call(
        draw(st.sampled_from(dtypes)),
        draw(st.sampled_from(LEADING)),
        draw(st.sampled_from(NORMALIZED)),
        draw(st.integers(0, 2**32 - 1)),
        2.0 ** draw(st.integers(-8, 8)),
        draw(st.sampled_from([0.0, 3.0, -100.0, 1000.0])),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
    )


@contextlib.contextmanager
def fast_paths(c: Call):
    """The call's fast paths (the compiled front door, the direct calls) on or off
    (``ops.FAST_PATHS``): the Python composition of each option runs with them off."""
    saved = ops.FAST_PATHS
    ops.FAST_PATHS = c.fast
    try:
        yield
    finally:
        ops.FAST_PATHS = saved


def _call(op, c: Call, w, b, **kw):
    """``(y, h)``: ``op`` on the call's tensors, ``h`` the normalized input."""
    fn = getattr(layernorm, op)
    args = (c.x, c.r) if op.startswith("add") else (c.x,)
    extra = () if "rms" in op else (b,)
    out = fn(*args, c.normalized, w, *extra, **kw)
    return out if op.startswith("add") else (out, c.x)


def _assert_rows_rounded_once(c: Call, y, h, w, b, rms, eps=1e-5):
    """Every element of ``y`` is the exact norm of ``h`` rounded once into ``y``'s dtype."""
    flat = (None if t is None else t.reshape(-1) for t in (w, b))
    _assert_correctly_rounded(c.rows(y), c.rows(h), *flat, eps, rms)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits_t(a), _bits_t(b))


@EXAMPLES
@given(calls(), st.sampled_from(OPS), st.sampled_from([1.0, -0.5, 2.0**-12]))
def test_offset_is_the_correctly_rounded_norm_for_its_gain(c, op, offset):
    """``offset``: the plain call with the gain ``offset_gain(w, offset)`` (bits), every
    element the exact norm for that gain rounded once."""
    with fast_paths(c):
        y, h = _call(op, c, c.w, c.b, eps=1e-5, offset=offset)
    gain = options.offset_gain(c.w, offset, c.dtype)
    plain_y, plain_h = _call(op, c, gain, c.b, eps=1e-5)
    assert _same_bits(y, plain_y) and torch.equal(h, plain_h)
    _assert_rows_rounded_once(c, y, h, gain, c.b, "rms" in op)


@EXAMPLES
@given(
    calls(),
    st.booleans(),
    st.sampled_from(["llama", "gemma", "none"]),
    st.sampled_from(["same", "float32", None]),
    st.sampled_from([0.0, 1.0]),
)
def test_casting_modes_are_their_float64_references(c, add, mode, wdtype, offset):
    """``casting_mode``: each mode's roundings where its family rounds
    (``test_options.reference_cast_rms_norm``), bit for bit."""
    w = None if wdtype is None else c.w.to(c.dtype if wdtype == "same" else torch.float32)
    offset = offset if w is not None else 0.0
    kw = {"casting_mode": mode, "offset": offset}
    with fast_paths(c):
        if add:
            y, h = layernorm.add_rms_norm(c.x, c.r, c.normalized, w, 1e-6, **kw)
        else:
            y, h = layernorm.rms_norm(c.x, c.normalized, w, 1e-6, **kw), c.x
    assert y.dtype == c.dtype and y.shape == c.x.shape
    if y.numel():  # (the reference stacks rows)
        flat = None if w is None else w.reshape(-1)
        want = reference_cast_rms_norm(c.rows(h), flat, 1e-6, offset, mode)
        assert _same_bits(c.rows(y), want)


@EXAMPLES
@given(calls(), st.sampled_from(OPS), st.integers(0, 1))
def test_out_dtype_is_the_exact_norm_rounded_once_into_it(c, op, pick):
    """``out_dtype`` narrower, or float32 from a 16-bit input: every element the exact
    norm rounded once into it (never through the input's dtype)."""
    out_dtype = OUT_DTYPES[c.dtype][pick]
    with fast_paths(c):
        y, h = _call(op, c, c.w, c.b, eps=1e-5, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == c.x.shape
    _assert_rows_rounded_once(c, y, h, c.w, c.b, "rms" in op)


@EXAMPLES
@given(calls(dtypes=[torch.bfloat16, torch.float16]), st.booleans())
def test_a_float32_stream_is_the_exact_sum_and_its_norm_each_rounded_once(c, rms):
    """``residual_dtype=float32`` with a float32 residual: ``residual_out`` is the exact
    sum rounded once to float32, ``y`` its exact norm rounded once into x's dtype."""
    r = c.r.float()
    op = layernorm.add_rms_norm if rms else layernorm.add_layer_norm
    extra = () if rms else (c.b,)
    with fast_paths(c):
        y, h = op(c.x, r, c.normalized, c.w, *extra, eps=1e-5, residual_dtype=torch.float32)
    assert h.dtype == torch.float32 and y.dtype == c.dtype
    want = [
        _round_fraction(Fraction(a) + Fraction(b), torch.float32)
        for a, b in zip(c.x.double().flatten().tolist(), r.double().flatten().tolist(), strict=True)
    ]
    assert h.flatten().double().tolist() == want
    _assert_rows_rounded_once(c, y, h, c.w, c.b, rms)


@EXAMPLES
@given(calls(), *FUSED_DRAWS)
def test_fused_norm_is_the_exact_dropout_add_and_its_norms(c, p, seed, x1, rowscale, residual):
    """``fused_norm`` with dropout, ``x1`` (and ``weight1``), ``rowscale`` and a residual:
    ``residual_out`` is the exact ``k0·s·x·rs + k1·s·x1 + residual`` rounded once
    (``test_dropout_add.oracle``), ``y`` and ``y1`` its exact norms rounded once."""
    lead = c.x.shape[: c.x.dim() - len(c.normalized)]
    scale = torch.rand(lead, generator=torch.Generator().manual_seed(seed % 2**32)) + 0.5
    kw = {
        "residual": c.r if residual else None,
        "x1": c.r * 0.5 if x1 else None,
        "weight1": c.w1 if x1 else None,
        "bias1": c.b1 if x1 else None,
        "rowscale": scale.to(c.dtype) if rowscale else None,
    }
    with fast_paths(c):
        out = layernorm.fused_norm(c.x, c.normalized, c.w, c.b, 1e-5, dropout_p=p, seed=seed, **kw)
    terms = [None if kw[k] is None else c.rows(kw[k]) for k in ("x1", "residual")]
    rs = None if kw["rowscale"] is None else kw["rowscale"].reshape(-1)
    h = c.rows(c.x) if out.residual_out is None else c.rows(out.residual_out)
    if out.residual_out is None:  # (h is x itself: no dropout, x1, rowscale or residual)
        assert p == 0.0 and not (x1 or rowscale or residual)
    else:
        want = dropout_add_oracle(c.rows(c.x), *terms, rs, seed, p, c.dtype)
        assert torch.equal(h.double(), want)
    _assert_rows_rounded_once(c, out.y, h, c.w, c.b, False)
    if x1:
        _assert_rows_rounded_once(c, out.y1, h, c.w1, c.b1, False)
    else:
        assert out.y1 is None


# ---------------------------------------------------------------------------------------
# gradients: each option's against the plain call's it is defined by


def _grads(op, c: Call, w, b, dy, dh=None, **kw):
    """``(y, gradients of x, r, w, b)``: ``op`` with gradients asked of fresh leaves of
    the call's ``x`` and ``r`` and of ``w`` and ``b``, for ``dy`` (and ``dh`` for
    ``residual_out``); absent gradients are None."""
    rms = "rms" in op
    x, r = (t.detach().clone().requires_grad_() for t in (c.x, c.r))
    w, b = (None if t is None else t.detach().clone().requires_grad_() for t in (w, b))
    fn = getattr(layernorm, op)
    add = op.startswith("add")
    slots = (x, r if add else None, w, None if rms else b)  # (the gradients' order)
    with fast_paths(c):
        out = fn(*((x, r) if add else (x,)), c.normalized, w, *(() if rms else (b,)), **kw)
        outputs, cotangents = ((out[0], out[1]), (dy, dh)) if add else ((out,), (dy,))
        leaves = [t for t in slots if t is not None]
        grads = iter(torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True))
    return outputs[0], [None if t is None else next(grads) for t in slots]


def _cotangent(c: Call, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(c.x.shape, generator=g, dtype=torch.float64).to(dtype)


def _assert_same_gradients(got, want):
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert _same_bits(a, b)


@EXAMPLES
@given(calls(), st.sampled_from(OPS), st.sampled_from([1.0, -0.5]), st.integers(0, 2**31))
def test_offset_gradients_are_the_plain_calls_for_its_gain(c, op, offset, seed):
    """With ``offset``, the gradients of x, the residual and the bias are the plain call's
    for the gain ``offset_gain(w, offset)`` (in the accumulation dtype), and the weight's
    is the gain's rounded once to the weight's dtype, bit for bit."""
    dy, dh = _cotangent(c, seed, c.dtype), _cotangent(c, seed + 1, c.dtype)
    _, got = _grads(op, c, c.w, c.b, dy, dh, eps=1e-5, offset=offset)
    gain = options.offset_gain(c.w, offset, c.dtype)
    _, want = _grads(op, c, gain, c.b, dy, dh, eps=1e-5)
    want[2] = want[2].to(c.w.dtype)
    _assert_same_gradients(got, want)


@EXAMPLES
@given(
    calls(dtypes=[torch.float32]), st.sampled_from(OPS), st.integers(0, 1), st.integers(0, 2**31)
)
def test_narrower_out_dtype_gradients_are_the_plain_calls_with_dy_widened(c, op, pick, seed):
    """A narrower ``out_dtype``: ``dy`` in y's dtype is widened exactly; every gradient is
    the plain call's for that ``dy``, bit for bit."""
    out_dtype = OUT_DTYPES[c.dtype][pick]
    dy, dh = _cotangent(c, seed, out_dtype), _cotangent(c, seed + 1, c.dtype)
    y, got = _grads(op, c, c.w, c.b, dy, dh, eps=1e-5, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    _, want = _grads(op, c, c.w, c.b, dy.to(c.dtype), dh, eps=1e-5)
    _assert_same_gradients(got, want)


@EXAMPLES
@given(calls(), *FUSED_DRAWS)
def test_fused_norm_gradients_are_the_dropout_add_backward(c, p, seed, x1, residual, through_y):
    """``fused_norm``'s input gradients are the torch dropout-add backward
    (``layernorm.backends._dropout_add``, the definition) of ``dh``, bit for bit: ``dh``
    the cotangent of ``residual_out``, or (``through_y``) the plain ``layer_norm``'s
    input gradient of ``y``."""
    from layernorm.backends import _dropout_add as da

    names = ["x"] + (["residual"] if residual else []) + (["x1"] if x1 else [])
    values = {"x": c.x, "residual": c.r, "x1": c.r * 0.5}
    leaves = {k: values[k].detach().clone().requires_grad_() for k in names}
    w, b = c.w.detach().requires_grad_(), c.b.detach()
    cotangent = _cotangent(c, seed % 2**31, c.dtype)
    with fast_paths(c):
        out = layernorm.fused_norm(
            leaves["x"], c.normalized, w, b, 1e-5, dropout_p=p, seed=seed,
            residual=leaves.get("residual"), x1=leaves.get("x1"),
        )  # fmt: skip
        through_y = through_y or out.residual_out is None  # (h is x: no residual_out)
        output = out.y if through_y else out.residual_out
        got = torch.autograd.grad(output, [leaves[k] for k in names], cotangent)
    dh = cotangent
    if through_y:  # the plain norm's input gradient of y, at h
        h = (c.x if out.residual_out is None else out.residual_out).detach().requires_grad_()
        y = layernorm.layer_norm(h, c.normalized, w.detach(), b, 1e-5)
        dh = torch.autograd.grad(y, h, cotangent)[0]
    if out.residual_out is None:  # h is x
        want = {"x": dh}
    else:
        dx0, dx1, dres = da.dropout_add_backward(
            c.rows(dh), None, seed, p, c.dtype, c.dtype if x1 else None,
            c.dtype if residual else None,
        )  # fmt: skip
        want = {"x": dx0, "x1": dx1, "residual": dres}
    for name, grad in zip(names, got, strict=True):
        assert _same_bits(c.rows(grad), c.rows(want[name])), name
