"""The op's own registrations (layernorm._op): the autocast policy, the exception type of
shape mismatches, the entry point each kind of call takes. tests/test_mechanisms.py runs
every PyTorch mechanism against torch's own ops."""

import pytest
import torch
import torch.nn.functional as F

import layernorm
from layernorm import _op, ops


@pytest.fixture(params=[True, False], ids=["fast", "no-fast"])
def fast_paths(request, monkeypatch):
    monkeypatch.setattr(ops, "FAST_PATHS", request.param)
    return request.param


def test_autocast_policy_is_registered_on_the_op():
    """CUDA autocast runs the op in float32 (as torch's fp32 list does layer_norm); CPU
    autocast leaves it alone (torch has no AutocastCPU kernel for layer_norm)."""
    assert {"cuda": torch.float32} == _op.AUTOCAST_DTYPE
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("layernorm::forward", "AutocastCUDA")
    assert not has("layernorm::forward", "AutocastCPU")
    assert not has("aten::layer_norm", "AutocastCPU")  # torch's own, for the record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_autocast_keeps_the_input_dtype_as_torch(fast_paths, dtype):
    x, w = torch.randn(3, 8).to(dtype), torch.rand(8) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = layernorm.layer_norm(x, 8, w)
        theirs = F.layer_norm(x, (8,), w.to(dtype))
    assert ours.dtype == theirs.dtype == dtype


def test_the_policy_casts_where_it_applies(fast_paths, monkeypatch):
    """The CUDA policy applied to CPU tensors (no GPU here): bfloat16 in, float32 out, and
    the cast is recorded by autograd (the gradient reaches x in its own dtype)."""
    monkeypatch.setitem(_op.AUTOCAST_DTYPE, "cpu", torch.float32)
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layernorm.layer_norm(x, 8)
        y_rms = layernorm.rms_norm(x, 8)
    assert y.dtype == y_rms.dtype == torch.float32
    torch.testing.assert_close(y, F.layer_norm(x.float(), (8,)))
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert layernorm.layer_norm(x, 8).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "call",
    [
        lambda: layernorm.layer_norm(torch.randn(2, 5), 4),
        lambda: layernorm.rms_norm(torch.randn(2, 5), (5,), torch.ones(4)),
        lambda: layernorm.layer_norm(torch.randn(2, 5), [], None),
        lambda: layernorm.add_layer_norm(torch.randn(2, 5), torch.randn(3, 5), 5),
        lambda: layernorm.LayerNorm(4)(torch.randn(2, 5)),
    ],
)
def test_shape_mismatches_raise_runtime_error_and_value_error(fast_paths, call):
    for kind in (RuntimeError, ValueError, ops.NormalizedShapeError):
        with pytest.raises(kind, match=r"normalized_shape|residual must match"):
            call()


def test_the_messages_are_torch_s(fast_paths):
    x = torch.randn(2, 5)
    for ours, theirs in [
        (lambda: layernorm.layer_norm(x, 4), lambda: F.layer_norm(x, (4,))),
        (
            lambda: layernorm.layer_norm(x, 5, torch.ones(4)),
            lambda: F.layer_norm(x, (5,), torch.ones(4)),
        ),
    ]:
        with pytest.raises(RuntimeError) as expected:
            theirs()
        with pytest.raises(
            RuntimeError, match=expected.value.args[0].split(",")[0].replace("[", r"\[")
        ):
            ours()


def test_dispatch_modes_see_the_custom_op_and_get_the_same_bits(fast_paths):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(3, 16), torch.randn(16)
    want = layernorm.layer_norm(x, 16, w)
    with Record():
        got = layernorm.layer_norm(x, 16, w)
        got_grad = layernorm.layer_norm(x.clone().requires_grad_(), 16, w)
    assert "layernorm.forward.default" in seen
    assert torch.equal(got, want) and torch.equal(got_grad.detach(), want)


def test_meta_tensors_give_shapes(fast_paths):
    y, h = layernorm.add_rms_norm(
        torch.empty(2, 3, 8, device="meta"), torch.empty(2, 3, 8, device="meta"), 8
    )
    assert y.shape == h.shape == (2, 3, 8) and y.is_meta


def test_unseen_declines_every_mechanism_and_records_gradient_reads_grad_mode():
    """``_op.unseen``, the one test behind the options' eager shortcuts: true for plain
    tensors in eager mode only; ``records_gradient`` needs grad mode and a tensor that
    requires grad."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(2, 4)
    w = torch.ones(4, requires_grad=True)
    assert _op.unseen(x, None, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _op.unseen(x)

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for mode in (Dispatch(), Function()):
        with mode:
            assert not _op.unseen(x)
    seen = []
    torch.func.vmap(lambda row: seen.append(_op.unseen(row)) or row)(x)
    torch.jit.trace(lambda t: seen.append(_op.unseen(t)) or t * 1, (x,), check_trace=False)
    with torch.autograd.forward_ad.dual_level():
        seen.append(_op.unseen(x))
    assert seen == [False, False, False]
    assert not _op.unseen(torch.empty(2, 4, device="meta"))
    assert _op.records_gradient(x, None, 3.0, w)
    assert not _op.records_gradient(x, None)
    with torch.no_grad():
        assert not _op.records_gradient(w)
