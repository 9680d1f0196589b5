"""Every PyTorch mechanism on our four functions and two modules, against torch's own ops
(``docs/contract.md`` §6): torch.func, forward AD, TorchScript (trace and script),
torch.export, ONNX (both exporters, run by onnxruntime), AOTInductor, autocast,
torch.compile, exception types, and calls a fast path must decline (fake tensors, dispatch
modes, subclasses, meta tensors, device contexts, inference mode).

Each test runs with the fast paths on and off (``layernorm.ops.FAST_PATHS``), and the two
give the same values. Oracles: :func:`torch.nn.functional.layer_norm` and ``rms_norm``;
``add_*`` as ``x + residual`` then the norm, both outputs compared. float32 within 1e-5,
float64 (the torch.func tests, as torch's own) within assert_close's float64 defaults.
"""

from __future__ import annotations

import io
import re
import shutil
import time
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap
from torch.testing import assert_close

import layernorm
from _mechanism_models import CASES, EPS, Case, CaseModule, N, mixed_pair
from layernorm import ops

F32 = {"rtol": 1e-5, "atol": 1e-5}
CASE_IDS = [case.id for case in CASES]
#: one case per function, with all its parameters (for the costlier mechanisms)
FULL = [c for c in CASES if c.weight and (c.bias or c.rms)]

# torch 2.13 deprecates TorchScript, and calls torch.jit.script itself when forward AD first
# loads its decompositions; its pytree helpers warn about their own LeafSpec.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch\\.jit\\.[a-z_]+` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]


@pytest.fixture(params=[True, False], ids=["fast", "nofast"])
def fast(request, monkeypatch):
    """The fast paths on (as users run) or switched off; every mechanism must give the
    same results either way."""
    monkeypatch.setattr(ops, "FAST_PATHS", request.param, raising=False)
    return request.param


def close(ours, theirs, **tolerance) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_close(a, b, **(tolerance or F32))


def present(*tensors):
    return [t for t in tensors if t is not None]


def test_fast_paths_switch_exists():
    assert ops.FAST_PATHS is True  # the default, read at every call


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fast_paths_off_never_reach_the_compiled_dispatch(case, monkeypatch):
    def refuse(*args):
        raise AssertionError("the compiled dispatch ran with FAST_PATHS = False")

    monkeypatch.setattr(ops, "FAST_PATHS", False)
    monkeypatch.setattr(ops._compiled, "norm", refuse)
    tensors = case.tensors((2, N))
    with torch.no_grad():
        close(case.ours(*tensors), case.torch(*tensors))


# ---------------------------------------------------------------------------------------
# Eager, and the fast paths against the slow ones


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fast_and_slow_paths_agree(case, monkeypatch):
    """Same values (bit for bit) and same gradients with the fast paths on and off, and
    both within torch's tolerance of torch's own ops."""
    tensors = case.tensors((3, 5, N))
    results = []
    for on in (True, False):
        monkeypatch.setattr(ops, "FAST_PATHS", on, raising=False)
        with torch.no_grad():
            inference = case.ours(*tensors)
        leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
        outputs = case.ours(*leaves)
        sum(o.sum() * (k + 1) for k, o in enumerate(outputs)).backward()
        results.append((inference, outputs, [t.grad for t in present(*leaves)]))
    (inf_on, out_on, grad_on), (inf_off, out_off, grad_off) = results
    close(inf_on, inf_off, rtol=0, atol=0)
    close(out_on, out_off, rtol=0, atol=0)
    close(grad_on, grad_off, rtol=0, atol=0)
    close(inf_on, case.torch(*tensors))


# ---------------------------------------------------------------------------------------
# torch.func: vmap


def _in_dims(case: Case, x_dim, param_dim=None):
    return (
        x_dim,
        x_dim if case.add else None,
        param_dim if case.weight else None,
        param_dim if case.bias else None,
    )


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_vmap_in_dims_0_rows_of_one_sample(case, fast):
    x, residual, weight, bias = case.tensors((4, N))  # each sample a 1-D row
    dims = _in_dims(case, 0)
    close(
        vmap(case.ours, dims)(x, residual, weight, bias),
        vmap(case.torch, dims)(x, residual, weight, bias),
    )


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_vmap_in_dims_1(case, fast):
    x, residual, weight, bias = case.tensors((3, 4, N))
    dims = _in_dims(case, 1)
    ours = vmap(case.ours, dims)(x, residual, weight, bias)
    close(ours, vmap(case.torch, dims)(x, residual, weight, bias))
    # vmap's outputs are batched at dim 0: the per-sample results of x[:, b]
    single = case.torch(x[:, 1], None if residual is None else residual[:, 1], weight, bias)
    close([o[1] for o in ours], single)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_nested_vmap(case, fast):
    x, residual, weight, bias = case.tensors((2, 3, 4, N))
    dims = _in_dims(case, 0)
    ours = vmap(vmap(case.ours, dims), _in_dims(case, 1))(x, residual, weight, bias)
    theirs = vmap(vmap(case.torch, dims), _in_dims(case, 1))(x, residual, weight, bias)
    close(ours, theirs)


