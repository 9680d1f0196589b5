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
