"""Experiments: smoke runs on tiny settings, the prenorm result on a fixed seed, CLI and report."""

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from layernorm.report import experiments
from layernorm.report.experiments import EXPERIMENTS, MODULES, parse_sizes, prenorm, report_section

NAMES = ["prenorm", "warmup", "batchsize", "rnn"]


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    """Every experiment once with its QUICK sizes, into one results folder."""
    out = tmp_path_factory.mktemp("results")
    results = {
        name: EXPERIMENTS[name](out / name, seed=0, progress=False, **MODULES[name].QUICK)
        for name in NAMES
    }
    return out, results


def test_registry():
    assert sorted(EXPERIMENTS) == sorted(NAMES)
    for name, module in MODULES.items():
        assert name == module.NAME and callable(EXPERIMENTS[name])
        assert set(module.QUICK) <= set(module.DEFAULTS)


@pytest.mark.parametrize("name", NAMES)
def test_quick_run_writes_plot_and_json(quick_results, name):
    out, results = quick_results
    result = results[name]
    png, data = out / name / f"{name}.png", out / name / f"{name}.json"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(data.read_text())
    assert saved == result
    assert result["name"] == name and result["seed"] == 0
    assert result["reproduced"] in (True, False, None)
    assert isinstance(result["summary"], str) and result["summary"].startswith(name)
    verdict_words = ("reproduced", "NOT reproduce", "does not reproduce", "partly")
    assert any(w in result["summary"] for w in verdict_words)
    assert result["settings"] == _listify({**MODULES[name].DEFAULTS, **MODULES[name].QUICK})
    headers, rows = result["table"]["headers"], result["table"]["rows"]
    assert rows and all(len(r) == len(headers) for r in rows)


def _listify(d):
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def test_quick_results_make_sense(quick_results):
    _, r = quick_results
    assert len(r["prenorm"]["per_layer"]["pre"]["8"]["grad_w2"]) == 8
    assert set(r["warmup"]["runs"]) == {"post", "post+warmup", "pre", "pre+warmup"}
    assert all(len(run["losses"]) == 12 for run in r["warmup"]["runs"].values())
    bn, ln = r["batchsize"]["runs"]["batch"], r["batchsize"]["runs"]["layer"]
    assert not bn["1"]["ok"] and "Expected more than 1 value per channel" in bn["1"]["error"]
    assert all(ln[b]["ok"] and ln[b]["train_eval_max_abs_diff"] == 0.0 for b in ln)
    assert bn["4"]["ok"] and bn["4"]["train_eval_max_abs_diff"] > 0
    assert set(r["rnn"]["runs"]) == {"LSTM", "LN-LSTM"}


def test_prenorm_qualitative_result_on_fixed_seed(tmp_path):
    """Post-LN's last-layer gradient beats Pre-LN's; Pre-LN's shrinks as L grows."""
    result = prenorm.run(
        tmp_path, seed=0, progress=False, layers=(6, 12, 24), seeds=3, d_model=32, d_ff=128,
        batch=8, seq_len=8,
    )  # fmt: skip
    post, pre = result["last_layer_w2"]["post"], result["last_layer_w2"]["pre"]
    assert all(a > b for a, b in zip(post, pre, strict=True))
    assert pre[0] > pre[1] > pre[2]
    assert result["checks"]["post_larger_than_pre_at_last_layer"]
    assert result["checks"]["pre_decreasing_with_L"]
    assert result["slopes"]["pre_last_w2"] < 0 and result["slopes"]["pre_stream_rms"] > 0.3


def test_runs_leave_the_callers_random_state_alone(tmp_path):
    state = torch.get_rng_state()
    threads = torch.get_num_threads()
    prenorm.run(tmp_path, progress=False, **prenorm.QUICK)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.get_num_threads() == threads


def test_same_seed_same_numbers(tmp_path):
    a = prenorm.run(tmp_path / "a", seed=3, progress=False, **prenorm.QUICK)
    b = prenorm.run(tmp_path / "b", seed=3, progress=False, **prenorm.QUICK)
    assert a["last_layer_w2"] == b["last_layer_w2"]