@pytest.mark.parametrize("case", [c for c in CASES if c.weight], ids=lambda c: c.id)
def test_vmap_batched_weight_and_bias(case, fast):
    """Per-sample parameters: in_dims=(0, 0 or None, 0, 0)."""
    x, residual, _, _ = case.tensors((3, 2, N))
    weight = torch.randn(3, N) + 1
    bias = torch.randn(3, N) if case.bias else None
    dims = _in_dims(case, 0, param_dim=0)
    close(
        vmap(case.ours, dims)(x, residual, weight, bias),
        vmap(case.torch, dims)(x, residual, weight, bias),
    )


@pytest.mark.parametrize("case", [c for c in CASES if c.weight and not c.add], ids=lambda c: c.id)
def test_vmap_batched_weight_only(case, fast):
    """x shared (in_dims None), weight batched: the batch reaches us only through weight."""
    x, _, _, bias = case.tensors((2, N))
    weight = torch.randn(3, N) + 1
    dims = (None, None, 0, None)
    close(
        vmap(case.ours, dims)(x, None, weight, bias), vmap(case.torch, dims)(x, None, weight, bias)
    )


# ---------------------------------------------------------------------------------------
# torch.func: derivatives (float64, as torch's own torch.func tests)


def _scalar(case: Case, run, shape, dtype=torch.float64):
    """A scalar of every output, with fixed weights that make each element count
    differently (drawn here: torch.func forbids random ops inside its transforms)."""
    generator = torch.Generator().manual_seed(1)
    projections = [torch.randn(shape, dtype=dtype, generator=generator) for _ in range(2)]

    def loss(x, residual, weight, bias):
        outputs = run(x, residual, weight, bias)
        return sum((o * p).sum() for o, p in zip(outputs, projections, strict=False))

    return loss


def _argnums(case: Case) -> tuple[int, ...]:
    return (
        (0,)
        + ((1,) if case.add else ())
        + ((2,) if case.weight else ())
        + ((3,) if case.bias else ())
    )


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_func_grad(case, fast):
    tensors = case.tensors((3, 5), torch.float64)
    argnums = _argnums(case)
    close(
        grad(_scalar(case, case.ours, (3, 5)), argnums)(*tensors),
        grad(_scalar(case, case.torch, (3, 5)), argnums)(*tensors),
        rtol=1e-7,
        atol=1e-7,
    )


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("jacobian", [jacrev, jacfwd], ids=["jacrev", "jacfwd"])
def test_func_jacobians(case, jacobian, fast):
    tensors = case.tensors((2, 5), torch.float64)
    argnums = _argnums(case)
    ours = jacobian(case.ours, argnums)(*tensors)
    theirs = jacobian(case.torch, argnums)(*tensors)
    for a, b in zip(ours, theirs, strict=True):  # one tuple (per argument) per output
        close(a, b, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_func_hessian(case, fast):
    x, residual, weight, bias = case.tensors((2, 4), torch.float64)

    def of_x(run):
        loss = _scalar(case, run, (2, 4))
        return lambda x: loss(x, residual, weight, bias)

    assert_close(hessian(of_x(case.ours))(x), hessian(of_x(case.torch))(x), rtol=1e-7, atol=1e-7)


def test_per_sample_gradients_over_functional_call(fast):
    """The Opacus pattern: vmap(grad(loss)) over functional_call of a model that holds
    our modules, against the same model with torch's."""

    def model(norms):
        return torch.nn.Sequential(
            torch.nn.Linear(5, N), norms[0](N), torch.nn.Tanh(), norms[1](N), torch.nn.Linear(N, 1)
        ).double()

    ours = model((layernorm.LayerNorm, layernorm.RMSNorm))
    oracle = model((torch.nn.LayerNorm, torch.nn.RMSNorm))
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    oracle.load_state_dict(ours.state_dict())
    xs, targets = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)

    def per_sample(net):
        params = {k: v.detach() for k, v in net.named_parameters()}

        def loss(params, x, target):
            out = functional_call(net, params, (x.unsqueeze(0),))
            return ((out - target.unsqueeze(0)) ** 2).sum()

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, targets)

    ours_grads, oracle_grads = per_sample(ours), per_sample(oracle)
    assert ours_grads.keys() == oracle_grads.keys()
    for name in ours_grads:
        assert ours_grads[name].shape[0] == 6
        assert_close(ours_grads[name], oracle_grads[name], rtol=1e-7, atol=1e-7)


