"""The claims ``layernorm check`` verifies: the seeds' math on the reference, and the
contract (docs/contract.md §3 numerics, §5 backend protocol) on every backend that can
run here.

Each check returns ``(passed, measured)``: a bool and a short text with the number it
measured, so a failure says by how much. The per-backend checks are the library's one
contract suite: ``layernorm check`` runs them, and tests/test_contract.py runs them on
every registered backend, so a new backend gets all of them by being registered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import backends, reference
from .backends.torch_ import accumulation_dtype
from .ops import add_layer_norm, add_rms_norm, layer_norm, rms_norm

__all__ = ["CHECKS", "Check", "Result", "backends_to_check", "dtypes", "run_checks"]

Outcome = tuple[bool, str]


@dataclass(frozen=True)
class Check:
    name: str
    claim: str
    run: Callable[[str | None], Outcome]  # gets a backend name, or None for math checks
    per_backend: bool


@dataclass(frozen=True)
class Result:
    check: str
    backend: str
    passed: bool
    measured: str


def _close(a, b, tol: float = 1e-12) -> tuple[bool, float]:
    err = float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
    return err <= tol, err


# ----------------------------------------------------------------------------------------
# The seeds' worked examples and math facts (reference, float64)


def _worked_examples(_backend: str | None) -> Outcome:
    third = 1 / 3
    cases = [
        (reference.layer_norm([1, 2, 3], 3, eps=third)[0], [-1, 0, 1]),
        (reference.layer_norm([11, 12, 13], 3, eps=third)[0], [-1, 0, 1]),
        (reference.layer_norm([2, 4, 6], 3, eps=third)[0], [-2 / 3**0.5, 0, 2 / 3**0.5]),
        (reference.layer_norm([1, 2, 3], 3, eps=4 / 3)[0], [-(0.5**0.5), 0, 0.5**0.5]),
        (reference.layer_norm([3, 3, 3], 3, [5, -2, 7], [1, -1, 2], eps=0.1)[0], [1, -1, 2]),
        (reference.layer_norm([2, 4, 4, 6], 4, eps=1e-5)[0], [-1.4142100, 0, 0, 1.4142100]),
        (reference.layer_norm([16, 22, 22, 28], 4, eps=1e-5)[0], [-1.4142132, 0, 0, 1.4142132]),
    ]
    errs = [_close(got, want, 1e-7)[1] for got, want in cases]
    return max(errs) <= 1e-7, f"max error {max(errs):.1e} over {len(cases)} examples"


def _bias_gradient(_backend: str | None) -> Outcome:
    beta = np.array([1.0, -1.0, 2.0])
    y, _, _ = reference.layer_norm([3, 3, 3], 3, None, beta, eps=0.5)
    _, _, dbias = reference.layer_norm_backward(y, [3, 3, 3], 3, None, eps=0.5)  # l = |y|²/2
    ok, _err = _close(dbias, beta)
    return ok and abs(
        y.mean() - 2 / 3
    ) < 1e-15, f"dbeta = {dbias.tolist()}, mean(y) = {y.mean():.6f}"


def _random_rows(count: int = 20, d: int = 6) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(0)
    for _ in range(count):
        yield rng.normal(size=d) * rng.uniform(0.01, 3)


def _eigenvalues(_backend: str | None) -> Outcome:
    worst = 0.0
    for z in _random_rows():
        for eps in (1e-3, 0.1, 1.0):
            e = reference.jacobian_eigenvalues(z, eps)
            radial, orthogonal = e["radial"], e["orthogonal"]
            assert radial is not None and orthogonal is not None  # random rows, d = 6
            want = sorted([0.0, radial] + [orthogonal] * (z.size - 2))
            got = np.sort(np.linalg.eigvals(reference.jacobian(z, eps)).real)
            worst = max(worst, _close(got, want)[1] / max(1.0, orthogonal))
    constant = reference.jacobian(np.full(4, 2.0), 0.25)
    p = np.eye(4) - 0.25
    ok_const, _ = _close(constant, p / 0.5)
    return (
        worst < 1e-10 and ok_const,
        f"max relative eigenvalue error {worst:.1e}; P/sqrt(eps) at constants",
    )


def _lipschitz(_backend: str | None) -> Outcome:
    ratio = 0.0
    for z in _random_rows():
        for eps in (1e-3, 0.1, 1.0):
            norm = float(np.linalg.norm(reference.jacobian(z, eps), 2))
            ratio = max(ratio, norm / reference.lipschitz_bound(eps))
    at_constant = float(np.linalg.norm(reference.jacobian(np.zeros(5), 0.01), 2))
    attained = abs(at_constant - reference.lipschitz_bound(0.01)) < 1e-9
    return (
        ratio <= 1 + 1e-12 and attained,
        f"max ‖Du‖₂/eps^-1/2 = {ratio:.6f}; attained at constants",
    )


def _core_variance(_backend: str | None) -> Outcome:
    z = np.array([1.0, 2.0, 3.0])  # q = 2/3
    half = reference.core_variance(z, 2 / 3)
    big, small = reference.core_variance(z, 1e-9), reference.core_variance(z, 1e9)
    core, _, _ = reference.layer_norm(z, 3, eps=0.5)
    ok = abs(half - 0.5) < 1e-15 and big > 0.999999 and small < 1e-9
    ok &= abs(core.var() - (2 / 3) / (2 / 3 + 0.5)) < 1e-15 and abs(core.mean()) < 1e-15
    return ok, f"q=eps: {half:.6f}; q/eps=1e9: {big:.9f}; q/eps=1e-9: {small:.1e}"


def _shift_and_scale(_backend: str | None) -> Outcome:
    z = np.array([0.3, -1.2, 2.5, 0.1])
    u = reference.layer_norm(z, 4, eps=0.1)[0]
    shift = _close(reference.layer_norm(z + 1000, 4, eps=0.1)[0], u, 1e-12)[1]
    scaled = reference.layer_norm(3 * z, 4, eps=0.1)[0]
    scale_gap = float(np.max(np.abs(scaled - u)))
    exact0 = _close(reference.layer_norm(3 * z, 4, eps=0)[0], reference.layer_norm(z, 4, eps=0)[0])
    return (
        shift < 1e-12 and scale_gap > 1e-3 and exact0[0],
        f"shift error {shift:.1e}; scale changes u by {scale_gap:.3f} (eps>0), {exact0[1]:.0e} (eps=0)",
    )


def _h_eps(_backend: str | None) -> Outcome:
    t = np.linspace(-50, 50, 101)
    worst = 0.0
    for eps in (0.01, 1.0):
        z = np.stack([-t, np.zeros_like(t), t], axis=1)
        third = reference.layer_norm(z, 3, eps=eps)[0][:, 2]
        worst = max(worst, _close(third, reference.h_eps(t, eps))[1])
        h = 1e-6
        numeric = (reference.h_eps(t + h, eps) - reference.h_eps(t - h, eps)) / (2 * h)
        worst = max(worst, _close(numeric, reference.h_eps_derivative(t, eps), 1e-6)[1] * 1e-6)
    limit = float(reference.h_eps(1e8, 1.0))
    ok = worst < 1e-10 and abs(limit - math.sqrt(1.5)) < 1e-9
    return (
        ok,
        f"max error {worst:.1e}; h(1e8) = {float(limit):.9f} vs sqrt(3/2) = {math.sqrt(1.5):.9f}",
    )


# ----------------------------------------------------------------------------------------
# The contract on a backend (docs/contract.md §3 numerics, §5 backend protocol)
#
# Each check takes a registered backend's name and runs it through the public functions
# (or, for the protocol, its kernel entries) on the device it runs on here. A new
# backend gets all of them by being registered: tests/test_contract.py runs them over
# layernorm.available_backends().

#: the shapes of the forward checks: one element, two, odd widths, several chunks of a
#: SIMD or warp width, a 3-D input, a 2-D normalized shape, a width past 4096
_FORWARD_SHAPES = [
    ((1, 1), (1,)),
    ((3, 2), (2,)),
    ((3, 7), (7,)),
    ((5, 1031), (1031,)),
    ((2, 3, 97), (97,)),
    ((4, 6, 10), (6, 10)),
    ((2, 4099), (4099,)),
]
#: |ours - reference| <= 2 |torch - reference| + ATOL (flash-attention's rule), per dtype;
#: torch is torch.nn.functional in float32 (in float64 for float64 input)
_ATOL = {
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
    torch.float32: 2e-6,
    torch.float64: 1e-12,
}
#: dx against the float64 reference, relative to max |dx| (one rounding to the dtype)
_GRAD_TOL = {
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
    torch.float32: 1e-5,
    torch.float64: 1e-12,
}
_DTYPE_ORDER = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _device(name: str) -> torch.device:
    return (
        torch.device("cuda")
        if name == "triton" and torch.cuda.is_available()
        else torch.device("cpu")
    )


def _emulated(name: str) -> bool:
    """Whether ``name`` runs in an emulator here (Triton's interpreter on CPU tensors, one
    NumPy program per row): the checks then keep to a few rows and widths under 2**15."""
    return name == "triton" and _device(name).type == "cpu"


def _rows(name: str, m: int) -> int:
    return min(m, 3) if _emulated(name) else m


def _wide(name: str) -> int:
    """A width past every backend's single-block row, so the chunked paths run: past
    2**16 columns, or (emulated, where each chunk costs) past Triton's 16384."""
    return 20000 if _emulated(name) else 70001


