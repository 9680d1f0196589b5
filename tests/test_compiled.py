"""The C++ part (layernorm.compiled): the op's CPU and autograd kernels and the front
door for the common call, with the bits of the Python path (the op's Python kernels and
Python autograd, in a process with LAYERNORM_COMPILED=0), and every other call (every
PyTorch mechanism, the uncommon calls) left to the dispatcher or to Python."""

import itertools
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import layernorm
from layernorm import backends, compiled
from layernorm.backends import numba_

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]
SHAPES = [(8,), (4, 64), (2, 3, 50), (2, 2, 2, 33), (1, 1, 768), (256, 1024)]

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler to build the compiled dispatch"
)


@pytest.fixture
def in_use(monkeypatch):
    """The compiled dispatch, loaded (conftest builds it), with no backend named."""
    monkeypatch.delenv("LAYERNORM_BACKEND", raising=False)
    layernorm.layer_norm(torch.ones(1, 2), 2)
    if compiled.unavailable_reason() is not None:
        pytest.fail(f"the compiled dispatch is not in use: {compiled.unavailable_reason()}")
    return compiled.norm


def _python_results():
    """Every case of the tests below that compare with the Python path, computed here
    (the C++ part in use) or in a process with LAYERNORM_COMPILED=0 (:func:`python_path`)."""
    results = {}
    for dtype in DTYPES:
        for op in OPS:
            for shape in SHAPES:
                results[str(dtype), op, shape] = _same_bits_case(dtype, op, shape)
    for op in OPS:
        results["double backward", op] = _second_order(op)
    results["parameters"] = _parameters_case()
    return results


@pytest.fixture(scope="module")
def python_path(tmp_path_factory):
    """:func:`_python_results` from a process where the C++ part is switched off."""
    path = tmp_path_factory.mktemp("python_path") / "results.pt"
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import torch; "
        "import test_compiled as t; from layernorm import compiled; "
        "assert compiled.status().startswith('not in use: switched off'); "
        f"torch.save(t._python_results(), {str(path)!r})"
    )
    env = {**os.environ, "LAYERNORM_COMPILED": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    return torch.load(path)


def _equal_lists(ours, theirs):
    assert len(ours) == len(theirs)
    for a, c in zip(ours, theirs, strict=True):
        assert len(a) == len(c)
        for p, q in zip(a, c, strict=True):
            assert p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q)


def _call(op, x, r, w, b, eps):
    n = x.shape[-1]
    if op == "layer_norm":
        return (layernorm.layer_norm(x, n, w, b, eps),)
    if op == "rms_norm":
        return (layernorm.rms_norm(x, (n,), w, eps),)
    if op == "add_layer_norm":
        return layernorm.add_layer_norm(x, r, n, w, b, eps)
    return layernorm.add_rms_norm(x, r, n, w, eps)


def _run(op, tensors, grad, eps):
    """Outputs, then (with grad) the gradients of every given tensor, for fixed output
    gradients that differ per element."""
    leaves = [None if t is None else t.clone().requires_grad_(grad) for t in tensors]
    outputs = _call(op, *leaves, eps)
    results = [o.detach() for o in outputs]
    if grad:
        given = [t for t in leaves if t is not None]
        dys = [torch.arange(o.numel()).view_as(o).remainder(7).to(o.dtype) - 3 for o in outputs]
        results += torch.autograd.grad(outputs, given, dys)
    return results


def _same_bits_case(dtype, op, shape):
    n = shape[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype) * 3 + 1
    r = torch.randn(shape, generator=g).to(dtype)
    w = torch.rand(n, generator=g).to(dtype) + 0.5
    b = torch.randn(n, generator=g).to(dtype)
    residual = r if op.startswith("add") else None
    b = None if op.endswith("rms_norm") else b
    cases = [
        (tensors, grad, eps)
        for tensors in [(x, residual, w, b), (x, residual, None, None), (x, residual, w, None)]
        for grad in (False, True)
        for eps in (1e-5, None)
        if eps is not None or op.endswith("rms_norm")
    ]
    return [_run(op, *case) for case in cases]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_same_bits_as_the_python_path(in_use, python_path, dtype, op, shape):
    """Outputs and all gradients, with and without weight and bias, inference and with
    grad, serial and parallel kernels ((256, 1024) is past numba_.SERIAL_NUMEL), as the
    Python path computes them."""
    n = shape[-1]
    x = torch.randn(shape, dtype=dtype)
    residual = x if op.startswith("add") else None
    assert in_use(x, residual, n, None, None, 1e-5, op.endswith("rms_norm"), None) is not None
    _equal_lists(_same_bits_case(dtype, op, shape), python_path[str(dtype), op, shape])


def _parameters_case():
    g = torch.Generator().manual_seed(0)
    results = []
    for dtype, param_dtype in [
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float16),
        (torch.float32, torch.bfloat16),
    ]:
        x = torch.randn(3, 40, generator=g).to(dtype)
        w = torch.nn.Parameter((torch.rand(40, generator=g) + 0.5).to(param_dtype))
        b = torch.nn.Parameter(torch.randn(40, generator=g).to(param_dtype))
        xs = x.clone().requires_grad_()
        y = layernorm.layer_norm(xs, 40, w, b)
        gx, gw, gb = torch.autograd.grad(y, (xs, w, b), torch.ones_like(y))
        results.append([y.detach(), gx, gw, gb])
    return results


def test_parameters_of_another_dtype_and_parameter_leaves(in_use, python_path):
    """Parameters of another dtype than the input (converted in C++) and nn.Parameter
    leaves: gradients in each leaf's own dtype, as the Python path gives them."""
    ours = _parameters_case()
    assert [t.dtype for t in ours[0]] == [torch.bfloat16] * 2 + [torch.float32] * 2
    assert [t.dtype for t in ours[2]] == [torch.float32] * 2 + [torch.bfloat16] * 2
    _equal_lists(ours, python_path["parameters"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(8,), (2, 3, 50), (2, 2, 2, 33), (256, 1024)], ids=str)
def test_16_bit_parameters_give_the_bits_of_their_float32_values(in_use, dtype, op, shape):
    """Parameters in the input's 16-bit dtype, which the kernels read as they are, give
    the bits of the same values in float32 (converted before the kernels, as every
    16-bit parameter was before): outputs and input gradients equal, and each 16-bit
    parameter's gradient the float32 one rounded to its dtype (the float32 sum rounded
    once more, as torch's autograd gives a float32 gradient to a 16-bit leaf)."""
    g = torch.Generator().manual_seed(2)
    n = shape[-1]
    x, r = ((torch.randn(shape, generator=g) * 2 + 1).to(dtype) for _ in range(2))
    w = (torch.randn(n, generator=g) + 1).to(dtype)
    b = None if op.endswith("rms_norm") else torch.randn(n, generator=g).to(dtype)
    residual = r if op.startswith("add") else None
    narrow = _run(op, (x, residual, w, b), True, 1e-5)
    wide = _run(op, (x, residual, w.float(), None if b is None else b.float()), True, 1e-5)
    params = 1 if b is None else 2
    assert [t.dtype for t in narrow[-params:]] == [dtype] * params
    assert [t.dtype for t in wide[-params:]] == [torch.float32] * params
    wide[-params:] = [t.to(dtype) for t in wide[-params:]]
    _equal_lists([narrow], [wide])


def test_grad_calls_go_through_the_op_and_its_cpp_autograd(in_use):
    """With a gradient, the front door calls layernorm::forward through the dispatcher:
    autograd records the C++ node; so do the calls it declines (a strided input), which
    reach the same op from Python."""
    x = torch.randn(2, 8)
    y, h = in_use(x, torch.randn(2, 8), 8, None, None, 1e-5, False, None)
    assert y.grad_fn is None and h.shape == (2, 8)
    xs = x.clone().requires_grad_()
    with torch.no_grad():
        assert in_use(xs, None, (8,), None, None, 1e-5, True, None)[0].grad_fn is None
    y, h = in_use(xs, None, 8, None, None, 1e-5, False, None)
    assert y.grad_fn.name() == "layernorm::NormBackward" and h is None
    w = torch.nn.Parameter(torch.randn(8))
    assert (
        in_use(x, None, 8, w, None, 1e-5, False, None)[0].grad_fn.name()
        == "layernorm::NormBackward"
    )
    assert layernorm.LayerNorm(8)(x).grad_fn.name() == "layernorm::NormBackward"
    strided = torch.randn(2, 16)[:, :8].requires_grad_()
    assert in_use(strided, None, 8, None, None, 1e-5, False, None) is None
    y = layernorm.layer_norm(strided, 8)
    names = []
    node = y.grad_fn
    while node is not None and node.name() != "layernorm::NormBackward":
        names.append(node.name())
        node = node.next_functions[0][0]
    assert node is not None, names


def test_the_op_itself_refuses_a_tangent_it_cannot_carry(in_use):
    """Forward AD goes through TransformNorm (its JVP); the op called directly with a
    dual input and grad mode on raises instead of dropping the tangent."""
    from torch.autograd import forward_ad

    x = torch.randn(2, 8)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        with pytest.raises(RuntimeError, match="no forward-mode derivative"):
            torch.ops.layernorm.forward(dual, None, None, None, 1e-5, False, "")
        y = layernorm.layer_norm(dual, 8)  # the functions carry the tangent
        tangent = forward_ad.unpack_dual(y).tangent
    _, expected = torch.func.jvp(
        lambda t: torch.nn.functional.layer_norm(t, (8,)), (x,), (torch.ones_like(x),)
    )
    torch.testing.assert_close(tangent, expected)


