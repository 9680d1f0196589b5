"""Checks of the kernel contract (``layernorm.backends``) that every backend's suite runs."""

import torch


def check_any_dim(kernels, device: str = "cpu") -> None:
    """A contiguous (*, N) tensor is M rows: its outputs are shaped like it, and its results
    are those of its (M, N) view, bit for bit; ``dy`` may come as (M, N) rows of a tensor
    shaped like ``x`` (as a strided gradient does)."""
    x, r, dy = (torch.randn(2, 3, 40, device=device) for _ in range(3))
    w, b = torch.rand(40, device=device), torch.randn(40, device=device)
    for rms in (False, True):
        flat = kernels.forward(x.view(6, 40), r.view(6, 40), w, b, 1e-5, rms)
        deep = kernels.forward(x, r, w, b, 1e-5, rms)
        assert deep[0].shape == deep[1].shape == x.shape
        for a, c in zip(flat, deep, strict=True):
            assert (a is None and c is None) or torch.equal(a.view(c.shape), c)
        mean, rstd = deep[2], deep[3]
        rows = dy.view(6, 40)
        flat_grads = kernels.backward(rows, flat[1], w, mean, rstd, rows, rms, True, True)
        deep_grads = kernels.backward(rows, deep[1], w, mean, rstd, dy, rms, True, True)
        assert deep_grads[0].shape == x.shape
        for a, c in zip(flat_grads, deep_grads, strict=True):
            assert torch.equal(a.view(c.shape), c)
