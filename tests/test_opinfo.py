"""torch's own test machinery on our four functions, two modules and two ops.

The sample set (:data:`SAMPLES`): torch's OpInfo samples for ``nn.functional.layer_norm``
and ``nn.functional.rms_norm`` (``op_db``'s ``sample_inputs_func``), extended with every
shape kind (1-D to 4-D inputs, a ``normalized_shape`` of one
and of several dims, a (3, 1, 7) input, transposed, expanded, channels-last and zero-size
inputs, weight and bias each present or absent) and with ``add_layer_norm`` /
``add_rms_norm``. Each sample is driven, with ``layernorm.ops.FAST_PATHS`` on and off,
through the checks that torch's ``test/test_ops.py`` (``TestGradients``) and
``test/functorch/test_ops.py`` run on an op: gradcheck with forward AD, batched grad and
batched forward grad; gradgradcheck forward-over-reverse; vmap over every argument (batch
dim first and last, one argument at a time and all at once); jvp; vjp; jacfwd; jacrev;
hessian; ``torch.autograd.functional.jacobian(vectorize=True)``. Every result is compared
with torch's own op under the same transform (float64, assert_close's defaults), except
hessian, compared with autograd's hessian of torch's op (torch.func's is wrong for
torch's own layer_norm: :func:`test_hessian`).

Also: ``torch.library.opcheck`` on ``layernorm::forward`` and ``layernorm::backward`` over
the sample set's kernel arguments; ModuleInfo samples (``module_db``) for
``nn.LayerNorm`` / ``nn.RMSNorm`` with our modules; and every sample kind in float32,
bfloat16 and float16 against torch (values, vjp, jvp).

Where torch's samples leave our contract: torch accepts a negative ``eps`` (a sample has
-0.5); we raise (§4), which is checked, and the sample runs with ``abs(eps)``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.func import hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.testing import assert_close
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_modules import module_db
from torch.utils._pytree import tree_leaves, tree_map

import layernorm
from layernorm import _op, ops

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch\\.jit\\.[a-z_]+` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]

NAMES = ("x", "residual", "weight", "bias")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One call: ``kind`` (the function), its tensors, ``normalized_shape`` and ``eps``."""

    id: str
    kind: str
    tensors: dict[str, torch.Tensor]
    normalized_shape: tuple[int, ...]
    eps: float | None
    #: applied to ``x`` and ``residual`` inside the call (an expanded input cannot be a
    #: leaf that gradcheck perturbs, the (1, N) tensor it expands can)
    view: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k for k in NAMES if k in self.tensors)

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.tensors[k] for k in self.names)

    def function(self, ours: bool) -> Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]:
        """The call as a function of :attr:`args`: ours, or torch's op (``add_*`` as
        ``x + residual`` then the norm, returning both)."""
        names, kind, shape, eps = self.names, self.kind, self.normalized_shape, self.eps
        view = self.view
        rms = kind.endswith("rms_norm")

        def f(*args):
            t = dict(zip(names, args, strict=True))
            x, r, w, b = (t.get(k) for k in NAMES)
            if view is not None:
                x, r = view(x), None if r is None else view(r)
            if ours:
                if kind == "layer_norm":
                    return layernorm.layer_norm(x, shape, w, b, eps)  # type: ignore[arg-type]
                if kind == "rms_norm":
                    return layernorm.rms_norm(x, shape, w, eps)
                if kind == "add_layer_norm":
                    return layernorm.add_layer_norm(x, r, shape, w, b, eps)  # type: ignore[arg-type]
                return layernorm.add_rms_norm(x, r, shape, w, eps)
            h = x if r is None else x + r
            y = F.rms_norm(h, shape, w, eps) if rms else F.layer_norm(h, shape, w, b, eps)  # type: ignore[arg-type]
            return y if r is None else (y, h)

        return f


