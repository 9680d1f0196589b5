"""Layer normalization of one vector, step by step: every quantity of docs/contract.md §1.

Used by ``layernorm explain``. Numbers may be given as fractions (``1/3``) so the seeds'
worked examples can be redone exactly; the arithmetic is float64 through
:mod:`layernorm.reference`.

Example::

    >>> e = explain([1, 2, 3], eps=1 / 3)
    >>> e["output"]
    [-1.0, 0.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from . import reference

__all__ = ["explain", "format_explanation", "parse_number"]


def parse_number(text: str) -> float:
    """A float from ``"0.5"``, ``"1/3"`` or ``"-2e-3"``; raises ValueError otherwise."""
    try:
        return float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError) as error:
        raise ValueError(f"not a number: {text!r} (use decimals or fractions like 1/3)") from error


def _clean(a: np.ndarray) -> list[float]:
    """Rounds away float64 noise below 1e-12 so exact answers print exactly."""
    return [float(v) for v in np.where(np.abs(a - np.round(a, 12)) < 1e-15, np.round(a, 12), a)]


def explain(
    z: Sequence[float],
    eps: float = 1e-5,
    gamma: Sequence[float] | None = None,
    beta: Sequence[float] | None = None,
) -> dict[str, object]:
    """Every intermediate of ``y = gamma ⊙ (z − mean)/sqrt(q + eps) + beta`` for one vector ``z``.

    Args:
        z: the input vector, ``d >= 1`` numbers.
        eps: the stabilizer, ``>= 0``. Default: ``1e-5``.
        gamma: gain, ``d`` numbers. Default: ``None`` (ones).
        beta: bias, ``d`` numbers. Default: ``None`` (zeros).

    Returns:
        a dict with ``d, mean, centered, variance, rstd, core, output``, the core
        Jacobian's closed-form ``eigenvalues`` and numerically computed ``spectrum``, the
        ``lipschitz_bound`` of the core and of the output, and the ``core_variance``.
    """
    row = np.asarray(z, dtype=np.float64)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"explain needs one non-empty vector, got shape {list(row.shape)}")
    d = row.size
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is not None and len(p) != d:
            raise ValueError(f"{name} must have {d} numbers like the input, got {len(p)}")
    if eps < 0:
        raise ValueError(f"eps must be non-negative, got eps={eps}")
    y, mean, rstd = reference.layer_norm(row, d, gamma, beta, eps)
    core, _, _ = reference.layer_norm(row, d, None, None, eps)
    v = row - row.mean()
    q = float(v @ v) / d
    spectrum = np.sort(np.linalg.eigvals(reference.jacobian(row, eps)).real)
    return {
        "d": d,
        "eps": eps,
        "mean": float(mean),
        "centered": _clean(v),
        "variance": q,
        "rstd": float(rstd),
        "core": _clean(core),
        "output": _clean(y),
        "output_mean": float(np.mean(y)),
        "eigenvalues": reference.jacobian_eigenvalues(row, eps),
        "spectrum": _clean(spectrum),
        "lipschitz_bound": reference.lipschitz_bound(eps),
        "lipschitz_bound_output": reference.lipschitz_bound(eps, gamma),
        "core_variance": reference.core_variance(row, eps),
    }


def _fmt(v: object) -> str:
    if v is None:
        return "none (no such direction)"
    if isinstance(v, list):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    if isinstance(v, float):
        return f"{v:.10g}"
    return str(v)


def format_explanation(e: dict[str, object]) -> str:
    """The dict from :func:`explain` as the lines ``layernorm explain`` prints."""
    eig = e["eigenvalues"]
    assert isinstance(eig, dict)
    lines = [
        f"d = {e['d']}, eps = {_fmt(e['eps'])}",
        f"mean              mu = (1/d) sum z_i          = {_fmt(e['mean'])}",
        f"centered          v  = z - mu                  = {_fmt(e['centered'])}",
        f"variance          q  = (1/d) |v|^2             = {_fmt(e['variance'])}",
        f"rstd                 = (q + eps)^(-1/2)        = {_fmt(e['rstd'])}",
        f"core              u  = v * rstd                = {_fmt(e['core'])}",
        f"output            y  = gamma * u + beta        = {_fmt(e['output'])}",
        f"mean of output                                 = {_fmt(e['output_mean'])}",
        "Jacobian of the core, D u = rstd * (P - v v^T / (d (q + eps))):",
        f"  eigenvalue on 1 (common offset)              = {_fmt(eig['ones'])}",
        f"  eigenvalue on v, eps/(q+eps)^(3/2)           = {_fmt(eig['radial'])}",
        f"  eigenvalue on the rest, (q+eps)^(-1/2)       = {_fmt(eig['orthogonal'])}",
        f"  all eigenvalues, computed numerically        = {_fmt(e['spectrum'])}",
        f"Lipschitz bound of the core, eps^(-1/2)        = {_fmt(e['lipschitz_bound'])}",
        f"Lipschitz bound of the output, * max|gamma|    = {_fmt(e['lipschitz_bound_output'])}",
        f"variance of the core, q/(q+eps)                = {_fmt(e['core_variance'])}",
    ]
    return "\n".join(lines)
