"""Cases and tiny models for tests/test_mechanisms.py: each of our four functions beside
torch's own ops as the oracle (``add_*`` as ``x + residual`` then the norm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm

EPS = 1e-5
N = 8


@dataclass(frozen=True)
class Case:
    """One public function with or without its affine parameters."""

    kind: str  # layer_norm, rms_norm, add_layer_norm, add_rms_norm
    weight: bool
    bias: bool

    @property
    def id(self) -> str:
        return self.kind + ("-w" if self.weight else "") + ("b" if self.bias else "")

    @property
    def add(self) -> bool:
        return self.kind.startswith("add_")

    @property
    def rms(self) -> bool:
        return "rms" in self.kind

    def tensors(
        self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """(x, residual, weight, bias), None where the case has none; parameters of
        shape ``shape[-1:]`` with values away from 1 and 0."""
        n = shape[-1]
        x = torch.randn(shape, dtype=dtype) * 2 + 0.5
        residual = torch.randn(shape, dtype=dtype) if self.add else None
        weight = torch.randn(n, dtype=dtype) + 1 if self.weight else None
        bias = torch.randn(n, dtype=dtype) if self.bias else None
        return x, residual, weight, bias

    def ours(self, x, residual=None, weight=None, bias=None) -> tuple[Tensor, ...]:
        n = x.shape[-1]
        if self.kind == "layer_norm":
            return (layernorm.layer_norm(x, (n,), weight, bias, EPS),)
        if self.kind == "rms_norm":
            return (layernorm.rms_norm(x, (n,), weight, EPS),)
        if self.kind == "add_layer_norm":
            return tuple(layernorm.add_layer_norm(x, residual, (n,), weight, bias, EPS))
        return tuple(layernorm.add_rms_norm(x, residual, (n,), weight, EPS))

    def torch(self, x, residual=None, weight=None, bias=None) -> tuple[Tensor, ...]:
        n = x.shape[-1]
        h = x + residual if self.add else x
        if self.rms:
            y = F.rms_norm(h, (n,), weight, EPS)
        else:
            y = F.layer_norm(h, (n,), weight, bias, EPS)
        return (y, h) if self.add else (y,)


CASES = [
    Case("layer_norm", False, False),
    Case("layer_norm", True, False),
    Case("layer_norm", True, True),
    Case("rms_norm", False, False),
    Case("rms_norm", True, False),
    Case("add_layer_norm", False, False),
    Case("add_layer_norm", True, True),
    Case("add_rms_norm", False, False),
    Case("add_rms_norm", True, False),
]


class CaseModule(torch.nn.Module):
    """One case as a module (weight and bias as parameters): ``forward(x, residual)``
    returns the case's outputs."""

    def __init__(self, case: Case, oracle: bool = False, dtype=torch.float32) -> None:
        super().__init__()
        self.case, self.oracle = case, oracle
        _, _, weight, bias = case.tensors((1, N), dtype)
        self.weight = None if weight is None else torch.nn.Parameter(weight)
        self.bias = None if bias is None else torch.nn.Parameter(bias)

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, ...]:
        run = self.case.torch if self.oracle else self.case.ours
        return run(x, residual if self.case.add else None, self.weight, self.bias)


class Mixed(torch.nn.Module):
    """A tiny model that uses both modules and all four functions."""

    def __init__(self, oracle: bool = False) -> None:
        super().__init__()
        self.oracle = oracle
        self.linear = torch.nn.Linear(N, N)
        norms = (
            (torch.nn.LayerNorm, torch.nn.RMSNorm)
            if oracle
            else (
                layernorm.LayerNorm,
                layernorm.RMSNorm,
            )
        )
        self.layer = norms[0](N)
        self.rms = norms[1](N, eps=EPS)
        self.gain = torch.nn.Parameter(torch.randn(N) + 1)
        self.shift = torch.nn.Parameter(torch.randn(N))
        with torch.no_grad():
            self.layer.weight.add_(torch.randn(N))
            self.layer.bias.add_(torch.randn(N))
            self.rms.weight.add_(torch.randn(N))

    def forward(self, x: Tensor) -> Tensor:
        h = self.layer(self.linear(x))
        h = self.rms(torch.relu(h) + x)
        ours = not self.oracle
        add_layer = Case("add_layer_norm", True, True)
        add_rms = Case("add_rms_norm", True, False)
        y, h = (add_layer.ours if ours else add_layer.torch)(h, x, self.gain, self.shift)
        z, h = (add_rms.ours if ours else add_rms.torch)(y, h, self.gain)
        w = (
            Case("layer_norm", False, False).ours
            if ours
            else Case("layer_norm", False, False).torch
        )(z)[0]
        v = (Case("rms_norm", True, False).ours if ours else Case("rms_norm", True, False).torch)(
            h, None, self.gain
        )[0]
        return w + v


def mixed_pair() -> tuple[Mixed, Mixed]:
    """Ours and torch's with the same parameters."""
    ours = Mixed()
    oracle = Mixed(oracle=True)
    oracle.load_state_dict(ours.state_dict())
    return ours.eval(), oracle.eval()
