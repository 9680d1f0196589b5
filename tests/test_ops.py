"""The PyTorch functions: autograd, shapes and layouts, the backend choice, bad input.

The numerics contract (agreement with the reference, offsets, constant rows, NaN,
batch invariance, determinism) is tests/test_contract.py, on every backend; here every
call names ``backend="torch"`` unless it tests the automatic choice.
"""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import layernorm
from layernorm import reference

B = "torch"
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_default_eps_is_the_computation_dtypes_as_in_torch(dtype):
    # torch documents finfo(x.dtype).eps but uses float32's for half inputs; we match torch
    x = torch.full((1, 4), 0.05, dtype=dtype)
    assert torch.equal(layernorm.rms_norm(x, 4), F.rms_norm(x, (4,)))
    assert layernorm.rms_norm(x, 4).float().tolist() == [[1.0] * 4]


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


# --- bad input (docs/contract.md §4) ---------------------------------------------------------------------


_BAD_SHAPES = [
    torch.tensor([4]),  # a tensor of sizes
    torch.ones(4),  # a weight passed where the shape goes
    4.0,
    [4.0],
    True,
    [True],
    "4",
    None,
    [4, None],
    [3, 4.0],
    [torch.tensor(4.0)],
    [3, torch.tensor(4.0)],
    range(4, 5),
    np.int64(4),
]


@pytest.mark.parametrize("shape", _BAD_SHAPES, ids=lambda s: type(s).__name__ + repr(s)[:12])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_a_bad_normalized_shape_is_torchs_type_error(shape, fast, op, monkeypatch):
    """What torch's argument parser rejects is the same TypeError, with torch's message,
    from every entry point that takes a ``normalized_shape``, before any work: never a
    tensor's values or a float truncated into a shape."""
    monkeypatch.setattr(layernorm.ops, "FAST_PATHS", fast)
    x = torch.randn(2, 3, 4)
    with pytest.raises(TypeError) as theirs:
        getattr(F, op)(x, shape)
    message = str(theirs.value)
    added = message.replace(op, f"add_{op}", 1)
    added = added.replace("(position 2)", "(position 3)").replace("at pos 2 ", "at pos 3 ")
    fused = message.replace(op, "fused_norm", 1)
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        getattr(layernorm, op)(x, shape)
    with pytest.raises(TypeError, match=f"^{re.escape(added)}$"):
        getattr(layernorm, f"add_{op}")(x, x, shape)
    with pytest.raises(TypeError, match=f"^{re.escape(fused)}$"):
        layernorm.fused_norm(x, shape, rms=op == "rms_norm")


def test_a_bool_is_no_size():
    """Stricter than torch, which reads ``True`` after the first element as 1."""
    with pytest.raises(TypeError, match=r"failed to unpack the object at pos 2 .*got bool"):
        layernorm.layer_norm(torch.randn(2, 1, 1), [1, True])


@pytest.mark.parametrize(
    "shape",
    [[4], (4,), torch.Size([4]), [np.int64(4)], (np.int32(4),), (torch.tensor(4),), (3, 4), 4],
    ids=repr,
)
def test_every_normalized_shape_torch_takes_is_taken(shape):
    """The shapes torch's ``F.layer_norm`` takes give its result (and an int, as
    ``nn.LayerNorm`` takes it)."""
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    expected = F.layer_norm(x, [shape] if isinstance(shape, int) else shape)
    torch.testing.assert_close(layernorm.layer_norm(x, shape), expected)
    torch.testing.assert_close(
        layernorm.rms_norm(x, shape), F.rms_norm(x, [shape] if isinstance(shape, int) else shape)
    )


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
        ValueError, match=r"residual must match input.*residual \[2, 4\] torch.float16"
    ):  # (a wider residual is the residual stream: tests/test_residual_dtype.py)
        layernorm.add_rms_norm(x, x.half(), 4)
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


# --- the kernel argument shapes and the backend choice -------------------------------------


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