# ---------------------------------------------------------------------------------------
# Forward-mode AD


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_ad_dual_tensors(case, fast):
    primals = case.tensors((3, 6), torch.float64)
    tangents = [None if p is None else torch.randn_like(p) for p in primals]
    results = []
    for run in (case.ours, case.torch):
        with fwAD.dual_level():
            duals = [
                None if p is None else fwAD.make_dual(p, t)
                for p, t in zip(primals, tangents, strict=True)
            ]
            outputs = [fwAD.unpack_dual(o) for o in run(*duals)]
            results.append(([o.primal for o in outputs], [o.tangent for o in outputs]))
    (ours_primal, ours_tangent), (their_primal, their_tangent) = results
    assert all(t is not None for t in ours_tangent)
    close(ours_primal, their_primal, rtol=1e-7, atol=1e-7)
    close(ours_tangent, their_tangent, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_func_jvp(case, fast):
    primals = tuple(case.tensors((3, 6), torch.float64))
    argnums = _argnums(case)

    def only(run):  # jvp wants tensor arguments only: close over the absent ones
        def f(*args):
            full = [None] * 4
            for i, a in zip(argnums, args, strict=True):
                full[i] = a
            return run(*full)

        return f

    args = tuple(primals[i] for i in argnums)
    tangents = tuple(torch.randn_like(a) for a in args)
    ours_out, ours_t = jvp(only(case.ours), args, tangents)
    their_out, their_t = jvp(only(case.torch), args, tangents)
    close(ours_out, their_out, rtol=1e-7, atol=1e-7)
    close(ours_t, their_t, rtol=1e-7, atol=1e-7)


# ---------------------------------------------------------------------------------------
# TorchScript


def _tensor_constants(graph) -> list[torch.Size]:
    shapes = []
    for node in graph.nodes():
        if node.kind() == "prim::Constant" and node.output().type().kind() == "TensorType":
            shapes.append(node.t("value").shape)
    return shapes


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_jit_trace_recomputes_on_new_inputs(case, fast):
    module, oracle = CaseModule(case), CaseModule(case, oracle=True)
    oracle.load_state_dict(module.state_dict())
    example = (torch.randn(3, 4, N), torch.randn(3, 4, N))
    with torch.no_grad():
        traced = torch.jit.trace(module, example)
    for shape in ((3, 4, N), (5, 2, N)):  # new values; then a new leading shape
        new = (torch.randn(shape) * 3 - 1, torch.randn(shape))
        with torch.no_grad():
            close(traced(*new), oracle(*new))
    # Nothing of the outputs' shape is baked in as a constant (a trace that recorded a
    # kernel's result, or an uninitialized buffer, shows up as one).
    assert all(s != torch.Size((3, 4, N)) for s in _tensor_constants(traced.inlined_graph))


def test_jit_trace_with_grad_and_modules(fast):
    ours, oracle = mixed_pair()
    example = torch.randn(2, 3, N)
    traced = torch.jit.trace(ours, example)
    new = torch.randn(2, 3, N, requires_grad=True)
    close([traced(new)], [oracle(new)])
    traced(new).sum().backward()
    ours_grad = new.grad.clone()
    new.grad = None
    oracle(new).sum().backward()
    assert_close(ours_grad, new.grad, **F32)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm", "LayerNorm-no-affine", "RMSNorm-3d"])
def test_jit_script_modules(module, fast):
    build = {
        "LayerNorm": lambda m: m.LayerNorm(N),
        "RMSNorm": lambda m: m.RMSNorm(N, eps=EPS),
        "LayerNorm-no-affine": lambda m: m.LayerNorm(N, elementwise_affine=False),
        "RMSNorm-3d": lambda m: m.RMSNorm((2, N)),
    }[module]
    ours, oracle = build(layernorm), build(torch.nn)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p))
    oracle.load_state_dict(ours.state_dict())
    scripted = torch.jit.script(ours)
    x = torch.randn(3, 2, N) * 2 + 1
    with torch.no_grad():
        close([scripted(x)], [oracle(x)])
        close([scripted(x)], [ours(x)])
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    with torch.no_grad():
        close([torch.jit.load(buffer)(x)], [oracle(x)])


