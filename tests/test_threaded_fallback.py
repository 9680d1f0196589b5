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


def _compiled_in_use() -> None:
    from layernorm import compiled

    layernorm.layer_norm(torch.ones(1, 2), 2)
    if compiled.unavailable_reason() is not None:
        pytest.skip(f"the compiled dispatch is not in use: {compiled.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_compiled_threads_fix_flagged_rows_in_every_span(dtype, monkeypatch):
    """The C++ front door's threaded call (its own helper threads, spans of ROW_BLOCK
    rows, flags gathered from every span), forward and backward: tie rows flagged for the
    exact fallback in several spans come out as they round, and 1, 2 and 3 threads give
    the same bits, outputs and every gradient."""
    monkeypatch.delenv("LAYERNORM_BACKEND", raising=False)
    _compiled_in_use()
    from layernorm.backends import _threads

    pool = _threads._Pool()
    pool.cpus = 4  # (lending then depends on the thread count, not on this machine)
    lent: list[tuple[int, bool]] = []  # (helpers, whether Python's helpers run them)
    borrow = pool.borrow
    monkeypatch.setattr(
        pool,
        "borrow",
        lambda wanted, start=True: lent.append((borrow(wanted, start), start)) or lent[-1][0],
    )
    monkeypatch.setattr(_threads, "_pool", pool)
    n, m = 64, 1024  # 2^16 elements: two grains, so 2 threads get a helper
    ulp = float(torch.finfo(dtype).eps)
    g = torch.Generator().manual_seed(1)
    ties = [0, 1, 31, 32, 33, 95, 96, 256, 500, 511, 512, 768, 1023]
    # forward: z = (0, 1, ...), eps = 0.75, gamma = ulp, beta = 1: 1 - ulp/2 and a tie
    x = torch.randn(m, n, generator=g)
    x[ties] = torch.tensor([0.0, 1.0] * (n // 2))
    x = x.to(dtype)
    w, b = torch.full((n,), ulp), torch.ones(n)
    # backward: z = (0, 1, ...), dy = (4 ulp, 0, ...), dresidual_out = 1: dz + 1 is
    # 1 + 3 ulp/2 (a tie, to 1 + 2 ulp) and 1 - 3 ulp/2 (exact)
    dy = torch.randn(m, n, generator=g)
    dy[ties] = torch.tensor([4 * ulp, 0.0] * (n // 2))
    dy = dy.to(dtype)
    rho = torch.randn(m, n, generator=g)
    rho[ties] = 1.0
    rho = rho.to(dtype)

    def run() -> list[torch.Tensor]:
        y = layernorm.layer_norm(x, n, w, b, eps=0.75)
        xs, r = x.clone().requires_grad_(), torch.zeros_like(x).requires_grad_()
        ws = torch.ones(n, requires_grad=True)
        out, residual_out = layernorm.add_layer_norm(xs, r, n, ws, eps=0.75)
        grads = torch.autograd.grad((out, residual_out), (xs, ws), (dy, rho))
        return [y, *grads]

    threads = torch.get_num_threads()
    runs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            runs.append(run())
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(p, q) for p, q in zip(runs[0], other, strict=True))
    # three calls (a forward, a forward with grad, a backward) with 2 threads and with 3,
    # each lent one helper (two grains of work), run by C++'s helpers (not Python's)
    assert lent == [(1, False)] * 6 and pool.started == 0
    y, dx, _ = runs[1]
    for i in ties:
        assert y[i].double().tolist() == [1.0 - ulp / 2, 1.0] * (n // 2), i
        assert dx[i].double().tolist() == [1.0 + 2 * ulp, 1.0 - 1.5 * ulp] * (n // 2), i
