r"""Post-LN vs Pre-LN: the gradient of every layer's feed-forward weights at initialization.

Xiong et al. (2020, "On Layer Normalization in the Transformer Architecture") bound the
gradient of the last layer's FFN weight ``W2`` at initialization: for Post-LN it is
``O(d·sqrt(ln d))``, whatever the depth ``L``; for Pre-LN ``O(d·sqrt(ln d / L))``, shrinking like
``1/sqrt(L)``, because the residual stream grows like ``sqrt(L)`` and the final norm divides
by it. Hence Post-LN's large gradients near the output and its need for warm-up.

What is measured: Xavier-initialized :class:`~layernorm.nn.TransformerStack` s (Pre-LN with
the final norm) of ``L`` layers for each ``L`` in ``layers``, several seeds each. The
input is ``N(0, 1)`` noise of shape ``(batch, seq_len, d_model)``; the loss is the softmax
cross-entropy of a fixed random (Xavier) linear read-out of the stack's output to
``classes`` classes against random labels, averaged over tokens (a language model's loss at
initialization). After one backward pass, the Frobenius norms of ``∇W1`` and ``∇W2`` of
every layer's FFN, and the RMS of the residual stream that enters the final norm, averaged
over seeds. For one seed, Post-LN and Pre-LN get the same weights, inputs and labels. The trends in ``L`` are the slopes of least-squares lines in log-log axes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from ...nn.blocks import NormPosition, TransformerBlock, TransformerStack
from ._common import finish, new_figure, one_thread, progress_bar, seeded, settings

NAME = "prenorm"
TITLE = "Post-LN vs Pre-LN: FFN gradient norms at initialization"
CLAIM = (
    "At initialization Post-LN's last-layer FFN gradient is larger than Pre-LN's and does not "
    "depend on L; Pre-LN's shrinks like 1/sqrt(L) (Xiong et al. 2020)."
)
DEFAULTS: dict[str, Any] = {
    "layers": (6, 12, 24),
    "seeds": 8,
    "d_model": 64,
    "n_heads": 4,
    "d_ff": 256,
    "batch": 16,
    "seq_len": 16,
    "classes": 64,
}
QUICK: dict[str, Any] = {
    "layers": (2, 4, 8),
    "seeds": 2,
    "d_model": 16,
    "d_ff": 32,
    "batch": 4,
    "seq_len": 4,
}

#: Pre-LN's slope counts as "like 1/sqrt(L)" within this distance of -1/2.
SLOPE_TOLERANCE = 0.15
#: Post-LN's slope counts as "independent of L" below this in absolute value.
FLAT_TOLERANCE = 0.15


#: the two norm positions compared, in the order they are run
POSITIONS: tuple[NormPosition, ...] = ("post", "pre")


def _grad_norm(layer: torch.nn.Linear) -> float:
    grad = layer.weight.grad
    assert grad is not None  # called after the backward pass, which reaches every FFN
    return grad.norm().item()


def gradient_norms(
    n_layers: int, norm_position: NormPosition, seed: int, s: dict[str, Any]
) -> tuple[np.ndarray, float]:
    """Per-layer ``(‖∇W1‖_F, ‖∇W2‖_F)`` (shape ``(L, 2)``) and the RMS entering the final norm."""
    with seeded(seed):
        stack = TransformerStack(n_layers, s["d_model"], s["n_heads"], s["d_ff"], norm_position)
        readout = torch.nn.Linear(s["d_model"], s["classes"])
        torch.nn.init.xavier_uniform_(readout.weight)
        torch.nn.init.zeros_(readout.bias)
        x = torch.randn(s["batch"], s["seq_len"], s["d_model"])
        labels = torch.randint(0, s["classes"], (s["batch"] * s["seq_len"],))
    # Pre-LN: the stream entering the final norm; Post-LN (final_norm is Identity): the output.
    stream: list[torch.Tensor] = []
    stack.final_norm.register_forward_pre_hook(lambda _, args: stream.append(args[0].detach()))
    logits = readout(stack(x)).reshape(-1, s["classes"])
    F.cross_entropy(logits, labels).backward()
    blocks = [cast(TransformerBlock, block) for block in stack.layers]
    grads = np.array(
        [[_grad_norm(block.ffn.linear1), _grad_norm(block.ffn.linear2)] for block in blocks]
    )
    return grads, stream[0].pow(2).mean().sqrt().item()


def _slope(xs: list[int], ys: list[float]) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def run(out: Path, seed: int = 0, progress: bool = True, **sizes: Any) -> dict:
    """Runs the experiment, writes ``out/prenorm.png`` and ``out/prenorm.json``, returns the results.

    Args:
        out: folder for the files (created if missing).
        seed: base seed; run ``k`` of depth ``L`` uses ``seed + 1000·k + L``. Default: ``0``.
        progress: show a progress bar. Default: ``True``.
        **sizes: any of :data:`DEFAULTS` (``layers``, ``seeds``, ``d_model``, ...).

    Returns:
        the saved dict (see :mod:`layernorm.report.experiments._common`) with, per position and
        ``L``, the seed-mean per-layer norms ``grad_w1``, ``grad_w2``, the stream RMS, and
        the fitted ``slopes``.
    """
    started = time.perf_counter()
    s = settings(NAME, DEFAULTS, sizes)
    depths = sorted(set(s["layers"]))
    if len(depths) < 2:
        raise ValueError(f"prenorm needs at least two depths to fit a trend, got layers={depths}")
    with one_thread():
        per = _measure(depths, seed, progress, s)
    return _report(out, per, depths, seed, s, started)


def _measure(depths: list[int], seed: int, progress: bool, s: dict[str, Any]) -> dict:
    bar = progress_bar(2 * len(depths) * s["seeds"], NAME, progress)
    per: dict[str, dict[int, dict[str, Any]]] = {"post": {}, "pre": {}}
    for position in POSITIONS:
        for depth in depths:
            runs = []
            for k in range(s["seeds"]):
                runs.append(gradient_norms(depth, position, seed + 1000 * k + depth, s))
                bar.update()
            grads = np.stack([g for g, _ in runs])  # (seeds, L, 2)
            per[position][depth] = {
                "grad_w1": grads[:, :, 0].mean(0),
                "grad_w2": grads[:, :, 1].mean(0),
                "grad_w2_std": grads[:, :, 1].std(0),
                "stream_rms": float(np.mean([r for _, r in runs])),
            }
    bar.close()
    return per


def _report(
    out: Path, per: dict, depths: list[int], seed: int, s: dict[str, Any], started: float
) -> dict:
    last = {p: [float(per[p][L]["grad_w2"][-1]) for L in depths] for p in per}
    slopes = {
        "pre_last_w2": _slope(depths, last["pre"]),
        "post_last_w2": _slope(depths, last["post"]),
        "pre_stream_rms": _slope(depths, [per["pre"][L]["stream_rms"] for L in depths]),
    }
    larger = all(a > b for a, b in zip(last["post"], last["pre"], strict=True))
    pre_ok = abs(slopes["pre_last_w2"] + 0.5) <= SLOPE_TOLERANCE
    pre_down = all(b < a for a, b in zip(last["pre"], last["pre"][1:], strict=False))
    post_flat = abs(slopes["post_last_w2"]) <= FLAT_TOLERANCE
    reproduced: bool | None = True if larger and pre_ok and post_flat else None
    if not larger or not pre_down:
        reproduced = False

    def fmt(values: list[float]) -> str:
        return "/".join(f"{v:.3g}" for v in values)

    at = "/".join(map(str, depths))
    lines = [
        f"prenorm: FFN weight-gradient norms at initialization, {s['seeds']} seeds, d_model="
        f"{s['d_model']}; loss: cross-entropy of a random linear read-out against random labels.",
        f"Last layer |grad W2|: Post-LN {fmt(last['post'])}, Pre-LN {fmt(last['pre'])} at L={at}.",
        (
            "Post-LN's last-layer gradient is larger than Pre-LN's at every L: reproduced "
            f"(ratio {min(a / b for a, b in zip(last['post'], last['pre'], strict=True)):.2g}"
            f" to {max(a / b for a, b in zip(last['post'], last['pre'], strict=True)):.2g})."
            if larger
            else "Post-LN's last-layer gradient is NOT larger than Pre-LN's at every L: "
            "this claim does not reproduce here."
        ),
    ]
    pre_line = (
        f"Pre-LN last layer vs L: log-log slope {slopes['pre_last_w2']:+.2f} (claim: -0.50): "
    )
    if pre_ok:
        pre_line += "reproduced, it shrinks like 1/sqrt(L)."
    elif pre_down:
        pre_line += (
            "it decreases with L, but not like 1/sqrt(L): only partly reproduced. "
            f"The residual stream it is divided by does grow like L^{slopes['pre_stream_rms']:.2f}."
        )
    else:
        pre_line += "it does not decrease with L: does not reproduce."
    lines.append(pre_line)
    lines.append(
        f"Post-LN last layer vs L: slope {slopes['post_last_w2']:+.2f} (claim: independent of L): "
        + ("reproduced." if post_flat else "not flat, this part does not reproduce here.")
    )

    table_rows = []
    for L in depths:
        post, pre = per["post"][L], per["pre"][L]
        table_rows.append(
            [
                L,
                f"{post['grad_w2'][0]:.3g}",
                f"{post['grad_w2'][-1]:.3g}",
                f"{pre['grad_w2'][0]:.3g}",
                f"{pre['grad_w2'][-1]:.3g}",
                f"{post['grad_w2'][-1] / pre['grad_w2'][-1]:.2f}",
                f"{pre['stream_rms']:.2f}",
            ]
        )
    table = {
        "headers": [
            "L",
            "Post-LN first |∇W2|",
            "Post-LN last |∇W2|",
            "Pre-LN first |∇W2|",
            "Pre-LN last |∇W2|",
            "last: Post/Pre",
            "Pre-LN stream RMS",
        ],
        "rows": table_rows,
    }

    fig, (ax_layers, ax_depth) = new_figure(2)
    colors = dict(zip(depths, ["C0", "C1", "C2", "C3", "C4", "C5", "C6"], strict=False))
    for L in depths:
        idx = np.arange(1, L + 1)
        color = colors.get(L)
        ax_layers.plot(
            idx, per["post"][L]["grad_w2"], "-o", ms=3, color=color, label=f"Post-LN L={L}"
        )
        ax_layers.plot(
            idx, per["pre"][L]["grad_w2"], "--s", ms=3, color=color, label=f"Pre-LN L={L}"
        )
    ax_layers.set(xlabel="layer", ylabel="‖∇W2‖ (FFN, mean over seeds)", yscale="log")
    ax_layers.set_title("gradient norm per layer at init")
    ax_layers.legend(fontsize=7, ncol=2)
    ax_depth.loglog(depths, last["post"], "-o", label="Post-LN last layer")
    ax_depth.loglog(depths, last["pre"], "-s", label="Pre-LN last layer")
    ref = [last["pre"][0] * math.sqrt(depths[0] / L) for L in depths]
    ax_depth.loglog(depths, ref, ":", color="gray", label="∝ 1/sqrt(L)")
    ax_depth.set(xlabel="L (layers)", ylabel="‖∇W2‖ of the last layer")
    ax_depth.minorticks_off()
    ax_depth.set_xticks(depths, [str(L) for L in depths])
    ax_depth.set_title(
        f"Pre-LN slope {slopes['pre_last_w2']:+.2f}, Post-LN {slopes['post_last_w2']:+.2f}"
    )
    ax_depth.legend(fontsize=8)

    result = {
        "name": NAME,
        "title": TITLE,
        "claim": CLAIM,
        "settings": s,
        "seed": seed,
        "loss": "softmax cross-entropy of a fixed Xavier linear read-out vs random labels, "
        "mean over tokens; inputs N(0, 1)",
        "per_layer": {
            p: {str(L): {k: v for k, v in per[p][L].items()} for L in depths} for p in per
        },
        "last_layer_w2": last,
        "slopes": slopes,
        "checks": {
            "post_larger_than_pre_at_last_layer": larger,
            "pre_decreasing_with_L": pre_down,
            "pre_like_inverse_sqrt_L": pre_ok,
            "post_independent_of_L": post_flat,
        },
        "reproduced": reproduced,
        "summary": "\n".join(lines),
        "table": table,
    }
    return finish(out, NAME, fig, result, started)
