r"""LN-LSTM vs LSTM on a long-sequence task: the adding problem.

Ba, Kiros & Hinton (2016) normalize an LSTM's gate pre-activations and cell state at every
time step with that step's own statistics, and report faster training and more stable
hidden-state dynamics on long sequences.

What is measured: the adding problem (Hochreiter & Schmidhuber 1997). Each input is a
sequence of ``seq_len`` pairs ``(value, marker)``: values uniform in [0, 1], markers 0
except at one position in the first half and one in the second; the target is the sum of
the two marked values, read from the last hidden state by a linear layer. Predicting the
mean (1.0) scores the baseline MSE of 1/6 ≈ 0.167, which is where a model that has not
found the markers stays. A :class:`~layernorm.nn.LayerNormLSTM` with ``norm="layer"`` and
one with ``norm="none"`` (a plain LSTM, the same code path) start from the same weights
and see the same batches; Adam at ``lr``, gradients clipped to norm ``clip``. Reported:
training-loss curves, the mean loss over the last tenth of the steps, the held-out MSE on
``eval_size`` fresh sequences, and the first step at which the smoothed loss falls below
half the baseline.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...nn.lstm import LayerNormLSTM, LSTMNorm
from ._common import finish, moving_average, new_figure, one_thread, progress_bar, seeded, settings

NAME = "rnn"
TITLE = "LN-LSTM vs LSTM on the adding problem"
CLAIM = "Layer normalization per time step makes an LSTM train faster on long sequences (Ba et al. 2016)."
DEFAULTS: dict[str, Any] = {
    "seq_len": 50,
    "hidden": 32,
    "batch": 32,
    "steps": 250,
    "lr": 1e-2,
    "clip": 1.0,
    "eval_size": 1000,
}
QUICK: dict[str, Any] = {"seq_len": 8, "hidden": 8, "batch": 8, "steps": 6, "eval_size": 32}
BASELINE = 1.0 / 6.0
RUNS: dict[str, LSTMNorm] = {"LSTM": "none", "LN-LSTM": "layer"}


def adding_batch(
    n: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` adding-problem inputs ``(n, seq_len, 2)`` and targets ``(n,)``."""
    values = torch.rand(n, seq_len, generator=generator)
    first = torch.randint(0, seq_len // 2, (n,), generator=generator)
    second = torch.randint(seq_len // 2, seq_len, (n,), generator=generator)
    markers = torch.zeros(n, seq_len)
    rows = torch.arange(n)
    markers[rows, first] = 1.0
    markers[rows, second] = 1.0
    return torch.stack([values, markers], dim=-1), (values * markers).sum(1)


class Regressor(torch.nn.Module):
    """An LSTM (``norm`` as in :class:`~layernorm.nn.LayerNormLSTM`) and a linear read-out of its last state."""

    def __init__(self, hidden: int, norm: LSTMNorm) -> None:
        super().__init__()
        self.lstm = LayerNormLSTM(2, hidden, norm=norm, batch_first=True)
        self.readout = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.readout(out[:, -1]).squeeze(-1)


def train(norm: LSTMNorm, seed: int, s: dict[str, Any], bar) -> dict[str, Any]:
    """Trains one regressor; returns its per-step losses, final loss and held-out MSE."""
    with seeded(seed):
        model = Regressor(s["hidden"], norm)
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"])
    data = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(s["steps"]):
        x, y = adding_batch(s["batch"], s["seq_len"], data)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip"])
        optimizer.step()
        losses.append(loss.item())
        bar.update()
    x, y = adding_batch(s["eval_size"], s["seq_len"], torch.Generator().manual_seed(seed + 2))
    with torch.no_grad():
        held_out = F.mse_loss(model(x), y).item()
    smooth = moving_average(losses, max(1, s["steps"] // 20))
    below = np.flatnonzero(smooth < BASELINE / 2)
    return {
        "losses": losses,
        "final_loss": float(np.mean(losses[-max(1, s["steps"] // 10) :])),
        "held_out_mse": held_out,
        "steps_to_half_baseline": int(below[0]) + 1 if len(below) else None,
    }


def run(out: Path, seed: int = 0, progress: bool = True, **sizes: Any) -> dict:
    """Runs the experiment, writes ``out/rnn.png`` and ``out/rnn.json``, returns the results.

    Args:
        out: folder for the files (created if missing).
        seed: seeds the weights (``seed``), the training batches (``seed + 1``) and the
            held-out batch (``seed + 2``). Default: ``0``.
        progress: show a progress bar. Default: ``True``.
        **sizes: any of :data:`DEFAULTS` (``seq_len``, ``hidden``, ``steps``, ``lr``, ...).

    Returns:
        the saved dict (see :mod:`layernorm.report.experiments._common`) with ``runs["LSTM"]`` and
        ``runs["LN-LSTM"]``: losses, final loss, held-out MSE, steps to half the baseline.
    """
    started = time.perf_counter()
    s = settings(NAME, DEFAULTS, sizes)
    if s["seq_len"] < 2:
        raise ValueError(f"seq_len must be at least 2, got {s['seq_len']}")
    bar = progress_bar(len(RUNS) * s["steps"], NAME, progress)
    with one_thread():
        runs = {label: train(norm, seed, s, bar) for label, norm in RUNS.items()}
    bar.close()

    plain, ln = runs["LSTM"], runs["LN-LSTM"]
    learned = ln["held_out_mse"] < BASELINE / 2
    better = ln["held_out_mse"] < plain["held_out_mse"]
    reproduced: bool | None = True if learned and better else (None if better else False)

    def describe(label: str) -> str:
        r = runs[label]
        when = r["steps_to_half_baseline"]
        return (
            f"{label}: final training loss {r['final_loss']:.3g}, held-out MSE {r['held_out_mse']:.3g}, "
            + (
                f"below half the baseline after {when} steps"
                if when
                else "never below half the baseline"
            )
        )

    if reproduced:
        verdict = "reproduced: LN-LSTM learns the task and ends well below the plain LSTM."
    elif better:
        verdict = "only partly: LN-LSTM ends lower than the LSTM but has not learned the task (MSE above baseline/2)."
    else:
        verdict = "does NOT reproduce here: LN-LSTM did not end below the plain LSTM."
    lines = [
        f"rnn: adding problem, seq_len={s['seq_len']}, hidden={s['hidden']}, Adam lr={s['lr']:g}, "
        f"{s['steps']} steps of batch {s['batch']}, seed {seed}; baseline MSE {BASELINE:.3f}.",
        describe("LSTM"),
        describe("LN-LSTM"),
        f"Claim (LN-LSTM trains faster): {verdict}",
    ]
    table = {
        "headers": ["model", "final training loss", "held-out MSE", "steps to MSE < baseline/2"],
        "rows": [
            [
                k,
                f"{r['final_loss']:.4g}",
                f"{r['held_out_mse']:.4g}",
                r["steps_to_half_baseline"] or "never",
            ]
            for k, r in runs.items()
        ],
    }

    fig, (ax,) = new_figure(1, width=6.5)
    window = max(1, s["steps"] // 20)
    for label, r in runs.items():
        ax.plot(
            moving_average(r["losses"], window),
            label=f"{label} (held-out MSE {r['held_out_mse']:.3g})",
        )
    ax.axhline(BASELINE, color="gray", ls=":", lw=1, label="baseline (predict 1.0)")
    ax.set(xlabel="step", ylabel=f"training MSE (mean of {window} steps)", yscale="log")
    ax.set_title(f"adding problem, T = {s['seq_len']}")
    ax.legend(fontsize=8)

    result = {
        "name": NAME,
        "title": TITLE,
        "claim": CLAIM,
        "settings": s,
        "seed": seed,
        "baseline_mse": BASELINE,
        "runs": runs,
        "checks": {"ln_lstm_learns": learned, "ln_lstm_better_than_lstm": better},
        "reproduced": reproduced,
        "summary": "\n".join(lines),
        "table": table,
    }
    return finish(out, NAME, fig, result, started)
