"""float64 input over float64's whole range (docs/contract.md §3, "The whole range").

The numba backend (and the compiled dispatch, which runs its kernel) scales a float64 row
whose statistics would leave float64's range by a power of two before computing them.
Every output must be within the stated bound of the exact value, from rows of subnormal
elements to rows near the largest float64; the oracle is mpmath at 80 digits on the
given inputs, sharing no code with the kernels.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import torch

import layernorm

pytest.importorskip("numba")

#: row magnitudes: subnormal elements, both ends of the range, and the middle
SCALES = [2.0**-1060, 1e-300, 1e-160, 1.0, 1e160, 1e300, 1.7e308]


def _exact(z: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, rms: bool):
    """``(y, u)``: the exact outputs and normalized values, to 80 digits."""
    with mpmath.workdps(80):
        values = [mpmath.mpf(float(v)) for v in z]
        n = len(values)
        mean = mpmath.mpf(0) if rms else mpmath.fsum(values) / n
        q = mpmath.fsum((v - mean) ** 2 for v in values) / n
        rstd = 1 / mpmath.sqrt(q + mpmath.mpf(eps))
        u = [(v - mean) * rstd for v in values]
        y = [mpmath.mpf(float(b[j])) + mpmath.mpf(float(w[j])) * u[j] for j in range(n)]
        return y, u


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("eps", [0.0, 1e-300, 1e-5])
@pytest.mark.parametrize("scale", SCALES)
def test_float64_rows_normalize_over_the_whole_range(scale, eps, rms):
    """``|y - exact| <= 2^-40 (|gamma| (|u| + 1) + |beta|)`` for every element, ``u`` the
    exact normalized value (the bound of §3 for N <= 4096, rounded up); the automatic
    backend (the compiled dispatch where built) gives the same bits."""
    generator = torch.Generator().manual_seed(7)
    n = 200
    x = (torch.rand(3, n, generator=generator, dtype=torch.float64) * 2 - 1) * scale
    x[1] += 3 * scale if scale < 1e308 else 0.0  # an offset row
    w = torch.rand(n, generator=generator, dtype=torch.float64) + 0.5
    b = torch.randn(n, generator=generator, dtype=torch.float64)
    if rms:
        y = layernorm.rms_norm(x, (n,), w, eps=eps, backend="numba")
        automatic = layernorm.rms_norm(x, (n,), w, eps=eps)
        b = torch.zeros(n, dtype=torch.float64)
    else:
        y = layernorm.layer_norm(x, (n,), w, b, eps=eps, backend="numba")
        automatic = layernorm.layer_norm(x, (n,), w, b, eps=eps)
    assert torch.isfinite(y).all()
    # plain inference with the automatic backend: the compiled dispatch, the same kernel
    assert torch.equal(automatic, y)
    for row in range(3):
        exact, u = _exact(x[row].numpy(), w.numpy(), b.numpy(), eps, rms)
        for j in range(n):
            bound = 2.0**-40 * (float(w[j]) * (abs(float(u[j])) + 1) + abs(float(b[j])))
            assert abs(mpmath.mpf(float(y[row, j])) - exact[j]) <= bound, (row, j)