def test_jit_script_model_containing_modules(fast):
    def model(norms):
        return torch.nn.Sequential(torch.nn.Linear(N, N), norms[0](N), torch.nn.ReLU(), norms[1](N))

    ours = model((layernorm.LayerNorm, layernorm.RMSNorm))
    oracle = model((torch.nn.LayerNorm, torch.nn.RMSNorm))
    oracle.load_state_dict(ours.state_dict())
    scripted = torch.jit.script(ours)
    x = torch.randn(4, N, requires_grad=True)
    close([scripted(x)], [oracle(x)])
    scripted(x).pow(2).sum().backward()
    ours_grad, x.grad = x.grad, None
    oracle(x).pow(2).sum().backward()
    assert_close(ours_grad, x.grad, **F32)


# ---------------------------------------------------------------------------------------
# torch.export, ONNX, AOTInductor


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_export_runs_on_new_inputs(strict, fast):
    ours, oracle = mixed_pair()
    program = torch.export.export(ours, (torch.randn(2, 3, N),), strict=strict)
    new = torch.randn(2, 3, N) * 2 - 1
    with torch.no_grad():
        close([program.module()(new)], [oracle(new)])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_export_each_function(case, fast):
    module, oracle = CaseModule(case), CaseModule(case, oracle=True)
    oracle.load_state_dict(module.state_dict())
    program = torch.export.export(module, (torch.randn(3, N), torch.randn(3, N)), strict=False)
    new = (torch.randn(3, N) + 2, torch.randn(3, N))
    with torch.no_grad():
        close(program.module()(*new), oracle(*new))


def test_export_dynamic_batch(fast):
    ours, oracle = mixed_pair()
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(
        ours, (torch.randn(2, 3, N),), dynamic_shapes=({0: batch},), strict=False
    )
    new = torch.randn(5, 3, N)
    with torch.no_grad():
        close([program.module()(new)], [oracle(new)])


#: ONNX's own norms; else a decomposition, which needs a reduction and a square root
_NORM_OPS = {"LayerNormalization", "RMSNormalization"}
_REDUCTIONS = {"ReduceMean", "ReduceSum"}
_ROOTS = {"Sqrt", "Reciprocal", "Pow"}


def _onnx_check_and_run(model_bytes: bytes, x: torch.Tensor):
    import numpy as np
    import onnx
    import onnxruntime

    model = onnx.load_from_string(model_bytes)
    onnx.checker.check_model(model)
    nodes = list(model.graph.node)
    assert all(node.domain in ("", "ai.onnx") for node in nodes), {n.domain for n in nodes}
    op_types = {node.op_type for node in nodes}
    assert op_types & _NORM_OPS or (op_types & _REDUCTIONS and op_types & _ROOTS), op_types
    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(np.asarray(output))


@pytest.mark.filterwarnings("ignore::UserWarning")  # the exporter's own notices
def test_onnx_dynamo_exporter(fast):
    pytest.importorskip("onnxruntime")
    ours, oracle = mixed_pair()
    program = torch.onnx.export(ours, (torch.randn(2, 3, N),), dynamo=True, verbose=False)
    new = torch.randn(2, 3, N) * 2 - 1
    with torch.no_grad():
        expected = oracle(new)
    assert_close(_onnx_check_and_run(program.model_proto.SerializeToString(), new), expected, **F32)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # dynamo=False is deprecated
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_onnx_torchscript_exporter(fast):
    pytest.importorskip("onnxruntime")
    ours, oracle = mixed_pair()
    buffer = io.BytesIO()
    torch.onnx.export(ours, (torch.randn(2, 3, N),), buffer, dynamo=False)
    new = torch.randn(2, 3, N) * 2 - 1
    with torch.no_grad():
        expected = oracle(new)
    assert_close(_onnx_check_and_run(buffer.getvalue(), new), expected, **F32)


