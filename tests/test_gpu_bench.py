"""The GPU benchmark script's plan and bookkeeping, checked without a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_dry_run_prints_the_plan(bench, capsys):
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "op: layer_norm" in out and "bf16" in out and "fp32" in out
    cases = bench.plan(["bf16", "fp32"], list(bench.WIDTHS))
    assert [c.n for c in cases[:9]] == [1024 << k for k in range(9)]
    assert all(c.m * c.n == 1 << 28 for c in cases)
    assert all(f"{c.n:>7} {c.m:>7}" in out for c in cases)


def test_bytes_moved(bench):
    case = bench.Case("bf16", 4096)
    assert case.m == 65536
    assert case.bytes_moved("forward") == 2 * 2 * (1 << 28)
    assert case.bytes_moved("backward") == 3 * 2 * (1 << 28)
    assert case.bytes_moved("fwd+bwd") == 5 * 2 * (1 << 28)
    assert bench.Case("fp32", 4096).bytes_moved("copy") == 2 * 4 * (1 << 28)


def test_bad_widths_are_rejected(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--widths", "0"])
    assert "widths must be between 1 and" in capsys.readouterr().err


def test_measurement_bookkeeping_on_cpu(bench, monkeypatch):
    monkeypatch.setattr(bench, "TOTAL_ELEMENTS", 256)
    args = bench.parse_args(
        ["--widths", "16", "64", "--providers", "torch", "--dtypes", "fp32", "--budget-s", "60"]
    )
    calls = []

    def timer(fn):  # every call "takes" 0.5 ms, the copy included
        fn()
        calls.append(fn)
        return 0.5

    results = bench.run(args, device="cpu", timer=timer)
    assert [(r["N"], r["M"]) for r in results] == [(16, 16), (64, 4)]
    assert len(calls) == 2 * (1 + 3)  # copy + three modes per shape
    cells = results[0]["cells"]
    # same time as the copy: the fraction of copy bandwidth is the ratio of bytes moved
    assert cells["torch/forward"]["of_copy"] == pytest.approx(1.0)
    assert cells["torch/backward"]["of_copy"] == pytest.approx(1.5)
    assert cells["torch/fwd+bwd"]["GB/s"] == pytest.approx(5 * 256 * 4 / 0.5 / 1e6)
    table = bench.markdown(results, ["torch"])
    assert "### fwd+bwd" in table and "(250%)" in table and "vs torch" not in table
    args.budget_s = -1.0
    results = bench.run(args, device="cpu", timer=timer)
    assert results[0]["cells"]["torch/forward"] == {"note": "skipped (time budget)"}


def test_overrides_of_the_triton_limits(bench, capsys):
    args = bench.parse_args(["--set", "FUSED_BACKWARD_N=16384", "--set", "CHUNK_N=2048"])
    assert args.overrides == {"FUSED_BACKWARD_N": 16384, "CHUNK_N": 2048}
    for bad in ("FUSED=1", "CHUNK_N=big"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--set", bad])
        assert "--set takes NAME=INT" in capsys.readouterr().err


def test_speedup_column(bench):
    case = bench.Case("bf16", 1024)
    times = {"layernorm": 0.5, "torch": 1.0}
    ms = {"copy": 0.5, **{p: dict.fromkeys(bench.MODES, t) for p, t in times.items()}}
    args = bench.parse_args([])
    table = bench.markdown([bench._result(args, case, ms)], ["layernorm", "torch"])
    assert "| vs torch |" in table and "| 2.00x |" in table