def dtypes(name: str) -> list[torch.dtype]:
    """The floating dtypes backend ``name`` runs on its device here."""
    kernels, dev = backends.get(name), _device(name)
    return [
        d
        for d in _DTYPE_ORDER
        if kernels.cannot_run(torch.empty(1, 8, dtype=d, device=dev)) is None
    ]


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


def _f64_or_none(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else _f64(t)


def _err(a: torch.Tensor, want: np.ndarray) -> np.ndarray:
    return np.abs(a.detach().cpu().double().numpy() - want)


def _relative(a: torch.Tensor, want: np.ndarray) -> float:
    """max |a - want| relative to max(1, max |want|)."""
    return float(_err(a, want).max()) / max(1.0, float(np.abs(want).max()))


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, offset: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) + offset).to(dtype)


def _forward_agreement(name: str | None) -> Outcome:
    """layer_norm (no affine, gamma, gamma and beta) and rms_norm against the float64
    reference, within twice torch's own error plus a slack per dtype."""
    assert name is not None
    dev, worst = _device(name), {}
    for dtype in dtypes(name):
        ratio = 0.0
        for i, (shape, normalized) in enumerate(_FORWARD_SHAPES):
            x = (_randn(*shape, seed=i) * 3 + 1).to(dtype)
            w = (_randn(*normalized, seed=100 + i).abs() + 0.5).to(dtype)
            b = _randn(*normalized, seed=200 + i).to(dtype)
            calc = x if dtype == torch.float64 else x.float()
            for weight, bias in ((None, None), (w, None), (w, b)):
                ours = layer_norm(
                    x.to(dev),
                    normalized,
                    None if weight is None else weight.to(dev),
                    None if bias is None else bias.to(dev),
                    backend=name,
                )
                if ours.dtype != dtype or ours.shape != x.shape:
                    return False, f"{_short(dtype)} {shape}: got {ours.dtype} {list(ours.shape)}"
                theirs = F.layer_norm(
                    calc,
                    normalized,
                    None if weight is None else weight.to(calc.dtype),
                    None if bias is None else bias.to(calc.dtype),
                ).to(dtype)
                want = reference.layer_norm(
                    _f64(x), normalized, _f64_or_none(weight), _f64_or_none(bias)
                )[0]
                slack = _err(ours, want) - 2 * _err(theirs, want)
                ratio = max(ratio, float(slack.max()) / _ATOL[dtype])
            ours = rms_norm(x.to(dev), normalized, w.to(dev), eps=1e-6, backend=name)
            theirs = F.rms_norm(calc, normalized, w.to(calc.dtype), eps=1e-6).to(dtype)
            want = reference.rms_norm(_f64(x), normalized, _f64(w), eps=1e-6)[0]
            slack = _err(ours, want) - 2 * _err(theirs, want)
            ratio = max(ratio, float(slack.max()) / _ATOL[dtype])
        worst[_short(dtype)] = ratio
        if ratio > 1:
            return False, f"{_short(dtype)}: error {ratio:.2f}x the allowance over 2x torch's"
    return True, "excess over 2x torch's error, in allowances: " + ", ".join(
        f"{k} {max(v, 0.0):.2f}" for k, v in worst.items()
    )


