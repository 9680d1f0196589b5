"""The triton backend, run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1).

Small shapes only: the interpreter runs each program in NumPy. The ``path`` fixture
shrinks the limits so a width of a few hundred columns takes each forward path (fused,
wide) and the chunked backward. Tests that need a GPU are marked ``gpu``. The forward's
correct rounding is tested in test_triton_exact.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import layernorm
from _triton_interpreter import HAS_TRITON, import_for_the_interpreter
from layernorm import backends, reference

import_for_the_interpreter()

if HAS_TRITON:
    from layernorm.backends import torch_, triton_

INTERPRETED = HAS_TRITON and triton_._triton_interprets()
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: tolerances of an output stored in the dtype against the float64 reference
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2},
}
FUSED_N = 37  # one program per row
WIDE_N = 300  # several chunks per row under the ``wide`` fixture, last one partial


def _forget_triton() -> None:
    # The registry caches availability; TRITON_INTERPRET changes it.
    backends.forget("triton")


@pytest.fixture(autouse=True)
def interpret(request, monkeypatch):
    """Runs each CPU test with TRITON_INTERPRET=1 (GPU tests without), leaving no trace."""
    if request.node.get_closest_marker("gpu"):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    elif not INTERPRETED:
        pytest.skip("triton was imported compiled: run TRITON_INTERPRET=1 pytest " + __file__)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    _forget_triton()
    yield
    _forget_triton()


def _shrink(monkeypatch) -> None:
    """Sends rows wider than 128 columns to the chunked paths (chunks of 64 columns)."""
    monkeypatch.setattr(triton_, "FUSED_FORWARD_N", 128)
    monkeypatch.setattr(triton_, "FUSED_BACKWARD_N", 128)
    monkeypatch.setattr(triton_, "CHUNK_N", 64)
    monkeypatch.setattr(triton_, "BACKWARD_CHUNK_N", 64)


@pytest.fixture(params=["fused", "wide"])
def path(request, monkeypatch):
    """Runs a test on each forward path; returns the width that takes it. The backward is
    fused for the first, chunked for the others, and runs on at most 3 row blocks, so
    programs loop over several rows."""
    monkeypatch.setattr(triton_, "MAX_PROGRAMS", 3)
    if request.param == "fused":
        assert triton_.forward_path(FUSED_N, torch.float32) == "fused"
        assert triton_.uses_fused_backward(FUSED_N, torch.float32)
        return FUSED_N
    _shrink(monkeypatch)
    for dtype in DTYPES:
        assert triton_.forward_path(WIDE_N, dtype) == "wide"
        assert not triton_.uses_fused_backward(WIDE_N, dtype)
    return WIDE_N


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _params(n: int, dtype: torch.dtype = torch.float32):
    weight = (1 + 0.5 * torch.randn(n)).to(dtype)
    bias = torch.randn(n).to(dtype)
    return weight, bias


# ---------------------------------------------------------------------------------------
# Availability and choice


def test_available_under_interpreter():
    assert triton_.unavailable_reason() is None
    assert "triton" in layernorm.available_backends()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device makes it available")
def test_unavailable_without_interpreter_or_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    _forget_triton()
    assert "TRITON_INTERPRET=1" in triton_.unavailable_reason()
    assert "triton" not in layernorm.available_backends()
    with pytest.raises(RuntimeError, match="backend 'triton' is not available here"):
        layernorm.layer_norm(torch.randn(2, 4), 4, backend="triton")


def test_cannot_run():
    assert triton_.cannot_run(torch.zeros(2, 3)) is None
    assert triton_.cannot_run(torch.zeros(2, 3, dtype=torch.bfloat16)) is None
    assert "float64" in triton_.cannot_run(torch.zeros(2, 3, dtype=torch.float64))
    assert "meta" in triton_.cannot_run(torch.zeros(2, 3, device="meta"))
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run this input: .*float64"):
        layernorm.layer_norm(torch.zeros(2, 3, dtype=torch.float64), 3, backend="triton")


def test_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET=1" in triton_.cannot_run(torch.zeros(2, 3))


def test_automatic_choice_never_interprets_cpu_tensors():
    x = torch.randn(3, 8)
    assert not triton_.prefers(x)
    assert backends.choose(x) != "triton"


# ---------------------------------------------------------------------------------------
# Forward against the float64 reference


def test_forward_is_the_torch_backends_bits(path):
    # Both correctly rounded (docs/contract.md §3): the same bits, and the statistics
    # (rounded from float64 to float32) within a unit of float32 of each other.
    x = torch.randn(4, path) + 3
    weight, bias = _params(path)
    ours = triton_.forward(x, None, weight, bias, 1e-5, False)
    theirs = torch_.forward(x, None, weight, bias, 1e-5, False)
    assert torch.equal(ours[0], theirs[0])
    for a, b in zip(ours[2:], theirs[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=2.0**-23, atol=0)


def _grads(fn, inputs, dy):
    for t in inputs:
        t.requires_grad_(True)
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, dy)
    return [t.grad for t in inputs]


def _width_errors(n: int, offset: float) -> tuple[float, float, float]:
    """Core errors of layer norm and RMSNorm on one float32 row N(offset, 1) of width
    ``n``, and dx's error relative to its largest value, against float64 on that row."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    x = (offset + torch.randn(1, n, dtype=torch.float64)).float()
    dy, weight = torch.randn(1, n), torch.randn(n)
    u = layernorm.layer_norm(x.to(device), n, backend="triton")
    u_ref = reference.layer_norm(_np(x), n)[0]
    r = layernorm.rms_norm(x.to(device), n, eps=1e-6, backend="triton")
    r_ref = reference.rms_norm(_np(x), n, eps=1e-6)[0]
    (dx,) = _grads(
        lambda x: layernorm.layer_norm(x, n, weight.to(device), backend="triton"),
        [x.to(device)],
        (dy.to(device),),
    )
    dx_ref = reference.layer_norm_backward(_np(dy), _np(x), n, _np(weight))[0]
    return (
        float(np.abs(_np(u.cpu()) - u_ref).max()),
        float(np.abs(_np(r.cpu()) - r_ref).max() / np.abs(r_ref).max()),
        float(np.abs(_np(dx.cpu()) - dx_ref).max() / np.abs(dx_ref).max()),
    )


