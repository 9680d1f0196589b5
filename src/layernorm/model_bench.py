"""``layernorm bench --model llama``: a whole model, patched vs unpatched, side by side.

A realistic small Llama (hidden 1024, 4 layers, 16 heads, intermediate 2816, vocabulary
32000; built from a config, random weights, nothing downloaded) runs forward (no gradients),
forward + backward, and greedy ``generate`` (KV cache, batch 1, every norm call one row),
in each dtype. Two copies with the same weights, one given :func:`layernorm.patch`, alternate
call by call in one process, so drift of the machine hits both alike; each figure is the
median of ``--model-repeat`` runs, and the ratio is unpatched time / patched time (above 1:
patched faster).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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


def _seconds(fn: Callable[[torch.nn.Module], Any], m: torch.nn.Module) -> float:
    start = time.perf_counter()
    fn(m)
    return time.perf_counter() - start


def run(
    model: str = "llama",
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    quick: bool = False,
    repeat: int = 5,
    seq: int | None = None,
    new_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """Times ``model`` patched and unpatched; one dict per (dtype, measurement).

    Returns:
        dicts with ``dtype``, ``what``, ``unit`` (``"ms"`` or ``"tokens/s"``), ``plain``,
        ``patched`` (medians) and ``ratio`` (how many times faster the patched model is).
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
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        plain = copy.deepcopy(base).to(dtype)
        patched = copy.deepcopy(plain)
        replaced = layernorm.patch(patched)
        assert len(replaced) == 2 * config.num_hidden_layers + 1, replaced.summary()
        ids = torch.randint(0, config.vocab_size, (1, seq))
        prompt = ids[:, :prompt_len]

        def forward(m: torch.nn.Module, ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                m(ids)

        def forward_backward(m: torch.nn.Module, ids: torch.Tensor = ids) -> None:
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()

        def generate(m: torch.nn.Module, prompt: torch.Tensor = prompt) -> None:
            m.generate(  # type: ignore[operator]
                prompt,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

        for what, fn in (
            ("forward", forward),
            ("forward+backward", forward_backward),
            (f"generate {new_tokens} tokens", generate),
        ):
            times: dict[str, list[float]] = {"plain": [], "patched": []}
            for m in (plain, patched):  # warm-up: kernels compiled, caches filled
                fn(m)
            for _ in range(repeat):
                for name, m in (("plain", plain), ("patched", patched)):
                    times[name].append(_seconds(fn, m))
            medians = {k: statistics.median(v) for k, v in times.items()}
            if what.startswith("generate"):
                row = {
                    "unit": "tokens/s",
                    "plain": new_tokens / medians["plain"],
                    "patched": new_tokens / medians["patched"],
                }
            else:
                row = {
                    "unit": "ms",
                    "plain": 1e3 * medians["plain"],
                    "patched": 1e3 * medians["patched"],
                }
            row.update(dtype=dtype_name, what=what, ratio=medians["plain"] / medians["patched"])
            rows.append(row)
    return rows


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
    rows = run("llama", ("float32",), quick=quick, repeat=3, seq=None if quick else 128)
    cells = [
        (
            r["dtype"],
            r["what"],
            r["unit"],
            f"{r['plain']:.2f}",
            f"{r['patched']:.2f}",
            f"{r['ratio']:.3f}x",
        )
        for r in rows
    ]
    size = "the tiny test config" if quick else "hidden 1024, 4 layers, sequence 128"
    return (
        title + f"<p>{html.escape(size)}, medians of 3 interleaved runs; speedup = unpatched time /"
        " patched time. The full-size run (sequence 512, float32 and bfloat16):"
        " <code>layernorm bench --model llama</code>.</p>"
        + table(("dtype", "measurement", "unit", "unpatched", "patched", "speedup"), cells)
    )


def format_rows(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        f"{'dtype':<9} {'measurement':<20} {'unit':<9} {'unpatched':>10} {'patched':>10} "
        f"{'speedup':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['dtype']:<9} {r['what']:<20} {r['unit']:<9} {r['plain']:>10.2f} "
            f"{r['patched']:>10.2f} {r['ratio']:>7.3f}x"
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
    group.add_argument("--model-repeat", type=int, default=5, help="runs per median (default 5)")
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
    set_threads(args.threads)
    dtypes = tuple(d for d in args.model_dtypes.split(",") if d)
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            print(f"layernorm bench: error: unknown dtype {d!r}", file=sys.stderr)
            return 2
    rows = run(args.model, dtypes, quick=args.quick, repeat=args.model_repeat)
    import transformers

    config = llama_config(args.quick)
    header = (
        f"layernorm bench --model {args.model}{' --quick' if args.quick else ''}: "
        f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocabulary "
        f"{config.vocab_size}, sequence {32 if args.quick else 512}, batch 1, CPU, "
        f"{torch.get_num_threads()} threads; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; medians of {args.model_repeat} interleaved runs; "
        "speedup = unpatched time / patched time"
    )
    text = format_rows(rows, header)
    print(text, end="")
    if args.model_out:
        args.model_out.parent.mkdir(parents=True, exist_ok=True)
        args.model_out.write_text(text)
    return 0
