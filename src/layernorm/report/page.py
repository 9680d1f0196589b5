"""``layernorm report``: one self-contained HTML page (images inline) with the claims
table, the math's plots, and the benchmark and experiment sections.

Every plot is also written as a PNG beside ``index.html``.
"""

from __future__ import annotations

import html
import importlib
import math
import platform
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from .. import __version__, reference
from .._extras import progress, require
from ..checks import backends_to_check, run_checks
from ._html import img_tag, table

__all__ = [
    "plot_eigenvalues",
    "plot_h_eps",
    "plot_offset_error",
    "plot_width_error",
    "write_report",
]

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 70em; margin: 2em auto; padding: 0 1em; }
table { border-collapse: collapse; margin: 1em 0; } td, th { border: 1px solid #ccc; padding: .3em .6em; }
th { background: #f3f3f3; } img { max-width: 100%; } .pass { color: #070; } .fail { color: #b00; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; } table { display: block; overflow-x: auto; }
"""


def _figure():
    matplotlib = require("matplotlib", "report", "layernorm report")
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", "report", "layernorm report")


def plot_h_eps(path: Path, eps_values: tuple[float, ...] = (0.01, 0.1, 1.0, 4.0)) -> Path:
    """``h_eps(t)`` on ``(-t, 0, t)`` and its derivative, measured through the library's
    ``layer_norm`` (dots) beside the closed form (lines), with the asymptotes ``±sqrt(3/2)``."""
    from ..ops import layer_norm

    plt = _figure()
    t = np.linspace(-6, 6, 601)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = torch.tensor(np.stack([-t, 0 * t, t], axis=1))
    for eps in eps_values:
        (line,) = ax.plot(t, reference.h_eps(t, eps), label=f"eps = {eps:g}")
        measured = layer_norm(rows, 3, eps=eps)[:, 2].numpy()
        ax.plot(t[::30], measured[::30], "o", ms=3, color=line.get_color())
        ax2.plot(
            t, reference.h_eps_derivative(t, eps), color=line.get_color(), label=f"eps = {eps:g}"
        )
    for sign in (1, -1):
        ax.axhline(sign * math.sqrt(1.5), ls="--", color="gray", lw=1)
    ax.set(title="h_eps(t): third core coordinate of (-t, 0, t)", xlabel="t", ylabel="h_eps(t)")
    ax2.set(title="h'_eps(t) = eps / (2t²/3 + eps)^(3/2)", xlabel="t", yscale="log")
    ax.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_eigenvalues(path: Path, d: int = 8, eps: float = 0.1) -> Path:
    """The core Jacobian's eigenvalues, times ``sqrt(eps)``, against ``q/eps``: closed form
    (lines) beside the eigenvalues of the computed Jacobian (dots). The Lipschitz bound is 1."""
    plt = _figure()
    rng = np.random.default_rng(0)
    ratio = np.logspace(-3, 3, 41)
    measured = []
    for r in ratio:
        v = rng.normal(size=d)
        v -= v.mean()
        v *= math.sqrt(r * eps / (v @ v / d))  # q = r * eps
        z = v + rng.normal() * 5  # a random offset changes nothing
        measured.append(
            np.sort(np.linalg.eigvals(reference.jacobian(z, eps)).real) * math.sqrt(eps)
        )
    fig, ax = plt.subplots(figsize=(7, 4.2))
    grid = np.logspace(-3, 3, 400)
    ax.plot(grid, (1 + grid) ** -0.5, label="on v⊥ (and ⊥ 1): (q+eps)^-1/2")
    ax.plot(grid, (1 + grid) ** -1.5, label="on v: eps/(q+eps)^3/2")
    ax.axhline(1.0, ls="--", color="gray", lw=1, label="Lipschitz bound eps^-1/2")
    for r, eig in zip(ratio, measured, strict=True):
        ax.plot([r] * (d - 1), eig[1:], "k.", ms=3)
        ax.plot([r], eig[0], "kx", ms=4)
    ax.plot([], [], "k.", label="eigenvalues of the computed Jacobian")
    ax.plot([], [], "kx", label="on 1: 0")
    ax.set(
        xscale="log",
        xlabel="q / eps",
        ylabel="eigenvalue × sqrt(eps)",
        title=f"Jacobian spectrum, d = {d}",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _core_errors(inputs: list[torch.Tensor], names: list[str]) -> dict[str, list[float]]:
    """Max core error against the float64 reference of each float32 input (rows of its
    last dim), for torch.nn.functional.layer_norm and each of our backends in ``names``."""
    from ..ops import layer_norm

    series: dict[str, list[float]] = {"torch.nn.functional": []}
    series.update({f"layernorm ({n})": [] for n in names})
    for x in inputs:
        n = x.shape[-1]
        want = reference.layer_norm(x.double().numpy(), n)[0]
        outs = {"torch.nn.functional": torch.nn.functional.layer_norm(x, (n,))}
        outs.update({f"layernorm ({b})": layer_norm(x, n, backend=b) for b in names})
        for key, y in outs.items():
            series[key].append(float(np.max(np.abs(y.double().numpy() - want))))
    return series


def _plot_errors(
    path: Path,
    xs: list[float],
    series: dict[str, list[float]],
    xlabel: str,
    title: str,
    ylabel: str = "max |core error|",
    yscale: str = "log",
    bound: tuple[float, str] | None = (4e-6, "contract: 4e-6"),
) -> None:
    """Each series against ``xs`` (log x): by default the errors of :func:`_core_errors`,
    log-log, with the contract's bound dashed."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (key, errs) in enumerate(series.items()):  # shrinking marks: overlaps show
        ax.plot(xs, errs, "-", marker="osD^v*"[i % 6], ms=max(3.0, 9 - 1.5 * i), label=key)
    if bound is not None:
        ax.axhline(bound[0], ls="--", color="gray", lw=1, label=bound[1])
    ax.set(xscale="log", yscale=yscale, xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_offset_error(path: Path, names: list[str]) -> tuple[Path, list[list[str]]]:
    """Max core error against the float64 reference on float32 rows ``N(c, 1)``, for
    torch.nn.functional.layer_norm and each of our backends that runs on the CPU."""
    offsets = [0.0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6]
    gen = torch.Generator().manual_seed(0)
    inputs = [
        (torch.randn(64, 1024, dtype=torch.float64, generator=gen) + c).float() for c in offsets
    ]
    series = _core_errors(inputs, names)
    _plot_errors(
        path,
        [max(c, 1e-1) for c in offsets],
        series,
        "row offset c (0 drawn at 0.1)",
        "float32 rows N(c, 1), N = 1024: error against float64",
    )
    rows = [[f"{c:g}"] + [f"{series[k][i]:.1e}" for k in series] for i, c in enumerate(offsets)]
    return path, [["offset c", *series], *rows]


def plot_width_error(path: Path, names: list[str]) -> tuple[Path, list[list[str]]]:
    """Max core error against the float64 reference on one float32 row ``N(0, 1)`` of
    each width from 1K to 16M elements, for torch.nn.functional.layer_norm and each of
    our backends in ``names``."""
    widths = [1 << k for k in range(10, 25, 2)]
    gen = torch.Generator().manual_seed(0)
    series = _core_errors([torch.randn(1, n, generator=gen) for n in widths], names)
    _plot_errors(
        path,
        [float(n) for n in widths],
        series,
        "row width N",
        "one float32 row N(0, 1): error against float64",
    )
    rows = [[f"{n}"] + [f"{series[k][i]:.1e}" for k in series] for i, n in enumerate(widths)]
    return path, [["width N", *series], *rows]


def _claims_section() -> str:
    results = run_checks(backends_to_check())
    rows = [[r.check, r.backend, "pass" if r.passed else "FAIL", r.measured] for r in results]
    passed = sum(r.passed for r in results)
    body = table(["check", "backend", "result", "measured"], rows)
    body = body.replace("<td>pass</td>", '<td class="pass">pass</td>').replace(
        "<td>FAIL</td>", '<td class="fail">FAIL</td>'
    )
    return f"<h2>Claims checked</h2><p>{passed} of {len(results)} checks pass.</p>{body}"


def _math_section(out: Path) -> str:
    h = plot_h_eps(out / "h_eps.png")
    eig = plot_eigenvalues(out / "jacobian_eigenvalues.png")
    names = [n for n in backends_to_check() if n != "triton" or not torch.cuda.is_available()]
    offset_png, offset_rows = plot_offset_error(out / "offset_error.png", names)
    cpu = [n for n in names if n != "triton"]  # the interpreter is too slow for 16M
    width_png, width_rows = plot_width_error(out / "width_error.png", cpu)
    return (
        "<h2>The math</h2>"
        "<p>The third core coordinate of (-t, 0, t): measured through <code>layer_norm</code> "
        "(dots) and the closed form (lines); dashed: the asymptotes ±sqrt(3/2).</p>"
        + img_tag(h, "h_eps")
        + "<p>Eigenvalues of the core's Jacobian against q/eps, closed form beside the "
        "computed Jacobian: all at most eps^-1/2, the Lipschitz bound, attained as q → 0.</p>"
        + img_tag(eig, "Jacobian eigenvalues")
        + "<h2>Error independent of the row offset</h2>"
        + img_tag(offset_png, "offset error")
        + table(offset_rows[0], offset_rows[1:])
        + "<h2>Error independent of the row width</h2>"
        + img_tag(width_png, "width error")
        + table(width_rows[0], width_rows[1:])
    )


def _compiled_section() -> str:
    """Compiles the kernels and builds the compiled dispatch first if they are not here
    (as ``layernorm build`` does: the report's timings are the library's as users run it,
    and later processes start warm), and says whether the dispatch is in use."""
    from .. import compiled
    from ..backends import numba_

    numba_.build(numba_.build_processes())
    line = compiled.ensure()
    return f"<p>Compiled dispatch (small calls without Python in between): {html.escape(line)}.</p>"


def _plugin_section(module: str, call: Callable[[ModuleType], str]) -> str:
    try:
        return call(importlib.import_module(module))
    except Exception as error:  # a broken section must not lose the rest of the report
        return (
            f"<h2>{html.escape(module)}</h2><p class='fail'>failed: {html.escape(repr(error))}</p>"
        )


def write_report(
    out: Path, quick: bool = False, bench: bool = True, experiments: bool = True
) -> Path:
    """Writes ``out/index.html`` (and the PNGs beside it) and returns its path.

    Args:
        out: the output folder (created if missing).
        quick: small sizes everywhere, for a fast smoke version. Default: ``False``.
        bench: include the CPU benchmark section. Default: ``True``.
        experiments: include the experiments section; results already in
            ``out/experiments/`` are reused, missing ones are run. Default: ``True``.
    """
    _figure()  # fails now, naming the extra, rather than after the checks
    out.mkdir(parents=True, exist_ok=True)
    sections: list[tuple[str, Callable[[], str]]] = [
        ("compiled dispatch", _compiled_section),
        ("claims", _claims_section),
        ("math", lambda: _math_section(out)),
        (
            "same bits",
            lambda: _plugin_section(
                "layernorm.report.same_bits", lambda m: m.report_section(out, quick)
            ),
        ),
    ]
    if bench:
        sections.append(
            (
                "benchmarks",
                lambda: _plugin_section(
                    "layernorm.report.benchmark", lambda m: m.report_section(out / "bench", quick)
                ),
            )
        )
        sections.append(
            (
                "whole model",
                lambda: _plugin_section(
                    "layernorm.report.model_bench", lambda m: m.report_section(quick)
                ),
            )
        )
    if experiments:
        sections.append(
            (
                "experiments",
                lambda: _plugin_section(
                    "layernorm.report.experiments",
                    lambda m: m.report_section(out / "experiments", True, quick),
                ),
            )
        )
    parts = []
    with progress(sections, desc="report", unit="section") as bar:
        for name, make in bar:
            bar.set_postfix_str(name)
            parts.append(make())
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>layernorm report</title>"
        f"<style>{_STYLE}</style></head><body><h1>layernorm {__version__} report</h1>"
        f"<p>{html.escape(machine)}; backends here: {html.escape(', '.join(backends_to_check()))}.</p>"
        + "".join(parts)
        + "</body></html>"
    )
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
