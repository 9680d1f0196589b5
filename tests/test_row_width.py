"""docs/contract.md §3 on very wide rows: the core error bound of the offset tests holds
for rows of 16M elements, on each CPU backend (the triton backend's are in
test_triton_backend.py: the interpreter is too slow for such rows)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import layernorm
from layernorm import reference

WIDE = (1 << 24) + 3  # 16M elements: 4096 sum blocks of 4096 and a ragged last one
BACKENDS = [
    "torch",
    pytest.param(
        "numba",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("numba") is None, reason="numba is not installed"
        ),
    ),
]


def _max_err(a: torch.Tensor, ref: np.ndarray) -> float:
    return float(np.abs(a.detach().double().numpy() - ref).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_core_error_is_independent_of_the_row_width(backend, offset):
    # Float32 lane sums over the whole row (the numba kernels' before blocking) erred by
    # 4e-4 here, 4e-3 at offset 1e4.
    x = torch.randn(1, WIDE) + offset
    z = x.double().numpy()
    u = layernorm.layer_norm(x, WIDE, backend=backend)
    assert _max_err(u, reference.layer_norm(z, WIDE)[0]) < 4e-6
    r = layernorm.rms_norm(x, WIDE, eps=1e-6, backend=backend)
    r_ref = reference.rms_norm(z, WIDE, eps=1e-6)[0]
    assert _max_err(r, r_ref) < 4e-6 * np.abs(r_ref).max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_error_is_independent_of_the_row_width(backend):
    # The backward's row sums (mean(d), c1, c2) over 16M elements erred by 7e-4 relative.
    x = (torch.randn(1, WIDE) + 1e4).requires_grad_()
    w = torch.randn(WIDE, requires_grad=True)
    dy = torch.randn(1, WIDE)
    layernorm.layer_norm(x, WIDE, w, backend=backend).backward(dy)
    dx, _, _ = reference.layer_norm_backward(
        dy.double().numpy(), x.detach().double().numpy(), WIDE, w.detach().double().numpy()
    )
    assert _max_err(x.grad, dx) < 2e-5 * np.abs(dx).max()