def test_error_does_not_grow_with_the_chunk_count(monkeypatch):
    # docs/contract.md §3 on rows of many chunks: 64-column chunks stand in for the
    # 4096-column ones (the interpreter runs 4096 programs too slowly); the chunk totals
    # add in float64 (the GPU test below runs 16M elements).
    _shrink(monkeypatch)
    n = 64 * 64 + 3
    assert triton_.forward_path(n, torch.float32) == "wide"
    core, rms, dx = _width_errors(n, 1e4)
    assert core < 4e-6 and rms < 4e-6 and dx < 2e-5


@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    m=st.integers(1, 4),
    n=st.integers(1, 200),
    rms=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_property_is_the_torch_backends_bits_and_rows_are_independent(m, n, rms, dtype):
    # The autouse fixture only sets TRITON_INTERPRET, the same for every example.
    x = (4 * torch.randn(m, n) - 1).to(dtype)
    weight, bias = _params(n, dtype)
    bias = None if rms else bias
    with pytest.MonkeyPatch.context() as monkeypatch:
        _shrink(monkeypatch)  # n > 128: wide
        y = triton_.forward(x, None, weight, bias, 1e-5, rms)[0]
        alone = triton_.forward(x[-1:], None, weight, bias, 1e-5, rms)[0]
    assert torch.equal(alone, y[-1:])
    assert torch.equal(y, torch_.forward(x, None, weight, bias, 1e-5, rms)[0])


# ---------------------------------------------------------------------------------------
# Residual, strided rows, batch invariance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_rows_are_read_in_place(path, dtype):
    n = path
    big = torch.randn(6, n + 13).to(dtype)
    x, residual = big[::2, 5 : 5 + n], big[1::2, :n]
    assert x.stride() == (2 * (n + 13), 1)
    weight, bias = _params(n, dtype)
    strided = triton_.forward(x, residual, weight, bias, 1e-5, False)
    packed = triton_.forward(x.contiguous(), residual.contiguous(), weight, bias, 1e-5, False)
    for a, b in zip(strided, packed, strict=True):
        assert torch.equal(a, b)
    dy, dres = big[1::2, 3 : 3 + n], big[::2, 2 : 2 + n]
    z, mean, rstd = packed[1], packed[2], packed[3]
    grads = triton_.backward(dy, z, weight, mean, rstd, dres, False, True, True, 1e-5)
    grads_packed = triton_.backward(
        dy.contiguous(), z, weight, mean, rstd, dres.contiguous(), False, True, True, 1e-5
    )
    for a, b in zip(grads, grads_packed, strict=True):
        assert torch.equal(a, b)


