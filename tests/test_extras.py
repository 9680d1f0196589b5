"""Optional dependencies: a missing extra names itself; progress bars need no tqdm."""

import sys

import pytest

from layernorm import _extras
from layernorm.cli import main


def test_require_imports_an_installed_module():
    assert _extras.require("numpy", "report").__name__ == "numpy"


def test_a_missing_module_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # (an earlier test may import it)
    with pytest.raises(
        _extras.MissingExtra,
        match=r"^the demo needs scikit-learn: pip install 'layernorm\[report\]'$",
    ) as caught:
        _extras.require("sklearn.datasets", "report", "the demo")
    assert isinstance(caught.value, ImportError) and caught.value.name == "sklearn"


def test_progress_without_tqdm_iterates_and_ignores_updates(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with _extras.progress(range(3), desc="x") as bar:
        assert list(bar) == [0, 1, 2]
        bar.update()
        bar.set_postfix_str("y")
    assert list(_extras.progress(range(2), disable=True)) == [0, 1]


def test_an_experiment_without_matplotlib_fails_before_running(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["experiment", "rnn", "--out", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "layernorm experiment needs matplotlib: pip install 'layernorm[report]'" in err
    assert not any(tmp_path.iterdir())


def test_the_library_loads_none_of_the_tooling():
    """``import layernorm`` and calls of every function, module, backend and ``patch``
    load neither the report subpackage nor the tools' packages (docs/contract.md §2)."""
    import subprocess

    code = """
import sys, torch
before = set(sys.modules)  # torch.hub imports tqdm itself when it is installed
import layernorm
x, r = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
w = torch.ones(8)
x.requires_grad_()
layernorm.layer_norm(x, 8, w, w).sum().backward()
layernorm.rms_norm(x, (4, 8))
layernorm.add_layer_norm(x, r, 8)
layernorm.add_rms_norm(x, r, 8, w)
layernorm.RMSNorm(8)(x)
layernorm.patch(torch.nn.Sequential(torch.nn.LayerNorm(8)))
tooling = ("layernorm.report", "matplotlib", "tqdm", "sklearn", "transformers", "hf_coverage")
new = set(sys.modules) - before
print(sorted(m for m in new if m.split(".")[0] in tooling or m.startswith(tooling)))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_the_package_holds_no_coverage_sweep():
    import importlib.util

    assert importlib.util.find_spec("layernorm.nn.coverage") is None
    assert importlib.util.find_spec("layernorm.report") is not None
