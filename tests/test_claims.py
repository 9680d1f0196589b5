"""The seeds' qualitative claims that are not a formula of docs/contract.md §1, each checked directly."""

import numpy as np
import torch
import torch.nn.functional as F

import layernorm
from layernorm import reference


def test_rms_norm_drops_shift_invariance_keeps_scale_normalization():
    z = torch.tensor([[0.3, -1.2, 2.5, 0.1]], dtype=torch.float64)
    base = layernorm.rms_norm(z, 4, eps=0.0)
    assert (layernorm.rms_norm(z + 5, 4, eps=0.0) - base).abs().max() > 0.1  # no shift invariance
    torch.testing.assert_close(layernorm.rms_norm(7 * z, 4, eps=0.0), base)  # scale invariance
    assert (layernorm.layer_norm(z + 5, 4) - layernorm.layer_norm(z, 4)).abs().max() < 1e-12


def test_group_norm_with_one_group_has_layer_norm_axes():
    x = torch.randn(3, 4, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(
        F.group_norm(x, 1, eps=1e-5), layernorm.layer_norm(x, (4, 5, 6), eps=1e-5)
    )


def test_layer_norm_is_batch_norm_with_the_axis_transposed():
    """Seed 004: the same computation (and backward) with the reduction axis transposed."""
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 7, dtype=torch.float64)
    y = layernorm.layer_norm(x, 7, eps=1e-3)
    (gx,) = torch.autograd.grad(y, x, dy)
    xt = x.detach().t().clone().requires_grad_()
    yt = F.batch_norm(xt, None, None, training=True, eps=1e-3)
    (gxt,) = torch.autograd.grad(yt, xt, dy.t())
    torch.testing.assert_close(yt.t(), y)
    torch.testing.assert_close(gxt.t(), gx)


def test_shared_gain_and_bias_cannot_undo_normalization_for_every_example():
    """Seed 003 says the layer can learn gamma = sqrt(var + eps), beta = mu and recover its
    input. gamma and beta are shared by all rows while mu and var are per row, so that
    recovers one row's statistics, not every row's: the best shared (gamma, beta) leaves
    a large residual on rows with different scales."""
    x = np.array([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])
    u = reference.layer_norm(x, 3)[0]
    # per coordinate i, fit x[:, i] ≈ gamma_i * u[:, i] + beta_i by least squares
    residual = 0.0
    for i in range(3):
        a = np.stack([u[:, i], np.ones(2)], axis=1)
        coef, *_ = np.linalg.lstsq(a, x[:, i], rcond=None)
        residual += float(np.sum((a @ coef - x[:, i]) ** 2))
    assert residual > 1.0
    # one row alone is recovered exactly, as the seed's per-example argument says
    _, mean, rstd = reference.layer_norm(x[:1], 3)
    np.testing.assert_allclose(u[0] / rstd[0] + mean[0], x[0], atol=1e-12)


def test_no_running_statistics_and_same_result_in_train_and_eval():
    m = layernorm.LayerNorm(6)
    assert list(dict(m.named_buffers())) == []
    x = torch.randn(4, 6)
    y_train = m.train()(x)
    torch.testing.assert_close(m.eval()(x), y_train)


def test_sum_of_squares_identity_loses_precision():
    """Seed 004 suggests a single fused pass with the sum-of-squares identity; in float32
    that E[x²] - E[x]² formula loses all precision at large offsets (and can go negative),
    which the corrected two-pass used here does not."""
    x = (torch.randn(8, 1000, dtype=torch.float64) + 1e4).float()
    naive_var = (x * x).mean(1) - x.mean(1) ** 2
    true_var = torch.tensor(reference.layer_norm(x.numpy(), 1000)[2] ** -2 - 1e-5)
    assert (naive_var.double() - true_var).abs().max() > 1.0
    ours = layernorm.layer_norm(x, 1000)
    want = reference.layer_norm(x.numpy(), 1000)[0]
    assert np.abs(ours.double().numpy() - want).max() < 4e-6


def test_torch_cpu_error_grows_with_the_row_offset_and_ours_does_not():
    """docs/claims.md #30: float32 rows N(c, 1), 64 rows of 1000, against float64."""
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(64, 1000, generator=generator, dtype=torch.float64)
    for offset, torch_at_least in ((0.0, 0.0), (1e4, 1e-4), (1e6, 1e-2)):
        x = (noise + offset).float()
        truth = torch.from_numpy(reference.layer_norm(x.double().numpy(), 1000)[0])
        ours = (layernorm.layer_norm(x, 1000).double() - truth).abs().max()
        theirs = (F.layer_norm(x, (1000,)).double() - truth).abs().max()
        assert ours < 4e-6, (offset, ours)
        assert theirs >= torch_at_least, (offset, theirs)