def test_launch_configuration_depends_only_on_width_and_dtype():
    assert triton_.forward_path(2048, torch.float32) == "fused"
    assert triton_.forward_path(2049, torch.bfloat16) == "wide"
    assert triton_._tile_shape(4096) == (64, 64)
    assert triton_._tile_shape(2048) == (32, 64)
    assert triton_._tile_shape(1) == (1, 1)
    assert triton_.uses_fused_backward(512, torch.bfloat16)
    assert not triton_.uses_fused_backward(513, torch.float32)
    # float64 elements per thread (32 threads a warp): 8 in a fused forward row, 16 in a
    # wide chunk, 2 in a fused backward row, 8 in a backward chunk
    assert triton_._num_warps_forward(2048) == 8 and triton_._num_warps_forward(4096) == 8
    assert triton_._num_warps_forward(1024) == 4
    assert triton_._num_warps_backward(512) == 8 and triton_._num_warps_backward(2048) == 8
    # whole blocks of _weight_terms.ROWS (32) rows a program
    assert triton_._row_blocks(10, 1024, 1) == (1, 32)
    assert triton_._row_blocks(100_000, 1024, 1) == (3125, 32)


# ---------------------------------------------------------------------------------------
# Backward


def test_backward_without_parameters_or_parameter_grads(path):
    n = path
    x, dy = torch.randn(5, n), torch.randn(5, n)
    _, _, mean, rstd = triton_.forward(x, None, None, None, 1e-5, False)
    dx, dweight, dbias = triton_.backward(dy, x, None, mean, rstd, None, False, True, True, 1e-5)
    assert dweight is None
    np.testing.assert_allclose(_np(dbias), _np(dy).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        _np(dx), reference.layer_norm_backward(_np(dy), _np(x), n)[0], rtol=1e-4, atol=1e-4
    )
    weight = torch.randn(n)
    dx2, dweight, dbias = triton_.backward(
        dy, x, weight, mean, rstd, None, False, False, False, 1e-5
    )
    assert dweight is None and dbias is None
    dx3 = triton_.backward(dy, x, weight, mean, rstd, None, False, True, False, 1e-5)[0]
    assert torch.equal(dx2, dx3)


def test_double_backward_through_the_triton_forward():
    x, weight = torch.randn(3, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    ys = [layernorm.layer_norm(x, 6, weight, backend=b) for b in ("triton", "torch")]
    hvps = []
    for y in ys:
        (gx,) = torch.autograd.grad((y**3).sum(), x, create_graph=True)
        hvps.append(torch.autograd.grad(gx.sum(), [x, weight]))
    for ours, theirs in zip(*hvps, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_compiles_fullgraph_around_the_triton_kernels():
    # aot_eager traces the custom ops (fake kernels) and runs the interpreted kernels.
    import torch._dynamo

    torch._dynamo.reset()
    weight = torch.randn(40, requires_grad=True)

    def fn(x, residual):
        y, h = layernorm.add_rms_norm(x, residual, 40, weight, backend="triton")
        return layernorm.layer_norm(y * h, 40, backend="triton")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    x, residual = torch.randn(3, 40, requires_grad=True), torch.randn(3, 40)
    out = compiled(x, residual)
    torch.testing.assert_close(out, fn(x, residual), rtol=0, atol=0)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    (gx_eager,) = torch.autograd.grad(fn(x, residual).square().sum(), x)
    torch.testing.assert_close(gx, gx_eager, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# Rows wider than one program, with the default limits


@pytest.mark.parametrize("n", [20_000, (1 << 20) + 17], ids=["wide", "past-1M"])
def test_default_chunked_paths(n):
    # rows over many programs, past 1M elements
    assert triton_.forward_path(n, torch.float32) == "wide"
    x = 5 + torch.randn(2 if n < 1 << 20 else 1, n)
    weight, bias = _params(n)
    y, _, mean, rstd = triton_.forward(x, None, weight, bias, 1e-5, False)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(_np(x), n, _np(weight), _np(bias))
    np.testing.assert_allclose(_np(y), y_ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(_np(rstd), rstd_ref, rtol=1e-6)
    np.testing.assert_allclose(_np(mean), mean_ref, rtol=1e-6)
    assert torch.equal(y, torch_.forward(x, None, weight, bias, 1e-5, False)[0])
    if n > 1 << 20:
        return  # the interpreter is slow; the chunked backward is tested on small widths
    dy = torch.randn_like(x)
    dx = triton_.backward(dy, x, weight, mean, rstd, None, False, False, False, 1e-5)[0]
    dx_ref = reference.layer_norm_backward(_np(dy), _np(x), n, _np(weight))[0]
    np.testing.assert_allclose(_np(dx), dx_ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# On a GPU


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED,
    reason="needs a CUDA device and triton imported without TRITON_INTERPRET",
)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1024, 4099, 20_000, 65536, 262144, (1 << 20) + 3])
def test_gpu_matches_torch_at_large_shapes(dtype, n):
    m = max(2, (1 << 24) // n)
    x = (torch.randn(m, n, device="cuda") + 3).to(dtype).requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype).requires_grad_(True)
    bias = torch.randn(n, device="cuda").to(dtype).requires_grad_(True)
    assert backends.choose(x.detach()) == "triton"
    y = layernorm.layer_norm(x, n, weight, bias)
    y_ref = torch.nn.functional.layer_norm(x.float(), (n,), weight.float(), bias.float())
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, weight, bias], dy)
    refs = torch.autograd.grad(y_ref, [x, weight, bias], dy.float())
    for grad, ref in zip(grads, refs, strict=True):
        scale = ref.abs().max().item() + 1
        torch.testing.assert_close(grad.float(), ref.float(), rtol=2e-2, atol=1e-2 * scale)
    z = x.detach().float()
    y = layernorm.rms_norm(x.detach(), n, weight.detach(), 1e-6)
    y_ref = z * torch.rsqrt((z * z).mean(1, keepdim=True) + 1e-6) * weight.detach().float()
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("n", "dtype"),
    [(4096, torch.bfloat16), (65536, torch.bfloat16), (65536, torch.float32)],
    ids=["fused", "wide-bf16", "wide-fp32"],
)
def test_gpu_64_bit_offsets(n, dtype):
    m = (1 << 31) // n + 2  # past 2^31 elements
    if 5 * m * n * dtype.itemsize > 0.8 * torch.cuda.mem_get_info()[0]:
        pytest.skip("not enough free GPU memory for a tensor past 2^31 elements")
    x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
    y = layernorm.layer_norm(x, n, backend="triton")
    dy = torch.randn(2, n, device="cuda", dtype=dtype)
    (dx,) = torch.autograd.grad(y[-2:], x, dy)
    tail = x.detach()[-2:].float().requires_grad_(True)
    y_ref = torch.nn.functional.layer_norm(tail, (n,))
    torch.testing.assert_close(y[-2:].float(), y_ref, **TOL[dtype])
    (dx_ref,) = torch.autograd.grad(y_ref, tail, dy.float())
    torch.testing.assert_close(dx[-2:].float(), dx_ref, rtol=2e-2, atol=2e-2)
    assert not dx[:-2].any()