def test_bad_settings(tmp_path):
    with pytest.raises(TypeError, match="experiment 'prenorm' has no setting 'steps'"):
        prenorm.run(tmp_path, steps=3)
    with pytest.raises(ValueError, match="at least two depths"):
        prenorm.run(tmp_path, layers=(4, 4))
    with pytest.raises(ValueError, match="task must be one of"):
        EXPERIMENTS["warmup"](tmp_path, task="shuffle")
    with pytest.raises(ValueError, match=r"warmup must be in 1\.\.steps=10"):
        EXPERIMENTS["warmup"](tmp_path, steps=10, warmup=20)


def test_parse_sizes():
    assert parse_sizes("prenorm", ["layers=6,12", "seeds=2"]) == {"layers": (6, 12), "seeds": 2}
    assert parse_sizes("prenorm", ["layers=4"]) == {"layers": (4,)}
    assert parse_sizes("warmup", ["task=sort", "lr=1e-2", "steps=50"]) == {
        "task": "sort",
        "lr": 0.01,
        "steps": 50,
    }
    assert parse_sizes("rnn", ["lr=1"]) == {"lr": 1.0}
    with pytest.raises(ValueError, match="has no setting 'depth'"):
        parse_sizes("prenorm", ["depth=3"])
    with pytest.raises(ValueError, match="expects key=value"):
        parse_sizes("rnn", ["steps"])
    with pytest.raises(ValueError, match="must be an integer"):
        parse_sizes("rnn", ["steps=2.5"])
    with pytest.raises(ValueError, match="takes one value"):
        parse_sizes("rnn", ["steps=1,2"])


def _cli(argv):
    parser = argparse.ArgumentParser(prog="layernorm")
    experiments.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_runs_an_experiment(tmp_path, capsys):
    code = _cli(
        ["experiment", "prenorm", "--out", str(tmp_path), "--quick", "--no-progress",
         "--layers", "2", "3", "--set", "seeds=1"]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("prenorm:") and "prenorm.png" in printed
    saved = json.loads((tmp_path / "prenorm" / "prenorm.json").read_text())
    assert saved["settings"]["layers"] == [2, 3] and saved["settings"]["seeds"] == 1


def test_cli_rejects_bad_settings(tmp_path, capsys):
    assert _cli(["experiment", "batchsize", "--out", str(tmp_path), "--steps", "5"]) == 2
    assert "has no setting 'steps'" in capsys.readouterr().out
    assert _cli(["experiment", "rnn", "--out", str(tmp_path), "--set", "hidden=big"]) == 2
    assert not (tmp_path / "rnn").exists()
    with pytest.raises(SystemExit):
        _cli(["experiment", "nonsense"])


def test_report_section_reuses_results(quick_results, tmp_path):
    out, results = quick_results
    html = report_section(out, run_missing=False, quick=True)
    assert html.startswith("<h2>Experiments</h2>")
    assert html.count('<img alt="') == 4 and html.count("<table>") == 4
    for name in NAMES:
        assert f"<code>{name}</code>" in html
        assert results[name]["summary"].splitlines()[0].replace("'", "&#x27;") in html


def test_report_section_runs_only_the_missing(quick_results, tmp_path):
    out, _ = quick_results
    shutil.copytree(out, tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "prenorm")
    assert report_section(tmp_path / "r", run_missing=False).count("Not run.") == 1
    html = report_section(tmp_path / "r", run_missing=True, quick=True)
    assert "Not run." not in html and html.count("<img") == 4
    assert Path(tmp_path / "r" / "prenorm" / "prenorm.json").is_file()


def test_report_section_survives_a_failing_experiment(quick_results, tmp_path, monkeypatch):
    out, _ = quick_results
    shutil.copytree(out, tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "rnn")

    def broken(*args, **kwargs):
        raise RuntimeError("no time steps left")

    monkeypatch.setattr(MODULES["rnn"], "run", broken)
    html = report_section(tmp_path / "r", run_missing=True, quick=True)
    assert "<b>Failed:</b> RuntimeError: no time steps left" in html
    assert html.count("<img") == 3
