"""``layernorm bench --model llama``: a whole model, patched vs unpatched, side by side.

A realistic small Llama (hidden 1024, 4 layers, 16 heads, intermediate 2816, vocabulary
32000; built from a config, random weights, nothing downloaded) runs forward (no gradients),
forward + backward, and greedy ``generate`` (KV cache, batch 1, every norm call one row),
in each dtype. Two copies with the same weights, one given :func:`layernorm.patch`, run in
pairs in one process (one call each, the order swapped every pair), so drift of the machine
hits both alike. The speedup is the median over pairs of unpatched time / patched time (above
1: patched faster), with a distribution-free 95% interval; forward hooks also time the calls
inside the norm modules, the only part patching changes.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import _extras

__all__ = ["add_parser", "llama_config", "report_section", "run"]

MODELS = ("llama",)


def llama_config(quick: bool = False) -> Any:
    """The benchmark's Llama config; ``quick``: a tiny one for smoke tests."""
    import transformers

    if quick:
        return transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=1024,
    )


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The median of ``values`` and a distribution-free confidence interval for it.

    The interval is ``[x_(k+1), x_(n-k)]`` of the sorted values, with the largest ``k`` whose
    coverage ``1 - 2 P(Binomial(n, 1/2) <= k)`` is at least ``confidence``. With fewer than
    six values even ``[min, max]`` covers less than 95% (``1 - 2^(1-n)``); it is returned then.

    Returns:
        ``(median, low, high)``.
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    tail = (1 - confidence) / 2
    k = 0
    while k + 1 < n - k - 1 and sum(math.comb(n, i) for i in range(k + 2)) / 2**n <= tail:
        k += 1
    return statistics.median(xs), xs[k], xs[n - 1 - k]


