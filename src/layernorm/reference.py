"""The math of layer normalization and RMSNorm in NumPy: the source of truth.

Every fast backend is tested against these functions. They compute in float64
unless told otherwise (``dtype=``), one function per formula of docs/contract.md §1,
with the same names everywhere: ``mean``, ``rstd``, ``u`` (the normalized core), ``gh``,
``c1 = mean(gh * u)`` and ``c2 = mean(gh)``.

For one row ``z`` of ``d`` elements::

    mean = (1/d) Σ z_i          v = z - mean          q = (1/d) ‖v‖²
    rstd = (q + eps)^(-1/2)     u = v · rstd          y = weight ⊙ u + bias

Example::

    >>> import numpy as np
    >>> from layernorm import reference
    >>> y, mean, rstd = reference.layer_norm(np.array([1.0, 2.0, 3.0]), 3, eps=1 / 3)
    >>> y.round(12).tolist(), float(mean), float(rstd)
    ([-1.0, 0.0, 1.0], 2.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "core_variance",
    "h_eps",
    "h_eps_derivative",
    "jacobian",
    "jacobian_eigenvalues",
    "layer_norm",
    "layer_norm_backward",
    "lipschitz_bound",
    "rms_norm",
    "rms_norm_backward",
]

Shape = int | Sequence[int]


def _shape(normalized_shape: Shape) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) == 0:
        raise ValueError("normalized_shape must have at least one dimension, got ()")
    return shape


def _rows(x: ArrayLike, normalized_shape: Shape, dtype: type) -> tuple[NDArray, int]:
    """Flattens ``x`` to (M, N) rows of the trailing ``normalized_shape`` dims."""
    arr: NDArray = np.asarray(x, dtype=dtype)
    shape = _shape(normalized_shape)
    if arr.shape[arr.ndim - len(shape) :] != shape or arr.ndim < len(shape):
        raise ValueError(
            f"Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {list(arr.shape)}"
        )
    n = int(np.prod(shape))
    return arr.reshape(-1, n), n


def _param(p: ArrayLike | None, n: int, dtype: type) -> NDArray | None:
    return None if p is None else np.asarray(p, dtype=dtype).reshape(n)


def _check_eps(eps: float) -> None:
    if eps < 0:
        raise ValueError(f"eps must be non-negative, got {eps}")


def layer_norm(
    x: ArrayLike,
    normalized_shape: Shape,
    weight: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    eps: float = 1e-5,
    *,
    dtype: type = np.float64,
) -> tuple[NDArray, NDArray, NDArray]:
    r"""Layer normalization of every row of ``x`` over its trailing ``normalized_shape`` dims.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    with the biased variance (divisor ``d``) and ``eps`` inside the square root.

    Args:
        x: input of shape ``(*, *normalized_shape)``.
        normalized_shape: the trailing dims that form one row.
        weight: gain ``gamma`` of shape ``normalized_shape``. Default: ``None`` (ones).
        bias: bias ``beta`` of shape ``normalized_shape``. Default: ``None`` (zeros).
        eps: added to the variance inside the square root. Default: ``1e-5``.
        dtype: the arithmetic's dtype. Default: ``numpy.float64``.

    Returns:
        ``(y, mean, rstd)``: ``y`` shaped like ``x``; ``mean`` and ``rstd`` shaped like
        the leading dims.
    """
    _check_eps(eps)
    z, n = _rows(x, normalized_shape, dtype)
    mean = z.mean(axis=1)
    v = z - mean[:, None]
    q = (v * v).mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):  # eps = 0: a constant row is NaN
        rstd = 1.0 / np.sqrt(q + dtype(eps))
        u = v * rstd[:, None]
    y = _affine(u, _param(weight, n, dtype), _param(bias, n, dtype))
    lead = np.shape(x)[: np.ndim(x) - len(_shape(normalized_shape))]
    return y.reshape(np.shape(x)), mean.reshape(lead), rstd.reshape(lead)


def _affine(u: NDArray, weight: NDArray | None, bias: NDArray | None) -> NDArray:
    y = u if weight is None else u * weight
    return y if bias is None else y + bias


def layer_norm_backward(
    dy: ArrayLike,
    x: ArrayLike,
    normalized_shape: Shape,
    weight: ArrayLike | None = None,
    eps: float = 1e-5,
    *,
    dtype: type = np.float64,
) -> tuple[NDArray, NDArray, NDArray]:
    r"""Closed-form gradients of :func:`layer_norm`.

    Per row, with ``g = dy`` and ``gh = g ⊙ gamma``::

        dbias   = Σ_rows g
        dweight = Σ_rows g ⊙ u
        dx      = rstd · (gh − c2 − u · c1),   c1 = mean(gh ⊙ u),  c2 = mean(gh)

    Args:
        dy: gradient of the loss with respect to ``y``, shaped like ``x``.
        x: the forward's input.
        normalized_shape: as in :func:`layer_norm`.
        weight: the forward's gain. Default: ``None`` (ones).
        eps: as in :func:`layer_norm`. Default: ``1e-5``.
        dtype: the arithmetic's dtype. Default: ``numpy.float64``.

    Returns:
        ``(dx, dweight, dbias)``: ``dx`` shaped like ``x``; the others of ``normalized_shape``.
    """
    _check_eps(eps)
    shape = _shape(normalized_shape)
    z, n = _rows(x, shape, dtype)
    g, _ = _rows(dy, shape, dtype)
    mean = z.mean(axis=1, keepdims=True)
    v = z - mean
    rstd = 1.0 / np.sqrt((v * v).mean(axis=1, keepdims=True) + dtype(eps))
    u = v * rstd
    w = _param(weight, n, dtype)
    gh = g if w is None else g * w
    c1 = (gh * u).mean(axis=1, keepdims=True)
    c2 = gh.mean(axis=1, keepdims=True)
    dx = rstd * (gh - c2 - u * c1)
    return dx.reshape(np.shape(x)), (g * u).sum(axis=0).reshape(shape), g.sum(axis=0).reshape(shape)


def _rms_eps(eps: float | None, dtype: type) -> float:
    return float(np.finfo(dtype).eps) if eps is None else eps


def rms_norm(
    x: ArrayLike,
    normalized_shape: Shape,
    weight: ArrayLike | None = None,
    eps: float | None = None,
    *,
    dtype: type = np.float64,
) -> tuple[NDArray, NDArray]:
    r"""RMSNorm (Zhang & Sennrich 2019): ``y = gamma ⊙ z · rstd``, ``rstd = (mean(z²) + eps)^(-1/2)``.

    Args:
        x: input of shape ``(*, *normalized_shape)``.
        normalized_shape: the trailing dims that form one row.
        weight: gain ``gamma`` of shape ``normalized_shape``. Default: ``None`` (ones).
        eps: added inside the square root. Default: ``None``, the machine epsilon of
            ``dtype`` (as torch uses the input dtype's).
        dtype: the arithmetic's dtype. Default: ``numpy.float64``.

    Returns:
        ``(y, rstd)``.
    """
    eps = _rms_eps(eps, dtype)
    _check_eps(eps)
    z, n = _rows(x, normalized_shape, dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        rstd = 1.0 / np.sqrt((z * z).mean(axis=1) + dtype(eps))
        y = _affine(z * rstd[:, None], _param(weight, n, dtype), None)
    lead = np.shape(x)[: np.ndim(x) - len(_shape(normalized_shape))]
    return y.reshape(np.shape(x)), rstd.reshape(lead)


def rms_norm_backward(
    dy: ArrayLike,
    x: ArrayLike,
    normalized_shape: Shape,
    weight: ArrayLike | None = None,
    eps: float | None = None,
    *,
    dtype: type = np.float64,
) -> tuple[NDArray, NDArray]:
    """Closed-form gradients of :func:`rms_norm`: ``dx = rstd · (gh − u · c1)``, ``u = z · rstd``.

    Returns:
        ``(dx, dweight)``.
    """
    eps = _rms_eps(eps, dtype)
    _check_eps(eps)
    shape = _shape(normalized_shape)
    z, n = _rows(x, shape, dtype)
    g, _ = _rows(dy, shape, dtype)
    rstd = 1.0 / np.sqrt((z * z).mean(axis=1, keepdims=True) + dtype(eps))
    u = z * rstd
    w = _param(weight, n, dtype)
    gh = g if w is None else g * w
    c1 = (gh * u).mean(axis=1, keepdims=True)
    dx = rstd * (gh - u * c1)
    return dx.reshape(np.shape(x)), (g * u).sum(axis=0).reshape(shape)


def _one_row(z: ArrayLike) -> NDArray:
    arr = np.asarray(z, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"expected one non-empty row (a 1-d array), got shape {list(arr.shape)}")
    return arr


def jacobian(z: ArrayLike, eps: float, weight: ArrayLike | None = None) -> NDArray:
    r"""The Jacobian of the core ``u_eps`` at one row ``z`` (of the full output if ``weight``).

    .. math::
        D u_\epsilon(z) = (q + \epsilon)^{-1/2}
            \left(P - \frac{v v^\top}{d\,(q + \epsilon)}\right),
        \qquad P = I - \tfrac{1}{d} \mathbf{1}\mathbf{1}^\top

    The bias contributes nothing; the gain multiplies rows: ``diag(weight) · D u``.

    Args:
        z: one row, shape ``(d,)``.
        eps: the stabilizer, ``>= 0``.
        weight: gain of shape ``(d,)``. Default: ``None`` (the core's Jacobian).

    Returns:
        a ``(d, d)`` float64 matrix, ``J[i, j] = ∂y_i / ∂z_j``.
    """
    _check_eps(eps)
    z = _one_row(z)
    d = z.size
    v = z - z.mean()
    s = (v @ v) / d + eps
    p = np.eye(d) - np.full((d, d), 1.0 / d)
    jac = (p - np.outer(v, v) / (d * s)) / np.sqrt(s)
    return jac if weight is None else np.asarray(weight, dtype=np.float64)[:, None] * jac


def jacobian_eigenvalues(z: ArrayLike, eps: float) -> dict[str, float | None]:
    """The core Jacobian's eigenvalues in closed form.

    ``ones``: 0 on the all-ones vector. ``radial``: ``eps / (q + eps)^(3/2)`` on ``v``
    (``None`` when ``v = 0``). ``orthogonal``: ``(q + eps)^(-1/2)`` on every vector
    orthogonal to both (``None`` when there is none, i.e. ``d - 1 - [v != 0] == 0``).
    """
    _check_eps(eps)
    z = _one_row(z)
    d = z.size
    v = z - z.mean()
    q = float(v @ v) / d
    nonconstant = bool(np.any(v != 0))
    s = q + eps
    return {
        "ones": 0.0,
        "radial": eps / s**1.5 if nonconstant else None,
        "orthogonal": s**-0.5 if d - 1 - int(nonconstant) > 0 else None,
    }


def lipschitz_bound(eps: float, weight: ArrayLike | None = None) -> float:
    """Lipschitz constant of the core, ``eps^(-1/2)``, times ``max|weight|`` for the full output."""
    _check_eps(eps)
    bound = float("inf") if eps == 0 else eps**-0.5
    if weight is None:
        return bound
    return bound * float(np.max(np.abs(np.asarray(weight, dtype=np.float64))))


def core_variance(z: ArrayLike, eps: float) -> float:
    """Variance (divisor d) of the core: ``q / (q + eps)``; 1/2 at ``q = eps``."""
    _check_eps(eps)
    z = _one_row(z)
    v = z - z.mean()
    q = float(v @ v) / z.size
    return q / (q + eps)


def h_eps(t: ArrayLike, eps: float) -> NDArray:
    """Third coordinate of the core on the family ``(-t, 0, t)``: ``t / sqrt(2t²/3 + eps)``."""
    t = np.asarray(t, dtype=np.float64)
    return t / np.sqrt(2 * t * t / 3 + eps)


def h_eps_derivative(t: ArrayLike, eps: float) -> NDArray:
    """``h'_eps(t) = eps / (2t²/3 + eps)^(3/2)``."""
    t = np.asarray(t, dtype=np.float64)
    return eps / (2 * t * t / 3 + eps) ** 1.5