@pytest.mark.slow
def test_aot_inductor_cpu(tmp_path):
    """One tiny model through AOTInductor: the slowest test here, about 30 s of CPU time
    with an empty inductor cache (export 10 s, the C++ compile 17 s), most of it the
    compiler's fixed cost."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("AOTInductor needs a C++ compiler (none on PATH)")
    ours = torch.nn.Sequential(layernorm.LayerNorm(N), layernorm.RMSNorm(N, eps=EPS))
    oracle = torch.nn.Sequential(torch.nn.LayerNorm(N), torch.nn.RMSNorm(N, eps=EPS))
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p))
    oracle.load_state_dict(ours.state_dict())
    start = time.perf_counter()
    program = torch.export.export(ours, (torch.randn(2, N),), strict=False)
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "m.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    new = torch.randn(2, N) * 2 - 1
    with torch.no_grad():
        close([loaded(new)], [oracle(new)])
    print(f"AOTInductor: {time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------------------------------
# Autocast and torch.compile


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_autocast_cpu_bf16_dtype_as_torch(case, dtype, fast):
    """torch leaves layer_norm/rms_norm at the input dtype under CPU autocast (no
    AutocastCPU kernel); float32 parameters with either input."""
    x, residual, weight, bias = case.tensors((3, N))
    x = x.to(dtype)
    residual = None if residual is None else residual.to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = case.ours(x, residual, weight, bias)
        theirs = case.torch(x, residual, weight, bias)
    assert [o.dtype for o in ours] == [t.dtype for t in theirs]
    tolerance = F32 if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}
    close(ours, theirs, **tolerance)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_autocast_cpu_bf16_modules(module, dtype, fast):
    ours, oracle = getattr(layernorm, module)(N), getattr(torch.nn, module)(N)
    x = torch.randn(3, N, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
        y = ours(x)
        assert y.dtype == oracle(x).dtype
    # inside an autocast region with a linear before it, as models run
    linear = torch.nn.Linear(N, N)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
        assert ours(linear(x.float())).dtype == oracle(linear(x.float())).dtype


def test_autocast_policy_registered_as_torch():
    """CUDA autocast runs torch's layer_norm/rms_norm in float32 (its fp32 list); CPU
    autocast leaves them alone. The op's registrations mirror torch's (no GPU needed)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for key in ("AutocastCUDA", "AutocastCPU"):
        assert has("layernorm::forward", key) == has("aten::layer_norm", key), key


@pytest.mark.parametrize("case", FULL, ids=lambda c: c.id)
def test_compile_fullgraph(case, fast):
    torch._dynamo.reset()
    tensors = case.tensors((3, 4, N))
    compiled = torch.compile(case.ours, fullgraph=True, backend="eager")
    close(compiled(*tensors), case.torch(*tensors))
    leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
    sum(o.sum() for o in compiled(*leaves)).backward()
    theirs = [None if t is None else t.clone().requires_grad_() for t in tensors]
    sum(o.sum() for o in case.torch(*theirs)).backward()
    close([t.grad for t in present(*leaves)], [t.grad for t in present(*theirs)])


def test_compile_fullgraph_inductor_modules(fast):
    torch._dynamo.reset()
    ours = torch.nn.Sequential(layernorm.LayerNorm(N), layernorm.RMSNorm(N, eps=EPS))
    oracle = torch.nn.Sequential(torch.nn.LayerNorm(N), torch.nn.RMSNorm(N, eps=EPS))
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p))
    oracle.load_state_dict(ours.state_dict())
    compiled = torch.compile(ours, fullgraph=True)
    x = torch.randn(2, 3, N, requires_grad=True)
    close([compiled(x)], [oracle(x)])
    compiled(x).sum().backward()
    ours_grad, x.grad = x.grad, None
    oracle(x).sum().backward()
    assert_close(ours_grad, x.grad, **F32)


# ---------------------------------------------------------------------------------------
# Exceptions: the types torch raises


_INPUT = r"Given normalized_shape=\[{0}\], expected input with shape \[\*,? ?{0}\], but got input of size ?\[2, 4, 8\]"
_PARAM = r"Expected {0} to be of same shape as normalized_shape, but got {0} of shape \[9\] and normalized_shape = \[8\]"

