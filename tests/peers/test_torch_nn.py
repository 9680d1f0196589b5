"""PyTorch's own layer-norm and RMSNorm tests, re-expressed against our API.

Sources (pytorch/pytorch):

- ``test/test_nn.py``, ``TestNNDeviceType``: ``test_LayerNorm_general`` (with
  ``_test_LayerNorm_general`` and ``_test_LayerNorm_cpu_mixed_dtype``),
  ``test_LayerNorm_numeric``, ``test_rmsnorm_numeric``, ``test_layernorm_half_precision``
  and ``test_layernorm_weight_bias`` (both CUDA-only there; the properties hold on CPU);
  ``TestNN``: ``test_layer_norm_grads_with_create_graph_flag``, ``test_layer_norm_eps``
  (the constant-row case of pytorch/pytorch#108072).
- ``torch/testing/_internal/common_modules.py``: ``module_inputs_torch_nn_LayerNorm`` and
  ``module_inputs_torch_nn_RMSNorm`` (the same shapes as the ``LayerNorm_*`` entries of
  ``common_nn.new_module_tests``), run as ModuleInfo runs them: forward against torch's
  module, gradcheck and gradgradcheck in float64.
- ``torch/testing/_internal/common_methods_invocations.py``: ``sample_inputs_layer_norm``
  (and the same cases for ``rms_norm``), ``error_inputs_native_layer_norm`` and the
  ``rms_norm`` error inputs, with their exception type (RuntimeError) and message regexes.

Shrunk: ``test_LayerNorm_numeric`` normalizes one row of 256*256*144 instead of two.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _peers import (
    BACKENDS,
    assert_close_or_nearer,
    max_abs,
    parametrize_backends,
    reference_forward,
)
from torch.testing import assert_close, make_tensor

import layernorm


def _layer_norm_module(backend, *args, **kwargs):
    m = layernorm.LayerNorm(*args, **kwargs)
    m.backend = backend
    return m


def _rms_norm_module(backend, *args, **kwargs):
    m = layernorm.RMSNorm(*args, **kwargs)
    m.backend = backend
    return m


# ---------------------------------------------------------------------------------------
# test_nn.py: TestNNDeviceType.test_LayerNorm_general


@parametrize_backends
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_layer_norm_general(backend, dtype):
    """test_nn ``_test_LayerNorm_general``: with eps=0, unit weight and zero bias every row
    has mean 0 and variance 1; a constant weight s and bias b give mean b and variance s^2.
    Shapes of 2 to 5 dims of 3 to 5 each, a random number of trailing dims normalized;
    delta 1e-5 (1e-1 for half types)."""
    delta = 1e-5 if dtype == torch.float32 else 1e-1
    for ndim in range(2, 6):
        shape = torch.randint(3, 6, (ndim,)).tolist()
        x = torch.empty(*shape, dtype=dtype).uniform_(0, 10)
        normalized_ndim = int(torch.randint(1, ndim, ()))
        normalized_shape = shape[-normalized_ndim:]
        lead = shape[:-normalized_ndim]
        m = _layer_norm_module(backend, normalized_shape, eps=0).to(dtype)
        with torch.no_grad():
            m.weight.fill_(1)
            m.bias.fill_(0)
        rows = m(x).detach().double().view(*lead, -1)
        assert float(rows.mean(-1).abs().mean()) == pytest.approx(0, abs=delta)
        assert float(rows.var(-1, unbiased=False).mean()) == pytest.approx(1, abs=delta)

        scale, bias = torch.empty(2).uniform_(0.2, 2).tolist()
        with torch.no_grad():
            m.weight.fill_(scale)
            m.bias.fill_(bias)
        rows = m(x).detach().double().view(*lead, -1)
        assert float(rows.mean(-1).abs().mean()) == pytest.approx(bias, abs=delta)
        assert float(rows.var(-1, unbiased=False).mean()) == pytest.approx(scale**2, abs=delta)


#: _test_LayerNorm_general's bad_norm_shape_input_shape, with torch's message regexes
BAD_NORM_SHAPES = [
    ((), (), "Expected normalized_shape to be at least 1-dimensional"),
    ((2, 3), (3,), "Given normalized_shape="),
    ((2,), (1, 2, 3), "Given normalized_shape="),
    ((10,), (2, 3), "Given normalized_shape="),
    (10, (2, 3), "Given normalized_shape="),
]


@pytest.mark.parametrize(("normalized_shape", "input_shape", "match"), BAD_NORM_SHAPES)
def test_layer_norm_general_bad_shapes_torch(normalized_shape, input_shape, match):
    """The oracle: torch's nn.LayerNorm raises RuntimeError on each of these."""
    x = torch.empty(input_shape).uniform_(0, 10)
    with pytest.raises(RuntimeError, match=match):
        torch.nn.LayerNorm(normalized_shape)(x)