def _from_opinfo(name: str) -> list[Sample]:
    """torch's OpInfo samples of ``nn.functional.<name>`` (float64, requiring grad)."""
    (info,) = [o for o in op_db if o.name == f"nn.functional.{name}"]
    samples = []
    for i, s in enumerate(info.sample_inputs("cpu", torch.float64, requires_grad=True)):
        shape = tuple(s.args[0])
        keys = ("weight", "bias") if name == "layer_norm" else ("weight",)
        params = dict(zip(keys, s.args[1:], strict=False))
        tensors = {"x": s.input, **{k: v for k, v in params.items() if v is not None}}
        eps = s.kwargs.get("eps", 1e-5 if name == "layer_norm" else None)
        samples.append(Sample(f"opinfo-{name}-{i}", name, tensors, shape, eps))
    return samples


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _extended() -> list[Sample]:
    """Every shape kind, each with two of the four functions (each function on four or more)."""
    torch.manual_seed(1)
    transposed = _t(5, 3).t()  # (3, 5), rows not contiguous
    channels_last = _t(2, 3, 2, 3).contiguous(memory_format=torch.channels_last)

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.expand(*t.shape[:-2], 3, t.shape[-1])  # stride 0 over the rows

    kinds: list[tuple[str, torch.Tensor, tuple[int, ...], Callable | None]] = [
        ("1d", _t(7), (7,), None),
        ("2d", _t(3, 5), (5,), None),
        ("3d", _t(2, 3, 5), (5,), None),
        ("3d-1", _t(3, 1, 7), (7,), None),
        ("4d-2dims", _t(2, 1, 3, 4), (3, 4), None),
        ("3d-3dims", _t(2, 2, 3), (2, 2, 3), None),
        ("transposed", transposed, (5,), None),
        ("expanded", _t(1, 5), (5,), expand),
        ("channels-last", channels_last, (3,), None),
        ("zero-size", _t(0, 2, 5), (5,), None),
    ]
    functions = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
    samples = []
    for i, (kind, x, shape, view) in enumerate(kinds):
        # two functions per shape kind, each function on half of them
        for function in (functions[i % 4], functions[(i + 1 + i // 4) % 4]):
            # weight and bias present or absent, in turn over the shape kinds
            with_weight = (i + len(function)) % 3 != 0
            with_bias = i % 2 == 0 and not function.endswith("rms_norm")
            tensors = {"x": x.clone().requires_grad_()}  # (clone and randn_like keep strides)
            if function.startswith("add_"):
                tensors["residual"] = torch.randn_like(x).requires_grad_()
            if with_weight:
                tensors["weight"] = _t(*shape).requires_grad_()
            if with_bias:
                tensors["bias"] = _t(*shape).requires_grad_()
            eps = 1e-5 if function.endswith("layer_norm") else None
            samples.append(Sample(f"{function}-{kind}", function, tensors, shape, eps, view))
    return samples


SAMPLES = _from_opinfo("layer_norm") + _from_opinfo("rms_norm") + _extended()


def _eps_for_us(sample: Sample) -> Sample:
    """The sample as our contract takes it: a negative eps raises (§4), checked here,
    and the sample runs with its absolute value."""
    if sample.eps is None or sample.eps >= 0:
        return sample
    with pytest.raises(
        ValueError, match=re.escape(f"eps must be non-negative, got eps={sample.eps}")
    ):
        sample.function(ours=True)(*sample.args)
    return dataclasses.replace(sample, eps=abs(sample.eps))


@pytest.fixture(params=[True, False], ids=["fast", "nofast"])
def fast(request, monkeypatch):
    monkeypatch.setattr(ops, "FAST_PATHS", request.param)
    return request.param


@pytest.fixture(params=SAMPLES, ids=[s.id for s in SAMPLES])
def sample(request) -> Sample:
    return _eps_for_us(request.param)


def _same(ours, theirs, **tolerance) -> None:
    """Nested outputs equal in structure, shape and dtype, and close in value
    (assert_close's defaults unless told)."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert_close(ours, theirs, **tolerance)
        return
    assert type(ours) is type(theirs) and len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        _same(a, b, **tolerance)


def _both(sample: Sample, check: Callable) -> None:
    """``check(f)`` on ours and on torch's, compared."""
    _same(check(sample.function(ours=True)), check(sample.function(ours=False)))


def _weighted_sums(sample: Sample) -> tuple[Callable, Callable]:
    """Ours and torch's reduced to one scalar, the outputs weighted by one fixed random
    tensor each (for hessian)."""
    outputs = sample.function(ours=False)(*_detached(sample))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    weights = [torch.randn_like(o) for o in outputs]

    def reduced(f: Callable) -> Callable:
        def s(*args):
            out = f(*args)
            out = out if isinstance(out, tuple) else (out,)
            # (not sum(): 0 + a tensor fails under hessian's vmap over an empty batch)
            terms = [(o * w).sum() for o, w in zip(out, weights, strict=True)]
            return functools.reduce(operator.add, terms)

        return s

    return reduced(sample.function(ours=True)), reduced(sample.function(ours=False))


def _detached(sample: Sample) -> tuple[torch.Tensor, ...]:
    return tuple(a.detach() for a in sample.args)


# ---------------------------------------------------------------------------------------
# torch's test_ops: values and TestGradients


def test_values(sample, fast):
    _same(sample.function(True)(*sample.args), sample.function(False)(*sample.args))


def test_gradcheck(sample, fast):
    """As ``test_fn_grad`` and ``test_forward_mode_AD``: gradcheck with forward AD,
    batched grad and batched forward grad."""
    assert torch.autograd.gradcheck(
        sample.function(ours=True),
        sample.args,
        check_forward_ad=True,
        check_batched_grad=True,
        check_batched_forward_grad=True,
    )


def test_gradgradcheck(sample, fast):
    """As ``test_fn_gradgrad`` and ``test_fn_fwgrad_bwgrad``: reverse-over-reverse (with
    batched grad) and forward-over-reverse."""
    assert torch.autograd.gradgradcheck(
        sample.function(ours=True), sample.args, check_fwd_over_rev=True, check_batched_grad=True
    )


# ---------------------------------------------------------------------------------------
# functorch's test_ops


def _batched(t: torch.Tensor, dim: int, size: int = 2) -> torch.Tensor:
    """``size`` different copies of ``t`` stacked at ``dim`` (0 or -1)."""
    stacked = torch.stack([t + 0.1 * i for i in range(size)])
    return stacked if dim == 0 else stacked.movedim(0, -1)


def _in_dims(sample: Sample) -> list[tuple[int | None, ...]]:
    """Each argument batched alone (first and last dim), and all at once."""
    k = len(sample.args)
    choices = [tuple(d if j == i else None for j in range(k)) for i in range(k) for d in (0, -1)]
    return [*choices, (0,) * k, (-1,) * k]


def test_vmap(sample, fast):
    """vmap over every argument, compared with torch's op under the same vmap."""
    args = _detached(sample)
    for dims in _in_dims(sample):
        batched = tuple(a if d is None else _batched(a, d) for a, d in zip(args, dims, strict=True))
        _both(sample, lambda f, dims=dims, batched=batched: vmap(f, in_dims=dims)(*batched))


def test_jvp(sample, fast):
    args = _detached(sample)
    tangents = tuple(torch.randn_like(a) for a in args)
    _both(sample, lambda f: jvp(f, args, tangents))


def test_vjp(sample, fast):
    args = _detached(sample)
    out = sample.function(ours=False)(*args)
    cotangents = (
        tuple(torch.randn_like(o) for o in out) if isinstance(out, tuple) else torch.randn_like(out)
    )
    _both(sample, lambda f: vjp(f, *args)[1](cotangents))


def test_jacobians(sample, fast):
    """jacfwd and jacrev over every argument, and autograd's vectorized jacobian (which
    fails on an empty input for torch's op too, in its own code: checked for both)."""
    args = _detached(sample)
    argnums = tuple(range(len(args)))
    _both(sample, lambda f: jacfwd(f, argnums=argnums)(*args))
    _both(sample, lambda f: jacrev(f, argnums=argnums)(*args))
    if sample.tensors["x"].numel() == 0:
        for ours in (True, False):
            with pytest.raises(IndexError, match="index 0 is out of bounds for dimension 0"):
                torch.autograd.functional.jacobian(sample.function(ours), args, vectorize=True)
        return
    _both(sample, lambda f: torch.autograd.functional.jacobian(f, args, vectorize=True))


def test_hessian(sample, fast):
    """hessian (jacfwd over jacrev) of a weighted sum of the outputs, over every argument,
    against torch's op differentiated twice by autograd (``autograd.functional.hessian``:
    torch.func's hessian and jacrev-over-jacrev of torch's own layer_norm get the
    weight-input block wrong in torch 2.13; autograd's and ours agree)."""
    args = _detached(sample)
    argnums = tuple(range(len(args)))
    ours, theirs = _weighted_sums(sample)
    assert_close(theirs(*args), ours(*args))
    if sample.tensors["x"].numel():
        expected = torch.autograd.functional.hessian(theirs, args)
    else:  # (which fails on an empty input): the empty blocks, shaped as torch.func's are
        expected = [[torch.zeros(a.shape + b.shape, dtype=a.dtype) for b in args] for a in args]
    got = hessian(ours, argnums=argnums)(*args)
    for i, j in itertools.product(argnums, argnums):
        _same(got[i][j], expected[i][j])


# ---------------------------------------------------------------------------------------
# torch.library.opcheck on the registered ops


def _kernel_arguments(sample: Sample) -> tuple:
    """The sample's call as ``layernorm::forward`` takes it (``ops`` flattens to rows)."""
    n = 1
    for s in sample.normalized_shape:
        n *= s
    t = sample.tensors
    view = sample.view or (lambda v: v)

    def rows(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else _op.kernel_rows(view(v), n)

    def param(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else v.detach().reshape(-1).requires_grad_(v.requires_grad)

    x, residual = rows(t["x"].detach()), rows(t.get("residual"))
    if x is not None:
        x.requires_grad_()
    if residual is not None:
        residual = residual.detach().requires_grad_()
    rms = sample.kind.endswith("rms_norm")
    eps = sample.eps if sample.eps is not None else torch.finfo(torch.float64).eps
    return x, residual, param(t.get("weight")), param(t.get("bias")), eps, rms, ""


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.id for s in SAMPLES])
def test_opcheck(sample):
    """``torch.library.opcheck`` (schema, autograd registration, fake tensors, AOT
    dispatch with dynamic shapes) on both ops, with the sample's kernel arguments."""
    sample = _eps_for_us(sample)
    args = _kernel_arguments(sample)
    torch.library.opcheck(_op.forward_op, args)
    x, residual, weight, bias, eps, rms, backend = args
    with torch.no_grad():
        y, residual_out, mean, rstd = _op.forward_op(*args)
    z = x.detach() if residual is None else residual_out
    dy = torch.randn_like(y)
    dresidual = None if residual is None else torch.randn_like(y)
    w = None if weight is None else weight.detach()
    for need_dweight, need_dbias in ((w is not None, bias is not None), (False, False)):
        backward_args = (dy, z, w, mean, rstd, dresidual, rms, need_dweight, need_dbias)
        torch.library.opcheck(_op.backward_op, (*backward_args, backend, eps))


# ---------------------------------------------------------------------------------------
# Every dtype: values, vjp and jvp against torch's op computed in float64

#: the largest error allowed against float64, relative and absolute, per dtype (a few
#: ulps of the dtype; torch's own low-precision results can be further off: its
#: float16 JVP of a one-element row is NaN, its bfloat16 gradients on 3-wide rows 0.05
#: off)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("sample", SAMPLES, ids=[s.id for s in SAMPLES])
def test_dtypes(sample, dtype, fast):
    """Values, vjp and jvp in ``dtype`` within :data:`TOLERANCE` of torch's op in float64
    on the same (rounded) inputs, in ``dtype`` themselves."""
    sample = _eps_for_us(sample)
    args = tuple(a.detach().to(dtype) for a in sample.args)  # (to() keeps strides)
    wide = tuple(a.double() for a in args)
    ours, theirs = sample.function(ours=True), sample.function(ours=False)
    tol = {"rtol": TOLERANCE[dtype], "atol": TOLERANCE[dtype]}

    def same(got, expected) -> None:
        assert all(t.dtype == dtype for t in tree_leaves(got))
        _same(tree_map(lambda t: t.double(), got), expected, **tol)

    out, back = vjp(ours, *args)
    expected, expected_back = vjp(theirs, *wide)
    cotangents = tree_map(lambda t: torch.randn_like(t, dtype=torch.float64), expected)
    tangents = tuple(torch.randn_like(a) for a in wide)
    same(out, expected)
    same(back(tree_map(lambda t: t.to(dtype), cotangents)), expected_back(cotangents))
    got = jvp(ours, args, tuple(t.to(dtype) for t in tangents))[1]
    same(got, jvp(theirs, wide, tangents)[1])


# ---------------------------------------------------------------------------------------
# ModuleInfo: torch's samples for nn.LayerNorm and nn.RMSNorm, with our modules

OURS = {torch.nn.LayerNorm: layernorm.LayerNorm, torch.nn.RMSNorm: layernorm.RMSNorm}
MODULE_SAMPLES = [
    (info.module_cls, s)
    for info in module_db
    if info.module_cls in OURS
    for s in info.module_inputs_func(
        info, device="cpu", dtype=torch.float64, requires_grad=True, training=True
    )
]


@pytest.mark.parametrize(
    ("cls", "module_input"),
    MODULE_SAMPLES,
    ids=[f"{c.__name__}-{s.desc}" for c, s in MODULE_SAMPLES],
)
def test_modules(cls, module_input, fast):
    """Each ModuleInfo sample: our module built with the same arguments and loaded with
    torch's (randomized) parameters gives torch's outputs and gradients; gradcheck (forward
    AD, batched grad and forward grad) and gradgradcheck (forward over reverse) over the
    input and the parameters; vmap over a batch of inputs."""
    args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
    theirs = cls(*args, **kwargs, dtype=torch.float64)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours = OURS[cls](*args, **kwargs, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    (x,) = module_input.forward_input.args
    _same(ours(x), theirs(x))
    names = [name for name, _ in ours.named_parameters()]
    params = tuple(p.detach().requires_grad_() for p in ours.parameters())

    def call(module):
        def f(x, *params):
            return torch.func.functional_call(module, dict(zip(names, params, strict=True)), (x,))

        return f

    leaves = (x, *params)
    _same(
        torch.autograd.grad(call(ours)(*leaves).sum(), leaves),
        torch.autograd.grad(call(theirs)(*leaves).sum(), leaves),
    )
    # fast_mode (random projections): the op samples run the full Jacobians
    checks = {"check_batched_grad": True, "fast_mode": True}
    assert torch.autograd.gradcheck(
        call(ours), leaves, check_forward_ad=True, check_batched_forward_grad=True, **checks
    )
    assert torch.autograd.gradgradcheck(call(ours), leaves, check_fwd_over_rev=True, **checks)
    batch = torch.stack([x.detach(), 2 * x.detach()])
    _same(vmap(ours)(batch), vmap(theirs)(batch))


def test_vmap_over_autograd_grad(sample, fast):
    """Batched cotangents through a graph built outside vmap (``vmap`` over
    ``autograd.grad``): the backward op's vmap rule, for the input alone (the batch as
    more rows) and for every argument (per-sample parameter gradients)."""
    ours, theirs = sample.function(ours=True), sample.function(ours=False)
    leaves = sample.args
    out_ours, out_theirs = ours(*leaves), theirs(*leaves)
    if isinstance(out_ours, tuple):
        out_ours, out_theirs = out_ours[0], out_theirs[0]
    cotangents = torch.randn(3, *out_theirs.shape, dtype=out_theirs.dtype)
    for wrt in (leaves[:1], leaves):

        def grads(out, wrt=wrt):
            return vmap(lambda v: torch.autograd.grad(out, wrt, v, retain_graph=True))(cotangents)

        _same(grads(out_ours), grads(out_theirs))