def _backward_agreement(name: str | None) -> Outcome:
    """dx, dgamma, dbeta of layer_norm and rms_norm (with and without gamma) against the
    closed-form backward on the float64 reference, and the expanded dy of ``y.sum()``."""
    assert name is not None
    dev, worst = _device(name), {}
    m, n = _rows(name, 37), 301  # several partial-sum blocks, a ragged last one
    for dtype in dtypes(name):
        tol = _GRAD_TOL[dtype]
        # column sums over m rows (error grows like sqrt(m)), rounded once to the dtype
        col = np.sqrt(m) * 10 * (1e-13 if dtype == torch.float64 else 1e-6)
        if dtype in (torch.float16, torch.bfloat16):
            col += torch.finfo(dtype).eps
        ratios = [0.0]  # errors as fractions of what is allowed
        for rms in (False, True):
            for affine in (False, True):
                x = (_randn(m, n, seed=1, dtype=dtype) + 1).to(dev).requires_grad_()
                w = _randn(n, seed=2, dtype=dtype).to(dev).requires_grad_() if affine else None
                b = _randn(n, seed=3, dtype=dtype).to(dev).requires_grad_() if affine else None
                dy = _randn(m, n, seed=4, dtype=dtype).to(dev)
                if rms:
                    rms_norm(x, n, w, eps=1e-5, backend=name).backward(dy)
                    dx, dw = reference.rms_norm_backward(
                        _f64(dy), _f64(x), n, _f64_or_none(w), eps=1e-5
                    )
                    db = None
                else:
                    layer_norm(x, n, w, b, backend=name).backward(dy)
                    dx, dw, db = reference.layer_norm_backward(
                        _f64(dy), _f64(x), n, _f64_or_none(w)
                    )
                if _grad(x).dtype != dtype:
                    return False, f"{_short(dtype)}: dx came back as {_grad(x).dtype}"
                ratios.append(_relative(_grad(x), dx) / tol)
                for p, want in ((w, dw), (None if rms else b, db)):
                    if p is not None and want is not None:
                        ratios.append(_relative(_grad(p), want) / col)
        x = _randn(m, n, seed=5, dtype=dtype).to(dev).requires_grad_()
        layer_norm(x, n, backend=name).sum().backward()  # dy of strides (0, 0)
        dx = reference.layer_norm_backward(np.ones((m, n)), _f64(x), n)[0]
        ratios.append(_relative(_grad(x), dx) / tol)
        worst[_short(dtype)] = max(ratios)
        if max(ratios) > 1:
            return False, f"{_short(dtype)}: gradient error {max(ratios):.2f}x the allowance"
    return True, "gradient error in allowances: " + ", ".join(
        f"{k} {v:.2f}" for k, v in worst.items()
    )


