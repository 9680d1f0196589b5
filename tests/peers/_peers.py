"""What the peer suites under tests/peers/ share: the backends to run and the float64
oracle.

Each peer suite re-expresses another project's layer-norm / RMSNorm tests against our
public API (``layernorm.layer_norm``, ``rms_norm``, ``add_layer_norm``, ``add_rms_norm``,
``LayerNorm``, ``RMSNorm``); its docstrings name the source of every test. See README.md.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import layernorm
from layernorm import backends, reference


def cpu_backends() -> list[str | None]:
    """``None`` (the automatic choice: the compiled dispatch where it is built) and every
    available backend that runs CPU tensors here (triton only under TRITON_INTERPRET)."""
    names: list[str | None] = [None]
    for name in layernorm.available_backends():
        if backends.get(name).cannot_run(torch.empty(1)) is None:
            names.append(name)
    return names


BACKENDS = cpu_backends()
BACKEND_IDS = ["auto" if name is None else name for name in BACKENDS]


def parametrize_backends(func):
    return pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)(func)


def runs_on(backend: str | None, x: torch.Tensor) -> str:
    """The backend that actually runs ``x`` (the automatic choice resolved)."""
    return backends.choose(x, backend)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _np(t):
    return None if t is None else t.detach().double().numpy()


def reference_forward(x, normalized_shape, weight=None, bias=None, eps=1e-5, rms=False):
    """The float64 reference of :mod:`layernorm.reference` as a float64 tensor."""
    if rms:
        y = reference.rms_norm(_np(x), normalized_shape, _np(weight), eps)[0]
    else:
        y = reference.layer_norm(_np(x), normalized_shape, _np(weight), _np(bias), eps)[0]
    return torch.from_numpy(np.ascontiguousarray(y))


def reference_backward(dy, x, normalized_shape, weight=None, eps=1e-5, rms=False):
    """``(dx, dweight, dbias)`` of :mod:`layernorm.reference` as float64 tensors (dbias is
    None for RMSNorm)."""
    if rms:
        dx, dweight = reference.rms_norm_backward(
            _np(dy), _np(x), normalized_shape, _np(weight), eps
        )
        dbias = None
    else:
        dx, dweight, dbias = reference.layer_norm_backward(
            _np(dy), _np(x), normalized_shape, _np(weight), eps
        )
    return tuple(
        None if t is None else torch.from_numpy(np.ascontiguousarray(t))
        for t in (dx, dweight, dbias)
    )


def assert_close_or_nearer(ours, theirs, want, **tolerances):
    """Each element of ``ours`` is within assert_close's tolerances of ``theirs`` (torch),
    or at least as near the float64 ``want`` as torch's is. Torch's half-precision
    gradients are not always the better of two (rows of two elements, where the true
    gradient is of order eps, come out of torch's bfloat16 backward as large as 1e-2)."""
    from torch.testing import assert_close

    near = (ours.double() - want).abs() <= (theirs.double() - want).abs()
    ours = torch.where(near, theirs, ours)
    assert_close(ours, theirs, **tolerances)
