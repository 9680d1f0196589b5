"""LayerNorm / RMSNorm are exact drop-ins for torch's modules, and compile without breaks."""

import pytest
import torch
import torch.nn.functional as F

import layernorm


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"eps": 1e-6}, {"elementwise_affine": False}, {"bias": False}, {"dtype": torch.float64}],
)
def test_layer_norm_module_is_a_drop_in(kwargs):
    ours, theirs = layernorm.LayerNorm((4, 6), **kwargs), torch.nn.LayerNorm((4, 6), **kwargs)
    assert isinstance(ours, torch.nn.LayerNorm)
    assert repr(ours) == repr(theirs)
    assert [(k, v.shape, v.dtype) for k, v in ours.state_dict().items()] == [
        (k, v.shape, v.dtype) for k, v in theirs.state_dict().items()
    ]
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_(-2, 2)
    ours.load_state_dict(theirs.state_dict())  # torch -> ours
    x = torch.randn(3, 4, 6, dtype=kwargs.get("dtype", torch.float32))
    torch.testing.assert_close(ours(x), theirs(x))
    back = torch.nn.LayerNorm((4, 6), **kwargs)
    back.load_state_dict(ours.state_dict())  # ours -> torch
    torch.testing.assert_close(back(x), ours(x))


@pytest.mark.parametrize("kwargs", [{}, {"eps": 1e-6}, {"elementwise_affine": False}])
def test_rms_norm_module_is_a_drop_in(kwargs):
    ours, theirs = layernorm.RMSNorm([8], **kwargs), torch.nn.RMSNorm([8], **kwargs)
    assert isinstance(ours, torch.nn.RMSNorm)
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    if theirs.weight is not None:
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 2)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 8)
    torch.testing.assert_close(ours(x), theirs(x))


def test_module_backend_attribute_and_reset_parameters():
    m = layernorm.LayerNorm(8)
    m.backend = "torch"
    with torch.no_grad():
        m.weight.fill_(3)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.ones(8))
    x = torch.randn(2, 8)
    torch.testing.assert_close(m(x), F.layer_norm(x, (8,)))
    m.backend = "bogus"
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        m(x)


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16),
        layernorm.LayerNorm(16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 16),
        layernorm.RMSNorm(16),
    )
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 16, requires_grad=True)
    out = compiled(x)
    out.square().sum().backward()
    grad_compiled = x.grad.clone()
    x.grad = None
    model(x).square().sum().backward()
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(grad_compiled, x.grad)


def test_torch_compile_inductor_with_fused_residual():
    torch._dynamo.reset()

    def block(x, r, w, b):
        y, h = layernorm.add_layer_norm(x, r, x.shape[-1], w, b)
        return y * 2 + h

    x, r = torch.randn(3, 32, requires_grad=True), torch.randn(3, 32)
    w, b = torch.rand(32, requires_grad=True), torch.randn(32)
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x, r, w, b)
    out.sum().backward()
    torch.testing.assert_close(out, block(x, r, w, b))
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    block(x, r, w, b).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