def _residual(name: str | None) -> Outcome:
    """add_layer_norm / add_rms_norm: ``residual_out`` is ``x + residual`` rounded once,
    ``y`` is the norm of that rounded sum bit for bit, and the gradient reaching ``x``
    and ``residual`` is the same ``dz + dresidual_out``."""
    assert name is not None
    dev = _device(name)
    m, n = _rows(name, 6), 257
    for dtype in dtypes(name):
        acc = accumulation_dtype(dtype)
        for rms in (False, True):
            x = _randn(m, n, seed=1, dtype=dtype).to(dev).requires_grad_()
            r = _randn(m, n, seed=2, dtype=dtype).to(dev).requires_grad_()
            w = (_randn(n, seed=3, dtype=dtype).abs() + 0.5).to(dev)
            b = _randn(n, seed=4, dtype=dtype).to(dev)
            if rms:
                y, h = add_rms_norm(x, r, n, w, eps=1e-5, backend=name)
                alone = rms_norm(h.detach(), n, w, eps=1e-5, backend=name)
            else:
                y, h = add_layer_norm(x, r, n, w, b, backend=name)
                alone = layer_norm(h.detach(), n, w, b, backend=name)
            what = f"{_short(dtype)} {'add_rms_norm' if rms else 'add_layer_norm'}"
            if not torch.equal(h, (x.detach().to(acc) + r.detach().to(acc)).to(dtype)):
                return False, f"{what}: residual_out is not x + residual rounded once"
            if not torch.equal(y, alone):
                return False, f"{what}: y differs from the norm of residual_out"
            dy, dh = _randn(m, n, seed=5, dtype=dtype).to(dev), _randn(m, n, seed=6, dtype=dtype)
            torch.autograd.backward([y, h], [dy, dh.to(dev)])
            if rms:
                dz = reference.rms_norm_backward(_f64(dy), _f64(h), n, _f64(w), eps=1e-5)[0]
            else:
                dz = reference.layer_norm_backward(_f64(dy), _f64(h), n, _f64(w))[0]
            want = dz + _f64(dh)
            err = _relative(_grad(x), want)
            if err > _GRAD_TOL[dtype] or not torch.equal(_grad(x), _grad(r)):
                return False, f"{what}: d(input) error {err:.1e}, or d(residual) differs"
    return True, "residual_out rounded once, y of it bitwise, one gradient for both inputs"


