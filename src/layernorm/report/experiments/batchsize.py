r"""Layer norm vs batch norm at small batch sizes, and train-mode vs eval-mode outputs.

Layer normalization computes its statistics from each example alone, so it works at any
batch size and behaves identically in training and evaluation. Batch normalization uses
the batch's statistics in training and running averages in evaluation: it cannot train on
one example at a time and degrades at batch sizes of a few (Ba et al. 2016; the seeds).

What is measured: one MLP classifier, ``64 → hidden → hidden → 10`` with a norm after each
hidden linear layer and ReLU after the norm, with this library's LayerNorm or with
:class:`torch.nn.BatchNorm1d`, trained from the same initial weights by Adam at ``lr`` for
``epochs`` epochs at each batch size, or more until at least ``min_steps`` updates (so large
batches are not simply under-trained; incomplete last batches dropped), on scikit-learn's
bundled 8×8 digits (1797 images, no download; pixels / 16; a fixed ``test_fraction`` split).
Reported: test accuracy in eval mode, and the train-vs-eval output difference: the mean and
max ``|logit|`` difference on the test set between train mode and eval mode, both run on the
same chunks of the training batch size (train mode on a copy, so no running statistic moves).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..._extras import require
from ...nn.modules import LayerNorm
from ._common import finish, new_figure, one_thread, progress_bar, seeded, settings

NAME = "batchsize"
TITLE = "Layer norm vs batch norm across batch sizes (digits)"
CLAIM = (
    "Layer norm works at any batch size and is identical in training and evaluation; batch "
    "norm fails at batch size 1, degrades at small batches, and differs between the two modes."
)
DEFAULTS: dict[str, Any] = {
    "batch_sizes": (1, 4, 32, 128),
    "epochs": 4,
    "min_steps": 300,
    "hidden": 64,
    "lr": 1e-3,
    "test_fraction": 0.25,
}
QUICK: dict[str, Any] = {
    "batch_sizes": (1, 4, 32),
    "epochs": 1,
    "min_steps": 10,
    "hidden": 16,
    "test_fraction": 0.8,
}
NORMS = ("layer", "batch")


def load_digits_split(test_fraction: float, seed: int) -> tuple[torch.Tensor, ...]:
    """Digits as float32 tensors ``(x_train, y_train, x_test, y_test)``, pixels scaled to [0, 1]."""
    datasets = require("sklearn.datasets", "report", "the batchsize experiment (digits data)")
    digits = datasets.load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = round(test_fraction * len(y))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def classifier(norm: str, hidden: int) -> torch.nn.Sequential:
    """``Linear → Norm → ReLU → Linear → Norm → ReLU → Linear`` for 64 inputs, 10 classes."""

    def make() -> torch.nn.Module:
        return LayerNorm(hidden) if norm == "layer" else torch.nn.BatchNorm1d(hidden)

    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        make(),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        make(),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def n_steps(n_train: int, batch_size: int, s: dict[str, Any]) -> int:
    """Updates at one batch size: ``epochs`` epochs, rounded up to whole epochs >= ``min_steps``."""
    per_epoch = n_train // batch_size
    epochs = max(s["epochs"], -(-s["min_steps"] // per_epoch))
    return epochs * per_epoch


def _batches(n: int, size: int, generator: torch.Generator) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=generator)
    return [order[k : k + size] for k in range(0, n - size + 1, size)]


def train_one(
    norm: str, batch_size: int, data, seed: int, s: dict[str, Any], bar
) -> dict[str, Any]:
    """Trains one classifier; returns accuracy and train-vs-eval differences, or the error."""
    x_train, y_train, x_test, y_test = data
    with seeded(seed):
        model = classifier(norm, s["hidden"])
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"])
    shuffle = torch.Generator().manual_seed(seed + 1)
    model.train()
    steps, total = 0, n_steps(len(y_train), batch_size, s)
    try:
        while steps < total:
            for idx in _batches(len(y_train), batch_size, shuffle):
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                steps += 1
                bar.update()
    except ValueError as error:  # batch norm refuses to train on one example
        bar.update(total - steps)
        return {"ok": False, "error": str(error), "steps": steps}

    with torch.no_grad():
        model.eval()
        eval_logits = model(x_test)
        train_mode = copy.deepcopy(model).train()  # a copy: its running statistics may move
        # Both modes see the same chunks of the training batch size: a matrix product's
        # rounding depends on how many rows it gets, and that is not what is measured here.
        # A last chunk of one example cannot run through batch norm in train mode.
        chunks = [x_test[k : k + batch_size] for k in range(0, len(x_test), batch_size)]
        chunks = [c for c in chunks if len(c) > 1 or norm == "layer"]
        keep = sum(len(c) for c in chunks)
        chunked_eval = torch.cat([model(c) for c in chunks])
        train_logits = torch.cat([train_mode(c) for c in chunks])
    diff = (train_logits - chunked_eval).abs()
    return {
        "ok": True,
        "steps": steps,
        "accuracy": (eval_logits.argmax(1) == y_test).float().mean().item(),
        "train_mode_accuracy": (train_logits.argmax(1) == y_test[:keep]).float().mean().item(),
        "train_eval_mean_abs_diff": diff.mean().item(),
        "train_eval_max_abs_diff": diff.max().item(),
    }


def run(out: Path, seed: int = 0, progress: bool = True, **sizes: Any) -> dict:
    """Runs the experiment, writes ``out/batchsize.png`` and ``out/batchsize.json``, returns the results.

    Args:
        out: folder for the files (created if missing).
        seed: seeds the split, the initial weights (``seed``) and the shuffling (``seed + 1``).
            Default: ``0``.
        progress: show a progress bar. Default: ``True``.
        **sizes: any of :data:`DEFAULTS` (``batch_sizes``, ``epochs``, ``hidden``, ``lr``, ...).

    Returns:
        the saved dict (see :mod:`layernorm.report.experiments._common`) with ``runs[norm][batch
        size]``: accuracy and train-vs-eval differences, or ``ok: False`` and the error.
    """
    started = time.perf_counter()
    s = settings(NAME, DEFAULTS, sizes)
    sizes_ = sorted(s["batch_sizes"])
    data = load_digits_split(s["test_fraction"], seed)
    n_train = len(data[1])
    bar = progress_bar(len(NORMS) * sum(n_steps(n_train, b, s) for b in sizes_), NAME, progress)
    runs: dict[str, dict[int, dict[str, Any]]] = {norm: {} for norm in NORMS}
    with one_thread():
        for norm in NORMS:
            for b in sizes_:
                runs[norm][b] = train_one(norm, b, data, seed, s, bar)
    bar.close()
    return _report(out, runs, sizes_, seed, s, n_train, started)


def _report(out, runs, sizes_, seed, s, n_train, started) -> dict:
    ln, bn = runs["layer"], runs["batch"]
    ln_accs = [ln[b]["accuracy"] for b in sizes_]
    ln_exact = all(ln[b]["train_eval_max_abs_diff"] == 0.0 for b in sizes_)
    ln_stable = max(ln_accs) - min(ln_accs) <= 0.05
    bn_ok = [b for b in sizes_ if bn[b]["ok"]]
    bn_failed = [b for b in sizes_ if not bn[b]["ok"]]
    big = max(sizes_)
    small = [b for b in bn_ok if b <= 4]
    bn_degrades = bool(bn_failed) or any(
        bn[b]["accuracy"] < bn[big]["accuracy"] - 0.02 for b in small
    )
    bn_differs = all(bn[b]["train_eval_max_abs_diff"] > 0 for b in bn_ok)
    claims = {
        "layer_norm_train_equals_eval": ln_exact,
        "layer_norm_accuracy_stable_across_batch_sizes": ln_stable,
        "batch_norm_fails_or_degrades_at_small_batches": bn_degrades,
        "batch_norm_train_differs_from_eval": bn_differs,
    }
    reproduced: bool | None = all(claims.values()) or (None if ln_exact and bn_differs else False)

    def acc(r: dict) -> str:
        return f"{r['accuracy']:.3f}" if r["ok"] else "failed"

    def diff(r: dict) -> str:
        return f"{r['train_eval_mean_abs_diff']:.3g}" if r["ok"] else "-"

    lines = [
        f"batchsize: digits ({n_train} train images), MLP hidden={s['hidden']}, Adam lr={s['lr']:g}, "
        f"{s['epochs']} epochs per batch size (at least {s['min_steps']} updates), seed {seed}.",
        "test accuracy  LN: "
        + ", ".join(f"b={b} {acc(ln[b])}" for b in sizes_)
        + "  |  BN: "
        + ", ".join(f"b={b} {acc(bn[b])}" for b in sizes_),
        "train-vs-eval mean |Δlogit|  LN: "
        + ", ".join(f"b={b} {diff(ln[b])}" for b in sizes_)
        + "  |  BN: "
        + ", ".join(f"b={b} {diff(bn[b])}" for b in sizes_),
    ]
    if bn_failed:
        lines.append(
            f"BN cannot train at batch size {', '.join(map(str, bn_failed))}: torch says "
            f"“{bn[bn_failed[0]]['error']}”."
        )
    verdicts = {
        "layer_norm_train_equals_eval": (
            "LN gives bit-identical outputs in train and eval mode",
            "LN's train and eval outputs differ",
        ),
        "layer_norm_accuracy_stable_across_batch_sizes": (
            "LN's accuracy is stable across batch sizes (within 0.05)",
            "LN's accuracy varies by more than 0.05 across batch sizes",
        ),
        "batch_norm_fails_or_degrades_at_small_batches": (
            "BN fails or loses accuracy at batch sizes <= 4",
            "BN does not lose accuracy at small batch sizes here",
        ),
        "batch_norm_train_differs_from_eval": (
            "BN's train-mode outputs differ from eval mode",
            "BN's train and eval outputs agree",
        ),
    }
    for key, ok in claims.items():
        yes, no = verdicts[key]
        lines.append(f"{yes}: reproduced." if ok else f"{no}: this part does NOT reproduce.")
    table = {
        "headers": [
            "batch size",
            "LN accuracy",
            "BN accuracy",
            "LN train-vs-eval mean |Δ|",
            "BN train-vs-eval mean |Δ|",
            "BN train-mode accuracy",
        ],
        "rows": [
            [
                b,
                acc(ln[b]),
                acc(bn[b]),
                diff(ln[b]),
                diff(bn[b]),
                f"{bn[b]['train_mode_accuracy']:.3f}" if bn[b]["ok"] else "failed",
            ]
            for b in sizes_
        ],
    }

    fig, (ax_acc, ax_diff) = new_figure(2)
    ax_acc.plot(sizes_, ln_accs, "-o", label="LayerNorm")
    ax_acc.plot(bn_ok, [bn[b]["accuracy"] for b in bn_ok], "-s", label="BatchNorm (eval mode)")
    for b in bn_failed:
        ax_acc.plot([b], [0.0], "x", color="C1", ms=10)
        ax_acc.annotate(
            "BN cannot train", (b, 0.0), textcoords="offset points", xytext=(6, 6), fontsize=8
        )
    ax_acc.set(xscale="log", xlabel="batch size", ylabel="test accuracy", ylim=(-0.03, 1.03))
    ax_acc.set_xticks(sizes_, [str(b) for b in sizes_])
    ax_acc.set_title("digits test accuracy")
    ax_acc.legend(fontsize=8)
    width = 0.38
    pos = np.arange(len(sizes_))
    ln_d = [ln[b]["train_eval_mean_abs_diff"] for b in sizes_]
    bn_d = [bn[b]["train_eval_mean_abs_diff"] if bn[b]["ok"] else 0.0 for b in sizes_]
    ax_diff.bar(pos - width / 2, ln_d, width, label="LayerNorm")
    ax_diff.bar(pos + width / 2, bn_d, width, label="BatchNorm")
    for k, b in enumerate(sizes_):
        if ln_d[k] == 0.0:
            ax_diff.annotate("0", (pos[k] - width / 2, 0), ha="center", va="bottom", fontsize=8)
        if not bn[b]["ok"]:
            ax_diff.annotate(
                "failed", (pos[k] + width / 2, 0), ha="center", va="bottom", fontsize=8
            )
    ax_diff.set_xticks(pos, [str(b) for b in sizes_])
    ax_diff.set(xlabel="batch size", ylabel="mean |logit(train mode) − logit(eval mode)|")
    ax_diff.set_title("train-vs-eval output difference")
    ax_diff.legend(fontsize=8)

    result = {
        "name": NAME,
        "title": TITLE,
        "claim": CLAIM,
        "settings": s,
        "seed": seed,
        "runs": {norm: {str(b): r for b, r in runs[norm].items()} for norm in runs},
        "checks": claims,
        "reproduced": reproduced,
        "summary": "\n".join(lines),
        "table": table,
    }
    return finish(out, NAME, fig, result, started)