class _NormClock:
    """Seconds spent inside the forwards of a model's replaced-or-replaceable norm modules,
    timed by forward hooks (the same hooks on both models, so their cost cancels)."""

    def __init__(self, model: torch.nn.Module, norm_class: str) -> None:
        self.seconds = 0.0
        self._start = 0.0
        self._handles = []
        for module in model.modules():
            if type(module).__name__ == norm_class:
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._leave))

    def _enter(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _pairs(
    fn: Callable[[torch.nn.Module], Any],
    models: dict[str, torch.nn.Module],
    clocks: dict[str, _NormClock],
    repeat: int,
    seconds: float,
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Runs ``fn`` on both models in pairs, swapping who goes first each pair, until at
    least ``repeat`` pairs and ``seconds`` of wall time (at most 99 pairs); per pair: whole
    seconds and seconds inside the norms, per model name."""
    whole: list[dict[str, float]] = []
    norms: list[dict[str, float]] = []
    begin = time.perf_counter()
    while len(whole) < 99 and (len(whole) < repeat or time.perf_counter() - begin < seconds):
        order = list(models) if len(whole) % 2 == 0 else list(reversed(models))
        pair: dict[str, float] = {}
        in_norms: dict[str, float] = {}
        for name in order:
            clocks[name].seconds = 0.0
            start = time.perf_counter()
            fn(models[name])
            pair[name] = time.perf_counter() - start
            in_norms[name] = clocks[name].seconds
        whole.append(pair)
        norms.append(in_norms)
    return whole, norms


def run(
    model: str = "llama",
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    quick: bool = False,
    repeat: int = 3,
    seq: int | None = None,
    new_tokens: int | None = None,
    seconds: float = 60.0,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Times ``model`` patched and unpatched; one dict per (dtype, measurement).

    Each measurement runs in pairs (one call of each model, the order swapped every pair)
    until at least ``repeat`` pairs and ``seconds`` seconds; warm-up calls on a short input
    compile the kernels first. ``progress``: a bar over the measurements, on stderr.

    Returns:
        dicts with ``dtype``, ``what``, ``unit`` (``"ms"`` or ``"tokens/s"``), ``plain`` and
        ``patched`` (medians over the pairs), ``ratio`` (the median over pairs of unpatched
        time / patched time: above 1, the patched model is faster) with ``low`` and ``high``
        (its 95% interval, :func:`median_interval`), ``pairs``, and ``plain_norms`` and
        ``patched_norms`` (median ms inside the norm modules' forwards per call).
    """
    import transformers

    import layernorm

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {list(MODELS)}")
    transformers.logging.set_verbosity_error()
    seq = seq or (32 if quick else 512)
    new_tokens = new_tokens or (4 if quick else 32)
    prompt_len = 8 if quick else 64
    config = llama_config(quick)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    rows = []
    bar = _extras.progress(total=3 * len(dtypes), desc="model", disable=not progress, leave=False)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        plain = copy.deepcopy(base).to(dtype)
        patched = copy.deepcopy(plain)
        norm_class = type(patched.model.norm).__name__
        replaced = layernorm.patch(patched)
        assert len(replaced) == 2 * config.num_hidden_layers + 1, replaced.summary()
        models = {"plain": plain, "patched": patched}
        clocks = {name: _NormClock(m, norm_class) for name, m in models.items()}
        ids = torch.randint(0, config.vocab_size, (1, seq))
        prompt = ids[:, :prompt_len]

        def forward(m: torch.nn.Module, ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                m(ids)

        def forward_backward(m: torch.nn.Module, ids: torch.Tensor = ids) -> None:
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()

        def generate(
            m: torch.nn.Module, prompt: torch.Tensor = prompt, tokens: int = new_tokens
        ) -> None:
            m.generate(  # type: ignore[operator]
                prompt,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )

        short = ids[:, :16]
        for what, fn, warm_up in (
            ("forward", forward, functools.partial(forward, ids=short)),
            ("forward+backward", forward_backward, functools.partial(forward_backward, ids=short)),
            (f"generate {new_tokens} tokens", generate, functools.partial(generate, tokens=2)),
        ):
            bar.set_description(f"{dtype_name} {what}")
            for m in models.values():  # kernels compiled for these shapes' paths
                warm_up(m)
            whole, norms = _pairs(fn, models, clocks, repeat, seconds)
            ratio, low, high = median_interval([p["plain"] / p["patched"] for p in whole])
            medians = {k: statistics.median(p[k] for p in whole) for k in models}
            row: dict[str, Any] = {
                "dtype": dtype_name,
                "what": what,
                "ratio": ratio,
                "low": low,
                "high": high,
                "pairs": len(whole),
            }
            for k in models:
                row[k] = (
                    new_tokens / medians[k] if what.startswith("generate") else 1e3 * medians[k]
                )
                row[f"{k}_norms"] = 1e3 * statistics.median(p[k] for p in norms)
            row["unit"] = "tokens/s" if what.startswith("generate") else "ms"
            rows.append(row)
            bar.update()
        for clock in clocks.values():
            clock.remove()
    bar.close()
    return rows


#: the table's columns, shared by the text and the HTML forms
COLUMNS = (
    "dtype",
    "measurement",
    "unit",
    "unpatched",
    "patched",
    "speedup",
    "95% interval",
    "pairs",
    "in norms, ms",
)


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    return (
        r["dtype"],
        r["what"],
        r["unit"],
        f"{r['plain']:.2f}",
        f"{r['patched']:.2f}",
        f"{r['ratio']:.3f}x",
        f"{r['low']:.3f}-{r['high']:.3f}",
        str(r["pairs"]),
        f"{r['plain_norms']:.2f} -> {r['patched_norms']:.2f}",
    )


_LEGEND = (
    "speedup = the median over pairs of unpatched time / patched time (above 1: patched"
    " faster), with its 95% interval; in norms: median ms per call inside the norm modules'"
    " forwards, unpatched -> patched"
)


def report_section(quick: bool) -> str:
    """An HTML fragment for ``layernorm report``: the Llama of :func:`llama_config`,
    patched vs unpatched, in float32 on a 128-token sequence (about a minute; ``quick``: the
    tiny config). Without transformers installed, a line saying so."""
    import html
    import importlib.util

    from ._html import table

    title = "<h2>Whole model: a small Llama, patched vs unpatched</h2>"
    if importlib.util.find_spec("transformers") is None:
        return title + "<p>Needs transformers (<code>pip install transformers</code>).</p>"
    rows = run(
        "llama",
        ("float32",),
        quick=quick,
        repeat=3,
        seq=None if quick else 128,
        seconds=0.0 if quick else 10.0,
    )
    size = "the tiny test config" if quick else "hidden 1024, 4 layers, sequence 128"
    return (
        title + f"<p>{html.escape(size)}; {html.escape(_LEGEND)}. The full-size run (sequence"
        " 512, float32 and bfloat16): <code>layernorm bench --model llama</code>.</p>"
        + table(COLUMNS, [_cells(r) for r in rows])
    )


def format_rows(rows: list[dict[str, Any]], header: str) -> str:
    """``rows`` of :func:`run` as a plain-text table under ``header``."""
    widths = [-9, -20, -9, 10, 10, 8, 13, 5, 16]
    lines = [header, _LEGEND, ""]
    for cells in (COLUMNS, *(_cells(r) for r in rows)):
        lines.append(
            " ".join(
                f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)
            )
        )
    return "\n".join(lines) + "\n"


def add_parser(subparsers: Any) -> None:
    """Adds ``--model`` (and its options) to the ``bench`` subcommand."""
    bench: argparse.ArgumentParser = subparsers.choices["bench"]
    group = bench.add_argument_group("whole model (--model)")
    group.add_argument(
        "--model",
        choices=MODELS,
        help="time a small realistic model patched vs unpatched instead of single calls",
    )
    group.add_argument(
        "--model-dtypes",
        default="float32,bfloat16",
        help="comma-separated (default float32,bfloat16)",
    )
    group.add_argument(
        "--model-repeat", type=int, default=3, help="at least this many pairs (default 3)"
    )
    group.add_argument(
        "--model-seconds",
        type=float,
        default=60.0,
        help="and at least this long per measurement, at most 99 pairs (default 60)",
    )
    group.add_argument("--model-out", type=Path, help="also write the table to this file")
    single_calls = bench.get_default("func")

    def dispatch(args: argparse.Namespace) -> int:
        return _main(args) if args.model else single_calls(args)

    bench.set_defaults(func=dispatch)


def _main(args: argparse.Namespace) -> int:
    from .benchmark import set_threads

    if args.model_repeat < 1:
        print(
            f"layernorm bench: error: --model-repeat must be >= 1, got {args.model_repeat}",
            file=sys.stderr,
        )
        return 2
    if args.model_seconds < 0:
        print(
            f"layernorm bench: error: --model-seconds must be >= 0, got {args.model_seconds}",
            file=sys.stderr,
        )
        return 2
    set_threads(args.threads)
    dtypes = tuple(d for d in args.model_dtypes.split(",") if d)
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            print(f"layernorm bench: error: unknown dtype {d!r}", file=sys.stderr)
            return 2
    rows = run(
        args.model,
        dtypes,
        quick=args.quick,
        repeat=args.model_repeat,
        seconds=args.model_seconds,
        progress=sys.stderr.isatty(),
    )
    import transformers

    config = llama_config(args.quick)
    header = (
        f"layernorm bench --model {args.model}{' --quick' if args.quick else ''}: "
        f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocabulary "
        f"{config.vocab_size}, sequence {32 if args.quick else 512}, batch 1, CPU, "
        f"{torch.get_num_threads()} threads; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; pairs of calls, the order swapped each pair, for at least "
        f"{args.model_repeat} pairs and {args.model_seconds:g} s per measurement"
    )
    text = format_rows(rows, header)
    print(text, end="")
    if args.model_out:
        args.model_out.parent.mkdir(parents=True, exist_ok=True)
        args.model_out.write_text(text)
    return 0
