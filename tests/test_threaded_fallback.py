"""The exact fallback under threads: a large call runs in spans of rows over threads
(docs/contract.md §3, §5), and rows flagged for the exact fallback in any span, the
first row of a span included, come out as they do alone."""

from __future__ import annotations

import pytest
import torch

import layernorm
from layernorm.backends import numba_

pytest.importorskip("numba")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_flagged_rows_in_every_span_round_as_alone(dtype, monkeypatch):
    # rows z = (0, 1, ...) with eps = 0.75, gamma = ulp(1), beta = 1 land on rounding
    # midpoints (1 + ulp/2 is a tie), which the float64 bound cannot decide: flagged
    n, m = 64, 1024
    monkeypatch.setattr(numba_, "SERIAL_NUMEL", 1 << 15)  # (the Python path reads it)
    assert m * n >= numba_.SERIAL_NUMEL  # the threaded entry
    ulp = float(torch.finfo(dtype).eps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=g)
    # span starts (multiples of 128 here) after spans with no flagged row, too
    tie_rows = [0, 1, 31, 32, 33, 95, 96, 256, 500, 511, 512, 768, 1023]
    x[tie_rows] = torch.tensor([0.0, 1.0] * (n // 2))
    x = x.to(dtype)
    w, b = torch.full((n,), ulp), torch.ones(n)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = layernorm.layer_norm(x, n, w, b, eps=0.75, backend="numba")
    finally:
        torch.set_num_threads(threads)
    for i in tie_rows:
        assert y[i].double().tolist() == [1.0 - ulp / 2, 1.0] * (n // 2), i
    for i in range(0, m, 37):  # and every other row is its own call's bits
        alone = layernorm.layer_norm(x[i : i + 1], n, w, b, eps=0.75, backend="numba")
        assert torch.equal(
            y[i].view(torch.int16 if dtype != torch.float32 else torch.int32),
            alone[0].view(torch.int16 if dtype != torch.float32 else torch.int32),
        )