@gpu
@needs_cuda
@pytest.mark.parametrize("n", [1000, 20_000, 300_000], ids=["fused", "wide", "wide-300k"])
def test_gpu_batch_invariance_and_reproducible_parameter_grads(n):
    x = torch.randn(64, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(n, device="cuda", requires_grad=True)
    bias = torch.randn(n, device="cuda", requires_grad=True)
    with torch.no_grad():
        batch = layernorm.layer_norm(x, n, weight, bias)
        for rows in (slice(5, 6), slice(0, 3), slice(17, 64)):
            assert torch.equal(layernorm.layer_norm(x[rows], n, weight, bias), batch[rows])
    dy = torch.randn_like(batch)
    first = torch.autograd.grad(layernorm.layer_norm(x, n, weight, bias), [x, weight, bias], dy)
    second = torch.autograd.grad(layernorm.layer_norm(x, n, weight, bias), [x, weight, bias], dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [768, 4096, 20_000], ids=["fused", "fused-4096", "wide"])
def test_gpu_forward_is_the_cpu_backends_bits(dtype, n):
    # docs/contract.md §3: correctly rounded on the GPU too, so the CPU backend's bits
    m = max(4, (1 << 22) // n)
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(m, n, generator=g) * 3 + 100).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    cpu = "numba" if "numba" in layernorm.available_backends() else "torch"
    for rms in (False, True):
        if rms:
            ours = layernorm.add_rms_norm(x.cuda(), r.cuda(), n, w.cuda(), backend="triton")
            theirs = layernorm.add_rms_norm(x, r, n, w, backend=cpu)
        else:
            ours = layernorm.add_layer_norm(x.cuda(), r.cuda(), n, w.cuda(), b.cuda())
            theirs = layernorm.add_layer_norm(x, r, n, w, b, backend=cpu)
        for a, c in zip(ours, theirs, strict=True):
            assert torch.equal(a.cpu(), c)


@gpu
@needs_cuda
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_gpu_error_is_independent_of_the_row_width(offset):
    # docs/contract.md §3: the offset tests' bound on a row of 16M elements (4097 chunks).
    core, rms, dx = _width_errors((1 << 24) + 3, offset)
    assert core < 4e-6 and rms < 4e-6 and dx < 2e-5


@gpu
@needs_cuda
def test_gpu_torch_compile_fullgraph():
    module = layernorm.LayerNorm(4096, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(module, fullgraph=True)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = compiled(x)
    torch.testing.assert_close(y, module(x))
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
