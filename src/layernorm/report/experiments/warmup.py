r"""Learning-rate warm-up: needed by Post-LN, not by Pre-LN?

Xiong et al. (2020) trace Post-LN's need for warm-up to its large gradients near the output
at initialization: with a large learning rate from the first step, Post-LN training goes
wrong, while Pre-LN trains well without warm-up.

What is measured: four copies of a small :class:`~layernorm.nn.SequenceTransformer`
(encoder-only, ``layers`` blocks, this library's LayerNorm), Post-LN and Pre-LN, each trained
with and without a linear warm-up over the first ``warmup`` steps, by Adam
(betas 0.9, 0.98) at peak learning rate ``lr`` (constant after warm-up), on a synthetic
task: map a random sequence of ``seq_len`` tokens (ids 1..vocab-1) to its ``copy``,
``reverse`` or ``sort``, cross-entropy at every position. All four see the same batches; the
two of one position start from the same weights. Reported: the training-loss curves, the
mean loss over the last tenth of the steps, and the token accuracy on ``eval_size`` fresh
sequences.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...nn.blocks import NormPosition, SequenceTransformer
from ._common import finish, moving_average, new_figure, one_thread, progress_bar, seeded, settings

NAME = "warmup"
TITLE = "Learning-rate warm-up with Post-LN and Pre-LN"
CLAIM = (
    "Post-LN needs learning-rate warm-up (without it training fails or is much worse); "
    "Pre-LN trains as well without it (Xiong et al. 2020)."
)
DEFAULTS: dict[str, Any] = {
    "task": "reverse",
    "layers": 6,
    "d_model": 64,
    "n_heads": 4,
    "d_ff": 256,
    "vocab": 16,
    "seq_len": 16,
    "batch": 32,
    "steps": 200,
    "lr": 5e-3,
    "warmup": 50,
    "eval_size": 512,
}
QUICK: dict[str, Any] = {
    "layers": 2,
    "d_model": 16,
    "d_ff": 32,
    "seq_len": 6,
    "vocab": 6,
    "batch": 8,
    "steps": 12,
    "warmup": 4,
    "eval_size": 32,
}
TASKS = ("copy", "reverse", "sort")
#: the two norm positions compared, in the order they are run
POSITIONS: tuple[NormPosition, ...] = ("post", "pre")
#: a run counts as having learned the task at this held-out token accuracy
SOLVED = 0.9


def make_batch(task: str, n: int, seq_len: int, vocab: int, generator: torch.Generator):
    """``n`` random sequences of ids in ``[1, vocab)`` and their targets under ``task``."""
    x = torch.randint(1, vocab, (n, seq_len), generator=generator)
    if task == "copy":
        return x, x.clone()
    if task == "reverse":
        return x, x.flip(1)
    if task == "sort":
        return x, x.sort(dim=1).values
    raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")


def train(position: NormPosition, warmup: int, seed: int, s: dict[str, Any], bar) -> dict[str, Any]:
    """Trains one model; returns its per-step losses, final loss and held-out token accuracy."""
    with seeded(seed):
        model = SequenceTransformer(
            s["vocab"], s["seq_len"], s["layers"], s["d_model"], s["n_heads"], s["d_ff"], position
        )
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"], betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    data = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(s["steps"]):
        x, y = make_batch(s["task"], s["batch"], s["seq_len"], s["vocab"], data)
        loss = F.cross_entropy(model(x).reshape(-1, s["vocab"]), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.update()
    held_out = torch.Generator().manual_seed(seed + 2)
    x, y = make_batch(s["task"], s["eval_size"], s["seq_len"], s["vocab"], held_out)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(-1) == y).float().mean().item()
    tail = max(1, s["steps"] // 10)
    return {
        "losses": losses,
        "final_loss": float(np.mean(losses[-tail:])),
        "accuracy": accuracy,
        "finite": bool(np.all(np.isfinite(losses))),
    }


def run(out: Path, seed: int = 0, progress: bool = True, **sizes: Any) -> dict:
    """Runs the experiment, writes ``out/warmup.png`` and ``out/warmup.json``, returns the results.

    Args:
        out: folder for the files (created if missing).
        seed: seeds the weights (``seed``), the training batches (``seed + 1``) and the
            held-out batch (``seed + 2``). Default: ``0``.
        progress: show a progress bar. Default: ``True``.
        **sizes: any of :data:`DEFAULTS` (``task``, ``layers``, ``steps``, ``lr``, ``warmup``, ...).

    Returns:
        the saved dict (see :mod:`layernorm.report.experiments._common`) with ``runs``: for each of
        ``post``, ``post+warmup``, ``pre``, ``pre+warmup`` the losses, final loss and accuracy.
    """
    started = time.perf_counter()
    s = settings(NAME, DEFAULTS, sizes)
    if s["task"] not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {s['task']!r}")
    if not 0 < s["warmup"] <= s["steps"]:
        raise ValueError(f"warmup must be in 1..steps={s['steps']}, got {s['warmup']}")
    bar = progress_bar(4 * s["steps"], NAME, progress)
    runs: dict[str, dict[str, Any]] = {}
    with one_thread():
        for position in POSITIONS:
            runs[position] = train(position, 0, seed, s, bar)
            runs[f"{position}+warmup"] = train(position, s["warmup"], seed, s, bar)
    bar.close()

    acc = {k: r["accuracy"] for k, r in runs.items()}
    post_needs = (
        acc["post"] < SOLVED <= acc["post+warmup"] or acc["post"] < acc["post+warmup"] - 0.1
    )
    pre_fine = acc["pre"] >= acc["pre+warmup"] - 0.05
    reproduced: bool | None
    if post_needs and pre_fine:
        reproduced, verdict = True, "reproduced."
    elif not post_needs and pre_fine:
        reproduced = False
        verdict = (
            "does NOT reproduce here: Post-LN trained about as well without warm-up "
            "(try a larger --set lr=... or more layers)."
        )
    elif post_needs:
        reproduced = None
        verdict = "only partly: Post-LN needed warm-up, but Pre-LN also did worse without it."
    else:
        reproduced = False
        verdict = "does NOT reproduce: warm-up did not help Post-LN more than Pre-LN."

    def describe(key: str) -> str:
        r = runs[key]
        return (
            f"{key}: final loss {r['final_loss']:.3g}, held-out token accuracy {r['accuracy']:.2f}"
        )

    lines = [
        f"warmup: {s['task']} task, {s['layers']} layers, d_model={s['d_model']}, Adam lr={s['lr']:g}, "
        f"{s['steps']} steps, warm-up {s['warmup']} steps (one seed: {seed}).",
        *(describe(k) for k in runs),
        f"Claim (Post-LN needs warm-up, Pre-LN does not): {verdict}",
    ]
    table = {
        "headers": ["run", "final loss (last 10% of steps)", "held-out token accuracy", "finite"],
        "rows": [
            [k, f"{r['final_loss']:.4g}", f"{r['accuracy']:.3f}", r["finite"]]
            for k, r in runs.items()
        ],
    }

    fig, (ax,) = new_figure(1, width=6.5)
    styles = {
        "post": ("C3", "-"),
        "post+warmup": ("C3", "--"),
        "pre": ("C0", "-"),
        "pre+warmup": ("C0", "--"),
    }
    window = max(1, s["steps"] // 20)
    for key, r in runs.items():
        color, line = styles[key]
        label = key.replace("post", "Post-LN").replace("pre", "Pre-LN")
        label = label.replace("+warmup", ", warm-up") if "warmup" in key else f"{label}, no warm-up"
        ax.plot(
            moving_average(r["losses"], window),
            line,
            color=color,
            label=f"{label} (acc {r['accuracy']:.2f})",
        )
    ax.axvline(s["warmup"], color="gray", lw=0.8, ls=":")
    ax.set(xlabel="step", ylabel=f"training loss (mean of {window} steps)", yscale="log")
    ax.set_title(f"{s['task']} task, {s['layers']} layers, lr {s['lr']:g}")
    ax.legend(fontsize=8)

    result = {
        "name": NAME,
        "title": TITLE,
        "claim": CLAIM,
        "settings": s,
        "seed": seed,
        "runs": runs,
        "checks": {"post_needs_warmup": post_needs, "pre_fine_without_warmup": pre_fine},
        "reproduced": reproduced,
        "summary": "\n".join(lines),
        "table": table,
    }
    return finish(out, NAME, fig, result, started)
