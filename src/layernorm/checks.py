"""The claims ``layernorm check`` verifies: the seeds' math on the reference, and the
numerics contract (SPEC §3) on every backend that can run here.

Each check returns ``(passed, measured)``: a bool and a short text with the number it
measured, so a failure says by how much.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from . import backends, reference
from .ops import add_layer_norm, layer_norm, rms_norm

__all__ = ["CHECKS", "Check", "Result", "backends_to_check", "run_checks"]

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
# The numerics contract on a backend (SPEC §3)


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _device(name: str) -> torch.device:
    return (
        torch.device("cuda")
        if name == "triton" and torch.cuda.is_available()
        else torch.device("cpu")
    )


def _parity(name: str | None) -> Outcome:
    assert name is not None
    dev = _device(name)
    worst = {}
    for dtype, tol in ((torch.float32, 2e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)):
        x = torch.randn(33, 1031, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
        w = torch.rand(1031, generator=torch.Generator().manual_seed(2)) + 0.5
        b = torch.randn(1031, generator=torch.Generator().manual_seed(3))
        xq = x.to(dtype)
        y = layer_norm(xq.to(dev), 1031, w.to(dtype).to(dev), b.to(dtype).to(dev), backend=name)
        want, _, _ = reference.layer_norm(
            xq.double().numpy(), 1031, w.to(dtype).double(), b.to(dtype).double()
        )
        err = float(np.max(np.abs(y.double().cpu().numpy() - want)))
        r = rms_norm(xq.to(dev), 1031, w.to(dtype).to(dev), backend=name)
        want_r, _ = reference.rms_norm(
            xq.double().numpy(), 1031, w.to(dtype).double(), eps=torch.finfo(dtype).eps
        )
        err = max(err, float(np.max(np.abs(r.double().cpu().numpy() - want_r))))
        worst[str(dtype).removeprefix("torch.")] = err
        if err > tol:
            return False, f"{dtype}: max error {err:.1e} > {tol:.0e}"
    return True, "max error " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())


def _gradients(name: str | None) -> Outcome:
    assert name is not None
    dev = _device(name)
    x = torch.randn(17, 257, dtype=torch.float32, device=dev, requires_grad=True)
    w = torch.randn(257, device=dev, requires_grad=True)
    b = torch.randn(257, device=dev, requires_grad=True)
    dy = torch.randn(17, 257, device=dev)
    layer_norm(x, 257, w, b, backend=name).backward(dy)
    dx, dw, db = reference.layer_norm_backward(
        dy.cpu().double(), x.detach().cpu().double(), 257, w.detach().cpu().double()
    )
    errs = [
        float(
            np.max(np.abs(_grad(t).cpu().double().numpy() - r)) / max(1.0, float(np.max(np.abs(r))))
        )
        for t, r in ((x, dx), (w, dw), (b, db))
    ]
    return max(
        errs
    ) < 1e-5, f"max relative error dx {errs[0]:.1e}, dw {errs[1]:.1e}, db {errs[2]:.1e}"


def _offset(name: str | None) -> Outcome:
    assert name is not None
    worst = 0.0
    for c in (0.0, 1e2, 1e4, 1e6):
        x = (torch.randn(16, 1000, dtype=torch.float64) + c).float()
        y = layer_norm(x.to(_device(name)), 1000, backend=name)
        want, _, _ = reference.layer_norm(x.numpy(), 1000)
        worst = max(worst, float(np.max(np.abs(y.double().cpu().numpy() - want))))
    return worst < 4e-6, f"max core error {worst:.1e} for N(c,1) rows, c up to 1e6 (limit 4e-6)"


def _constant_rows(name: str | None) -> Outcome:
    assert name is not None
    dev = _device(name)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        if name == "triton" and dtype == torch.float64:
            continue
        for value in (0.1, -7.3, 1e4):
            for n in (3, 1000, 4099):
                x = torch.full((2, n), value, dtype=dtype, device=dev)
                w, b = torch.randn(n, device=dev).to(dtype), torch.randn(n, device=dev).to(dtype)
                if not torch.equal(layer_norm(x, n, w, b, backend=name), b.expand(2, n)):
                    return False, f"{dtype} row of {value} (N={n}) is not exactly beta"
    return True, "exactly beta in every dtype"


def _nan_isolation(name: str | None) -> Outcome:
    assert name is not None
    x = torch.randn(5, 64, device=_device(name))
    x[1, 3], x[3, 7] = float("nan"), float("inf")
    y = layer_norm(x, 64, backend=name)
    bad_rows = sorted({int(i) for i in torch.nonzero(~torch.isfinite(y))[:, 0]})
    return bad_rows == [1, 3], f"non-finite rows {bad_rows} (expected [1, 3])"


def _batch_invariance(name: str | None) -> Outcome:
    assert name is not None
    dev = _device(name)
    for n in (768, 70001):
        x = torch.randn(9, n, device=dev)
        whole = layer_norm(x, n, backend=name)
        r = rms_norm(x, n, backend=name)
        h = add_layer_norm(x, x.flip(0), n, backend=name)[0]
        for i in (0, 4, 8):
            alone = layer_norm(x[i : i + 1], n, backend=name)
            pair = add_layer_norm(x[i : i + 1], x.flip(0)[i : i + 1], n, backend=name)[0]
            if not (
                torch.equal(alone[0], whole[i])
                and torch.equal(rms_norm(x[i : i + 1], n, backend=name)[0], r[i])
                and torch.equal(pair[0], h[i])
            ):
                return False, f"row {i} of N={n} differs alone vs in a batch"
    return True, "bitwise identical alone and in a batch (N=768, 70001)"


def _determinism(name: str | None) -> Outcome:
    assert name is not None
    dev = _device(name)
    x = torch.randn(3000, 96, device=dev, requires_grad=True)
    w = torch.randn(96, device=dev, requires_grad=True)
    b = torch.randn(96, device=dev, requires_grad=True)
    dy = torch.randn(3000, 96, device=dev)
    grads = []
    for _ in range(3):
        x.grad = w.grad = b.grad = None
        layer_norm(x, 96, w, b, backend=name).backward(dy)
        grads.append((_grad(x).clone(), _grad(w).clone(), _grad(b).clone()))
    same = all(
        torch.equal(g, h) for other in grads[1:] for g, h in zip(grads[0], other, strict=True)
    )
    return same, "dx, dweight, dbias bitwise equal over 3 runs"


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
        "parity",
        "layer_norm and rms_norm match the float64 reference (float32, float16, bfloat16)",
        _parity,
        True,
    ),
    Check("gradients", "dx, dweight, dbias match the closed-form backward", _gradients, True),
    Check(
        "offset independence", "core error < 4e-6 on float32 rows N(c, 1), c ≤ 1e6", _offset, True
    ),
    Check("constant rows", "a constant row gives exactly beta, every dtype", _constant_rows, True),
    Check("NaN isolation", "NaN/Inf stay in their row", _nan_isolation, True),
    Check(
        "batch invariance",
        "a row's output is bitwise identical alone or in a batch",
        _batch_invariance,
        True,
    ),
    Check("determinism", "gradients are bitwise reproducible run to run", _determinism, True),
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