def _offset(name: str | None) -> Outcome:
    """The error of the core and of the gradients does not grow with the rows' offset."""
    assert name is not None
    dev, worst, worst_grad = _device(name), 0.0, 0.0
    m = _rows(name, 16)
    cases = [(m, 1000, c) for c in (0.0, 1e2, 1e4, 1e6)] + [(2, _wide(name), 1e6)]
    for rows, n, c in cases:
        x = _randn(rows, n, seed=int(c) % 97, offset=c)
        y = layer_norm(x.to(dev), n, backend=name)
        worst = max(worst, float(_err(y, reference.layer_norm(_f64(x), n)[0]).max()))
        xg = x.to(dev).requires_grad_()
        w = _randn(n, seed=7).to(dev).requires_grad_()
        dy = _randn(rows, n, seed=8).to(dev)
        layer_norm(xg, n, w, backend=name).backward(dy)
        dx, dw, _ = reference.layer_norm_backward(_f64(dy), _f64(x), n, _f64(w))
        for got, want in ((_grad(xg), dx), (_grad(w), dw)):
            worst_grad = max(worst_grad, float(_err(got, want).max() / np.abs(want).max()))
    return (
        worst < 4e-6 and worst_grad < 2e-5,
        f"max core error {worst:.1e} (limit 4e-6), gradients {worst_grad:.1e} relative "
        f"(limit 2e-5), float32 rows N(c, 1), c up to 1e6, N = 1000 and {_wide(name)}",
    )


def _constant_rows(name: str | None) -> Outcome:
    """A constant row gives exactly beta, in every dtype, alone and after a zero residual."""
    assert name is not None
    dev = _device(name)
    for dtype in dtypes(name):
        for value in (0.1, -7.3, 1e4, 1e6):
            value = min(value, float(torch.finfo(dtype).max))
            for n in (1, 3, 1000, 4097) + ((_wide(name),) if value == 1e4 else ()):
                x = torch.full((2, n), value, dtype=dtype, device=dev)
                w = _randn(n, seed=n, dtype=dtype).to(dev)
                b = _randn(n, seed=n + 1, dtype=dtype).to(dev)
                y = layer_norm(x, n, w, b, backend=name)
                y2, h = add_layer_norm(x, torch.zeros_like(x), n, w, b, backend=name)
                if not (torch.equal(y, b.expand(2, n)) and torch.equal(y2, y)):
                    return False, f"{_short(dtype)} row of {value} (N={n}) is not exactly beta"
                if not torch.equal(h, x):
                    return False, f"{_short(dtype)}: x + 0 is not x (N={n})"
    return True, "exactly beta in " + ", ".join(_short(d) for d in dtypes(name))


