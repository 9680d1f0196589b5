"""What every experiment shares: settings, seeding, progress bar, saving the JSON and the plot.

An experiment module defines ``NAME``, ``TITLE``, ``CLAIM`` (the claim it checks, one line),
``DEFAULTS`` (its sizes, which finish in about a minute on 2 CPU cores), ``QUICK`` (tiny
sizes for smoke tests) and ``run(out, seed=0, progress=True, **sizes) -> dict``. The dict
it returns is what it saves to ``out/NAME.json``; it holds at least ``name``, ``claim``,
``settings``, ``seed``, ``reproduced`` (True, False, or None when only partly),
``summary`` (plain text), ``table`` (``{"headers": [...], "rows": [...]}``), ``seconds``,
``json`` and ``plot`` (paths of the two files written).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..._extras import progress, require

__all__ = [
    "finish",
    "moving_average",
    "new_figure",
    "one_thread",
    "progress_bar",
    "seeded",
    "settings",
]


def settings(name: str, defaults: Mapping[str, Any], sizes: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``sizes``; a key not in ``defaults`` is an error.

    Every run calls it first, so it also checks that matplotlib is installed: a missing
    ``layernorm[report]`` fails before the training, not after it.
    """
    require("matplotlib.figure", "report", "layernorm experiment")
    unknown = sorted(set(sizes) - set(defaults))
    if unknown:
        raise TypeError(
            f"experiment {name!r} has no setting {', '.join(map(repr, unknown))}; "
            f"its settings are: {', '.join(sorted(defaults))}"
        )
    merged = dict(defaults)
    for key, value in sizes.items():
        merged[key] = tuple(value) if isinstance(defaults[key], tuple) else value
    return merged


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Runs the block with torch's CPU generator seeded, and restores the caller's state after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextmanager
def one_thread() -> Iterator[None]:
    """Runs the block with one intra-op thread, then restores the caller's count.

    The experiments' tensors are tiny: more threads only add synchronisation, and on a
    busy machine oversubscribed threads slow a run down several times.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def progress_bar(total: int, name: str, enabled: bool) -> Any:
    """A tqdm bar on stderr counting ``total`` units of work (silent unless ``enabled``
    and tqdm is installed)."""
    return progress(
        total=total, desc=f"experiment {name}", unit="step", disable=not enabled, leave=False
    )


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values: a smoothed loss curve of the same length."""
    v = np.asarray(values, dtype=np.float64)
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(idx - max(1, window), 0)
    return (c[idx] - c[lo]) / (idx - lo)


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.8) -> tuple[Any, list]:
    """A matplotlib figure with ``ncols`` axes, drawn off-screen (no pyplot, no GUI backend).

    Raises:
        ImportError: matplotlib is not installed (it comes with ``layernorm[report]``).
    """
    figure = require("matplotlib.figure", "report", "layernorm experiment")
    fig = figure.Figure(figsize=(width * ncols, height), layout="constrained")
    axes = [fig.add_subplot(1, ncols, k + 1) for k in range(ncols)]
    return fig, axes


def _plain(value: Any) -> Any:
    """JSON-ready: NumPy scalars and arrays to Python, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def finish(out: Path, name: str, fig: Any, result: dict[str, Any], started: float) -> dict:
    """Saves ``fig`` to ``out/NAME.png`` and ``result`` to ``out/NAME.json``; returns ``result``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot, data = out / f"{name}.png", out / f"{name}.json"
    fig.savefig(plot, dpi=110)
    result = _plain(
        {
            **result,
            "seconds": round(time.perf_counter() - started, 2),
            "json": str(data),
            "plot": str(plot),
        }
    )
    data.write_text(json.dumps(result, indent=1) + "\n")
    return result
