"""The PyTorch functions on the portable backend: parity, autograd, numerics, bad input.

Backend-specific suites (numba, triton) reuse the same properties in their own files;
here every call names ``backend="torch"`` unless it tests the automatic choice.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import layernorm
from _kernel_contract import check_any_dim
from layernorm import reference

B = "torch"
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# |ours - ref| <= 2 |torch - ref| + ATOL[dtype] (flash-attn's rule)
ATOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-12}
SHAPES = [
    ((1, 8), (8,)),
    ((3, 7), (7,)),
    ((5, 1031), (1031,)),
    ((2, 3, 97), (97,)),
    ((4, 6, 10), (6, 10)),
    ((2, 5000), (5000,)),
]


def _ref_check(ours, theirs, want, dtype):
    ours, theirs = ours.double().numpy(), theirs.double().numpy()
    bound = 2 * np.abs(theirs - want) + ATOL[dtype]
    assert np.all(np.abs(ours - want) <= bound), float(np.max(np.abs(ours - want) - bound))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "normalized_shape"), SHAPES)
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm_parity(dtype, shape, normalized_shape, affine):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    w = (torch.rand(normalized_shape) + 0.5).to(dtype) if affine != "none" else None
    b = torch.randn(normalized_shape).to(dtype) if affine == "both" else None
    ours = layernorm.layer_norm(x, normalized_shape, w, b, backend=B)
    assert ours.dtype == dtype and ours.shape == x.shape
    theirs = F.layer_norm(
        x.float(),
        normalized_shape,
        None if w is None else w.float(),
        None if b is None else b.float(),
    ).to(dtype)
    if dtype == torch.float64:
        theirs = F.layer_norm(x, normalized_shape, w, b)
    want = reference.layer_norm(
        x.double().numpy(),
        normalized_shape,
        None if w is None else w.double(),
        None if b is None else b.double(),
    )[0]
    _ref_check(ours, theirs, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "normalized_shape"), SHAPES)
def test_rms_norm_parity(dtype, shape, normalized_shape):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    w = (torch.rand(normalized_shape) + 0.5).to(dtype)
    ours = layernorm.rms_norm(x, normalized_shape, w, backend=B)
    theirs = F.rms_norm(x, normalized_shape, w)
    want = reference.rms_norm(
        x.double().numpy(), normalized_shape, w.double(), eps=torch.finfo(dtype).eps
    )[0]
    _ref_check(ours, theirs, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_default_eps_is_the_computation_dtypes_as_in_torch(dtype):
    # torch documents finfo(x.dtype).eps but uses float32's for half inputs; we match torch
    x = torch.full((1, 4), 0.05, dtype=dtype)
    assert torch.equal(layernorm.rms_norm(x, 4), F.rms_norm(x, (4,)))
    assert layernorm.rms_norm(x, 4).float().tolist() == [[1.0] * 4]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True])
def test_add_norm_is_norm_of_the_rounded_sum(dtype, rms):
    x, r = torch.randn(6, 257).to(dtype), torch.randn(6, 257).to(dtype)
    w = torch.rand(257).to(dtype)
    if rms:
        y, h = layernorm.add_rms_norm(x, r, 257, w, backend=B)
        want = layernorm.rms_norm(x + r, 257, w, backend=B)
    else:
        y, h = layernorm.add_layer_norm(x, r, 257, w, w, backend=B)
        want = layernorm.layer_norm(x + r, 257, w, w, backend=B)
    assert torch.equal(h, x + r)
    assert torch.equal(y, want)


# --- autograd --------------------------------------------------------------------------------


def _f64(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm_gradcheck_and_gradgradcheck(affine):
    x = _f64(3, 2, 5)
    args = [_f64(2, 5) if affine != "none" else None, _f64(2, 5) if affine == "both" else None]
    inputs = (x, *[a for a in args if a is not None])

    def f(x, *params):
        full = list(params) + [None] * (2 - len(params))
        return layernorm.layer_norm(x, (2, 5), *full, eps=0.1, backend=B)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("backend", [None, B])
def test_gradcheck_and_gradgradcheck_on_a_3d_input_taken_as_it_is(backend):
    """A contiguous 3-D input reaches the kernels (and the double backward's composite
    formula) without an (M, N) view."""
    x, r, w, b = _f64(2, 3, 6), _f64(2, 3, 6), _f64(6), _f64(6)

    def f(x, r, w, b):
        return layernorm.add_layer_norm(x, r, 6, w, b, eps=0.1, backend=backend)

    assert torch.autograd.gradcheck(f, (x, r, w, b))
    assert torch.autograd.gradgradcheck(f, (x, r, w, b))


def test_every_op_gradcheck_and_gradgradcheck():
    x, r, w, b = _f64(4, 6), _f64(4, 6), _f64(6), _f64(6)
    ops = [
        (lambda x, w: layernorm.rms_norm(x, 6, w, eps=0.01, backend=B), (x, w)),
        (lambda x, r, w, b: layernorm.add_layer_norm(x, r, 6, w, b, backend=B), (x, r, w, b)),
        (lambda x, r, w: layernorm.add_rms_norm(x, r, 6, w, eps=1e-3, backend=B), (x, r, w)),
    ]
    for f, inputs in ops:
        assert torch.autograd.gradcheck(f, inputs)
        assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_matches_reference(dtype):
    x = (torch.randn(64, 300) * 2 + 5).to(dtype).requires_grad_()
    w = torch.randn(300, dtype=dtype, requires_grad=True)
    b = torch.randn(300, dtype=dtype, requires_grad=True)
    dy = torch.randn(64, 300).to(dtype)
    layernorm.layer_norm(x, 300, w, b, backend=B).backward(dy)
    dx, dw, db = reference.layer_norm_backward(
        dy.double(), x.detach().double(), 300, w.detach().double()
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in ((x.grad, dx), (w.grad, dw), (b.grad, db)):
        assert got.dtype == dtype
        scale = max(1.0, float(np.abs(want).max()))
        assert float(np.abs(got.double().numpy() - want).max()) <= tol * scale * np.sqrt(
            64 if got is not x.grad else 1
        )


def test_regression_expanded_gradient_of_a_sum():
    # y.sum().backward() hands the backward a dy of strides (0, 0)
    x = torch.randn(5, 33, requires_grad=True)
    r = torch.randn(5, 33, requires_grad=True)
    y, h = layernorm.add_layer_norm(x, r, 33, backend=B)
    (y.sum() + h.sum()).backward()
    xx = (x + r).detach().requires_grad_()
    (F.layer_norm(xx, (33,)).sum() + xx.sum()).backward()
    torch.testing.assert_close(x.grad, xx.grad)


@pytest.mark.parametrize("backend", [None, B])
def test_expanded_gradient_of_a_sum_on_a_3d_input(backend):
    # a contiguous 3-D input reaches the kernels as it is; its gradient comes back
    # expanded (strides (0, 0, 0)) and must be taken as rows
    x = torch.randn(2, 5, 33, requires_grad=True)
    r = torch.randn(2, 5, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    y, h = layernorm.add_layer_norm(x, r, 33, w, backend=backend)
    (y.sum() + h.sum()).backward()
    xx = (x + r).detach().requires_grad_()
    ww = w.detach().requires_grad_()
    (F.layer_norm(xx, (33,), ww).sum() + xx.sum()).backward()
    assert x.grad.shape == x.shape
    torch.testing.assert_close(x.grad, xx.grad)
    torch.testing.assert_close(r.grad, xx.grad)
    torch.testing.assert_close(w.grad, ww.grad)


def test_residual_gradients_reach_both_inputs_separately():
    x, r = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    y, h = layernorm.add_layer_norm(x, r, 8, backend=B)
    (y.square().sum() + 3 * h.sum()).backward()
    assert torch.equal(x.grad, r.grad) and x.grad.data_ptr() != r.grad.data_ptr()
    x2 = (x + r).detach().requires_grad_()
    (F.layer_norm(x2, (8,)).square().sum() + 3 * x2.sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_saves_mean_and_rstd_not_the_core():
    x = torch.randn(16, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layernorm.layer_norm(x, 64, w, backend=B)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == [(16,), (16,), (16, 64), (64,)]
    (x_saved,) = [t for t in saved if t.shape == (16, 64)]
    assert x_saved.data_ptr() == x.data_ptr()  # the input itself, not u
    assert {t.dtype for t in saved if t.shape == (16,)} == {torch.float32}


# --- numerics contract (SPEC §3) -------------------------------------------------------------


@pytest.mark.parametrize("c", [0.0, 1e2, 1e4, 1e6])
def test_error_independent_of_offset(c):
    x = (torch.randn(32, 1000, dtype=torch.float64) + c).float()
    want = reference.layer_norm(x.numpy(), 1000)[0]
    assert np.abs(layernorm.layer_norm(x, 1000, backend=B).double().numpy() - want).max() < 4e-6
    if c >= 1e4:  # torch's own kernel does not have this property
        assert np.abs(F.layer_norm(x, (1000,)).double().numpy() - want).max() > 1e-4


@pytest.mark.parametrize("c", [0.0, 1e4, 1e6])
def test_gradient_error_independent_of_offset(c):
    x = (torch.randn(32, 1000, dtype=torch.float64) + c).float().requires_grad_()
    w = torch.randn(1000, requires_grad=True)
    dy = torch.randn(32, 1000)
    layernorm.layer_norm(x, 1000, w, backend=B).backward(dy)
    dx, dw, _ = reference.layer_norm_backward(
        dy.double(), x.detach().double(), 1000, w.detach().double()
    )
    assert np.abs(x.grad.double().numpy() - dx).max() < 2e-5 * np.abs(dx).max()
    assert np.abs(w.grad.double().numpy() - dw).max() < 2e-5 * np.abs(dw).max()


@given(
    st.sampled_from(DTYPES),
    st.floats(-1e4, 1e4, allow_nan=False, width=16),
    st.integers(1, 5000),
)
def test_constant_rows_give_exactly_beta(dtype, value, n):
    x = torch.full((2, n), value, dtype=dtype)
    w, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    assert torch.equal(layernorm.layer_norm(x, n, w, b, backend=B), b.expand(2, n))
    assert torch.equal(
        layernorm.add_layer_norm(x, torch.zeros_like(x), n, w, b, backend=B)[0], b.expand(2, n)
    )


def test_nan_and_inf_stay_in_their_row():
    x = torch.randn(6, 33)
    x[1, 4], x[4, 0] = float("nan"), float("-inf")
    for y in (layernorm.layer_norm(x, 33, backend=B), layernorm.rms_norm(x, 33, backend=B)):
        bad = ~torch.isfinite(y)
        assert bad[[1, 4]].all(dim=1).any() and not bad[[0, 2, 3, 5]].any()


@given(st.integers(1, 40), st.sampled_from([1, 5, 768, 4096, 4097, 70000]), st.sampled_from(DTYPES))
def test_batch_invariance(m, n, dtype):
    x = torch.randn(m, n).to(dtype)
    i = m // 2
    for f in (
        lambda t: layernorm.layer_norm(t, n, backend=B),
        lambda t: layernorm.rms_norm(t, n, backend=B),
        lambda t: layernorm.add_layer_norm(t, t * 0.5, n, backend=B)[0],
    ):
        assert torch.equal(f(x)[i], f(x[i : i + 1].clone())[0])


def test_parameter_gradients_are_reproducible():
    x = torch.randn(5000, 48, requires_grad=True)
    w, b = torch.randn(48, requires_grad=True), torch.randn(48, requires_grad=True)
    dy = torch.randn(5000, 48)
    grads = []
    for _ in range(2):
        x.grad = w.grad = b.grad = None
        layernorm.layer_norm(x, 48, w, b, backend=B).backward(dy)
        grads.append([x.grad.clone(), w.grad.clone(), b.grad.clone()])
    assert all(torch.equal(a, c) for a, c in zip(*grads, strict=True))


def test_stats_dtype_and_eps_zero():
    y = layernorm.layer_norm(torch.full((1, 4), 2.0), 4, eps=0.0, backend=B)
    assert torch.isnan(y).all()
    y = layernorm.layer_norm(torch.tensor([[1.0, 3.0]], dtype=torch.float64), 2, eps=0.0, backend=B)
    assert y.tolist() == [[-1.0, 1.0]]


# --- shapes and layouts ----------------------------------------------------------------------


def test_zero_size_inputs():
    for shape in [(0, 8), (2, 0, 8), (8,)]:
        x = torch.randn(shape, requires_grad=True)
        y = layernorm.layer_norm(x, 8, torch.ones(8), torch.zeros(8))
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape
    y, h = layernorm.add_rms_norm(torch.randn(0, 4), torch.randn(0, 4), 4)
    assert y.shape == h.shape == (0, 4)


def test_non_contiguous_strided_and_channels_last():
    base = torch.randn(6, 40)
    strided = base[:, 3:35]  # rows of 32 with a row stride of 40
    torch.testing.assert_close(layernorm.layer_norm(strided, 32), F.layer_norm(strided, (32,)))
    transposed = torch.randn(32, 6).t()
    torch.testing.assert_close(
        layernorm.layer_norm(transposed, 32), F.layer_norm(transposed, (32,))
    )
    image = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    torch.testing.assert_close(layernorm.layer_norm(image, (4, 5)), F.layer_norm(image, (4, 5)))
    torch.testing.assert_close(
        layernorm.rms_norm(image, (3, 4, 5)), F.rms_norm(image, (3, 4, 5), eps=None)
    )


def test_mixed_precision_weight():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w, b = torch.rand(64), torch.randn(64)  # float32 parameters, bfloat16 activations
    y = layernorm.layer_norm(x, 64, w, b)
    assert y.dtype == torch.bfloat16
    want = reference.layer_norm(x.double().numpy(), 64, w.double(), b.double())[0]
    assert np.abs(y.double().numpy() - want).max() < 3e-2


# --- backend choice --------------------------------------------------------------------------


def test_available_backends_and_explicit_choice(monkeypatch):
    assert "torch" in layernorm.available_backends()
    x = torch.randn(2, 8)
    monkeypatch.setenv("LAYERNORM_BACKEND", "torch")
    torch.testing.assert_close(layernorm.layer_norm(x, 8), F.layer_norm(x, (8,)))


def test_environment_choice_is_read_at_every_call(monkeypatch):
    from layernorm import backends

    x = torch.randn(2, 8)
    monkeypatch.delenv("LAYERNORM_BACKEND", raising=False)
    assert backends._environment_choice() is None
    assert backends.choose(x) != "torch"  # numba, where it is installed
    monkeypatch.setenv("LAYERNORM_BACKEND", "torch")
    assert backends._environment_choice() == "torch" and backends.choose(x) == "torch"
    monkeypatch.setenv("LAYERNORM_BACKEND", "")  # empty: the automatic choice
    assert backends.choose(x) == backends.choose(x, None) != "torch"
    assert backends.choose(x, "torch") == "torch"  # an explicit argument wins


def test_unknown_backend_errors(monkeypatch):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"unknown backend 'cuda-magic'; known backends"):
        layernorm.layer_norm(x, 8, backend="cuda-magic")
    monkeypatch.setenv("LAYERNORM_BACKEND", "nope")
    with pytest.raises(ValueError, match=r"unknown backend 'nope'"):
        layernorm.layer_norm(x, 8)


def test_backend_that_cannot_run_errors():
    if "triton" in layernorm.available_backends():
        pytest.skip("triton can run here")
    with pytest.raises(RuntimeError, match=r"backend 'triton' is not available here"):
        layernorm.layer_norm(torch.randn(2, 8), 8, backend="triton")


# --- bad input (SPEC §4) ---------------------------------------------------------------------


def test_bad_input_errors():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"at least 1-dimensional.*normalized_shape = \[\]"):
        layernorm.layer_norm(x, [])
    with pytest.raises(ValueError, match=r"at least 1-dimensional.*normalized_shape = \[\]"):
        layernorm.layer_norm(x, ())
    with pytest.raises(
        ValueError,
        match=r"normalized_shape=\[5\], expected input with shape \[\*, 5\], but got input of size \[2, 4\]",
    ):
        layernorm.layer_norm(x, 5)
    with pytest.raises(ValueError, match=r"normalized_shape=\[3, 4\].*size \[2, 4\]"):
        layernorm.rms_norm(x, (3, 4))
    with pytest.raises(ValueError, match=r"weight of shape \[5\] and normalized_shape = \[4\]"):
        layernorm.layer_norm(x, 4, torch.ones(5))
    with pytest.raises(ValueError, match=r"bias of shape \[2, 2\] and normalized_shape = \[4\]"):
        layernorm.layer_norm(x, 4, None, torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"floating-point input, got input of dtype torch.int64"):
        layernorm.layer_norm(torch.ones(2, 4, dtype=torch.long), 4)
    with pytest.raises(TypeError, match=r"floating-point input, got input of dtype torch.bool"):
        layernorm.rms_norm(torch.ones(2, 4, dtype=torch.bool), 4)
    with pytest.raises(TypeError, match=r"floating-point weight, got weight of dtype torch.int32"):
        layernorm.layer_norm(x, 4, torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"expected input to be a torch.Tensor, got ndarray"):
        layernorm.layer_norm(np.ones((2, 4)), 4)
    with pytest.raises(RuntimeError, match=r"same device, but got input on cpu and weight on meta"):
        layernorm.layer_norm(x, 4, torch.ones(4, device="meta"))
    with pytest.raises(ValueError, match=r"eps must be non-negative, got eps=-0.1"):
        layernorm.layer_norm(x, 4, eps=-0.1)
    with pytest.raises(ValueError, match=r"eps must be non-negative, got eps=nan"):
        layernorm.rms_norm(x, 4, eps=float("nan"))
    with pytest.raises(
        ValueError, match=r"residual must match input.*\[2, 4\] torch.float32 and residual \[1, 4\]"
    ):
        layernorm.add_layer_norm(x, torch.randn(1, 4), 4)
    with pytest.raises(
        ValueError, match=r"residual must match input.*residual \[2, 4\] torch.float64"
    ):
        layernorm.add_rms_norm(x, x.double(), 4)
    with pytest.raises(
        RuntimeError, match=r"same device, but got input on cpu and residual on meta"
    ):
        layernorm.add_layer_norm(x, torch.randn(2, 4, device="meta"), 4)
    with pytest.raises(
        ValueError,
        match=r"expected residual with shape \[\*, 4\], but got residual of size \[4, 2\]",
    ):
        layernorm.add_layer_norm(x, torch.randn(4, 2), 4)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_inference_autograd_and_custom_op_paths_agree_bitwise(backend):
    """Eager inference calls the kernel directly, eager autograd goes through an
    autograd.Function, torch.compile through the custom op: one result."""
    x, r = torch.randn(7, 300), torch.randn(7, 300)
    w, b = torch.rand(300), torch.randn(300)
    direct = layernorm.add_layer_norm(x, r, 300, w, b, backend=backend)
    with torch.no_grad():
        no_grad = layernorm.add_layer_norm(x.requires_grad_(), r, 300, w, b, backend=backend)
    tracked = layernorm.add_layer_norm(x, r, 300, w, b, backend=backend)
    op = torch.ops.layernorm.forward(x.detach(), r, w, b, 1e-5, False, backend or "")
    for y, h in (no_grad, tracked, op[:2]):
        assert torch.equal(y, direct[0]) and torch.equal(h, direct[1])
    assert tracked[0].requires_grad and not no_grad[0].requires_grad


def test_portable_backend_is_bitwise_identical_at_one_and_two_threads():
    x = torch.randn(300, 70001 // 7, requires_grad=True)
    w = torch.randn(x.shape[1], requires_grad=True)
    dy = torch.randn_like(x)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            x.grad = w.grad = None
            y = layernorm.layer_norm(x, x.shape[1], w, backend=B)
            y.backward(dy)
            results.append((y.detach(), x.grad.clone(), w.grad.clone()))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


# --- the common-call fast path and the kernel argument shapes ------------------------------


def test_common_call_takes_only_calls_the_full_checks_pass_unchanged():
    """``ops._common_call`` answers N only where the full checks would pass and change
    nothing; any other call gets 0 and goes through the full checks (and their errors)."""
    from layernorm import ops

    x, w, b = torch.randn(2, 3, 8), torch.randn(8), torch.randn(8)
    p = torch.nn.Parameter(torch.randn(8))

    def common(x=x, residual=None, shape=(8,), weight=w, bias=b, eps=1e-5, backend=None):
        return ops._common_call(x, residual, shape, weight, bias, eps, backend)

    assert common() == common(shape=8) == common(weight=p, bias=None) == 8
    assert common(residual=torch.randn(2, 3, 8), weight=None) == 8
    assert common(x=torch.randn(8)) == 8  # one row
    others = {
        "backend named": common(backend="numba"),
        "int eps": common(eps=1),
        "eps None": common(eps=None),
        "negative eps": common(eps=-1.0),
        "nan eps": common(eps=float("nan")),
        "two dims": common(x=torch.randn(2, 3, 8), shape=(3, 8), weight=None, bias=None),
        "torch.Size": common(shape=torch.Size([8])),
        "list": common(shape=[8]),
        "empty tuple": common(shape=()),
        "nested tuple": common(shape=((8,),)),
        "wrong N": common(shape=(4,)),
        "zero N": common(x=torch.randn(2, 0), shape=0, weight=None, bias=None),
        "0-dim input": common(x=torch.tensor(1.0), shape=1, weight=None, bias=None),
        "non-contiguous input": common(x=torch.randn(8, 6).t()),
        "strided rows": common(x=torch.randn(4, 16)[:, :8]),
        "integer input": common(x=torch.ones(2, 8, dtype=torch.long)),
        "Parameter input": common(x=torch.nn.Parameter(torch.randn(2, 8))),
        "meta input": common(x=torch.randn(2, 8, device="meta"), weight=None, bias=None),
        "weight shape": common(weight=torch.randn(4)),
        "weight 2-D": common(weight=torch.randn(1, 8)),
        "weight integer": common(weight=torch.ones(8, dtype=torch.int32)),
        "weight strided": common(weight=torch.randn(16)[::2]),
        "weight meta": common(weight=torch.randn(8, device="meta")),
        "weight list": common(weight=[1.0] * 8),
        "bias strided": common(bias=torch.randn(16)[::2]),
        "residual dtype": common(residual=x.double()),
        "residual shape": common(residual=torch.randn(6, 8)),
        "residual strided": common(residual=torch.randn(2, 3, 16)[..., :8]),
    }
    assert {k for k, v in others.items() if v != 0} == set()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8,), (3, 8), (2, 3, 50), (2, 2, 2, 33)])
def test_common_call_and_full_checks_agree_bitwise(monkeypatch, dtype, shape):
    """The same results, gradients included, with the fast path turned off."""
    from layernorm import ops

    n = shape[-1]
    x, r, dy = (torch.randn(shape, dtype=dtype) for _ in range(3))
    w, b = torch.rand(n, dtype=dtype) + 0.5, torch.randn(n, dtype=dtype)

    def run():
        xs, rs, ws, bs = (t.clone().requires_grad_() for t in (x, r, w, b))
        y, h = layernorm.add_layer_norm(xs, rs, n, ws, bs)
        torch.autograd.backward((y, h), (dy, dy))
        with torch.no_grad():
            plain = layernorm.layer_norm(x, (n,), w, b), layernorm.rms_norm(x, n, w, eps=1e-6)
        return (y, h, xs.grad, rs.grad, ws.grad, bs.grad, *plain)

    from layernorm import compiled

    monkeypatch.setattr(compiled, "norm", lambda *args: None)  # (tests/test_compiled.py)
    fast = run()
    assert ops._common_call(x, r, n, w, b, 1e-5, None) == n
    monkeypatch.setattr(ops, "_common_call", lambda *args: 0)
    full = run()
    for a, c in zip(fast, full, strict=True):
        assert a.shape == c.shape and torch.equal(a, c)


@pytest.mark.parametrize("name", ["torch", "numba"])
def test_backends_take_contiguous_tensors_of_any_dim(name):
    from layernorm import backends

    if name not in layernorm.available_backends():
        pytest.skip(f"{name} is not installed")
    check_any_dim(backends.get(name))


def test_automatic_choice_is_made_once_per_device_type_and_dtype(monkeypatch):
    from layernorm import backends

    monkeypatch.delenv("LAYERNORM_BACKEND", raising=False)
    backends.forget("numba")
    first = backends.pick(torch.randn(2, 8))
    asked = []
    monkeypatch.setattr(backends, "_automatic", lambda x: asked.append(x) or first)
    assert backends.pick(torch.randn(5, 3)) is first and asked == []  # remembered
    backends.pick(torch.randn(2, 8, dtype=torch.float64))  # another dtype: asks
    assert len(asked) == 1
    backends.forget("numba")  # forgets every remembered choice
    backends.pick(torch.randn(2, 8))
    assert len(asked) == 2
    backends.forget("numba")  # (what the stand-in chose)