@parametrize_backends
@pytest.mark.parametrize(("normalized_shape", "input_shape", "match"), BAD_NORM_SHAPES)
def test_layer_norm_general_bad_shapes(backend, normalized_shape, input_shape, match):
    """test_nn ``_test_LayerNorm_general``: a normalized_shape the input does not end with
    raises RuntimeError, as torch's module does."""
    x = torch.empty(input_shape).uniform_(0, 10)
    with pytest.raises(RuntimeError, match=match):
        _layer_norm_module(backend, normalized_shape)(x)


@parametrize_backends
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("elementwise_affine", [True, False])
def test_layer_norm_cpu_mixed_dtype(backend, dtype, elementwise_affine):
    """test_nn ``_test_LayerNorm_cpu_mixed_dtype``: a half input through a float32 module
    (mixed), through a module of its own dtype, and the float32 computation rounded to the
    half type agree (outputs at assert_close's defaults for the dtype, input gradients at
    1e-1); integer-valued input of shape (2, 3, 11, 3), normalized over (11, 3)."""
    x = torch.empty(2, 3, 11, 3, dtype=dtype).random_(1, 10)
    m = _layer_norm_module(backend, [11, 3], elementwise_affine=elementwise_affine).to(dtype)
    results = {}
    for name, module, inp in [
        ("fp32", copy.deepcopy(m).float(), x.float()),
        ("half", copy.deepcopy(m), x.clone()),
        ("mixed", copy.deepcopy(m).float(), x.clone()),
    ]:
        inp.requires_grad_(True)
        out = module(inp)
        out.sum().backward()
        results[name] = (out, inp.grad)
    out_fp32, grad_fp32 = results["fp32"]
    for name in ("half", "mixed"):
        out, grad = results[name]
        assert out.dtype == dtype
        assert_close(out, out_fp32.to(dtype))
        assert_close(grad, grad_fp32.to(dtype), atol=1e-1, rtol=1e-1)


# ---------------------------------------------------------------------------------------
# test_nn.py: TestNNDeviceType.test_LayerNorm_numeric (one row of 256*256*144 float32)

WIDE_SHAPE = [256, 256, 144]


@pytest.fixture(scope="module")
def wide_row():
    x = torch.rand(1, *WIDE_SHAPE, generator=torch.Generator().manual_seed(0))
    return x, reference_forward(x, WIDE_SHAPE, eps=1e-5).float()


def test_layer_norm_numeric_torch(wide_row):
    """The oracle: torch's own layer norm of the row is within 1e-5 of float64."""
    x, want = wide_row
    assert max_abs(F.layer_norm(x, WIDE_SHAPE), want) <= 1e-5