def test_the_kernels_leave_other_backends_to_python(monkeypatch, in_use):
    """The op's CPU kernels run what the numba backend runs and hand any other call to
    the op's Python kernel: a named backend, LAYERNORM_BACKEND, zero-size work, a large
    input; the results are that backend's."""
    from layernorm import _op

    x, w = torch.randn(3, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    torch_ = backends.get("torch")
    for backend in ("torch", "numba"):
        got = torch.ops.layernorm.forward(x, None, w, None, 1e-5, False, backend)
        expected = _op._forward_impl(x, None, w, None, 1e-5, False, backend)
        assert all(torch.equal(p, q) for p, q in zip(got, expected, strict=True))
    empty = torch.ops.layernorm.forward(x[:0], None, w, None, 1e-5, False, "")
    assert empty[0].shape == (0, 8)
    monkeypatch.setenv("LAYERNORM_BACKEND", "torch")
    xs = x.clone().requires_grad_()
    y = layernorm.layer_norm(xs, 8, w)
    (dx,) = torch.autograd.grad(y, xs, torch.ones_like(y))
    ref_y, _, mean, rstd = torch_.forward(x, None, w, None, 1e-5, False)
    assert y.grad_fn.name() == "layernorm::NormBackward" and torch.equal(y, ref_y)
    (ref_dx, _, _) = torch_.backward(
        torch.ones_like(x), x, w, mean, rstd, None, False, False, False, 1e-5
    )
    assert torch.equal(dx, ref_dx)


def test_only_flagged_rows_go_back_to_python(monkeypatch, in_use):
    """A row whose rounding the kernel's float64 bound leaves open (an exact tie) is
    rewritten by the exact fallback, that row alone, in the front door's inference and in
    the op's kernel with a gradient (docs/contract.md §3)."""
    n, ulp = 64, float(torch.finfo(torch.float32).eps)
    x = torch.randn(6, n)
    x[[1, 4]] = torch.tensor([0.0, 1.0] * (n // 2))  # with these: exact ties
    w, b = torch.full((n,), ulp), torch.ones(n)
    fixed = []
    fix_rows = numba_._fix_rows

    def spy(y, z, w, b, eps, rms, flags):
        fixed.append(flags.nonzero()[0].tolist())
        return fix_rows(y, z, w, b, eps, rms, flags)

    monkeypatch.setattr(numba_, "_fix_rows", spy)
    for grad in (False, True):
        y, _ = in_use(x.clone().requires_grad_(grad), None, n, w, b, 0.75, False, None)
        assert y[1].tolist() == y[4].tolist() == [1.0 - ulp / 2, 1.0] * (n // 2)
        assert torch.equal(y[0], layernorm.layer_norm(x[:1], n, w, b, eps=0.75)[0])
    assert fixed == [[1, 4], [1, 4]]


def _declines(in_use, x, w=None):
    """Whether the norm's front door declines the call; ``fused_norm``'s (a dropout call
    on the same tensors) gives the same answer."""
    norm = in_use(x, None, 8, w, None, 1e-5, False, None) is None
    fused_args = (None, None, None, None, 0.1, None, 1, None, None, None, 0.0, False, None)
    assert norm == (compiled.fused(x, 8, w, None, 1e-5, False, *fused_args) is None)
    return norm


def test_declines_every_mechanism(in_use):
    """None under every mechanism that would see or change the call, from the norm's
    front door and ``fused_norm``'s: the Python path then takes it
    (tests/test_mechanisms.py checks what each mechanism gets)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.autograd import forward_ad
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(2, 8), torch.randn(8)
    assert not _declines(in_use, x, w)
    with torch.inference_mode():
        assert not _declines(in_use, torch.randn(2, 8))  # inference tensors are plain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _declines(in_use, x)
    with Dispatch():
        assert _declines(in_use, x)
    with TorchFunctionMode():
        assert _declines(in_use, x)
    with torch.device("cpu"):  # a function mode too
        assert _declines(in_use, x)
    with FakeTensorMode():
        assert _declines(in_use, x)
    with forward_ad.dual_level():
        assert _declines(in_use, forward_ad.make_dual(x, torch.ones_like(x)))
        assert _declines(in_use, x, forward_ad.make_dual(w, torch.ones_like(w)))
    seen = []
    torch.func.vmap(lambda t: seen.append(_declines(in_use, t)) or t)(x)
    torch.func.vmap(lambda t: seen.append(_declines(in_use, x)) or t)(x)  # a closed-over x
    torch.func.grad(lambda t: seen.append(_declines(in_use, t)) or t.sum())(x)
    torch.jit.trace(lambda t: seen.append(_declines(in_use, t)) or t * 1, x, check_trace=False)
    assert seen == [True, True, True, True]


def test_every_other_call_is_left_to_python(monkeypatch, in_use):
    """None before any work for every call the common path does not cover; the call then
    runs (or raises) through Python as before."""
    x, w, b = torch.randn(2, 3, 8), torch.randn(8), torch.randn(8)

    def answer(x=x, residual=None, shape=(8,), weight=w, bias=b, eps=1e-5, backend=None):
        return in_use(x, residual, shape, weight, bias, eps, False, backend)

    assert answer() is not None and answer(shape=8) is not None
    for shape in (torch.Size([8]), [8]):  # what F.layer_norm is often given
        assert torch.equal(answer(shape=shape)[0], answer()[0])
    with torch.no_grad():
        assert answer(weight=torch.nn.Parameter(torch.randn(8)), eps=None) is not None
    others = {
        "backend named": answer(backend="numba"),
        "int eps": answer(eps=1),
        "negative eps": answer(eps=-1.0),
        "nan eps": answer(eps=float("nan")),
        "two dims": answer(shape=(3, 8), weight=None, bias=None),
        "two-dim torch.Size": answer(shape=torch.Size([3, 8]), weight=None, bias=None),
        "list of a float": answer(shape=[8.0]),
        "list of a bool": answer(x=torch.randn(2, 1), shape=[True], weight=None, bias=None),
        "empty tuple": answer(shape=()),
        "nested tuple": answer(shape=((8,),)),
        "bool shape": answer(x=torch.randn(2, 1), shape=True, weight=None, bias=None),
        "huge shape": answer(shape=1 << 70),
        "wrong N": answer(shape=(4,)),
        "zero N": answer(x=torch.randn(2, 0), shape=0, weight=None, bias=None),
        "no rows": answer(x=torch.randn(0, 8)),
        "0-dim input": answer(x=torch.tensor(1.0), shape=1, weight=None, bias=None),
        "non-contiguous input": answer(x=torch.randn(8, 6).t()),
        "strided rows": answer(x=torch.randn(4, 16)[:, :8]),
        "integer input": answer(x=torch.ones(2, 8, dtype=torch.long)),
        "complex input": answer(x=torch.randn(2, 8, dtype=torch.complex64), weight=None, bias=None),
        "Parameter input": answer(x=torch.nn.Parameter(torch.randn(2, 8))),
        "list input": answer(x=[[1.0] * 8]),
        "meta input": answer(x=torch.randn(2, 8, device="meta"), weight=None, bias=None),
        "large input": answer(x=torch.empty(numba_.STREAM_BYTES // 4 // 8, 8)),
        "weight shape": answer(weight=torch.randn(4)),
        "weight 2-D": answer(weight=torch.randn(1, 8)),
        "weight integer": answer(weight=torch.ones(8, dtype=torch.int32)),
        "weight strided": answer(weight=torch.randn(16)[::2]),
        "weight meta": answer(weight=torch.randn(8, device="meta")),
        "weight list": answer(weight=[1.0] * 8),
        "bias strided": answer(bias=torch.randn(16)[::2]),
        "residual dtype": answer(residual=x.double()),
        "residual shape": answer(residual=torch.randn(6, 8)),
        "residual strided": answer(residual=torch.randn(2, 3, 16)[..., :8]),
        "residual Parameter": answer(residual=torch.nn.Parameter(torch.randn(2, 3, 8))),
    }
    assert {k for k, v in others.items() if v is not None} == set()
    monkeypatch.setenv("LAYERNORM_BACKEND", "torch")  # a backend named by the environment
    assert answer() is None
    monkeypatch.setenv("LAYERNORM_BACKEND", "")  # (empty: the automatic choice, as in Python)
    assert answer() is not None


def _front_door_inputs(op, dtype):
    """``(shape, x, residual, op's parameters)`` for 1-D, 3-D and 4-D inputs, seeded."""
    torch.manual_seed(0)
    for shape in [(50,), (2, 3, 50), (2, 2, 2, 33)]:
        n = shape[-1]
        x, r, w, b = (torch.randn(s).to(dtype) for s in (shape, shape, (n,), (n,)))
        yield shape, x, r, (w,) if "rms" in op else (w, b)


@pytest.fixture
def options_norm_calls(monkeypatch):
    """The calls of ``options.norm`` (the options' Python path) during a test, one entry
    each: none where the compiled front door took a call."""
    from layernorm import options

    return _calls_of(monkeypatch, options, "norm")


def _calls_of(monkeypatch, module, name: str) -> list[int]:
    """A list that gets an entry at each call of ``module.name`` during the test (the
    function wrapped, its results unchanged)."""
    seen: list[int] = []
    function = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: seen.append(1) or function(*a, **k))
    return seen


#: offsets the options' front door takes (float32 values) and leaves to Python
OFFSETS_TAKEN = [0.0, 1.0, -0.5, 2.0**-149, -(2.0**127)]
OFFSETS_LEFT = [0.1, 1e-46, 3.5e38, 1]
#: weight dtypes: None for x's
WEIGHT_DTYPES = [None, torch.float32, torch.float64, torch.bfloat16]


def _bits(t):
    """``t``'s bit patterns (NaNs and signed zeros compared too)."""
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_same_tensors(results, case):
    """The tensors of every run in ``results`` (``(name, tensors, ...)`` each) are those
    of the last, dtype and bits."""
    for got in (run[1] for run in results[:-1]):
        for a, e in zip(got, results[-1][1], strict=True):
            assert a.dtype == e.dtype and torch.equal(_bits(a), _bits(e)), case


def _taken(x_dtype, weight, offset, mode):
    """Whether the front door takes an options call (its documented rule)."""
    if not isinstance(offset, float) or offset not in OFFSETS_TAKEN or mode == "none":
        return False
    if weight is None:
        return offset == 0.0
    if mode == "llama":
        return True
    one_addition = x_dtype == torch.float64 or weight.dtype != torch.float64
    return one_addition or (mode is None and offset == 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_options_front_door_has_the_bits_of_options_norm(
    in_use, monkeypatch, options_norm_calls, op, dtype
):
    """``offset`` and ``casting_mode`` None, "gemma", "llama" (rms ops) through the C++
    front door ("none" is left to Python): y, residual_out and every gradient bitwise those of the Python path
    (``options.norm`` with the fast paths off), on 1-D, 3-D and 4-D inputs, weights of
    each dtype (and none), offsets it takes and offsets it leaves to Python; and it takes
    exactly the calls its rule says (``options.norm`` is not called for them)."""
    from layernorm import ops

    seen = options_norm_calls
    rms = "rms" in op
    residual = op.startswith("add_")
    modes = [None, "gemma", "llama", "none"] if rms else [None]
    torch.manual_seed(0)
    checked = taken = 0
    for shape in [(50,), (2, 3, 50), (2, 2, 2, 33)]:
        n = shape[-1]
        x, r = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        for wdtype, mode, offset, grad in itertools.product(
            [*WEIGHT_DTYPES, "none"], modes, OFFSETS_TAKEN + OFFSETS_LEFT, [False, True]
        ):
            w = None if wdtype == "none" else torch.randn(n).to(wdtype or dtype)
            if w is None and offset != 0:
                continue  # options.norm's ValueError (test_options::test_offset_checks)
            kw = {"offset": offset} if mode is None else {"offset": offset, "casting_mode": mode}
            results = []
            for fast in (True, False):
                monkeypatch.setattr(ops, "FAST_PATHS", fast)
                leaves = [t.clone().requires_grad_(grad) for t in (x, r)]
                w_leaf = None if w is None else w.clone().requires_grad_(grad)
                args = (leaves[0], leaves[1]) if residual else (leaves[0],)
                tail = () if rms else (None,)
                del seen[:]
                out = getattr(layernorm, op)(*args, (n,), w_leaf, *tail, **kw)
                outs = list(out) if residual else [out]
                if grad:
                    wanted = list(args) + ([] if w_leaf is None else [w_leaf])
                    torch.manual_seed(1)
                    loss = sum((o.double() * torch.randn_like(o, dtype=torch.float64)).sum()
                               for o in outs)  # fmt: skip
                    outs += torch.autograd.grad(loss, wanted)
                results.append((outs, not seen))
            (fast_out, fast_taken), (slow_out, slow_taken) = results
            assert not slow_taken
            case = (shape, wdtype, mode, offset, grad)
            assert fast_taken == _taken(dtype, w, offset, mode), case
            for a, b in zip(fast_out, slow_out, strict=True):
                assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), case
            checked += 1
            taken += fast_taken
    assert taken > checked // 3


#: out= cases of the front door: (options, ops they apply to, whether it takes them); an
#: option's value "fresh", "empty", "strided" or "x" names the tensor it gets
OUT_CASES = {
    "out": ({"out": "fresh"}, OPS, True),
    "out offset": ({"out": "fresh", "offset": 1.0}, OPS, True),
    "out too small": ({"out": "empty"}, OPS, False),
    "out strided": ({"out": "strided"}, OPS, False),
    "out is x": ({"out": "x"}, OPS, False),
    "out gemma": ({"out": "fresh", "casting_mode": "gemma"}, ["rms_norm", "add_rms_norm"], True),
    "out llama": ({"out": "fresh", "casting_mode": "llama"}, ["rms_norm", "add_rms_norm"], False),
    "both": ({"out": "fresh", "residual_out": "fresh"}, ["add_layer_norm", "add_rms_norm"], True),
    "residual_out": ({"residual_out": "fresh"}, ["add_layer_norm", "add_rms_norm"], True),
}


def _out_options(spec, x):
    """``spec``'s options for an input ``x`` (see :data:`OUT_CASES`)."""
    tensors = {
        "fresh": lambda: torch.empty_like(x),
        "empty": lambda: x.new_empty(0),
        "strided": lambda: x.new_empty((*x.shape, 2))[..., 0],
        "x": lambda: x,
    }
    return {k: tensors[v]() if k.endswith("out") else v for k, v in spec.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_options_front_door_writes_out_as_options_norm(
    in_use, monkeypatch, options_norm_calls, op, dtype
):
    """``out=`` and ``residual_out=`` (with ``offset`` and "gemma" too) through the C++
    front door: the kernels write into them (the returned tensors are they, their
    version counters bumped), bit for bit ``options.norm``'s results (the fast paths
    off); outputs it cannot write (another shape, non-contiguous, sharing memory with the
    input, the "llama" mode) are left to Python, which resizes or copies as before; with
    a gradient asked for, Python raises torch's error."""
    from layernorm import ops

    seen = options_norm_calls
    residual = op.startswith("add_")
    for shape, x, r, params in _front_door_inputs(op, dtype):
        n = shape[-1]
        for name, (spec, ops_, taken) in OUT_CASES.items():
            if op not in ops_:
                continue
            results = []
            for fast in (True, False):
                monkeypatch.setattr(ops, "FAST_PATHS", fast)
                x_in = x.clone()
                kw = _out_options(spec, x_in)
                versions = {k: v._version for k, v in kw.items() if isinstance(v, torch.Tensor)}
                del seen[:]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # torch's resize warning
                    got = getattr(layernorm, op)(
                        *((x_in, r) if residual else (x_in,)), (n,), *params, **kw
                    )
                got = list(got) if residual else [got]
                for k, v in kw.items():
                    if isinstance(v, torch.Tensor):
                        assert any(g is v for g in got), (name, k)
                        assert v._version > versions[k], (name, k)
                results.append(([_bits(g).clone() for g in got], not seen))
            (fast_out, fast_taken), (slow_out, _) = results
            assert fast_taken == taken, (shape, name)
            for a, c in zip(fast_out, slow_out, strict=True):
                assert torch.equal(a, c), (shape, name)
    monkeypatch.setattr(ops, "FAST_PATHS", True)
    x = torch.randn(3, 50, dtype=dtype, requires_grad=True)
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        getattr(layernorm, op)(
            *((x, x.detach()) if residual else (x,)), (50,), out=torch.empty(3, 50, dtype=dtype)
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_options_front_door_takes_out_dtype(in_use, monkeypatch, options_norm_calls, op, dtype):
    """``out_dtype`` (with ``offset`` and ``out=`` too) through the C++ front door, bit for
    bit ``options.norm``'s (the fast paths off: for a narrower one the op
    ``layernorm::forward_to``), ``residual_out`` in the input's dtype: a narrower one
    (the kernels of that dtype pair; with a gradient recorded by the C++ node, every
    gradient bitwise too), the input's own (the plain call), a wider one without a
    residual (the input converted first). A wider one with a residual and one with a
    casting mode (norm's ValueError) are left to Python."""
    from layernorm import ops, options

    seen = options_norm_calls
    residual = op.startswith("add_")
    for shape, x, r, params in _front_door_inputs(op, dtype):
        n = shape[-1]
        for y_dtype, extra, grad in itertools.product(
            DTYPES, [{}, {"offset": 1.0}, {"out": True}, {"casting_mode": "gemma"}], [False, True]
        ):
            if "casting_mode" in extra and "rms" not in op:
                continue
            narrower = y_dtype in options._NARROWER[dtype]
            results = []
            for fast in (True, False):
                monkeypatch.setattr(ops, "FAST_PATHS", fast)
                kw = {**extra, "out_dtype": y_dtype}
                if "out" in kw:
                    kw["out"] = torch.empty(shape, dtype=y_dtype)
                    if grad:
                        continue  # (torch's error: test_options_front_door_writes_out_...)
                x_in = x.clone().requires_grad_(grad)
                leaves = [x_in, *(p.clone().requires_grad_(grad) for p in params)]
                del seen[:]
                try:
                    got = getattr(layernorm, op)(
                        *((x_in, r) if residual else (x_in,)), (n,), *leaves[1:], **kw
                    )
                except ValueError as error:  # casting_mode with out_dtype: Python's error
                    assert "does not combine with out_dtype" in str(error)
                    assert "casting_mode" in extra and seen
                    continue
                got = list(got) if residual else [got]
                assert got[0].dtype == y_dtype and (not residual or got[1].dtype == dtype)
                if grad:
                    torch.manual_seed(1)
                    loss = sum((o.double() * torch.randn(o.shape, dtype=torch.float64)).sum()
                               for o in got)  # fmt: skip
                    got += torch.autograd.grad(loss, leaves)
                results.append(([_bits(g.detach()).clone() for g in got], not seen))
            if len(results) < 2:
                continue
            (fast_out, fast_taken), (slow_out, _) = results
            case = (shape, y_dtype, extra, grad)
            wider = y_dtype != dtype and not narrower
            takes = narrower or y_dtype == dtype or (wider and not residual)
            assert fast_taken == (takes and "casting_mode" not in extra), case
            for a, c in zip(fast_out, slow_out, strict=True):
                assert torch.equal(a, c), case


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_options_front_door_takes_memory_efficient(in_use, monkeypatch, options_norm_calls, op):
    """``memory_efficient=True`` alone: without a gradient the plain call (as
    ``recompute.norm`` makes it), with one C++'s ``MemoryEfficientBackward`` node; the
    front door runs both, bit for bit the Python path's; with another option, Python's
    ``recompute`` (or its ValueError) as before."""
    from layernorm import recompute

    seen = options_norm_calls
    x, w = torch.randn(2, 3, 50), torch.randn(50)
    f = getattr(layernorm, op)
    for kw, grad, taken in [
        ({"memory_efficient": True}, False, True),
        ({"memory_efficient": False}, False, True),
        ({"memory_efficient": True}, True, True),
        ({"memory_efficient": False, "offset": 1.0}, True, True),
        ({"memory_efficient": True, "out_dtype": torch.float64}, False, False),
        ({"memory_efficient": True, "out_dtype": torch.float64}, True, False),
        ({"memory_efficient": 1}, False, False),
    ]:
        del seen[:]
        y = f(x.clone().requires_grad_(grad), 50, w, **kw)
        assert (not seen) == taken, kw
        monkeypatch.setattr(compiled, "norm", lambda *a: None)
        python = f(x.clone().requires_grad_(grad), 50, w, **kw)
        monkeypatch.setattr(compiled, "norm", in_use)
        assert torch.equal(_bits(y.detach()), _bits(python.detach())), kw
        if grad and kw["memory_efficient"] and taken:
            assert y.grad_fn.name() == "layernorm::MemoryEfficientBackward"
            assert python.grad_fn.name() == "MemoryEfficientNormBackward"
    with pytest.raises(ValueError, match="does not combine"):
        f(x, 50, w, memory_efficient=True, offset=1.0)
    assert recompute.applies(x.requires_grad_(), w, None)


def _recorder(saved):
    """A saved-tensors pack hook that keeps what autograd saves in ``saved``."""
    return lambda t: saved.append(t) or t


#: (shape, normalized_shape, whether the front door takes it)
MEMORY_EFFICIENT_SHAPES = [
    ((64,), 64, True), ((4, 64), 64, True), ((2, 3, 96), (96,), True),
    ((2, 2, 3, 40), 40, True), ((1, 5), 5, True), ((300, 1024), 1024, True),
    ((2, 3, 4, 16), (4, 16), False), ((0, 8), 8, False),
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_memory_efficient_node_is_python_s_bits(in_use, monkeypatch, dtype, op):
    """With a gradient, ``memory_efficient=True`` through the front door (float32 and
    bfloat16: C++'s ``MemoryEfficientBackward``, the numba entry of
    ``_numba_recompute``; float16 and float64: Python's ``MemoryEfficientNorm``) gives the
    Python path's output and gradients bit for bit, for every shape, with and without
    the parameters, at 1 and 2 threads; it saves ``y``, not ``x``; an in-place change of
    ``y`` makes the backward raise, as a saved output does; a backward that builds a
    graph builds none (once differentiable), and a batched gradient (vmap over the
    backward) runs the torch operations, as Python's does."""
    f = getattr(layernorm, op)
    node = "layernorm::MemoryEfficientBackward"
    threads = torch.get_num_threads()
    for (shape, nshape, takes), affine in itertools.product(MEMORY_EFFICIENT_SHAPES, (True, False)):
        g = torch.Generator().manual_seed(len(shape) + shape[-1])
        p_shape = (nshape,) if isinstance(nshape, int) else nshape
        x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
        w = (torch.randn(p_shape, generator=g) + 2).to(dtype) if affine else None
        b = torch.randn(p_shape, generator=g).to(dtype) if affine and op == "layer_norm" else None
        dy = torch.randn(shape, generator=g).to(dtype)
        results = []
        for python, count in ((False, 2), (False, 1), (True, 1)):
            torch.set_num_threads(count)
            monkeypatch.setattr(compiled, "norm", (lambda *a: None) if python else in_use)
            leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
            params = leaves[1:] + [None] * (3 - len(leaves))
            saved: list[torch.Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(_recorder(saved), lambda t: t):
                if op == "layer_norm":
                    y = f(leaves[0], nshape, params[0], params[1], memory_efficient=True)
                else:
                    y = f(leaves[0], nshape, params[0], memory_efficient=True)
            monkeypatch.setattr(compiled, "norm", in_use)
            torch.set_num_threads(threads)
            name = y.grad_fn.name()
            if x.numel():
                assert not any(t.data_ptr() == leaves[0].data_ptr() for t in saved)
                assert any(t.data_ptr() == y.data_ptr() for t in saved)
            grads = torch.autograd.grad(y, leaves, dy)
            results.append((name, [y.detach(), *grads]))
        entry = dtype in (torch.float32, torch.bfloat16) and takes
        assert results[0][0] == (node if entry else "MemoryEfficientNormBackward"), shape
        assert results[2][0] == "MemoryEfficientNormBackward"
        _assert_same_tensors(results, (shape, affine))

    x = torch.randn(3, 2, 40, dtype=dtype, requires_grad=True)
    w = (torch.randn(40) + 2).to(dtype).requires_grad_()
    dys = torch.randn(4, 3, 2, 40, dtype=dtype)
    batched = []
    for norm in ((lambda *a: None), in_use):  # Python's MemoryEfficientNorm, then C++'s
        monkeypatch.setattr(compiled, "norm", norm)
        y = f(x, 40, w, memory_efficient=True)
        batched.append(torch.autograd.grad(y, (x, w), dys, retain_graph=True,
                                           is_grads_batched=True))  # fmt: skip
    assert y.grad_fn.name() == (node if dtype in (torch.float32, torch.bfloat16) else
                                "MemoryEfficientNormBackward")  # fmt: skip
    for a, e in zip(*batched, strict=True):
        assert a.shape == e.shape and torch.equal(_bits(a), _bits(e))
    (gx,) = torch.autograd.grad(y, x, dys[0], create_graph=True, retain_graph=True)
    assert not gx.requires_grad
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match=r"modified by an inplace|modified inplace"):
        torch.autograd.grad(y, x, dys[0])


#: layer_norm_linear's front-door cases: (input shape, normalized_shape, whether C++
#: takes the call)
NORM_LINEAR_CASES = [((8,), 8, True), ((4, 8), 8, True), ((2, 3, 8), (8,), True),
                     ((2, 2, 3, 8), 8, True), ((0, 8), 8, False), ((300, 64), 64, True),
                     ((2, 3, 8), (3, 8), False)]  # fmt: skip


def _norm_linear_inputs(dtype, rms):
    """Each case of :data:`NORM_LINEAR_CASES` with and without the norm's parameters
    (``affine``) and the linear's bias: ``((shape, nshape, takes, affine), (x, weight,
    bias, linear_weight, linear_bias), generator)``, the linear of 5 outputs."""
    for (shape, nshape, takes), affine, linear_bias in itertools.product(
        NORM_LINEAR_CASES, (True, False), (True, False)
    ):
        g = torch.Generator().manual_seed(len(shape) + shape[-1])
        p_shape = (nshape,) if isinstance(nshape, int) else nshape
        x = torch.randn(shape, generator=g).to(dtype)
        w = torch.randn(p_shape, generator=g).to(dtype) if affine else None
        b = torch.randn(p_shape, generator=g).to(dtype) if affine and not rms else None
        lw = torch.randn(5, shape[-1], generator=g).to(dtype)
        lb = torch.randn(5, generator=g).to(dtype) if linear_bias else None
        yield (shape, nshape, takes, affine), (x, w, b, lw, lb), g


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_norm_linear_node_is_python_s_bits(in_use, monkeypatch, dtype, rms):
    """``layer_norm_linear`` with a gradient through ``compiled.norm_linear`` (C++'s
    ``layernorm::NormLinearBackward``) gives Python's ``NormLinear`` output and every
    gradient bit for bit: 1-D to 4-D, zero-size, with and without the norm's parameters
    and the linear's bias, at 1 and 2 threads; it saves x, the parameters, mean and
    rstd (one value a row), never the norm's output; a multi-dim normalized_shape, a
    strided input, a backend or a linear weight of another dtype go to Python; batched
    gradients run the op's vmap rule, as Python's do; once differentiable."""
    node = "layernorm::NormLinearBackward"
    threads = torch.get_num_threads()
    for (shape, nshape, takes, affine), (x, w, b, lw, lb), g in _norm_linear_inputs(dtype, rms):
        p_shape = (nshape,) if isinstance(nshape, int) else nshape
        dout = torch.randn(*shape[:-1], 5, generator=g).to(dtype)
        results = []
        for python, count in ((False, 2), (False, 1), (True, 1)):
            torch.set_num_threads(count)
            monkeypatch.setattr(compiled, "norm_linear", (lambda *a: None) if python else
                                compiled.norm_linear if not results else results[0][2])  # fmt: skip
            leaves = [t.clone().requires_grad_() if t is not None else None
                      for t in (x, w, b, lw, lb)]  # fmt: skip
            saved: list[torch.Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(_recorder(saved), lambda t: t):
                out = layernorm.layer_norm_linear(leaves[0], nshape, *leaves[1:], rms=rms)
            torch.set_num_threads(threads)
            present = [t for t in leaves if t is not None]
            kept = {t.data_ptr() for t in leaves[:4] if t is not None}  # x, w, b, lw
            m = x.numel() // math.prod(p_shape)  # the norm's rows: mean and rstd
            assert all(t.data_ptr() in kept or t.numel() in (0, m) for t in saved), shape
            grads = torch.autograd.grad(out, present, dout)
            results.append((out.grad_fn.name(), [out.detach(), *grads], compiled.norm_linear))
        monkeypatch.setattr(compiled, "norm_linear", results[0][2])
        assert results[0][0] == (node if takes else "NormLinearBackward"), shape
        assert results[2][0] == "NormLinearBackward"
        _assert_same_tensors(results, (shape, affine))

    x = torch.randn(3, 2, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(8, dtype=dtype, requires_grad=True)
    lw = torch.randn(4, 8, dtype=dtype, requires_grad=True)
    for args, kw in (((x[..., ::1].transpose(0, 1), 8, w, None, lw), {}),
                     ((x, 8, w, None, lw), {"backend": "torch"}),
                     ((x, 8, w, None, lw.to(torch.float32 if dtype == torch.float64 else
                                              torch.float64)), {})):  # fmt: skip
        assert compiled.norm_linear(*args, None, None, rms, kw.get("backend")) is None
    out = layernorm.layer_norm_linear(x, 8, w, None, lw, rms=rms)
    assert out.grad_fn.name() == node
    douts = torch.randn(3, *out.shape, dtype=dtype)
    batched = []
    for norm_linear in ((lambda *a: None), results[0][2]):  # Python's NormLinear, then C++'s
        monkeypatch.setattr(compiled, "norm_linear", norm_linear)
        out = layernorm.layer_norm_linear(x, 8, w, None, lw, rms=rms)
        batched.append(torch.autograd.grad(out, (x, w, lw), douts, retain_graph=True,
                                           is_grads_batched=True))  # fmt: skip
    for a, e in zip(*batched, strict=True):
        assert a.shape == e.shape and torch.equal(_bits(a), _bits(e))
    (gx,) = torch.autograd.grad(out, x, douts[0], create_graph=True)
    assert not gx.requires_grad


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_linear_front_door_takes_inference(in_use, monkeypatch, dtype, rms):
    """``layer_norm_linear`` without a gradient through ``compiled.norm_linear`` (the
    kernel, then ``at::linear``) is the Python composition ``F.linear(norm(...))`` bit for
    bit (the fast paths off), with no Python norm call: 1-D to 4-D, zero-size, with and
    without the norm's parameters and the linear's bias, at 1 and 2 threads, under
    ``no_grad`` and with leaves that do not require grad; a multi-dim normalized_shape
    goes to Python."""
    from layernorm import ops

    calls = []
    python_norm = ops._norm
    monkeypatch.setattr(ops, "_norm", lambda *a, **k: calls.append(1) or python_norm(*a, **k))
    threads = torch.get_num_threads()
    for (case, (x, w, b, lw, lb), _), no_grad in itertools.product(
        _norm_linear_inputs(dtype, rms), (True, False)
    ):
        _, nshape, takes, _ = case
        results = []
        for fast, count in ((True, 2), (True, 1), (False, 1)):
            monkeypatch.setattr(ops, "FAST_PATHS", fast)
            torch.set_num_threads(count)
            del calls[:]
            with torch.set_grad_enabled(not no_grad):
                out = layernorm.layer_norm_linear(x, nshape, w, b, lw, lb, rms=rms)
            torch.set_num_threads(threads)
            assert out.grad_fn is None
            results.append((bool(calls), [out]))
        monkeypatch.setattr(ops, "FAST_PATHS", True)
        assert results[0][0] == (not takes) and results[2][0], (case, no_grad)
        _assert_same_tensors(results, (case, no_grad))


@pytest.mark.parametrize(
    ("x_dtype", "p_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float64),
        (torch.bfloat16, torch.float64),
        (torch.float32, torch.bfloat16),
    ],
    ids=str,
)
def test_option_nodes_take_mixed_parameter_dtypes(in_use, monkeypatch, x_dtype, p_dtype):
    """Parameters of another dtype than the input (apex's ``MixedFused*``): the
    ``memory_efficient`` and ``layer_norm_linear`` nodes give the Python path's bits,
    outputs and gradients (the parameters' in their own dtypes)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g).to(x_dtype)
    w = (torch.randn(64, generator=g) + 2).to(p_dtype)
    b = torch.randn(64, generator=g).to(p_dtype)
    lw = torch.randn(5, 64, generator=g).to(x_dtype)
    norm, norm_linear = compiled.norm, compiled.norm_linear
    for kind in ("memory_efficient", "layer_norm_linear"):
        results = []
        for python in (False, True):
            monkeypatch.setattr(compiled, "norm", (lambda *a: None) if python else norm)
            monkeypatch.setattr(compiled, "norm_linear",
                                (lambda *a: None) if python else norm_linear)  # fmt: skip
            leaves = [t.clone().requires_grad_() for t in (x, w, b, lw)]
            if kind == "memory_efficient":
                out = layernorm.layer_norm(leaves[0], 64, leaves[1], leaves[2],
                                           memory_efficient=True)  # fmt: skip
                leaves = leaves[:3]
            else:
                out = layernorm.layer_norm_linear(leaves[0], 64, *leaves[1:])
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
            results.append((out.grad_fn.name(), [out.detach(), *grads]))
        if not (kind == "memory_efficient" and x_dtype == torch.float16):
            assert results[0][0].startswith("layernorm::"), (kind, results[0][0])
        _assert_same_tensors(results, kind)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_options_front_door_takes_the_norm_of_a_wider_residual_stream(
    in_use, monkeypatch, options_norm_calls, op, dtype
):
    """``add_*`` with the residual stream in a wider dtype (a float32 or float64 residual,
    or ``residual_dtype``): without a gradient, the norm of ``h`` (rounded into ``x``'s
    dtype, or ``out_dtype``, ``offset`` and ``out=`` too) through the C++ front door, bit
    for bit ``options.norm``'s (the fast paths off); with one too (the norm's y narrower
    than h: recorded by the C++ node), every gradient bitwise."""
    from layernorm import ops

    seen = options_norm_calls
    torch.manual_seed(0)
    for shape in [(50,), (2, 3, 50), (2, 2, 2, 33)]:
        n = shape[-1]
        x, w, b = torch.randn(shape).to(dtype), torch.randn(n).to(dtype), torch.randn(n)
        params = (w,) if "rms" in op else (w, b.to(dtype))
        for rdtype, extra, grad in itertools.product(
            [torch.float32, torch.float64], [{}, {"offset": 1.0}, {"out": True}], [False, True]
        ):
            if rdtype == dtype or (grad and "out" in extra):
                continue
            r = torch.randn(shape, dtype=rdtype)
            results = []
            for fast in (True, False):
                monkeypatch.setattr(ops, "FAST_PATHS", fast)
                kw = dict(extra)
                if "out" in kw:
                    kw["out"] = torch.empty(shape, dtype=dtype)
                x_in, r_in = x.clone().requires_grad_(grad), r.clone().requires_grad_(grad)
                del seen[:]
                y, h = getattr(layernorm, op)(x_in, r_in, (n,), *params, **kw)
                assert y.dtype == dtype and h.dtype == rdtype
                got = [y, h]
                if grad:
                    torch.manual_seed(1)
                    loss = sum((o.double() * torch.randn(o.shape, dtype=torch.float64)).sum()
                               for o in got)  # fmt: skip
                    got += torch.autograd.grad(loss, (x_in, r_in))
                # options.norm runs the stream (once); again for its norm unless C++ did;
                # not at all where C++ runs the whole call (a float32 stream of 16-bit x)
                results.append(([_bits(g.detach()).clone() for g in got], len(seen)))
            (fast_out, fast_calls), (slow_out, _) = results
            case = (shape, rdtype, extra, grad)
            whole = rdtype == torch.float32 and dtype != torch.float32 and not extra
            assert fast_calls == (0 if whole else 1), case
            for a, c in zip(fast_out, slow_out, strict=True):
                assert torch.equal(a, c), case


@pytest.fixture
def python_dropout_adds(monkeypatch):
    """The calls of ``fused.dropout_add`` (fused_norm's Python dropout-add) during a test:
    none where the compiled front door took a ``fused_norm`` call."""
    from layernorm import fused

    return _calls_of(monkeypatch, fused, "dropout_add")


def _fused_both_ways(monkeypatch, seen, x, n, weight, bias, **kw):
    """``fused_norm`` with the fast paths on, then off, from one generator state (the
    default one's and a given one's): each output's bits, the generators' next draws, and
    whether Python's dropout-add ran."""
    from layernorm import ops

    runs = []
    for fast in (True, False):
        monkeypatch.setattr(ops, "FAST_PATHS", fast)
        torch.manual_seed(11)
        if kw.get("generator") is not None:
            kw["generator"].manual_seed(11)
        del seen[:]
        out = layernorm.fused_norm(x, (n,), weight, bias, **kw)
        outs = [None if t is None else t.view(torch.uint8) if t.dtype == torch.bool else _bits(t)
                for t in out]  # fmt: skip
        draws = torch.randint(1 << 30, (4,))
        if kw.get("generator") is not None:
            draws = torch.cat([draws, torch.randint(1 << 30, (4,), generator=kw["generator"])])
        runs.append((outs, draws, bool(seen)))
    return runs


def _assert_same_run(fast, slow, case):
    (fast_out, fast_draws, _), (slow_out, slow_draws, _) = fast, slow
    assert torch.equal(fast_draws, slow_draws), case  # the generator's state
    for a, b in zip(fast_out, slow_out, strict=True):
        assert (a is None) == (b is None), case
        if a is not None:
            assert a.shape == b.shape and torch.equal(a, b), case


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_front_door_has_the_bits_of_fused_norm(
    in_use, monkeypatch, python_dropout_adds, dtype
):
    """``fused_norm`` with dropout or ``x1`` (no gradient) through the C++ front door: every
    output (y, y1, residual_out, both masks) bitwise the Python path's (the fast paths
    off), the default generator left in the same state (a seed drawn as Python draws it),
    on 1-D, 3-D and 4-D inputs, with and without residual, x1, a second weight set, a seed,
    the masks, for layer norm and RMSNorm; and Python's dropout-add never runs for them."""
    for shape, x, r, _ in _front_door_inputs("layer_norm", dtype):
        n = shape[-1]
        x1 = torch.randn(shape).to(dtype)
        w, b, w1, b1 = (torch.randn(n).to(dtype) for _ in range(4))
        for rms, residual, second, p, masks, seed, weights1 in itertools.product(
            [False, True], [False, True], [False, True], [0.0, 0.3], [False, True],
            [None, 77, -(2**63)], [False, True],
        ):  # fmt: skip
            if p == 0.0 and not second:
                continue  # h = x + residual: add_*'s front door
            kw = {"rms": rms, "dropout_p": p, "return_dropout_mask": masks, "seed": seed}
            if masks:  # (with the masks: the dtype options given as x's own, flash-attn's way)
                kw["residual_dtype"] = kw["out_dtype"] = dtype
            if residual:
                kw["residual"] = r
            if second:
                kw["x1"] = x1
            if weights1:
                kw["weight1"], kw["bias1"] = w1, None if rms else b1
            case = (shape, kw.keys(), rms, p, masks, seed)
            fast, slow = _fused_both_ways(
                monkeypatch, python_dropout_adds, x, n, w, None if rms else b, **kw
            )
            assert not fast[2] and slow[2], case  # taken by C++ / run by Python
            _assert_same_run(fast, slow, case)


def _fused_gradients(monkeypatch, seen, fast, base, leaves, n, create_graph=False, **kw):
    """``fused_norm`` on clones of ``base`` (``leaves`` require grad) with the fast paths
    ``fast``: the bits of y, residual_out and every leaf's gradient of a seeded loss, and
    whether Python's dropout-add ran."""
    from layernorm import ops

    monkeypatch.setattr(ops, "FAST_PATHS", fast)
    t = {k: v.clone().requires_grad_(k in leaves) for k, v in base.items()}
    named = {"residual": "r", "x1": "x1", "weight1": "w1", "bias1": "b1"}
    options = {k: t[v] for k, v in named.items() if kw.pop(k, False)}
    del seen[:]
    out = layernorm.fused_norm(t["x"], (n,), t["w"], t.get("b"), seed=5, **options, **kw)
    outs = [o for o in (out.y, out.y1, out.residual_out) if o is not None and o.requires_grad]
    g = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
               for o in outs)  # fmt: skip
    used = {"x", "w", "b"} | {named[k] for k in options}
    wanted = [t[k] for k in leaves if k in used and k in t]
    grads = torch.autograd.grad(loss, wanted, create_graph=create_graph)
    if create_graph:  # a second order: the gradient of the gradients' weighted sum
        total = sum((q.double() * torch.randn(q.shape, generator=g, dtype=torch.float64)).sum()
                    for q in grads)  # fmt: skip
        grads = torch.autograd.grad(total, wanted, allow_unused=True)
    kept = [out.y, out.residual_out, *grads]
    return [None if q is None else _bits(q.detach()) for q in kept], bool(seen)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_front_door_trains_with_the_bits_of_fused_norm(
    in_use, monkeypatch, python_dropout_adds, dtype
):
    """With a gradient asked the front door records the dropout-add's C++ node
    (``layernorm::DropoutAddBackward``, whose backward calls the numba entry) and the
    norm's: y, residual_out and the gradient of every leaf (x, x1, residual, each weight
    set) bitwise the Python path's (``EagerDropoutAdd``, the fast paths off), with every
    subset of leaves, on 1-D, 3-D and 4-D inputs, for layer norm and RMSNorm."""
    for shape, x, r, _ in _front_door_inputs("layer_norm", dtype):
        n = shape[-1]
        base = {"x": x, "r": r, "x1": torch.randn(shape).to(dtype)}
        base.update(w=torch.randn(n).to(dtype), w1=torch.randn(n), b1=torch.randn(n))
        for rms, second, p, leaves in itertools.product(
            [False, True], [False, True], [0.0, 0.3], [("x", "r", "x1", "w", "w1"), ("x",), ("w",), ("r",)]
        ):  # fmt: skip
            if p == 0.0 and not second:
                continue
            b = {} if rms else {"b": torch.randn(n).to(dtype), "b1": base["b1"]}
            inputs = {**base, **b} if not rms else {k: v for k, v in base.items() if k != "b1"}
            kw = {"rms": rms, "dropout_p": p, "residual": True, "x1": second,
                  "weight1": True, "bias1": not rms}  # fmt: skip
            case = (shape, rms, second, p, leaves)
            fast = _fused_gradients(monkeypatch, python_dropout_adds, True, inputs, leaves, n, **kw)
            slow = _fused_gradients(
                monkeypatch, python_dropout_adds, False, inputs, leaves, n, **kw
            )
            assert not fast[1] and slow[1], case
            for a, c in zip(fast[0], slow[0], strict=True):
                assert (a is None) == (c is None) and (a is None or torch.equal(a, c)), case


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_front_door_takes_a_float32_stream(in_use, monkeypatch, python_dropout_adds, dtype):
    """A float32 residual stream of 16-bit terms (``residual_dtype=torch.float32``, or a
    float32 residual: flash-attn's ``residual_in_fp32``) with dropout or ``x1``: the front
    door runs the dropout-add's entries of the (terms, stream) pair and the norms of h
    into x's dtype. Every output, mask and gradient is bitwise the Python path's (the fast
    paths off), the generator is left in the same state; 1-D, 3-D and 4-D inputs, every
    subset of residual, x1, a second weight set, a seed and the masks, and with a
    gradient of every leaf. It leaves to Python only the exact three-term sum without a
    residual (``_numba_dropout._sum3`` picks another kernel for it)."""
    for shape, x, _, _ in _front_door_inputs("layer_norm", dtype):
        n = shape[-1]
        r32, x1 = torch.randn(shape), torch.randn(shape).to(dtype)
        w, b, w1, b1 = (torch.randn(n).to(dtype) for _ in range(4))
        for rms, residual, second, p, masks, seed, given in itertools.product(
            [False, True], [False, True], [False, True], [0.0, 0.3], [False, True],
            [None, 77], ["residual_dtype", "residual"],
        ):  # fmt: skip
            if (p == 0.0 and not second) or (given == "residual" and not residual):
                continue  # (h = x + residual: add_*'s; a stream named by the residual alone)
            kw = {"rms": rms, "dropout_p": p, "return_dropout_mask": masks, "seed": seed}
            if given == "residual_dtype":
                kw["residual_dtype"] = torch.float32
            if residual:
                kw["residual"] = r32
            if second:
                kw["x1"], kw["weight1"], kw["bias1"] = x1, w1, None if rms else b1
            case = (shape, kw.keys(), rms, p, masks, seed)
            fast, slow = _fused_both_ways(
                monkeypatch, python_dropout_adds, x, n, w, None if rms else b, **kw
            )
            assert fast[2] == (p == 0.0 and not residual) and slow[2], case
            _assert_same_run(fast, slow, case)
        base = {"x": x, "r": r32, "x1": x1, "w": w, "w1": w1.float(), "b": b, "b1": b1}
        for rms, second, p, leaves in itertools.product(
            [False, True], [False, True], [0.0, 0.3], [("x", "r", "x1", "w", "w1"), ("x",), ("r",)]
        ):  # fmt: skip
            if p == 0.0 and not second:
                continue
            inputs = {k: v for k, v in base.items() if not (rms and k in ("b", "b1"))}
            kw = {"rms": rms, "dropout_p": p, "residual": True, "x1": second,
                  "weight1": True, "bias1": not rms, "residual_dtype": torch.float32}  # fmt: skip
            case = (shape, rms, second, p, leaves)
            runs = [_fused_gradients(monkeypatch, python_dropout_adds, fast, inputs, leaves, n,
                                     **dict(kw)) for fast in (True, False)]  # fmt: skip
            assert not runs[0][1] and runs[1][1], case
            for a, c in zip(runs[0][0], runs[1][0], strict=True):
                assert (a is None) == (c is None) and (a is None or torch.equal(a, c)), case


def _rowscales(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Rowscales for ``shape``'s rows: float32 values as ``(M,)`` (the decided pass),
    53-bit float64 values in the leading shape (the exact pass), and bfloat16 ones."""
    lead = shape[:-1]
    m = math.prod(lead)
    return [
        torch.rand(m) + 0.5,
        (torch.rand(lead, dtype=torch.float64) + 0.5) / 3,
        (torch.rand(m) * 4 - 2).bfloat16(),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_front_door_takes_a_rowscale_and_a_generator(
    in_use, monkeypatch, python_dropout_adds, dtype
):
    """A rowscale (flash-attn's drop-path: ``(M,)`` or x's leading shape, any floating
    dtype) and a CPU generator of the user's go through the front door: every output,
    mask and gradient bitwise the Python path's (the fast paths off), the default and the
    given generator left in the same state (``_fused_both_ways``); 1-D, 3-D and 4-D
    inputs, with and without dropout, residual, x1, a seed and (16-bit x) a float32
    stream, and with a gradient of every leaf (the rowscale saved by the C++ node, handed
    to Python's formula for a graph of the backward)."""
    for shape, x, r, _ in _front_door_inputs("layer_norm", dtype):
        n = shape[-1]
        x1 = torch.randn(shape).to(dtype)
        w, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
        streams = [None, torch.float32] if dtype in (torch.bfloat16, torch.float16) else [None]
        for rowscale, p, residual, second, seed, generator, stream in itertools.product(
            [None, *_rowscales(shape)], [0.0, 0.3], [False, True], [False, True], [None, 77],
            [None, torch.Generator()], streams,
        ):  # fmt: skip
            if rowscale is None and (generator is None or (p == 0.0 and not second)):
                continue  # (the other front door tests' calls)
            kw = {"dropout_p": p, "return_dropout_mask": True, "seed": seed}
            kw.update(rowscale=rowscale, generator=generator, residual_dtype=stream)
            if residual:
                kw["residual"] = r if stream is None else r.to(stream)
            if second:
                kw["x1"] = x1
            case = (shape, kw.keys(), None if rowscale is None else rowscale.dtype, p, seed)
            fast, slow = _fused_both_ways(monkeypatch, python_dropout_adds, x, n, w, b, **kw)
            # taken by C++ but the exact three-term sum into a stream (float32 stream test)
            sum3 = stream is not None and rowscale is None and p == 0.0 and not residual
            assert fast[2] == sum3 and slow[2], case  # (run by Python)
            _assert_same_run(fast, slow, case)
        base = {"x": x, "r": r, "x1": x1, "w": w, "b": b}
        for rowscale, p, second, leaves, create_graph in itertools.product(
            _rowscales(shape), [0.0, 0.3], [False, True], [("x", "r", "x1", "w"), ("x",), ("r",)],
            [False, True],
        ):  # fmt: skip
            kw = {"dropout_p": p, "residual": True, "x1": second, "rowscale": rowscale}
            case = (shape, rowscale.dtype, p, second, leaves, create_graph)
            runs = [
                _fused_gradients(monkeypatch, python_dropout_adds, fast, base, leaves, n,
                                 create_graph, **dict(kw))
                for fast in (True, False)
            ]  # fmt: skip
            # (a graph of the backward: its transpose is the Python dropout-add)
            assert runs[0][1] == create_graph and runs[1][1], case
            for a, c in zip(runs[0][0], runs[1][0], strict=True):
                assert (a is None) == (c is None) and (a is None or torch.equal(a, c)), case


def test_fused_front_door_saves_the_rowscale_as_python_does(in_use, monkeypatch):
    """The C++ node saves the rowscale as ``EagerDropoutAdd`` does: changed in place
    after the forward, the backward raises autograd's error, on either path; a rowscale
    that requires grad raises Python's error in grad mode and is taken without it."""
    from layernorm import ops

    for fast in (True, False):
        monkeypatch.setattr(ops, "FAST_PATHS", fast)
        x = torch.randn(4, 16, requires_grad=True)
        rowscale = torch.rand(4)
        out = layernorm.fused_norm(x, 16, dropout_p=0.1, rowscale=rowscale, seed=1)
        assert (out.residual_out.grad_fn.name() == "layernorm::DropoutAddBackward") == fast
        rowscale.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.y.sum().backward()
        with pytest.raises(RuntimeError, match="rowscale gets no gradient"):
            layernorm.fused_norm(x, 16, dropout_p=0.1, rowscale=rowscale.requires_grad_())
        with torch.no_grad():
            layernorm.fused_norm(x, 16, dropout_p=0.1, rowscale=rowscale)
        rowscale.requires_grad_(False)


@pytest.fixture
def python_fused_checks(monkeypatch):
    """The calls of ``fused._check_same`` (the first of fused_norm's Python checks) during
    a test: none where the compiled front door took a ``fused_norm`` call."""
    from layernorm import fused

    return _calls_of(monkeypatch, fused, "_check_same")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_front_door_takes_the_call_without_a_dropout_add(
    in_use, monkeypatch, python_fused_checks, dtype
):
    """Without dropout, x1 or a rowscale (flash-attn's ``layer_norm_fn`` as most models
    call it) ``fused_norm`` is the norm of x, or add_*'s of x and the residual, or for
    16-bit x in a float32 stream (``residual_in_fp32``) the norm of x + residual (or x
    widened) rounded into x's dtype: the front door hands it to the norm's, and every
    output (y, residual_out or None, the masks of ones) and gradient is bitwise the
    Python path's; 1-D, 3-D and 4-D inputs, layer norm and RMSNorm, eps given or not, the
    dtype options given as x's own. It leaves to Python a second weight set and a
    float64 stream."""
    half = dtype in (torch.bfloat16, torch.float16)
    for shape, x, r, _ in _front_door_inputs("layer_norm", dtype):
        n = shape[-1]
        w, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
        for rms, residual, masks, eps, own, stream in itertools.product(
            [False, True], [False, True], [False, True], [None, 1e-3], [False, True],
            [None, torch.float32] if half else [None],
        ):  # fmt: skip
            kw = {"rms": rms, "return_dropout_mask": masks, "eps": eps, "residual_dtype": stream}
            if residual:
                kw["residual"] = r if stream is None else r.to(stream)
            if own:
                kw["out_dtype"] = dtype
                kw["residual_dtype"] = stream or dtype
            case = (shape, rms, residual, masks, eps, own, stream)
            fast, slow = _fused_both_ways(
                monkeypatch, python_fused_checks, x, n, w, None if rms else b, **kw
            )
            assert not fast[2] and slow[2], case  # taken by C++ / run by Python
            _assert_same_run(fast, slow, case)
        base = {"x": x, "r": r, "w": w, "b": b}
        for rms, leaves, stream in itertools.product(
            [False, True], [("x", "r", "w", "b"), ("x",), ("r",), ("w",)],
            [None, torch.float32] if half else [None],
        ):  # fmt: skip
            inputs = {k: v for k, v in base.items() if not (rms and k == "b")}
            if stream is not None:
                inputs["r"] = inputs["r"].to(stream)
            kw = {"rms": rms, "residual": True}
            runs = [_fused_gradients(monkeypatch, python_fused_checks, fast, inputs, leaves, n,
                                     **dict(kw)) for fast in (True, False)]  # fmt: skip
            assert not runs[0][1] and runs[1][1], (shape, rms, leaves)
            for a, c in zip(runs[0][0], runs[1][0], strict=True):
                assert (a is None) == (c is None) and (a is None or torch.equal(a, c)), leaves
    x = torch.randn(3, 16).to(dtype)
    wider = {torch.float64: (), torch.float32: (torch.float64,)}.get(dtype, (torch.float64,))
    for kw in [{"weight1": torch.randn(16).to(dtype)}, *({"residual_dtype": t} for t in wider)]:
        fast, slow = _fused_both_ways(monkeypatch, python_fused_checks, x, 16, None, None, **kw)
        assert fast[2] and slow[2], kw.keys()
        _assert_same_run(fast, slow, kw.keys())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_add_front_door_takes_a_float32_stream(in_use, monkeypatch, op, dtype):
    """add_*'s float32 residual of 16-bit x (flash-attn's and quack's stream), with
    ``residual_dtype=torch.float32`` or without options, goes to C++
    (``options._stream_front_door``: ``compiled.fused`` without a dropout-add) instead of
    ``options.residual_stream``: y, residual_out and every gradient bitwise the Python
    path's, on 1-D, 3-D and 4-D inputs, with and without parameters; with other options
    Python runs it."""
    from layernorm import ops, options

    seen = []
    python_stream = options.residual_stream
    monkeypatch.setattr(
        options, "residual_stream", lambda *a, **k: seen.append(1) or python_stream(*a, **k)
    )
    function = getattr(layernorm, op)
    rms = op == "add_rms_norm"
    for shape, x, _, params in _front_door_inputs(op.removeprefix("add_"), dtype):
        n = shape[-1]
        r32 = torch.randn(shape)
        for kw, affine, grad in itertools.product(
            [{}, {"residual_dtype": torch.float32}, {"out_dtype": dtype}], [False, True],
            [False, True],
        ):  # fmt: skip
            runs = []
            for fast in (True, False):
                monkeypatch.setattr(ops, "FAST_PATHS", fast)
                leaves = [t.clone().requires_grad_(grad) for t in (x, r32, *params)]
                p = leaves[2:] if affine else [None] * len(params)
                del seen[:]
                y, h = function(leaves[0], leaves[1], (n,), *p, **kw)
                outs = [y, h]
                if grad:
                    used = leaves if affine else leaves[:2]
                    g = torch.Generator().manual_seed(2)
                    loss = (
                        y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)
                    ).sum()
                    loss = (
                        loss
                        + (
                            h.double() * torch.randn(h.shape, generator=g, dtype=torch.float64)
                        ).sum()
                    )
                    outs += torch.autograd.grad(loss, used)
                runs.append(([_bits(t.detach()) for t in outs], bool(seen)))
            case = (shape, kw, affine, grad, rms)
            assert not runs[0][1] and runs[1][1], case  # taken by C++ / run by Python
            for a, b in zip(runs[0][0], runs[1][0], strict=True):
                assert torch.equal(a, b), case
    monkeypatch.setattr(ops, "FAST_PATHS", True)
    x, r32 = torch.randn(3, 8).to(dtype), torch.randn(3, 8)
    del seen[:]
    function(x, r32, 8, torch.ones(8), offset=1.0)
    assert seen  # (an option the stream's door does not take)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_front_door_takes_an_offset_and_an_out_dtype(
    in_use, monkeypatch, python_fused_checks, dtype
):
    """An ``offset`` (flash-attn's ``zero_centered_weight``, quack's ``weight_offset``) or
    another ``out_dtype`` than x's: the front door runs the dropout-add and the norm of h
    with those options through the norm's door (an offset that is a float32 value, y as
    narrow as h or narrower) or fused_norm's own ``_norm`` (an offset of 0.1, a wider
    float32 y: ``compiled._norm_of_h``). Every output, mask and gradient bitwise the
    Python path's, the generator in the same state; 1-D, 3-D and 4-D inputs, with
    dropout, x1, a rowscale or none of them, a residual, a second weight set, narrower
    and wider out_dtypes, (16-bit x) a float32 stream; an option's error is Python's,
    after the dropout-add as there."""
    for shape, x, r, _ in _front_door_inputs("layer_norm", dtype):
        n = shape[-1]
        x1, rs = torch.randn(shape).to(dtype), torch.rand(shape[:-1]) + 0.5
        w, b, w1 = (torch.randn(n).to(dtype) for _ in range(3))
        half = dtype in (torch.bfloat16, torch.float16)
        for block, residual, weights1, offset, out_dtype, rms, stream in itertools.product(
            ["dropout", "x1", "rowscale", None], [False, True], [False, True], [0.0, 1.0, 0.1],
            [None, torch.bfloat16, torch.float32], [False, True],
            [None, torch.float32] if half else [None],
        ):  # fmt: skip
            if (offset == 0.0 and out_dtype in (None, dtype)) or (weights1 and block is None):
                continue  # (the other front door tests' calls; y1 without a block: Python's)
            if stream is not None and block == "x1" and not residual:
                continue  # (Python's: the exact three-term sum into a stream)
            kw = {"rms": rms, "offset": offset, "out_dtype": out_dtype, "return_dropout_mask": True}
            kw.update(
                dropout_p=0.2 if block == "dropout" else 0.0,
                x1=x1 if block == "x1" else None,
                rowscale=rs if block == "rowscale" else None,
                residual=None if not residual else r if stream is None else r.to(stream),
                weight1=w1 if weights1 else None,
                residual_dtype=stream,
            )
            case = (shape, block, residual, weights1, offset, out_dtype, rms, stream)
            fast, slow = _fused_both_ways(
                monkeypatch, python_fused_checks, x, n, w, None if rms else b, **kw
            )
            assert not fast[2] and slow[2], case  # taken by C++ / run by Python
            _assert_same_run(fast, slow, case)
        base = {"x": x, "r": r, "x1": x1, "w": w, "b": b, "w1": w1}
        for block, offset, out_dtype, leaves in itertools.product(
            ["dropout", "x1", None], [0.0, 1.0], [None, torch.bfloat16],
            [("x", "r", "x1", "w", "b", "w1"), ("x",), ("w",)],
        ):  # fmt: skip
            if offset == 0.0 and out_dtype in (None, dtype):
                continue
            kw = {"dropout_p": 0.2 if block == "dropout" else 0.0, "residual": True,
                  "x1": block == "x1", "weight1": block is not None, "offset": offset,
                  "out_dtype": out_dtype}  # fmt: skip
            case = (shape, block, offset, out_dtype, leaves)
            runs = [_fused_gradients(monkeypatch, python_fused_checks, fast, base, leaves, n,
                                     **dict(kw)) for fast in (True, False)]  # fmt: skip
            assert not runs[0][1] and runs[1][1], case
            for a, c in zip(runs[0][0], runs[1][0], strict=True):
                assert (a is None) == (c is None) and (a is None or torch.equal(a, c)), case
    from layernorm import ops

    x, draws = torch.randn(3, 16).to(dtype), []
    for fast in (True, False):
        monkeypatch.setattr(ops, "FAST_PATHS", fast)
        torch.manual_seed(3)
        with pytest.raises(ValueError, match=r"offset=1.0 needs a weight"):
            layernorm.fused_norm(x, 16, dropout_p=0.2, offset=1.0)
        draws.append(torch.randint(1 << 30, (2,)))
    assert torch.equal(*draws)  # the seed drawn before the error, on either path


def test_fused_front_door_node_hands_python_what_it_was_not_built_for(
    in_use, monkeypatch, python_dropout_adds
):
    """The node's backward goes to Python's formula (fused.gradients) for a graph of the
    backward (create_graph: second-order gradients) and for batched gradients (vmap):
    the Python path's results either way."""
    x, r, x1 = (torch.randn(3, 4, 16) for _ in range(3))
    base = {"x": x, "r": r, "x1": x1, "w": torch.randn(16), "b": torch.randn(16)}
    kw = {"dropout_p": 0.25, "residual": True, "x1": True}
    fast, slow = (
        _fused_gradients(monkeypatch, python_dropout_adds, f, base, ("x", "r", "x1", "w"), 16,
                         create_graph=True, **kw)
        for f in (True, False)
    )  # fmt: skip
    for a, c in zip(fast[0], slow[0], strict=True):
        assert (a is None) == (c is None) and (a is None or torch.equal(a, c))
    from layernorm import ops

    monkeypatch.setattr(ops, "FAST_PATHS", True)
    leaf = x.clone().requires_grad_()
    out = layernorm.fused_norm(leaf, 16, residual=r, dropout_p=0.25, seed=3)
    assert out.residual_out.grad_fn.name() == "layernorm::DropoutAddBackward"
    cotangents = torch.randn(2, 3, 4, 16)
    (batched,) = torch.autograd.grad(
        out.residual_out, leaf, cotangents, retain_graph=True, is_grads_batched=True
    )
    for i in range(2):
        (one,) = torch.autograd.grad(out.residual_out, leaf, cotangents[i], retain_graph=True)
        assert torch.equal(batched[i], one)


def test_fused_front_door_over_threads(in_use, monkeypatch, python_dropout_adds):
    """Rows split over torch's threads (spans as ``_threads`` lends them) give the bits
    of the Python path, which splits them its own way."""
    x, r, x1 = (torch.randn(256, 1024) for _ in range(3))
    w, b = torch.randn(1024), torch.randn(1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for kw in ({"residual": r, "dropout_p": 0.1}, {"x1": x1, "residual": r}):
            fast, slow = _fused_both_ways(
                monkeypatch, python_dropout_adds, x, 1024, w, b, return_dropout_mask=True, **kw
            )
            assert not fast[2] and slow[2]
            _assert_same_run(fast, slow, kw.keys())
    finally:
        torch.set_num_threads(threads)


def test_fused_front_door_leaves_other_calls_to_python(in_use, monkeypatch, python_dropout_adds):
    """Every call outside the front door's rule runs Python's path (its dropout-add runs),
    with the same results as with the fast paths off: each option it does not take, a seed or probability of another type, strided or mixed-dtype tensors."""
    torch.manual_seed(0)
    x, r, x1 = (torch.randn(3, 4, 16) for _ in range(3))
    w, b = torch.randn(16), torch.randn(16)
    cases = {
        "residual_dtype": {"dropout_p": 0.2, "residual_dtype": torch.float64},
        "residual_dtype of the residual's": {
            "dropout_p": 0.2,
            "residual": r.double(),
            "residual_dtype": torch.float64,
        },
        "int offset": {"dropout_p": 0.2, "offset": 1},
        "backend": {"dropout_p": 0.2, "backend": "numba"},
        "int p": {"x1": x1, "dropout_p": 0},
        "p = 1": {"dropout_p": 1.0},
        "seed >= 2^63": {"dropout_p": 0.2, "seed": 2**64 - 1},
        "strided x1": {"x1": torch.randn(3, 4, 32)[..., ::2], "dropout_p": 0.2},
        "float64 residual": {"residual": r.double(), "dropout_p": 0.2},
        "int eps": {"dropout_p": 0.2, "eps": 0},
    }
    for name, kw in cases.items():
        fast, slow = _fused_both_ways(monkeypatch, python_dropout_adds, x, 16, w, b, **kw)
        assert fast[2] and slow[2], name
        _assert_same_run(fast, slow, name)
    monkeypatch.setenv("LAYERNORM_BACKEND", "torch")  # a backend named: Python's choice
    fast, slow = _fused_both_ways(monkeypatch, python_dropout_adds, x, 16, w, b, dropout_p=0.2)
    assert fast[2]
    _assert_same_run(fast, slow, "LAYERNORM_BACKEND")


def test_fused_front_door_errors_are_python_s(in_use):
    """Calls the front door declines raise Python's errors; a wrong call of its own
    function raises TypeError."""
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="rms=True takes no bias"):
        layernorm.fused_norm(x, 8, None, torch.ones(8), rms=True, dropout_p=0.1)
    with pytest.raises(ValueError, match="bias1 needs weight1"):
        layernorm.fused_norm(x, 8, x1=x, bias1=torch.ones(8))
    with pytest.raises(ValueError, match="has to be between 0 and 1"):
        layernorm.fused_norm(x, 8, dropout_p=1.5)
    with pytest.raises(RuntimeError, match=r"x1 must have the input's shape"):
        layernorm.fused_norm(x, 8, x1=torch.randn(2, 4), dropout_p=0.1)
    with pytest.raises(TypeError, match="dropout seed must be an int, got bool"):
        layernorm.fused_norm(x, 8, dropout_p=0.1, seed=True)
    with pytest.raises(TypeError, match="fused takes fused_norm's 19 arguments"):
        compiled.fused(x)


def test_errors_are_python_s(in_use):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"expected input with shape \[\*, 4\]"):
        layernorm.layer_norm(x, 4)
    with pytest.raises(ValueError, match="eps must be non-negative"):
        layernorm.layer_norm(x, 8, eps=-1.0)
    with pytest.raises(TypeError, match="norm takes 8 or 14 arguments"):
        in_use(x)


def test_only_when_numba_is_the_automatic_choice(monkeypatch, in_use):
    """The extension asks the registry which backend runs a dtype (once, until
    backends.forget): where numba is not the automatic choice it leaves the call to it."""
    x = torch.randn(2, 8, dtype=torch.float64)
    assert in_use(x, None, 8, None, None, 1e-5, False, None) is not None
    monkeypatch.setattr(numba_, "prefers", lambda x: False)
    try:
        backends.forget("numba")
        assert in_use(x, None, 8, None, None, 1e-5, False, None) is None
        assert backends.choose(x) == "torch"
        torch.testing.assert_close(
            layernorm.layer_norm(x, 8), torch.nn.functional.layer_norm(x, (8,))
        )
    finally:
        monkeypatch.undo()
        backends.forget("numba")
    assert in_use(x, None, 8, None, None, 1e-5, False, None) is not None


def _second_order(op):
    """Gradients of a function of the first gradients (create_graph=True)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, generator=g, dtype=torch.float64)
    r = torch.randn(3, 6, generator=g, dtype=torch.float64)
    w = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(6, generator=g, dtype=torch.float64)
    residual = r if op.startswith("add") else None
    b = None if op.endswith("rms_norm") else b
    ls = [t.clone().requires_grad_() if t is not None else None for t in (x, residual, w, b)]
    outputs = _call(op, *ls, 1e-5)
    gs = [t for t in ls if t is not None]
    first = torch.autograd.grad([o.sum() for o in outputs], gs, create_graph=True)
    loss = sum((g * g).sum() for g in first)
    return [torch.autograd.grad(loss, gs, allow_unused=True, materialize_grads=True)]


@pytest.mark.parametrize("op", OPS)
def test_double_backward(in_use, python_path, op):
    """create_graph=True: the node's backward goes through the differentiable formula
    (gradgradcheck), with the Python path's bits."""
    x, r = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    w, b = torch.rand(6, dtype=torch.float64) + 0.5, torch.randn(6, dtype=torch.float64)
    residual = r if op.startswith("add") else None
    b = None if op.endswith("rms_norm") else b

    def f(*tensors):
        return _call(op, *tensors, 1e-5)

    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, residual, w, b)]
    given = tuple(t for t in leaves if t is not None)
    present = [t is not None for t in leaves]
    assert f(*leaves)[0].grad_fn.name() == "layernorm::NormBackward"
    assert torch.autograd.gradgradcheck(lambda *t: f(*_fill(t, present)), given)
    _equal_lists(_second_order(op), python_path["double backward", op])


def _fill(tensors, present):
    """(x, residual, w, b) from the given tensors, None where ``present`` says absent."""
    given = iter(tensors)
    return [next(given) if p else None for p in present]


def test_gradients_as_autograd_asks_for_them(in_use):
    """Only the residual (or only the weight) requiring grad; x and residual both: two
    tensors, never one handed to two leaves; an unused output's gradient is zeros."""
    x, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.rand(8) + 0.5
    rs = r.clone().requires_grad_()
    y, h = layernorm.add_layer_norm(x, rs, 8, w)
    (dr,) = torch.autograd.grad(y.sum(), rs)
    ws = w.clone().requires_grad_()
    (dw,) = torch.autograd.grad(layernorm.layer_norm(x, 8, ws).sum(), ws)
    torch.testing.assert_close(dw, (layernorm.layer_norm(x, 8)).sum(0))
    xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
    y, h = layernorm.add_layer_norm(xs, rs, 8, w)
    dx, dr2 = torch.autograd.grad(y.sum(), (xs, rs))
    assert torch.equal(dx, dr2) and dx.data_ptr() != dr2.data_ptr() and torch.equal(dr, dx)
    xs = x.clone().requires_grad_()
    y, h = layernorm.add_layer_norm(xs, r, 8, w)
    (dh,) = torch.autograd.grad(h.sum(), xs)  # y unused: its gradient is zeros
    assert torch.equal(dh, torch.ones_like(x))


def test_backward_twice_raises_and_inplace_change_is_caught(in_use):
    x = torch.randn(2, 8, requires_grad=True)
    y = layernorm.layer_norm(x, 8)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    z = torch.randn(2, 8, requires_grad=True) * 1  # a non-leaf, saved by the node
    y = layernorm.layer_norm(z, 8)
    with torch.no_grad():
        z.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inference_mode(in_use):
    x = torch.randn(3, 16)
    with torch.inference_mode():
        y = layernorm.layer_norm(x, 16)
    assert torch.equal(y, layernorm.layer_norm(x, 16))


def test_switched_off_and_not_built(monkeypatch, tmp_path):
    monkeypatch.setattr(compiled, "_reason", compiled._reason)  # (restored afterwards)
    monkeypatch.setenv("LAYERNORM_COMPILED", "0")
    assert compiled._load() is None
    assert compiled.unavailable_reason() == "switched off (LAYERNORM_COMPILED=0)"
    monkeypatch.delenv("LAYERNORM_COMPILED")
    monkeypatch.setenv("LAYERNORM_CACHE_DIR", str(tmp_path))
    assert compiled.library_path().parent == tmp_path
    assert compiled._load() is None
    assert compiled.unavailable_reason().startswith("not built here (run `layernorm build`")


def test_build_error_says_why(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LAYERNORM_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(RuntimeError, match="cannot build layernorm's compiled dispatch"):
        compiled.build()


def test_name_follows_the_source_and_torch(monkeypatch):
    name = compiled._module_name()
    assert name.startswith("layernorm_compiled_")
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert compiled._module_name() != name


def test_under_torch_compile_the_custom_op_is_traced(in_use):
    x = torch.randn(4, 8)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return layernorm.layer_norm(x, 8) * 2

    assert torch.equal(f(x), layernorm.layer_norm(x, 8) * 2)


def test_status_and_ensure(monkeypatch, in_use):
    assert compiled.status() == f"in use ({compiled.library_path()})"
    assert compiled.ensure() == compiled.status()  # built: nothing to do

    def fails(**kwargs):
        raise RuntimeError("cannot build layernorm's compiled dispatch: no compiler")

    monkeypatch.setattr(compiled, "_extension", None)
    monkeypatch.setattr(compiled, "_reason", "not built here")
    monkeypatch.setattr(compiled, "library_path", lambda: compiled.cache_dir() / "absent.so")
    monkeypatch.setattr(compiled, "build", fails)
    assert (
        compiled.ensure() == "not in use: cannot build layernorm's compiled dispatch: no compiler"
    )


def test_cli_build(monkeypatch, tmp_path, capsys):
    from layernorm import cli

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LAYERNORM_CACHE_DIR", str(blocker / "cache"))
    assert cli.main(["build"]) == 1
    assert "layernorm build: error: cannot build layernorm's compiled dispatch" in (
        capsys.readouterr().err
    )
    monkeypatch.setattr(compiled, "build", lambda **kwargs: tmp_path / "x.so")
    assert cli.main(["build", "--verbose"]) == 0
    assert capsys.readouterr().out.startswith(f"built {tmp_path / 'x.so'} in ")


def test_report_says_whether_it_is_in_use(in_use):
    from layernorm.report import page as report

    section = report._compiled_section()
    assert section.startswith("<p>Compiled dispatch") and "in use (" in section


def test_kernel_addresses_are_distinct_and_survive_forget(in_use):
    """Regression: entries were found by a symbol name that closures of one name could
    share once loaded from numba's cache, so after ``backends.forget`` the extension
    called another dtype's kernel (wrong values, then heap corruption)."""
    names = numba_.ENTRIES
    before = [compiled._resolve(d, name) for d in range(4) for name in names]
    backends.forget("numba")
    after = [compiled._resolve(d, name) for d in range(4) for name in names]
    assert before == after and len(set(before)) == 16
    for dtype in compiled.DTYPES:
        x, w = torch.randn(4, 64).to(dtype), torch.rand(64).to(dtype) + 0.5
        y, _ = in_use(x, None, 64, w, None, 1e-5, False, None)
        assert torch.equal(y, numba_.forward(x, None, w, None, 1e-5, False, False)[0])


def test_eps_none_is_the_ops_default(in_use):
    """eps=None in the extension is _op.default_eps, handed to it at set-up: the same
    bits as the numba backend called with that eps, for every dtype."""
    from layernorm import _op

    for dtype in compiled.DTYPES:
        x, w = torch.randn(4, 64).to(dtype), torch.rand(64).to(dtype) + 0.5
        y, _ = in_use(x, None, 64, w, None, None, True, None)
        expected = numba_.forward(x, None, w, None, _op.default_eps(dtype), True, False)[0]
        assert torch.equal(y, expected)


@pytest.mark.parametrize(
    "direction", ["forward", "backward", "dropout_add", "sum3", "dropout_add_backward"]
)
def test_a_kernel_signature_mismatch_raises(monkeypatch, in_use, direction):
    """The extension compares the numba kernels' signatures (_kernel_abi) with the ones it
    was built for, so a mismatch raises instead of calling with wrong arguments."""
    from layernorm.backends import _kernel_abi

    extension = compiled._extension
    assert extension is not None
    signature = _kernel_abi.signature
    wrong = {direction: signature(direction).replace(":i64", ":f64", 1)}  # a first argument
    monkeypatch.setattr(_kernel_abi, "signature", lambda d: wrong.get(d) or signature(d))
    with pytest.raises(RuntimeError, match="rebuild it"):
        compiled._use(extension)
    monkeypatch.undo()
    compiled._use(extension)  # (set up again, as it was)
    assert in_use(torch.randn(2, 8), None, 8, None, None, 1e-5, False, None) is not None


def test_threads_training_at_once_agree(in_use):
    """Python threads running forward and backward at once (the backward on autograd's
    threads, without the GIL; absent parameters take the shared constants): each gets
    the bits of a call alone, and none waits on another forever."""
    import threading

    x, r = torch.randn(4, 48), torch.randn(4, 48)

    def run():
        xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
        y, h = layernorm.add_layer_norm(xs, rs, 48)
        return [y.detach(), *torch.autograd.grad((y, h), (xs, rs), (y.detach(), x))]

    alone = run()
    failures = []

    def worker():
        for _ in range(40):
            if not all(torch.equal(p, q) for p, q in zip(run(), alone, strict=True)):
                failures.append("differs")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and failures == []


def test_a_profiler_sees_the_op(in_use):
    """Under torch.profiler the front door's call with grad goes through the dispatcher,
    so the op and its backward appear as events."""
    x = torch.randn(4, 64, requires_grad=True)
    with torch.profiler.profile() as profile:
        layernorm.layer_norm(x, 64).sum().backward()
    names = {event.name for event in profile.events()}
    assert {"layernorm::forward", "layernorm::NormBackward", "layernorm::backward"} <= names


def test_the_backward_dispatches_when_a_mechanism_would_see_it(in_use):
    """NormBackward calls the backward's CPU kernel itself only when nothing would see the
    call: under a dispatch mode the backward goes through the dispatcher, so the mode sees
    layernorm::backward, and the gradients have the same bits either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    leaves = [t.requires_grad_() for t in (torch.randn(4, 64), torch.randn(64), torch.randn(64))]
    y = layernorm.layer_norm(leaves[0], 64, leaves[1], leaves[2])  # the front door's call
    assert y.grad_fn.name() == "layernorm::NormBackward"
    dy = torch.arange(y.numel()).view_as(y).remainder(7).float() - 3
    direct = torch.autograd.grad(y, leaves, dy, retain_graph=True)
    with Record() as mode:
        seen = torch.autograd.grad(y, leaves, dy)
    assert "layernorm.backward.default" in mode.names
    assert all(torch.equal(p, q) for p, q in zip(direct, seen, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_thread_runs_the_serial_entry_to_the_same_bits(in_use, dtype):
    """With one torch thread a large call runs the serial entry in C++, not the threaded
    one through Python: the same bits, outputs and gradients."""
    x = torch.randn(256, 1024).to(dtype)
    w = (torch.rand(1024) + 0.5).to(dtype)
    assert x.numel() >= numba_.SERIAL_NUMEL

    def run():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = layernorm.layer_norm(xs, 1024, ws)
        return [y.detach(), *torch.autograd.grad(y, (xs, ws), torch.ones_like(y))]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        many = run()
        torch.set_num_threads(1)
        one = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(p, q) for p, q in zip(one, many, strict=True))
