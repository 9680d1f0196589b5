"""The NumPy reference: the seeds' worked examples (corrected) and docs/contract.md §1 as properties."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from layernorm import reference

THIRD = 1 / 3


# --- the seeds' worked examples ---------------------------------------------------------


def test_seed_example_123_eps_third():
    y, mean, rstd = reference.layer_norm([1, 2, 3], 3, eps=THIRD)
    np.testing.assert_allclose(y, [-1, 0, 1], atol=1e-15)
    assert mean == 2 and rstd == pytest.approx(1.0)


def test_seed_example_shift_by_ten():
    np.testing.assert_allclose(
        reference.layer_norm([11, 12, 13], 3, eps=THIRD)[0], [-1, 0, 1], atol=1e-14
    )


def test_seed_example_scale_by_two_is_not_invariant():
    y, _, _ = reference.layer_norm([2, 4, 6], 3, eps=THIRD)  # variance 8/3
    np.testing.assert_allclose(y, [-2 / math.sqrt(3), 0, 2 / math.sqrt(3)], atol=1e-15)


def test_seed_example_eps_four_thirds():
    y, _, _ = reference.layer_norm([1, 2, 3], 3, eps=4 / 3)
    np.testing.assert_allclose(y, np.array([-1, 0, 1]) / math.sqrt(2), atol=1e-15)


def test_seed_example_constant_input_gives_beta_and_bias_gradient():
    beta = np.array([1.0, -1.0, 2.0])
    for gamma in (None, [5.0, -3.0, 0.5]):
        y, _, _ = reference.layer_norm([3, 3, 3], 3, gamma, beta, eps=0.2)
        np.testing.assert_array_equal(y, beta)
    assert y.mean() == pytest.approx(2 / 3)
    # l = |y|²/2, so dl/dy = y and dbeta = g = (1, -1, 2)
    _, _, dbias = reference.layer_norm_backward(y, [3, 3, 3], 3, [5.0, -3.0, 0.5], eps=0.2)
    np.testing.assert_array_equal(dbias, beta)
    # a parameter reused at several positions sums their contributions
    _, _, dbias2 = reference.layer_norm_backward(np.stack([y, y]), np.full((2, 3), 3.0), 3, eps=0.2)
    np.testing.assert_array_equal(dbias2, 2 * beta)


def test_seed_example_h4_corrected():
    # Seed 004 prints x̂ = [-1.41419, 0, 0, 1.41419] for x = [2, 4, 4, 6], eps = 1e-5; the
    # correct value is 2/sqrt(2.00001) = 1.4142100 (and 1.4142132 for x' = 3x + 10).
    y, mean, _ = reference.layer_norm([2, 4, 4, 6], 4, eps=1e-5)
    assert mean == 4
    np.testing.assert_allclose(y, [-1.4142100268524473, 0, 0, 1.4142100268524473], rtol=1e-14)
    y2, _, _ = reference.layer_norm([16, 22, 22, 28], 4, eps=1e-5)
    np.testing.assert_allclose(y2, [-1.4142131695361582, 0, 0, 1.4142131695361582], rtol=1e-14)
    assert abs(y2 - y).max() < 5e-6  # "matching to 4 decimal places" holds, but not exactly
    g = reference.layer_norm([2, 4, 4, 6], 4, [0.5, 0.5, 2, 2], [1, 1, -1, -1], eps=1e-5)[0]
    np.testing.assert_allclose(g, [0.29289498657377633, 1, -1, 1.8284200537048947], rtol=1e-14)


def test_jacobian_at_constant_input_is_p_over_sqrt_eps():
    p = np.eye(4) - 0.25
    np.testing.assert_allclose(reference.jacobian(np.full(4, 7.0), 0.09), p / 0.3, atol=1e-14)


# --- docs/contract.md §1 facts as properties ----------------------------------------------------------

rows = hnp.arrays(
    np.float64,
    st.integers(2, 12),
    elements=st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False),
)
eps_values = st.floats(1e-6, 10.0)


@given(rows, eps_values, st.floats(-1e4, 1e4))
def test_shift_invariance(z, eps, c):
    u = reference.layer_norm(z, z.size, eps=eps)[0]
    np.testing.assert_allclose(reference.layer_norm(z + c, z.size, eps=eps)[0], u, atol=1e-6)


@given(rows, eps_values, st.floats(0.01, 100.0))
def test_scale_law(z, eps, a):
    v = z - z.mean()
    q = float(v @ v) / z.size
    want = a * v / math.sqrt(a * a * q + eps)
    np.testing.assert_allclose(reference.layer_norm(a * z, z.size, eps=eps)[0], want, atol=1e-9)


@given(rows, eps_values)
def test_core_mean_and_variance(z, eps):
    u = reference.layer_norm(z, z.size, eps=eps)[0]
    assert abs(u.mean()) < 1e-9
    assert u.var() == pytest.approx(reference.core_variance(z, eps), abs=1e-9)


@given(rows, eps_values)
def test_jacobian_matches_finite_differences_and_eigenvalues(z, eps):
    jac = reference.jacobian(z, eps)
    h = 1e-4 * math.sqrt(float(np.var(z)) + eps)  # small against the curvature scale
    cols = [
        (
            reference.layer_norm(z + h * e, z.size, eps=eps)[0]
            - reference.layer_norm(z - h * e, z.size, eps=eps)[0]
        )
        / (2 * h)
        for e in np.eye(z.size)
    ]
    scale = reference.lipschitz_bound(eps)
    np.testing.assert_allclose(np.array(cols).T / scale, jac / scale, atol=1e-5)
    eig = reference.jacobian_eigenvalues(z, eps)
    got = np.sort(np.linalg.eigvals(jac).real)
    nonconstant = eig["radial"] is not None
    want = (
        [0.0]
        + ([eig["radial"]] if nonconstant else [])
        + [eig["orthogonal"]] * (z.size - 1 - nonconstant)
    )
    np.testing.assert_allclose(got / scale, np.sort(want) / scale, atol=1e-9)
    assert np.linalg.norm(jac, 2) <= scale * (1 + 1e-9)


@given(rows, eps_values, hnp.arrays(np.float64, 12, elements=st.floats(-3, 3)))
def test_full_output_jacobian_and_lipschitz(z, eps, gamma):
    gamma = gamma[: z.size]
    jac = reference.jacobian(z, eps, gamma)
    np.testing.assert_allclose(jac, gamma[:, None] * reference.jacobian(z, eps), atol=1e-12)
    assert np.linalg.norm(jac, 2) <= reference.lipschitz_bound(eps, gamma) * (1 + 1e-9) + 1e-12


def test_h_eps_family_and_asymptotes():
    t = np.linspace(-20, 20, 81)
    for eps in (1e-3, 0.5, 3.0):
        z = np.stack([-t, 0 * t, t], axis=1)
        np.testing.assert_allclose(
            reference.layer_norm(z, 3, eps=eps)[0][:, 2], reference.h_eps(t, eps), atol=1e-14
        )
        h = 1e-5
        numeric = (reference.h_eps(t + h, eps) - reference.h_eps(t - h, eps)) / (2 * h)
        np.testing.assert_allclose(numeric, reference.h_eps_derivative(t, eps), atol=1e-7)
    assert reference.h_eps(1e9, 1.0) == pytest.approx(math.sqrt(1.5))
    assert reference.h_eps(-1e9, 1.0) == pytest.approx(-math.sqrt(1.5))


def test_core_variance_landmarks():
    z = np.array([1.0, 2.0, 3.0])
    assert reference.core_variance(z, 2 / 3) == pytest.approx(0.5)
    assert reference.core_variance(z, 1e-12) == pytest.approx(1.0)
    assert reference.core_variance(z, 1e12) < 1e-12


@given(
    hnp.arrays(
        np.float64, st.tuples(st.integers(1, 4), st.integers(2, 9)), elements=st.floats(-10, 10)
    ),
    eps_values,
)
def test_backward_matches_torch_autograd(x, eps):
    n = x.shape[1]
    rng = np.random.default_rng(1)
    w, b, dy = rng.normal(size=n), rng.normal(size=n), rng.normal(size=x.shape)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    torch.nn.functional.layer_norm(xt, (n,), wt, bt, eps).backward(torch.tensor(dy))
    dx, dw, db = reference.layer_norm_backward(dy, x, n, w, eps)
    for got, want in ((dx, xt.grad), (dw, wt.grad), (db, bt.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-7, atol=1e-7)
    xt.grad = wt.grad = None
    torch.nn.functional.rms_norm(xt, (n,), wt, eps).backward(torch.tensor(dy))
    dx, dw = reference.rms_norm_backward(dy, x, n, w, eps)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-7, atol=1e-7)
    np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-7, atol=1e-7)


def test_multi_dim_normalized_shape_and_leading_dims():
    x = np.random.default_rng(0).normal(size=(2, 3, 4, 5))
    y, mean, rstd = reference.layer_norm(x, (4, 5))
    assert y.shape == x.shape and mean.shape == (2, 3) and rstd.shape == (2, 3)
    want = torch.nn.functional.layer_norm(torch.tensor(x), (4, 5)).numpy()
    np.testing.assert_allclose(y, want, atol=1e-12)
    y, rstd = reference.rms_norm(x, (4, 5))
    np.testing.assert_allclose(
        y, torch.nn.functional.rms_norm(torch.tensor(x), (4, 5)).numpy(), atol=1e-12
    )


def test_rms_norm_default_eps_is_machine_epsilon():
    _, rstd = reference.rms_norm(np.zeros(4), 4)
    assert rstd == pytest.approx(np.finfo(np.float64).eps ** -0.5)


def test_eps_zero_constant_row_is_nan():
    y, _, _ = reference.layer_norm([2.0, 2.0], 2, eps=0.0)
    assert np.isnan(y).all()


# --- errors ----------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match="eps must be non-negative"):
        reference.layer_norm([1.0, 2.0], 2, eps=-1)
    with pytest.raises(ValueError, match="eps must be non-negative"):
        reference.lipschitz_bound(-0.5)
    with pytest.raises(ValueError, match=r"normalized_shape must have at least one dimension"):
        reference.layer_norm([1.0, 2.0], ())
    with pytest.raises(
        ValueError, match=r"expected input with shape \[\*, 3\], but got input of size \[2\]"
    ):
        reference.layer_norm([1.0, 2.0], 3)
    with pytest.raises(ValueError, match=r"expected one non-empty row"):
        reference.jacobian(np.zeros((2, 2)), 0.1)
    with pytest.raises(ValueError, match=r"expected one non-empty row"):
        reference.core_variance([], 0.1)