@parametrize_backends
def test_layer_norm_numeric(backend, wide_row):
    """test_nn ``test_LayerNorm_numeric``: ``nn.LayerNorm([256, 256, 144])`` on uniform
    [0, 1) input is within atol 1e-5 (rtol 0) of the reference; here the reference is
    float64, and one row of 9.4M elements is normalized (the original does two)."""
    x, want = wide_row
    y = _layer_norm_module(backend, WIDE_SHAPE)(x)
    assert max_abs(y, want) <= 1e-5


# ---------------------------------------------------------------------------------------
# test_nn.py: TestNNDeviceType.test_rmsnorm_numeric


@parametrize_backends
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_numeric(backend, dtype):
    """test_nn ``test_rmsnorm_numeric``: ``rms_norm`` of a (1, 2, 3) half input over all
    three dims, weight of the same shape, eps 0.5, equals the float32 computation rounded
    to the dtype (assert_close's defaults for the dtype)."""
    shape = (1, 2, 3)
    x = torch.rand(*shape, dtype=dtype)
    w = torch.rand(*shape, dtype=dtype)
    y = layernorm.rms_norm(x, shape, w, 0.5, backend=backend)
    upcast = x.float()
    want = (upcast * torch.rsqrt(upcast.pow(2).mean(dim=(0, 1, 2), keepdim=True) + 0.5)) * w
    assert y.dtype == dtype
    assert_close(y, want.type_as(x))
    assert_close(y, F.rms_norm(x, shape, w, 0.5))


# ---------------------------------------------------------------------------------------
# test_nn.py: test_layernorm_half_precision, test_layernorm_weight_bias (CUDA there)


@parametrize_backends
def test_layer_norm_half_precision(backend):
    """test_nn ``test_layernorm_half_precision``: a float16 layer norm equals the float32
    one rounded to float16, bit for bit (atol 0, rtol 0); (1, 5, 128) input of
    rand * 0.1, unit weight and zero bias."""
    width = 128
    x = torch.rand(1, 5, width, dtype=torch.half) * 0.1
    weight = torch.ones(width, dtype=torch.half)
    bias = torch.zeros(width, dtype=torch.half)
    y16 = layernorm.layer_norm(x, (width,), weight, bias, 1e-5, backend=backend)
    y32 = layernorm.layer_norm(
        x.float(), (width,), weight.float(), bias.float(), 1e-5, backend=backend
    )
    assert_close(y16, y32.half(), atol=0, rtol=0)


@parametrize_backends
def test_layer_norm_weight_bias(backend):
    """test_nn ``test_layernorm_weight_bias``: no weight is a weight of ones and no bias a
    bias of zeros; (1, 5, 128) float32 input of rand * 0.1."""
    width = 128
    x = torch.rand(1, 5, width) * 0.1
    data = torch.randn(width)
    ones, zeros = torch.ones(width), torch.zeros(width)
    run = lambda w, b: layernorm.layer_norm(x, (width,), w, b, 1e-5, backend=backend)  # noqa: E731
    assert_close(run(None, data), run(ones, data))
    assert_close(run(data, None), run(data, zeros))


# ---------------------------------------------------------------------------------------
# test_nn.py: TestNN.test_layer_norm_eps, TestNN.test_layer_norm_grads_with_create_graph_flag


@parametrize_backends
def test_layer_norm_eps(backend):
    """test_nn ``test_layer_norm_eps`` (pytorch/pytorch#108072): rows of two equal large
    values, eps 1e-6, no affine, normalize to exactly zero (no cancellation residue
    amplified by 1/sqrt(eps))."""
    x = torch.tensor([[[2.0, 2.0], [14.0, 14.0]], [[2.0, 2.0], [14.0, 14.0]]])
    m = _layer_norm_module(backend, 2, eps=1e-6, elementwise_affine=False)
    assert_close(m(x), torch.zeros_like(x))