#: (id, call on a module of functions (F or layernorm), the message both raise)
SHAPE_MISMATCH = [
    ("layer_norm", lambda f, x: f.layer_norm(x, (N + 1,)), _INPUT.format(9)),
    ("rms_norm", lambda f, x: f.rms_norm(x, (N + 1,)), _INPUT.format(9)),
    ("layer_norm-2d", lambda f, x: f.layer_norm(x, (3, N)), _INPUT.format("3, 8")),
    (
        "layer_norm-weight",
        lambda f, x: f.layer_norm(x, (N,), torch.ones(N + 1)),
        _PARAM.format("weight"),
    ),
    (
        "layer_norm-bias",
        lambda f, x: f.layer_norm(x, (N,), None, torch.ones(N + 1)),
        _PARAM.format("bias"),
    ),
    (
        "rms_norm-weight",
        lambda f, x: f.rms_norm(x, (N,), torch.ones(N + 1)),
        _PARAM.format("weight"),
    ),
]


@pytest.mark.parametrize("name,call,message", SHAPE_MISMATCH, ids=[s[0] for s in SHAPE_MISMATCH])
def test_shape_mismatch_raises_runtime_error_as_torch(name, call, message, fast):
    x = torch.randn(2, 4, N)
    with pytest.raises(RuntimeError, match=message):
        call(F, x)
    with pytest.raises(RuntimeError, match=message) as ours:
        call(layernorm, x)
    assert isinstance(ours.value, ValueError)  # the earlier contract holds too


@pytest.mark.parametrize("kind", ["add_layer_norm", "add_rms_norm"])
def test_residual_shape_mismatch_raises_runtime_error(kind, fast):
    with pytest.raises(RuntimeError, match="residual must match input"):
        getattr(layernorm, kind)(torch.randn(2, N), torch.randn(3, N), N)


def test_module_shape_mismatch_raises_runtime_error(fast):
    with pytest.raises(RuntimeError, match=r"Given normalized_shape=\[8\], expected input"):
        layernorm.LayerNorm(N)(torch.randn(2, N + 1))
    with pytest.raises(RuntimeError, match=r"Given normalized_shape=\[8\], expected input"):
        torch.nn.LayerNorm(N)(torch.randn(2, N + 1))


# ---------------------------------------------------------------------------------------
# Calls a fast path must decline


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fake_tensor_mode(case, fast):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode() as mode:
        tensors = [None if t is None else mode.from_tensor(t) for t in case.tensors((3, 4, N))]
        outputs = case.ours(*tensors)
        expected = case.torch(*tensors)
    for o, e in zip(outputs, expected, strict=True):
        assert isinstance(o, FakeTensor)
        assert o.shape == e.shape and o.dtype == e.dtype


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.name()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "autograd"])
def test_dispatch_mode_sees_the_norm(case, requires_grad, fast):
    tensors = [None if t is None else t.requires_grad_(requires_grad) for t in case.tensors((3, N))]
    with _Recorder() as recorder:
        outputs = case.ours(*tensors)
    assert recorder.ops, "a dispatch mode saw nothing: a kernel ran behind its back"
    recorded = " ".join(recorder.ops)
    assert "layernorm::forward" in recorded or re.search(r"aten::(mean|sum|var|rsqrt)", recorded)
    close(outputs, case.torch(*tensors))


class _Tagged(torch.Tensor):
    """A trivial tensor subclass (through __torch_function__)."""


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tensor_subclass(case, fast):
    tensors = case.tensors((3, N))
    tagged = [None if t is None else t.as_subclass(_Tagged) for t in tensors]
    outputs = case.ours(*tagged)
    close([o.as_subclass(torch.Tensor) for o in outputs], case.torch(*tensors))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_meta_tensors(case, fast):
    tensors = [None if t is None else t.to("meta") for t in case.tensors((3, 4, N))]
    outputs = case.ours(*tensors)
    for o, e in zip(outputs, case.torch(*tensors), strict=True):
        assert o.is_meta and o.shape == e.shape and o.dtype == e.dtype


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_device_context(case, fast):
    tensors = case.tensors((3, N))
    with torch.device("meta"):  # factory functions default to meta; our inputs are CPU
        outputs = case.ours(*tensors)
        expected = case.torch(*tensors)
    assert [o.device for o in outputs] == [e.device for e in expected]
    close(outputs, expected)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_inference_mode(case, fast):
    tensors = case.tensors((3, 4, N))
    with torch.inference_mode():
        outputs = case.ours(*tensors)
    assert all(o.is_inference() for o in outputs)
    close(outputs, case.torch(*tensors))