def _zero_eps(name: str | None) -> Outcome:
    """eps = 0 is allowed: a constant row is then 0/0 (NaN), any other row is exact."""
    assert name is not None
    dev = _device(name)
    y = layer_norm(torch.full((1, 8), 2.0, device=dev), 8, eps=0.0, backend=name)
    if not torch.isnan(y).all():
        return False, f"a constant row with eps=0 gave {y.tolist()}, not NaN"
    for dtype in dtypes(name):
        y = layer_norm(
            torch.tensor([[1.0, 3.0]], dtype=dtype, device=dev), 2, eps=0.0, backend=name
        )
        if y.tolist() != [[-1.0, 1.0]]:
            return False, f"{_short(dtype)} (1, 3) with eps=0 gave {y.tolist()}, not (-1, 1)"
    return True, "constant row NaN, (1, 3) exactly (-1, 1)"


def _nan_isolation(name: str | None) -> Outcome:
    """NaN, Inf and -Inf stay in their row: every other row is the bits of a clean call."""
    assert name is not None
    dev = _device(name)
    rows = _rows(name, 5)
    keep = [i for i in range(rows) if i != 1]
    x = _randn(rows, 300, seed=1).to(dev)
    w, b = _randn(300, seed=2).to(dev), _randn(300, seed=3).to(dev)
    for poison in (math.nan, math.inf, -math.inf):
        bad = x.clone()
        bad[1, 150] = poison
        for op, f in (
            ("layer_norm", lambda t: layer_norm(t, 300, w, b, backend=name)),
            ("rms_norm", lambda t: rms_norm(t, 300, w, backend=name)),
        ):
            y, clean = f(bad), f(x[keep])
            if torch.isfinite(y[1]).all() or not torch.equal(y[keep], clean):
                return False, f"{op}: a {poison} in row 1 reached another row, or vanished"
    n = _wide(name)
    x = _randn(2, n, seed=4).to(dev)
    bad = x.clone()
    bad[1, n // 2] = math.nan
    y = layer_norm(bad, n, backend=name)
    if torch.isfinite(y[1]).all() or not torch.equal(y[:1], layer_norm(x[:1], n, backend=name)):
        return False, f"layer_norm: a nan in row 1 of N={n} reached row 0, or vanished"
    return True, f"NaN, Inf, -Inf stay in their row (layer_norm, rms_norm; N = 300, {n})"


def _batch_invariance(name: str | None) -> Outcome:
    """A row's output and gradient are the same bits alone and in any batch."""
    assert name is not None
    dev = _device(name)
    m = _rows(name, 9)
    widths = (1, 5, 768, 4097, _wide(name))
    for n in widths:
        x, dy = _randn(m, n, seed=n).to(dev), _randn(m, n, seed=n + 1).to(dev)
        w = _randn(n, seed=n + 2).to(dev)
        ops = (  # (the op, whether to compare dx too)
            (lambda t, n=n, w=w: layer_norm(t, n, w, backend=name), True),
            (lambda t, n=n, w=w: rms_norm(t, n, w, backend=name), True),
            (lambda t, n=n: add_layer_norm(t, t.flip(-1), n, backend=name)[0], False),
        )
        for op, backward in ops:
            xs = x.clone().requires_grad_(backward)
            whole = op(xs)
            if backward:
                whole.backward(dy)
            for i in sorted({0, m // 2, m - 1}):
                xi = x[i : i + 1].clone().requires_grad_(backward)
                alone = op(xi)
                same = torch.equal(alone[0], whole[i])
                if backward:
                    alone.backward(dy[i : i + 1].clone())
                    same = same and torch.equal(_grad(xi)[0], _grad(xs)[i])
                if not same:
                    return False, f"row {i} of N={n} differs alone vs in a batch of {m}"
    return True, f"bitwise identical alone and in a batch (N={', '.join(map(str, widths))})"


def _determinism(name: str | None) -> Outcome:
    """Outputs and gradients are the same bits run to run (no atomics in the reductions)."""
    assert name is not None
    dev = _device(name)
    m = _rows(name, 2100)  # several row blocks of the parameter gradients' partial sums
    x = _randn(m, 96, seed=1).to(dev).requires_grad_()
    w = _randn(96, seed=2).to(dev).requires_grad_()
    b = _randn(96, seed=3).to(dev).requires_grad_()
    dy = _randn(m, 96, seed=4).to(dev)
    runs = []
    for _ in range(2):
        x.grad = w.grad = b.grad = None
        y = layer_norm(x, 96, w, b, backend=name)
        y.backward(dy)
        runs.append((y.detach(), _grad(x).clone(), _grad(w).clone(), _grad(b).clone()))
    same = all(torch.equal(a, c) for a, c in zip(*runs, strict=True))
    return same, f"y, dx, dweight, dbias bitwise equal in 2 runs ({m} rows)"


def _kernel_protocol(name: str | None) -> Outcome:
    """The kernel entries keep docs/contract.md §5: output dtypes and layouts, statistics
    in the accumulation dtype (``mean`` None for RMSNorm), None for what is not asked
    for, and a contiguous ``(*, N)`` tensor taken as its ``(M, N)`` rows, bit for bit."""
    assert name is not None
    kernels, dev = backends.get(name), _device(name)
    for dtype in dtypes(name):
        acc, what = accumulation_dtype(dtype), _short(dtype)
        x = _randn(10, 33, seed=1, dtype=dtype).to(dev)
        y, residual_out, mean, rstd = kernels.forward(x, None, None, None, 1e-5, False)
        if residual_out is not None or mean is None or mean.dtype != acc or rstd.dtype != acc:
            return False, f"{what} forward: residual_out, mean or rstd break the contract"
        if y.dtype != dtype or y.shape != x.shape or not y.is_contiguous():
            return (
                False,
                f"{what} forward: y is {y.dtype} {list(y.shape)}, contiguous {y.is_contiguous()}",
            )
        _, want_mean, want_rstd = reference.layer_norm(_f64(x), 33)
        if _err(mean, want_mean).max() > 1e-6 or (_err(rstd, want_rstd) / want_rstd).max() > 1e-6:
            return False, f"{what} forward: mean or rstd differ from the reference"
        _, _, mean_rms, rstd_rms = kernels.forward(x, None, None, None, 1e-5, True)
        if mean_rms is not None or rstd_rms.dtype != acc:
            return False, f"{what} forward (rms): mean must be None, rstd in {acc}"
        dy, w = _randn(10, 33, seed=2, dtype=dtype).to(dev), _randn(33, seed=3, dtype=dtype).to(dev)
        dx, dweight, dbias = kernels.backward(dy, x, w, mean, rstd, None, False, False, False, 1e-5)
        if dweight is not None or dbias is not None or dx.dtype != dtype:
            return False, f"{what} backward: unrequested dweight/dbias, or dx in {dx.dtype}"
        if not torch.equal(
            dx, kernels.backward(dy, x, w, mean, rstd, None, False, True, True, 1e-5)[0]
        ):
            return False, f"{what} backward: dx depends on need_dweight/need_dbias"
    try:
        _any_dim(kernels, dev)
    except AssertionError as error:
        return False, f"a (2, 3, 40) tensor and its (6, 40) rows differ: {error}"
    return True, "dtypes, layouts, None outputs; (*, N) = its (M, N) rows bit for bit"


def _any_dim(kernels, device: torch.device) -> None:
    """A contiguous (*, N) tensor is M rows: its outputs are shaped like it, and its results
    are those of its (M, N) view, bit for bit; ``dy`` may come as (M, N) rows of a tensor
    shaped like ``x`` (as a strided gradient does)."""
    x, r, dy = (_randn(2, 3, 40, seed=s).to(device) for s in (1, 2, 3))
    w, b = _randn(40, seed=4).abs().to(device), _randn(40, seed=5).to(device)
    for rms in (False, True):
        flat = kernels.forward(x.view(6, 40), r.view(6, 40), w, b, 1e-5, rms)
        deep = kernels.forward(x, r, w, b, 1e-5, rms)
        assert deep[0].shape == deep[1].shape == x.shape, "output shapes"
        for a, c in zip(flat, deep, strict=True):
            assert (a is None and c is None) or torch.equal(a.view(c.shape), c), "forward"
        mean, rstd = deep[2], deep[3]
        rows = dy.view(6, 40)
        flat_grads = kernels.backward(rows, flat[1], w, mean, rstd, rows, rms, True, True, 1e-5)
        deep_grads = kernels.backward(rows, deep[1], w, mean, rstd, dy, rms, True, True, 1e-5)
        assert deep_grads[0].shape == x.shape, "dx shape"
        for a, c in zip(flat_grads, deep_grads, strict=True):
            assert torch.equal(a.view(c.shape), c), "backward"


CHECKS: list[Check] = [
    Check(
        "worked examples",
        "seeds' examples: (1,2,3)→(-1,0,1), shift, scale, eps=4/3, constant → beta, H=4 example",
        _worked_examples,
        False,
    ),
    Check(
        "bias gradient", "constant input: y = beta, dbeta = g, mean(y) = 2/3", _bias_gradient, False
    ),
    Check(
        "Jacobian eigenvalues",
        "0 on 1, eps/(q+eps)^1.5 on v, (q+eps)^-0.5 else; P/sqrt(eps) at constants",
        _eigenvalues,
        False,
    ),
    Check("Lipschitz bound", "‖D u‖₂ ≤ eps^-1/2, attained at constant inputs", _lipschitz, False),
    Check(
        "core variance", "mean(u) = 0, var(u) = q/(q+eps): 1/2 at q = eps", _core_variance, False
    ),
    Check(
        "shift vs scale",
        "exact shift invariance; scale invariance only for eps = 0",
        _shift_and_scale,
        False,
    ),
    Check(
        "h_eps",
        "h(t) = t/sqrt(2t²/3+eps), h' = eps/(2t²/3+eps)^1.5, asymptotes ±sqrt(3/2)",
        _h_eps,
        False,
    ),
    Check(
        "forward agreement",
        "layer_norm and rms_norm match the float64 reference within 2x torch's error, every dtype",
        _forward_agreement,
        True,
    ),
    Check(
        "backward agreement",
        "dx, dweight, dbias match the closed-form backward, every dtype",
        _backward_agreement,
        True,
    ),
    Check(
        "residual",
        "add_*: residual_out rounded once, y its norm bitwise, one gradient for both",
        _residual,
        True,
    ),
    Check(
        "offset independence",
        "core error < 4e-6, gradients < 2e-5 on float32 rows N(c, 1), c <= 1e6",
        _offset,
        True,
    ),
    Check("constant rows", "a constant row gives exactly beta, every dtype", _constant_rows, True),
    Check("zero eps", "eps = 0: constant rows NaN, others exact", _zero_eps, True),
    Check("NaN isolation", "NaN/Inf stay in their row", _nan_isolation, True),
    Check(
        "batch invariance",
        "a row's output and gradient are bitwise identical alone or in a batch",
        _batch_invariance,
        True,
    ),
    Check("determinism", "outputs and gradients are bitwise reproducible", _determinism, True),
    Check(
        "kernel protocol",
        "kernel outputs' dtypes, layouts and Nones; (*, N) inputs taken as rows",
        _kernel_protocol,
        True,
    ),
]


def backends_to_check() -> list[str]:
    """The backends that can run here on a device this machine has."""
    names = []
    for name in backends.available_backends():
        probe = torch.empty(1, 8, device=_device(name))
        if backends.get(name).cannot_run(probe) is None:
            names.append(name)
    return names


def run_checks(names: list[str] | None = None, progress: bool = False) -> list[Result]:
    """Runs every check: the math ones once, the numerics ones on each backend in ``names``."""
    from tqdm.auto import tqdm

    names = backends_to_check() if names is None else names
    jobs: list[tuple[Check, str | None]] = [(c, None) for c in CHECKS if not c.per_backend]
    jobs += [(c, n) for n in names for c in CHECKS if c.per_backend]
    results = []
    for check, name in tqdm(jobs, desc="checks", disable=not progress, leave=False):
        try:
            passed, measured = check.run(name)
        except Exception as error:  # a crash is a failure, with its message
            passed, measured = False, f"error: {type(error).__name__}: {error}"
        results.append(Result(check.name, name or "reference", passed, measured))
    return results