@parametrize_backends
def test_layer_norm_grads_with_create_graph_flag(backend):
    """test_nn ``test_layer_norm_grads_with_create_graph_flag``: the input gradient is the
    same with and without ``create_graph`` (rtol 1e-3, atol 1e-5); (4, 4, 16) input,
    weight 0.1."""
    x = torch.randn((4, 4, 16), requires_grad=True)
    m = _layer_norm_module(backend, (16,), 1e-5, True)
    with torch.no_grad():
        m.weight.fill_(0.1)
    (plain,) = torch.autograd.grad(m(x).sum(), x, create_graph=False)
    (graph,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    assert graph.requires_grad
    assert_close(plain, graph, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------
# common_modules.py: module_inputs_torch_nn_LayerNorm / _RMSNorm (ModuleInfo)

#: (desc, constructor args, constructor kwargs, input shape)
MODULE_INPUTS = [
    ("1d_elementwise_affine", ([5], 1e-3), {}, (4, 5, 5)),
    ("1d_elementwise_affine_large_batch", ([5], 1e-3), {}, (128, 5, 5)),
    ("1d_no_elementwise_affine", ([5], 1e-3, False), {}, (4, 5, 5)),
    ("3d_elementwise_affine", ([2, 2, 5], 1e-3), {}, (4, 2, 2, 5)),
    ("3d_no_elementwise_affine", ([2, 2, 5], 1e-3, False), {}, (4, 2, 2, 5)),
    ("1d_empty_elementwise_affine", ([5], 1e-3), {}, (0, 5)),
    ("3d_elementwise_affine_no_bias", ([2, 2, 5], 1e-3), {"bias": False}, (4, 2, 2, 5)),
]
MODULES = {
    "LayerNorm": (torch.nn.LayerNorm, _layer_norm_module),
    "RMSNorm": (torch.nn.RMSNorm, _rms_norm_module),
}


def _module_cases():
    for kind in MODULES:
        for desc, args, kwargs, shape in MODULE_INPUTS:
            if kind == "RMSNorm" and "bias" in kwargs:
                continue  # RMSNorm has no bias
            yield pytest.param(kind, args, kwargs, shape, id=f"{kind}-{desc}")


def _module_pair(kind, backend, args, kwargs, dtype):
    theirs_cls, ours_make = MODULES[kind]
    theirs = theirs_cls(*args, **kwargs).to(dtype)
    with torch.no_grad():  # ModuleInfo keeps the default init; random parameters test more
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours = ours_make(backend, *args, **kwargs).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@parametrize_backends
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("kind", "args", "kwargs", "shape"), list(_module_cases()))
def test_module_inputs(backend, dtype, kind, args, kwargs, shape):
    """ModuleInfo ``module_inputs_torch_nn_{LayerNorm,RMSNorm}``: each input's output and
    gradients (input and parameters) equal torch's module's, at assert_close's defaults;
    RMSNorm's output also equals ModuleInfo's ``rms_norm_reference_fn`` (upcast to float32,
    ``type_as`` the input). Inputs are ``make_tensor``'s (uniform in [-9, 9])."""
    ours, theirs = _module_pair(kind, backend, args, kwargs, dtype)
    x = make_tensor(shape, dtype=dtype, device="cpu")
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    assert_close(y_ours, y_theirs)
    if kind == "RMSNorm" and dtype != torch.float64:  # its reference upcasts to float32
        dims = tuple(range(-len(ours.normalized_shape), 0))
        upcast = x.float()
        want = upcast * torch.rsqrt(upcast.pow(2).mean(dim=dims, keepdim=True) + ours.eps)
        if ours.weight is not None:
            want = want * ours.weight
        assert_close(y_ours, want.type_as(x))
    dy = torch.randn_like(y_theirs)
    y_ours.backward(dy)
    y_theirs.backward(dy)
    assert_close(x_ours.grad, x_theirs.grad)
    for (name, p_ours), p_theirs in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert_close(p_ours.grad, p_theirs.grad, msg=name)


@parametrize_backends
@pytest.mark.parametrize(
    ("kind", "args", "kwargs", "shape"),
    [c for c in _module_cases() if c.values[3][0] not in (0, 128)],  # gradcheck's cost
)
def test_module_inputs_gradcheck(backend, kind, args, kwargs, shape):
    """ModuleInfo ``test_grad`` / ``test_gradgrad``: gradcheck and gradgradcheck of the
    module in float64, over the input and the parameters."""
    ours, _ = _module_pair(kind, backend, args, kwargs, torch.float64)
    x = make_tensor(shape, dtype=torch.float64, device="cpu", requires_grad=True)
    params = tuple(ours.parameters())
    names = [name for name, _ in ours.named_parameters()]

    def run(inp, *ps):
        return torch.func.functional_call(ours, dict(zip(names, ps, strict=True)), (inp,))

    assert torch.autograd.gradcheck(run, (x, *params), fast_mode=True)
    assert torch.autograd.gradgradcheck(run, (x, *params), fast_mode=True)


# ---------------------------------------------------------------------------------------
# common_methods_invocations.py: sample_inputs_layer_norm (and rms_norm's same cases)

#: (input shape, normalized_shape, eps or None for the default); the OpInfo's eps=-0.5
#: sample is test_opinfo_negative_eps below
OPINFO_SAMPLES = [
    ((1, 2, 3), (1, 2, 3), 0.5),
    ((1,), (1,), None),
    ((1, 2), (2,), None),
    ((0, 1), (1,), None),
]
OPINFO_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _opinfo_call(rms, backend, x, normalized_shape, weight, bias, eps):
    kwargs = {} if eps is None else {"eps": eps}
    if rms:
        ours = layernorm.rms_norm(x, normalized_shape, weight, backend=backend, **kwargs)
        return ours, F.rms_norm
    ours = layernorm.layer_norm(x, normalized_shape, weight, bias, backend=backend, **kwargs)
    return ours, F.layer_norm


@parametrize_backends
@pytest.mark.parametrize("dtype", OPINFO_DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize(("shape", "normalized_shape", "eps"), OPINFO_SAMPLES)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_optional_args"])
def test_opinfo_samples(backend, dtype, rms, shape, normalized_shape, eps, affine):
    """OpInfo ``sample_inputs_layer_norm``: output and gradients (input, weight, bias)
    equal torch's functional op's at assert_close's defaults for the dtype, or are nearer
    the float64 result than torch's; weight and bias of ``make_tensor`` like the input, or
    none ("Without any optional args")."""
    make = lambda s: make_tensor(s, dtype=dtype, device="cpu", requires_grad=True)  # noqa: E731
    x = make(shape)
    weight = make(normalized_shape) if affine else None
    bias = make(normalized_shape) if affine and not rms else None
    leaves = [t for t in (x, weight, bias) if t is not None]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    it = iter(copies)
    x2, w2, b2 = next(it), (next(it) if weight is not None else None), None
    if bias is not None:
        b2 = next(it)
    ours, torch_op = _opinfo_call(rms, backend, x, normalized_shape, weight, bias, eps)
    args = (x2, normalized_shape, w2) if rms else (x2, normalized_shape, w2, b2)
    theirs = torch_op(*args, **({} if eps is None else {"eps": eps}))
    assert ours.dtype == theirs.dtype
    assert_close(ours, theirs)
    if x.numel() == 0:
        return
    dy = torch.randn_like(theirs)
    ours.backward(dy)
    theirs.backward(dy)
    # the float64 truth, for elements where ours and torch's differ by more than rounding
    exact = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(exact)
    x64, w64 = next(it), (next(it) if weight is not None else None)
    b64 = next(it) if bias is not None else None
    args64 = (x64, normalized_shape, w64) if rms else (x64, normalized_shape, w64, b64)
    default_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    y64 = torch_op(*args64, eps=default_eps if eps is None else eps)
    y64.backward(dy.double())
    for mine, other, truth in zip(leaves, copies, exact, strict=True):
        assert_close_or_nearer(mine.grad, other.grad, truth.grad)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_opinfo_negative_eps(rms):
    """OpInfo ``sample_inputs_layer_norm``'s ((2, 2, 3), (2, 3), eps=-0.5) sample: torch
    computes it (the variance of make_tensor's input exceeds 0.5); our documented contract
    (``eps >= 0``) rejects it with a ValueError."""
    x = make_tensor((2, 2, 3), dtype=torch.float32, device="cpu")
    w = make_tensor((2, 3), dtype=torch.float32, device="cpu")
    if rms:
        assert torch.isfinite(F.rms_norm(x, (2, 3), w, eps=-0.5)).all()
        call = lambda: layernorm.rms_norm(x, (2, 3), w, eps=-0.5)  # noqa: E731
    else:
        assert torch.isfinite(F.layer_norm(x, (2, 3), w, w, eps=-0.5)).all()
        call = lambda: layernorm.layer_norm(x, (2, 3), w, w, eps=-0.5)  # noqa: E731
    with pytest.raises(ValueError, match="eps must be non-negative"):
        call()


# ---------------------------------------------------------------------------------------
# common_methods_invocations.py: error_inputs_native_layer_norm and rms_norm's error inputs

#: (op, input shape, normalized_shape, weight shape, bias shape, torch's regex)
ERROR_INPUTS = [
    ("layer_norm", (1, 2, 3), (), None, None, "Expected normalized_shape to be at least 1-dimensional"),
    ("layer_norm", (1, 2, 3), (1, 2, 3), (1, 2), None, "Expected weight to be of same shape as normalized_shape"),
    ("layer_norm", (1, 2, 3), (1, 2, 3), None, (1, 2), "Expected bias to be of same shape as normalized_shape"),
    ("layer_norm", (2, 2, 3), (2, 2), None, None, "Given normalized_shape="),
    ("rms_norm", (1, 2, 3), (), None, None, "Expected normalized_shape to be at least 1-dimensional"),
    ("rms_norm", (1, 2, 3), (1, 2, 3), (1, 2), None, "Expected weight to be of same shape as normalized_shape"),
    ("rms_norm", (2, 2, 3), (2, 2), None, None, "Given normalized_shape="),
]  # fmt: skip


def _error_call(fn_module, op, shape, normalized_shape, weight_shape, bias_shape, **kwargs):
    make = lambda s: None if s is None else make_tensor(s, dtype=torch.float32, device="cpu")  # noqa: E731
    x, weight, bias = make(shape), make(weight_shape), make(bias_shape)
    if op == "rms_norm":
        return getattr(fn_module, op)(x, normalized_shape, weight, 1e-5, **kwargs)
    return getattr(fn_module, op)(x, normalized_shape, weight, bias, 1e-5, **kwargs)


@pytest.mark.parametrize(
    ("op", "shape", "normalized_shape", "weight", "bias", "match"), ERROR_INPUTS
)
def test_error_inputs_torch(op, shape, normalized_shape, weight, bias, match):
    """The oracle: torch raises RuntimeError matching the OpInfo's regex."""
    with pytest.raises(RuntimeError, match=match):
        _error_call(F, op, shape, normalized_shape, weight, bias)


@parametrize_backends
@pytest.mark.parametrize(
    ("op", "shape", "normalized_shape", "weight", "bias", "match"), ERROR_INPUTS
)
def test_error_inputs(backend, op, shape, normalized_shape, weight, bias, match):
    """OpInfo error inputs: the same exception type as torch (RuntimeError) and a message
    matching torch's regex; the exception is a ValueError too (issue 14 item 7)."""
    with pytest.raises(RuntimeError, match=match) as raised:
        _error_call(layernorm, op, shape, normalized_shape, weight, bias, backend=backend)
    assert isinstance(raised.value, ValueError)


assert BACKENDS[0] is None  # the automatic choice always runs
