"""Smoke runs of the benchmark harness on tiny sizes (speed itself is never asserted)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layernorm
from layernorm.report import benchmark

SRC = Path(layernorm.__file__).resolve().parents[1]
ROOT = SRC.parent


def test_run_measures_every_configuration_with_ratios():
    results = benchmark.run(
        [(4, 32)], ("layer_norm", "add_layer_norm"), ("fwd", "bwd"), "float32",
        ("torch", "layernorm", "layernorm:torch"), repeat=3, warmup=1, progress=False,
    )  # fmt: skip
    copy = [r for r in results if r.provider == "copy"]
    assert len(copy) == 1 and copy[0].bytes == 2 * 4 * 32 * 4
    rows = [r for r in results if r.provider != "copy"]
    assert len(rows) == 2 * 2 * 3
    for r in rows:
        assert r.error is None and r.gbps > 0 and 0 < r.min_ms <= r.q25_ms <= r.ms <= r.q75_ms
        assert r.bytes == benchmark.TENSORS_MOVED[(r.op, r.direction)] * 4 * 32 * 4
        assert r.of_copy is not None and r.vs_torch is not None
    assert all(r.vs_torch == 1.0 for r in rows if r.provider == "torch")
    text = benchmark.format_table(results)
    assert "add_layer_norm" in text and "layernorm:torch" in text


def test_a_failing_provider_is_reported_not_raised():
    results = benchmark.run(
        [(2, 8)], ("rms_norm",), ("fwd",), "float32", ("torch", "layernorm:nosuch"), 2, 1, False
    )
    failed = [r for r in results if r.provider == "layernorm:nosuch"]
    assert failed[0].error is not None and "unknown backend" in failed[0].error
    assert "failed:" in benchmark.format_table(results)


def test_run_rejects_a_non_positive_repeat():
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        benchmark.run([(2, 8)], repeat=0)


def test_cli_writes_json_and_plot(tmp_path):
    parser = argparse.ArgumentParser()
    benchmark.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "--shapes", "3x16,5x40", "--ops", "rms_norm", "--directions", "fwd,fwdbwd",
         "--repeat", "2", "--warmup", "1", "--threads", "1",
         "--json", str(tmp_path / "r.json"), "--out", str(tmp_path)]
    )  # fmt: skip
    assert args.func(args) == 0
    payload = json.loads((tmp_path / "r.json").read_text())
    assert payload["machine"]["cpu_count"] >= 1
    assert {r["provider"] for r in payload["results"]} == {"copy", "torch", "layernorm"}
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shapes", "8x"], "a shape is MxN"),
        (["--shapes", "0x8"], "must be positive"),
        (["--ops", "softmax"], "choose from"),
    ],
)
def test_cli_rejects_bad_arguments(argv, message, capsys):
    parser = argparse.ArgumentParser()
    benchmark.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", *argv])
    assert message in capsys.readouterr().err


def _cache_settings() -> dict[str, str]:
    """The variables that say where the kernel cache is: a script run by a test finds the
    kernels the suite built (tests/conftest.py) instead of compiling its own."""
    names = ("HOME", "XDG_CACHE_HOME", "LAYERNORM_CACHE_DIR", "NUMBA_CACHE_DIR")
    return {name: os.environ[name] for name in names if name in os.environ}


def test_harness_script_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "harness.py"), "--shapes", "2x8",
         "--ops", "layer_norm", "--directions", "fwd", "--repeat", "2", "--warmup", "1"],
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", **_cache_settings()},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "layer_norm" in done.stdout and "vs torch" in done.stdout


def test_report_section_is_html_with_an_inline_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmark, "REPORT_SHAPES", ((2, 16),))
    monkeypatch.setattr(benchmark, "OPS", ("layer_norm",))
    html = benchmark.report_section(tmp_path, quick=False)
    assert html.startswith("<p>") and "<table>" in html and "data:image/png;base64," in html
    assert (tmp_path / "bench.png").exists()


def test_small_calls_script_measures_both_providers():
    spec = importlib.util.spec_from_file_location(
        "small_calls", ROOT / "benchmarks" / "small_calls.py"
    )
    small_calls = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(small_calls)
    calls = []
    timings = small_calls.rr({"a": lambda: calls.append(1), "b": lambda: None}, rounds=3, inner=5)
    assert set(timings) == {"a", "b"} and all(t > 0 for t in timings.values())
    assert len(calls) == 300 + 3 * 5  # warm-up, then every round
    line = small_calls.measure((2, 8), "rms_norm", rounds=3)  # the real thing, tiny
    assert line.startswith("rms_norm (2, 8): inference torch") and "via the op" in line
    assert "with grad" in line and "forward+backward" in line
    args = small_calls.parse_args(["--dtype", "bfloat16", "--threads", "1", "--breakdown"])
    assert (args.dtype, args.threads, args.rounds, args.breakdown) == ("bfloat16", 1, 31, True)
    with pytest.raises(SystemExit):  # an unknown flag stops before any timing
        small_calls.parse_args(["--rows", "3"])


def test_fused_options_script_measures_every_case(monkeypatch):
    # every case of benchmarks/fused_options.py runs both calls (and their backward) on a
    # tiny shape and prints its ratio line; a broken case would only show when someone
    # benchmarks
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "fused_options", ROOT / "benchmarks" / "fused_options.py"
    )
    fused_options = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fused_options)
    for name in fused_options.CASES:
        for dtype in (torch.float32, torch.bfloat16):
            line = fused_options.measure(name, (2, 8), dtype, rounds=1)
            assert line.startswith(f"{name} (2, 8) {str(dtype)[6:]}: inference torch"), line
            assert line.endswith("x)") and ("forward+backward" in line) == (name != "out")
    args = fused_options.parse_args(["--cases", "rowscale", "--clock", "cpu"])
    assert (args.cases, args.clock, args.dtype) == ("rowscale", "cpu", "float32")


def test_kernel_ab_script_compares_two_revisions(capsys):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    spec = importlib.util.spec_from_file_location("kernel_ab", ROOT / "benchmarks" / "kernel_ab.py")
    kernel_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_ab)
    # float64's backward: it compiles in seconds, twice here (a forward takes half a
    # minute to a minute a revision; the script's forward timing is the same loop)
    kernel_ab.main(
        ["--base", "HEAD", "--shapes", "4x16", "--rounds", "2", "--threads", "1",
         "--dtype", "float64", "--directions", "bwd"]
    )  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("base HEAD vs the working tree, float64, 1 threads")
    assert [line.split(":")[0] for line in lines[1:]] == ["bwd 4x16"]
    assert all("new/base" in line for line in lines[1:])
    unchanged = (
        subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "src/layernorm/backends"], cwd=ROOT
        ).returncode
        == 0
    )
    if unchanged:  # the same source, compiled twice in one process: the same bits
        assert all(line.endswith("same bits: yes") for line in lines[1:])
