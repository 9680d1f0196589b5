"""The ``layernorm`` command end to end (explain, check, report) in-process and as a program."""

import re
import subprocess
import sys

import pytest

from layernorm import cli
from layernorm.explain import explain, parse_number


def test_explain_seed_example(capsys):
    assert cli.main(["explain", "1", "2", "3", "--eps", "1/3"]) == 0
    out = capsys.readouterr().out
    assert "mean              mu = (1/d) sum z_i          = 2\n" in out
    assert "= (-1, 0, 1)" in out
    assert "eigenvalue on v, eps/(q+eps)^(3/2)           = 0.3333333333" in out
    assert "Lipschitz bound of the core, eps^(-1/2)        = 1.732050808" in out
    assert "variance of the core, q/(q+eps)                = 0.6666666667" in out


def test_explain_constant_row_with_gain_and_bias(capsys):
    assert (
        cli.main(
            [
                "explain",
                "3",
                "3",
                "3",
                "--eps",
                "0.5",
                "--gamma",
                "2",
                "-4",
                "1",
                "--beta",
                "1",
                "-1",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "output            y  = gamma * u + beta        = (1, -1, 2)" in out
    assert "mean of output                                 = 0.6666666667" in out
    assert "none (no such direction)" in out  # no radial direction at a constant
    assert "Lipschitz bound of the output, * max|gamma|    = 5.656854249" in out


def test_explain_values():
    e = explain([2, 4, 6], eps=1 / 3)
    assert e["output"] == pytest.approx([-(2 / 3**0.5), 0, 2 / 3**0.5])
    assert e["variance"] == pytest.approx(8 / 3)
    assert parse_number("1/3") == pytest.approx(1 / 3)


def test_explain_errors(capsys):
    with pytest.raises(ValueError, match=r"not a number: 'x'"):
        parse_number("x")
    with pytest.raises(ValueError, match=r"gamma must have 3 numbers like the input, got 2"):
        explain([1, 2, 3], 0.1, gamma=[1, 2])
    with pytest.raises(ValueError, match=r"eps must be non-negative, got eps=-1"):
        explain([1, 2, 3], -1)
    assert cli.main(["explain", "1", "2", "--eps", "-1"]) == 2
    assert "eps must be non-negative" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["explain", "1", "two"])
    assert "not a number: 'two'" in capsys.readouterr().err


def test_check_passes_and_prints_table(capsys, monkeypatch):
    from layernorm import checks

    # the checks themselves run in tests/test_contract.py: here, the command around two
    keep = {"worked examples", "offset independence"}
    monkeypatch.setattr(checks, "CHECKS", [c for c in checks.CHECKS if c.name in keep])
    assert cli.main(["check", "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "worked examples" in out
    assert re.search(r"offset independence +torch +pass", out)
    assert ", 0 failed" in out


def test_check_reports_failure(capsys, monkeypatch):
    from layernorm import checks

    broken = checks.Check(
        "always broken", "a claim that fails", lambda _: (False, "measured 1"), False
    )
    monkeypatch.setattr(checks, "CHECKS", [broken])
    assert cli.main(["check", "--backend", "torch"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_report_writes_self_contained_html(tmp_path):
    assert (
        cli.main(["report", "--out", str(tmp_path), "--quick", "--no-bench", "--no-experiments"])
        == 0
    )
    page = (tmp_path / "index.html").read_text()
    assert page.count("data:image/png;base64,") >= 3
    assert "Claims checked" in page and "FAIL" not in page
    assert "The same bits everywhere" in page
    for png in ("h_eps.png", "jacobian_eigenvalues.png", "offset_error.png", "scale_correct.png"):
        assert (tmp_path / png).stat().st_size > 10_000


def test_python_dash_m_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "layernorm", "explain", "1", "2", "3", "--eps", "1/3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "(-1, 0, 1)" in done.stdout
