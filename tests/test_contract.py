"""The contract suite: every check of :mod:`layernorm.checks` on every registered backend.

The checks (numerics, docs/contract.md §3; backend protocol, §5) live once, in
``layernorm.checks``, where ``layernorm check`` runs them too; this file runs each one on
each backend of :func:`layernorm.available_backends`, so a new backend gets the whole
contract by being registered. The backend test files keep only what is specific to
their kernels.

Triton runs here in its interpreter when the machine has no GPU, as in
tests/test_triton_backend.py: ``TRITON_INTERPRET=1`` must be set when triton is first
imported, and is set for each triton test alone. The checks then keep to a few rows
(:func:`layernorm.checks._emulated`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch

import layernorm
from _triton_interpreter import HAS_TRITON, import_for_the_interpreter
from layernorm import backends, checks

import_for_the_interpreter()


def _interpreted_triton() -> bool:
    """Whether triton is installed, there is no GPU, and it was imported for its interpreter."""
    if not HAS_TRITON or torch.cuda.is_available():
        return False
    from layernorm.backends import triton_

    return triton_._triton_interprets()


INTERPRETED_TRITON = _interpreted_triton()


def _registered() -> list[str]:
    """``available_backends()``, triton included where its interpreter can run it."""
    saved = os.environ.get("TRITON_INTERPRET")
    if INTERPRETED_TRITON:
        os.environ["TRITON_INTERPRET"] = "1"
    backends.forget("triton")  # the registry caches availability; the variable changes it
    try:
        return layernorm.available_backends()
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
        backends.forget("triton")


BACKENDS = _registered()
PER_BACKEND = [c for c in checks.CHECKS if c.per_backend]
REFERENCE = [c for c in checks.CHECKS if not c.per_backend]


def _id(check: checks.Check) -> str:
    return check.name.replace(" ", "_")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> Iterator[str]:
    """A registered backend's name; triton with its interpreter on, where it needs it."""
    name = request.param
    if name == "triton" and INTERPRETED_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    backends.forget("triton")
    yield name
    backends.forget("triton")


@pytest.mark.parametrize("check", PER_BACKEND, ids=_id)
def test_backend_keeps_the_contract(backend, check):
    passed, measured = check.run(backend)
    assert passed, f"{check.name} on {backend}: {measured}"


@pytest.mark.parametrize("check", REFERENCE, ids=_id)
def test_reference_math(check):
    passed, measured = check.run(None)
    assert passed, f"{check.name}: {measured}"


def test_every_registered_backend_is_checked():
    """The suite covers the registry: torch always, numba and triton where they run."""
    assert "torch" in BACKENDS
    assert set(BACKENDS) <= set(backends.BACKENDS)
    if importlib.util.find_spec("numba") is not None:
        assert "numba" in BACKENDS
    if INTERPRETED_TRITON or (HAS_TRITON and torch.cuda.is_available()):
        assert "triton" in BACKENDS


def test_a_failing_check_says_by_how_much(monkeypatch):
    """A backend that breaks the contract fails the check, with the measured number."""
    from layernorm.backends import torch_

    real = torch_.forward

    def off_by_a_bit(x, residual, weight, bias, eps, rms, stats=True):
        y, residual_out, mean, rstd = real(x, residual, weight, bias, eps, rms, stats)
        return y * (1 + 4 * torch.finfo(y.dtype).eps), residual_out, mean, rstd

    monkeypatch.setattr(torch_, "forward", off_by_a_bit)
    passed, measured = checks._constant_rows("torch")
    assert not passed and "is not exactly beta" in measured
