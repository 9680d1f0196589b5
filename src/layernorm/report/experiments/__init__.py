"""Experiments that reproduce the claims about layer normalization, one command each.

``layernorm experiment NAME`` runs one (about a minute on 2 CPU cores with the defaults),
writes ``NAME.png`` and ``NAME.json`` into ``OUT/NAME/`` and prints a summary that says
plainly whether the claim reproduced::

    prenorm     Post-LN vs Pre-LN gradient norms at initialization (Xiong et al. 2020)
    warmup      learning-rate warm-up with Post-LN and Pre-LN
    batchsize   layer norm vs batch norm at batch sizes 1..128, train vs eval mode (digits)
    rnn         LN-LSTM vs LSTM on the adding problem (Ba et al. 2016)

From Python: ``EXPERIMENTS[name](out_dir, seed=0, progress=True, **sizes) -> dict``.
"""

from __future__ import annotations

import argparse
import ast
import html
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from . import batchsize, prenorm, rnn, warmup

__all__ = ["EXPERIMENTS", "MODULES", "add_parser", "parse_sizes", "report_section"]

MODULES: dict[str, ModuleType] = {m.NAME: m for m in (prenorm, warmup, batchsize, rnn)}
#: name -> ``run(out, seed=0, progress=True, **sizes) -> dict``
EXPERIMENTS: dict[str, Callable[..., dict]] = {name: m.run for name, m in MODULES.items()}
DEFAULT_OUT = Path("layernorm-results")


def _coerce(name: str, key: str, value: Any) -> Any:
    """``value`` in the type of the experiment's default for ``key`` (int, float, str or tuple)."""
    defaults = MODULES[name].DEFAULTS
    if key not in defaults:
        raise ValueError(
            f"experiment {name!r} has no setting {key!r}; its settings are: "
            f"{', '.join(sorted(defaults))}"
        )
    default = defaults[key]
    if isinstance(default, tuple):
        items = value if isinstance(value, list | tuple) else (value,)
        return tuple(type(default[0])(v) for v in items)
    if isinstance(value, list | tuple):
        raise ValueError(f"setting {key!r} of {name!r} takes one value, got {list(value)}")
    if isinstance(default, bool) or not isinstance(default, int | float):
        return type(default)(value)
    if isinstance(default, int) and float(value) != int(float(value)):
        raise ValueError(f"setting {key!r} of {name!r} must be an integer, got {value!r}")
    return type(default)(float(value)) if isinstance(default, int) else float(value)


def parse_sizes(name: str, pairs: list[str]) -> dict[str, Any]:
    """``["steps=100", "layers=6,12"]`` -> ``{"steps": 100, "layers": (6, 12)}`` for ``name``."""
    sizes = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word such as task=sort
        sizes[key.strip()] = _coerce(name, key.strip(), value)
    return sizes


def _handle(args: argparse.Namespace) -> int:
    name = args.name
    module = MODULES[name]
    try:
        sizes = dict(module.QUICK) if args.quick else {}
        if args.steps is not None:
            sizes["steps"] = _coerce(name, "steps", args.steps)
        if args.layers is not None:
            sizes["layers"] = _coerce(name, "layers", args.layers)
        sizes.update(parse_sizes(name, args.set or []))
    except ValueError as error:
        print(f"layernorm experiment {name}: {error}")
        return 2
    out = Path(args.out) / name
    result = EXPERIMENTS[name](out, seed=args.seed, progress=not args.no_progress, **sizes)
    print(result["summary"])
    print(f"wrote {result['plot']} and {result['json']} ({result['seconds']:.0f} s)")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``experiment`` subcommand to ``subparsers``; its ``func(args)`` returns an exit code.

    ``experiment NAME [--out DIR] [--seed N] [--quick] [--steps N] [--layers N [N ...]]
    [--set KEY=VALUE ...] [--no-progress]``
    """
    settings = "; ".join(
        f"{name}: {', '.join(f'{k}={v}' for k, v in m.DEFAULTS.items())}"
        for name, m in MODULES.items()
    )
    parser = subparsers.add_parser(
        "experiment",
        help="reproduce a claim about layer normalization (prenorm, warmup, batchsize, rnn)",
        description="Runs one experiment, writes OUT/NAME/NAME.png and NAME.json, prints a "
        "summary. Settings and defaults: " + settings,
    )
    parser.add_argument("name", choices=sorted(MODULES), help="which experiment")
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help=f"results folder (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    parser.add_argument("--steps", type=int, help="training steps (warmup, rnn)")
    parser.add_argument(
        "--layers", type=int, nargs="+", help="depths (prenorm: several; warmup: one)"
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="any other setting, e.g. --set lr=3e-3 --set task=sort (repeatable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_handle)
    return parser


def _load(folder: Path, name: str) -> dict | None:
    data, plot = folder / f"{name}.json", folder / f"{name}.png"
    if not (data.is_file() and plot.is_file()):
        return None
    try:
        result = json.loads(data.read_text())
    except (OSError, ValueError):
        return None
    result["plot"] = str(plot)  # the folder may have moved since
    return result


def report_section(out_dir: Path, run_missing: bool = True, quick: bool = False) -> str:
    """The experiments as an HTML fragment: each one's plot (inline), table and summary.

    Results already in ``out_dir/NAME/`` (``NAME.json`` and ``NAME.png``) are reused; a
    missing one is run (into that folder, seed 0, ``QUICK`` sizes if ``quick``) when
    ``run_missing``, else the section says how to produce it. An experiment that raises
    is reported as failed, with its error, and the others still appear.

    Args:
        out_dir: the folder holding one subfolder per experiment.
        run_missing: run the experiments whose results are missing. Default: ``True``.
        quick: run missing ones with their tiny sizes. Default: ``False``.

    Returns:
        an HTML fragment starting with ``<h2>``.
    """
    from .._html import img_tag, table

    parts = ["<h2>Experiments</h2>"]
    for name, module in MODULES.items():
        folder = Path(out_dir) / name
        result = _load(folder, name)
        parts.append(f"<h3>{html.escape(module.TITLE)} (<code>{name}</code>)</h3>")
        parts.append(f"<p><b>Claim.</b> {html.escape(module.CLAIM)}</p>")
        if result is None and run_missing:
            try:
                result = module.run(
                    folder, seed=0, progress=False, **(module.QUICK if quick else {})
                )
            except Exception as error:  # one failed experiment must not sink the report
                parts.append(
                    f"<p><b>Failed:</b> {html.escape(type(error).__name__)}: "
                    f"{html.escape(str(error))}</p>"
                )
                continue
        if result is None:
            parts.append(
                f"<p>Not run. Run <code>layernorm experiment {name} --out "
                f"{html.escape(str(out_dir))}</code> to add it.</p>"
            )
            continue
        verdict = {True: "reproduced", False: "did not reproduce", None: "partly reproduced"}[
            result.get("reproduced")
        ]
        settings = ", ".join(f"{k}={v}" for k, v in result.get("settings", {}).items())
        parts.append(
            f"<p><b>Result: {verdict}.</b> Seed {result.get('seed')}; settings: "
            f"{html.escape(settings)}; {result.get('seconds', 0):.0f} s.</p>"
        )
        parts.append(img_tag(result["plot"], alt=f"{name} plot"))
        if result.get("table"):
            parts.append(table(result["table"]["headers"], result["table"]["rows"]))
        parts.append(f"<pre>{html.escape(result['summary'])}</pre>")
    return "\n".join(parts)
