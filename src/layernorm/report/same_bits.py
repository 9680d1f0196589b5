"""The report's "the same bits everywhere" section: how many outputs are correctly rounded
(the exact result of ``docs/contract.md`` §1 rounded once, as :mod:`.oracle` computes it),
how often any two implementations give the same bits, and whether each gives the same
bits for the same rows called one at a time, strided or as a 3-D batch.

Implementations: torch's own ``F.layer_norm`` / ``F.rms_norm``, each of our backends that
runs here (on its device: the triton backend on a GPU, or, without one, in Triton's
interpreter, which the section switches on for itself when triton is installed and not
imported yet; otherwise it is absent and the section says why), the decomposition (``layernorm._op.decomposition``: what tracing,
scripting, export and ONNX record), and, on a machine with a GPU, torch's own and our
torch backend on CUDA tensors.

Inputs: rows ``N(offset, 3)`` rounded to the dtype, random weight and bias in the dtype,
eps = 1e-5; and float32 rows of every magnitude from 1e-38 to 3e38 (the largest
``|x|`` of each row set to the magnitude) with eps = 0, so that the statistics alone
decide at every scale. Limits: the oracle is Python integers and mpmath, so the shapes
are small (a few hundred thousand elements in all); the agreement of 10**7 elements is
the tests' (tests/test_exact.py), not the report's.
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import _op, backends
from .._extras import progress
from ..checks import backends_to_check
from ._html import img_tag, table

__all__ = [
    "DTYPES",
    "VARIANTS",
    "Case",
    "Tally",
    "absent_backends",
    "cases",
    "implementations",
    "invariance",
    "measure",
    "plot_scale_share",
    "report_section",
    "scale_cases",
    "triton_interpreter",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORMATS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
OPS = ("layer_norm", "rms_norm")
_SIGN = {torch.float32: 1 << 31, torch.bfloat16: 1 << 15, torch.float16: 1 << 15}
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# rms: whether RMSNorm; (x, weight, bias, eps, rms) -> y on the CPU
Norm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, float, bool], torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One measured input: ``rows`` rows of ``n`` elements ``N(offset, 3)`` in ``dtype``,
    or, with ``magnitude`` set, rows whose largest ``|x|`` is ``magnitude``."""

    op: str
    dtype: torch.dtype
    rows: int
    n: int
    offset: float = 0.0
    magnitude: float | None = None
    eps: float = 1e-5

    def inputs(self, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(x, weight, bias)``, all in :attr:`dtype`; ``bias`` is ``None`` for rms_norm."""
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(self.rows, self.n, generator=g, dtype=torch.float64)
        if self.magnitude is None:
            z = z * 3 + self.offset
        else:
            z = z / z.abs().amax(1, keepdim=True) * self.magnitude
        w = torch.randn(self.n, generator=g).to(self.dtype)
        b = torch.randn(self.n, generator=g).to(self.dtype)
        return z.to(self.dtype), w, (None if self.op == "rms_norm" else b)


def cases(quick: bool) -> list[Case]:
    """The section's inputs: both ops, every dtype, a few shapes and offsets (float32 to
    1e6; the halves to 100, as they cannot hold a spread of 3 much further out)."""
    shapes = [(4, 768)] if quick else [(16, 768), (2, 4096)]
    wide = (0.0, 1e4) if quick else (0.0, 1e2, 1e4, 1e6)
    half = (0.0, 1e2) if quick else (0.0, 10.0, 1e2)
    return [
        Case(op, dtype, m, n, offset)
        for op in OPS
        for dtype in DTYPES
        for m, n in shapes
        for offset in (wide if dtype == torch.float32 else half)
    ]


def scale_cases(quick: bool) -> list[Case]:
    """float32 rows of each magnitude from 1e-38 to 3e38, eps = 0, both ops."""
    exponents = range(-38, 39, 8) if quick else range(-38, 39, 4)
    magnitudes = [10.0**k for k in exponents] + [3e38]
    m, n = (2, 256) if quick else (4, 1024)
    return [Case(op, torch.float32, m, n, magnitude=s, eps=0.0) for s in magnitudes for op in OPS]


def _device_of(backend: str) -> torch.device:
    cuda = torch.cuda.is_available()
    return torch.device("cuda" if cuda and backend == "triton" else "cpu")


def _ours(backend: str, device: torch.device) -> Norm:
    from ..ops import layer_norm, rms_norm

    def norm(x, w, b, eps, rms):
        x, w = x.to(device), w.to(device)
        if rms:
            return rms_norm(x, x.shape[-1], w, eps=eps, backend=backend).cpu()
        return layer_norm(x, x.shape[-1], w, b.to(device), eps=eps, backend=backend).cpu()

    return norm


def _torch_own(device: torch.device) -> Norm:
    def norm(x, w, b, eps, rms):
        x, w = x.to(device), w.to(device)
        f = torch.nn.functional
        if rms:
            return f.rms_norm(x, (x.shape[-1],), w, eps=eps).cpu()
        return f.layer_norm(x, (x.shape[-1],), w, b.to(device), eps=eps).cpu()

    return norm


def _decomposition(x, w, b, eps, rms):
    return _op.decomposition(x, None, w, None if rms else b, eps, rms)[0]


def implementations(names: list[str] | None = None) -> dict[str, Norm]:
    """The compared implementations by label: torch's own, ``layernorm (<backend>)`` for
    each backend in ``names`` (default: every one that runs here), the decomposition, and
    on a GPU torch's own and our torch backend on CUDA tensors."""
    names = backends_to_check() if names is None else names
    found: dict[str, Norm] = {"torch.nn.functional": _torch_own(torch.device("cpu"))}
    for name in names:
        device = _device_of(name)
        label = f"layernorm ({name}{', cuda' if device.type == 'cuda' else ''})"
        found[label] = _ours(name, device)
    found["decomposition"] = _decomposition
    if torch.cuda.is_available():
        found["torch.nn.functional (cuda)"] = _torch_own(torch.device("cuda"))
        found["layernorm (torch, cuda)"] = _ours("torch", torch.device("cuda"))
    return found


def absent_backends(names: list[str]) -> dict[str, str]:
    """Each known backend not in ``names``, with the reason it does not run here."""
    reasons = {}
    for name in backends.BACKENDS:
        if name in names:
            continue
        try:
            why = backends.get(name).cannot_run(torch.empty(1, 8, device=_device_of(name)))
        except RuntimeError as error:
            why = str(error)
        reasons[name] = why or "not among the backends checked here"
    return reasons


def _bits(t: torch.Tensor) -> np.ndarray:
    mask = (1 << 32) - 1 if t.dtype == torch.float32 else (1 << 16) - 1
    return t.contiguous().view(_INT[t.dtype]).numpy().astype(np.int64) & mask


def _ordered(bits: np.ndarray, sign: int) -> np.ndarray:
    """Bit patterns as integers in the order of their values (+0 and -0 both 0)."""
    magnitude = bits & (sign - 1)
    return np.where(bits & sign, -magnitude, magnitude)


@dataclass
class Tally:
    """Counts over the measured elements: ``correct[label][(op, dtype)] = (hits, total)``,
    ``agree[dtype][(a, b)]`` = elements where labels a and b give the same bits,
    ``total[dtype]``, and ``per_case``: for each case and label, the share correctly
    rounded and the worst distance in ulps from the correctly rounded value (``inf``
    for a NaN or infinity where that value is finite)."""

    correct: dict[str, dict[tuple[str, torch.dtype], list[int]]] = field(default_factory=dict)
    agree: dict[torch.dtype, dict[tuple[str, str], int]] = field(default_factory=dict)
    total: dict[torch.dtype, int] = field(default_factory=dict)
    per_case: list[tuple[Case, dict[str, tuple[float, float]]]] = field(default_factory=list)

    def share(self, label: str, op: str, dtype: torch.dtype) -> float:
        hits, total = self.correct[label][(op, dtype)]
        return hits / total

    def agreement(self, dtype: torch.dtype, a: str, b: str) -> float:
        return self.agree[dtype][(a, b)] / self.total[dtype]


def _oracle_bits(case: Case, x, w, b) -> tuple[np.ndarray, np.ndarray]:
    from . import oracle

    n = case.n
    gamma = w.double().numpy()
    beta = np.zeros(n) if b is None else b.double().numpy()
    want, zero = [], []
    for z in x.double().numpy():
        bits, is_zero = oracle.forward(
            z, gamma, beta, case.eps, case.op == "rms_norm", FORMATS[case.dtype]
        )
        want.append(bits)
        zero.append(is_zero)
    return np.stack(want), np.stack(zero)


def measure(found: dict[str, Norm], all_cases: list[Case], desc: str = "same bits") -> Tally:
    """Runs every implementation on every case (the inputs of the i-th case drawn with
    seed i) and counts against the oracle. An exactly zero result counts as correctly
    rounded with either sign."""
    tally = Tally()
    labels = list(found)
    with progress(all_cases, desc=desc, unit="case", leave=False) as bar:
        for seed, case in enumerate(bar):
            x, w, b = case.inputs(seed)
            want, zero = _oracle_bits(case, x, w, b)
            sign = _SIGN[case.dtype]
            got = {
                label: _bits(norm(x, w, b, case.eps, case.op == "rms_norm")).reshape(want.shape)
                for label, norm in found.items()
            }
            worst: dict[str, tuple[float, float]] = {}
            for label in labels:
                g = got[label]
                hit = (g == want) | (zero & ((g & (sign - 1)) == 0))
                counts = tally.correct.setdefault(label, {}).setdefault(
                    (case.op, case.dtype), [0, 0]
                )
                counts[0] += int(hit.sum())
                counts[1] += hit.size
                nonfinite = (g & (sign - 1)) >= _exponent_mask(case.dtype)
                ulps = np.abs(_ordered(g, sign) - _ordered(want, sign)).astype(np.float64)
                ulps[hit] = 0.0
                ulps[nonfinite & ~hit] = math.inf
                worst[label] = (float(hit.mean()), float(ulps.max(initial=0.0)))
            tally.per_case.append((case, worst))
            pairs = tally.agree.setdefault(case.dtype, {})
            for a in labels:
                for c in labels:
                    pairs[(a, c)] = pairs.get((a, c), 0) + int((got[a] == got[c]).sum())
            tally.total[case.dtype] = tally.total.get(case.dtype, 0) + want.size
    return tally


def _row_by_row(norm: Norm) -> Norm:
    def each(x, w, b, eps, rms):
        return torch.cat([norm(x[i : i + 1], w, b, eps, rms) for i in range(x.shape[0])])

    return each


def _strided(norm: Norm) -> Norm:
    def strided(x, w, b, eps, rms):
        rows = torch.zeros(x.shape[0], x.shape[1] + 8, dtype=x.dtype)[:, : x.shape[1]]
        return norm(rows.copy_(x), w, b, eps, rms)

    return strided


def _three_d(norm: Norm) -> Norm:
    def batch(x, w, b, eps, rms):
        return norm(x.view(x.shape[0], 1, x.shape[1]), w, b, eps, rms).reshape(x.shape)

    return batch


VARIANTS: dict[str, Callable[[Norm], Norm]] = {
    "each row alone": _row_by_row,
    "strided rows (stride N + 8)": _strided,
    "as a 3-D batch (M, 1, N)": _three_d,
}


def invariance(found: dict[str, Norm], some: list[Case]) -> dict[str, dict[str, float]]:
    """For each implementation and each of :data:`VARIANTS` (the same rows called another
    way), the share of elements whose bits equal those of the plain (M, N) call."""
    equal = {label: dict.fromkeys(VARIANTS, 0) for label in found}
    total = 0
    with progress(some, desc="layouts", unit="case", leave=False) as bar:
        for seed, case in enumerate(bar):
            x, w, b = case.inputs(seed)
            rms = case.op == "rms_norm"
            for label, norm in found.items():
                plain = _bits(norm(x, w, b, case.eps, rms))
                for variant, make in VARIANTS.items():
                    other = _bits(make(norm)(x, w, b, case.eps, rms))
                    equal[label][variant] += int((other == plain).sum())
            total += x.numel()
    return {label: {v: k / total for v, k in row.items()} for label, row in equal.items()}


def gradient_agreement(
    found: dict[str, Norm], some: list[Case]
) -> dict[torch.dtype, tuple[int, dict[tuple[str, str], int]]]:
    """Per dtype: the number of ``dweight`` and ``dbias`` elements over ``some`` cases
    (``dy`` N(0, 1), drawn with seed 1000 + i) and, for each pair of implementations,
    on how many of them the two give the same bits."""
    counts: dict[torch.dtype, tuple[int, dict[tuple[str, str], int]]] = {}
    for i, case in enumerate(some):
        x, w, b = case.inputs(i)
        g = torch.Generator().manual_seed(1000 + i)
        dy = torch.randn(x.shape, generator=g).to(case.dtype)
        bits = {}
        for label, norm in found.items():
            params = [w.clone().requires_grad_()]
            if b is not None:
                params.append(b.clone().requires_grad_())
            y = norm(x, params[0], params[1] if b is not None else None, case.eps, b is None)
            grads = torch.autograd.grad(y, params, dy)
            bits[label] = np.concatenate([_bits(grad) for grad in grads])
        total, agree = counts.get(case.dtype, (0, {}))
        for a in found:
            for c in found:
                agree[(a, c)] = agree.get((a, c), 0) + int((bits[a] == bits[c]).sum())
        counts[case.dtype] = (total + len(bits[next(iter(found))]), agree)
    return counts


def _exponent_mask(dtype: torch.dtype) -> int:
    return {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}[dtype]


def _percent(share: float) -> str:
    """A share as a percentage that never reads 100% unless every element is."""
    if share in (0.0, 1.0):
        return f"{share:.0%}"
    return f"{math.floor(share * 1e5) / 1e3:.3f}%"


def _ulps(value: float) -> str:
    return "NaN/inf" if math.isinf(value) else f"{value:.3g}"


def plot_scale_share(path: Path, tally: Tally) -> tuple[Path, list[list[str]]]:
    """The share of correctly rounded float32 outputs (layer_norm and rms_norm pooled)
    against the rows' magnitude, per implementation, from the scale cases of ``tally``;
    and the table beside it (share, and the worst error in ulps)."""
    from .page import _plot_errors

    magnitudes = sorted({c.magnitude for c, _ in tally.per_case if c.magnitude is not None})
    labels = list(tally.correct)
    share: dict[str, list[float]] = {label: [] for label in labels}
    worst: dict[str, list[float]] = {label: [] for label in labels}
    for s in magnitudes:
        rows = [(c, r) for c, r in tally.per_case if c.magnitude == s]
        for label in labels:
            share[label].append(100 * float(np.mean([r[label][0] for _, r in rows])))
            worst[label].append(max(r[label][1] for _, r in rows))
    _plot_errors(
        path,
        magnitudes,
        share,
        "row magnitude (largest |x| of the row)",
        "float32 rows, eps = 0: correctly rounded outputs",
        ylabel="correctly rounded outputs (%)",
        yscale="linear",
        bound=None,
    )
    body = [
        [f"{s:.0e}"] + [f"{_percent(share[k][i] / 100)} ({_ulps(worst[k][i])})" for k in labels]
        for i, s in enumerate(magnitudes)
    ]
    return path, [["magnitude", *labels], *body]


@contextlib.contextmanager
def triton_interpreter() -> Iterator[None]:
    """Runs the block with ``TRITON_INTERPRET=1`` where that makes the triton backend run
    CPU tensors: no GPU, triton installed and not imported yet (or imported interpreted).
    Triton fixes its mode when first imported, so after the block triton stays imported
    in interpreter mode for the rest of the process; the variable is restored."""
    usable = not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
    if usable and "triton" in sys.modules:
        from ..backends import triton_

        usable = triton_._triton_interprets()
    if not usable:
        yield
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    backends.forget("triton")
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
        backends.forget("triton")


def report_section(out: Path, quick: bool = False, names: list[str] | None = None) -> str:
    """The section's HTML; writes ``out/scale_correct.png``. ``names``: the backends
    (default: every one that runs here, the triton backend in its interpreter on a
    machine without a GPU)."""
    with triton_interpreter():
        return _section(out, quick, backends_to_check() if names is None else names)


def _section(out: Path, quick: bool, names: list[str]) -> str:
    found = implementations(names)
    measured = cases(quick)
    main = measure(found, measured)
    scale = measure(found, scale_cases(quick), desc="scale range")
    labels = list(found)
    headers = ["implementation"] + [f"{op} {FORMATS[d]}" for op in OPS for d in DTYPES]
    shares = [
        [label]
        + [
            _percent(main.share(label, op, d)) if (op, d) in main.correct[label] else "-"
            for op in OPS
            for d in DTYPES
        ]
        for label in labels
    ]
    matrices = "".join(
        f"<p>{FORMATS[d]}, {main.total[d]} elements:</p>"
        + table(
            ["", *labels],
            [[a] + [_percent(main.agreement(d, a, b)) for b in labels] for a in labels],
        )
        for d in DTYPES
        if d in main.total
    )
    png, scale_rows = plot_scale_share(out / "scale_correct.png", scale)
    first = measured[0]
    same_shape = [c for c in measured if (c.rows, c.n, c.offset) == (first.rows, first.n, 0.0)]
    layouts = invariance(found, same_shape)
    gradients = gradient_agreement(found, same_shape)
    gradient_matrices = "".join(
        f"<p>{FORMATS[d]}, {total} elements:</p>"
        + table(
            ["", *labels],
            [[a] + [_percent(agree[(a, c)] / total) for c in labels] for a in labels],
        )
        for d, (total, agree) in gradients.items()
    )
    absent = absent_backends(names)
    missing = "".join(
        f"<li>layernorm ({html.escape(n)}): {html.escape(why)}</li>" for n, why in absent.items()
    )
    shapes = sorted({(c.rows, c.n) for c in measured})
    offsets = {
        name: ", ".join(f"{o:g}" for o in sorted({c.offset for c in measured if c.dtype in ds}))
        for name, ds in (("float32", DTYPES[:1]), ("the halves", DTYPES[1:]))
    }
    return (
        "<h2>The same bits everywhere</h2>"
        "<p>The share of outputs that are correctly rounded: the exact result of "
        "docs/contract.md §1 on the given inputs (eps at its float64 value) rounded once "
        "to nearest-even, as an exact oracle computes it (layernorm.report.oracle: Python "
        "integers, mpmath, squares of rationals; it shares no code with the kernels). "
        f"Rows N(offset, 3) of shapes {html.escape(str(shapes))} at offsets "
        f"{offsets['float32']} (float32) and {offsets['the halves']} (the halves), random "
        "weight and bias, eps = 1e-5. An exactly "
        "zero result counts as correct with either sign.</p>"
        + table(headers, shares)
        + ("<p>Not measured here:</p><ul>" + missing + "</ul>" if missing else "")
        + "<h3>Bitwise agreement</h3><p>The share of elements on which two implementations "
        "give the same bits, over all the inputs above, per dtype.</p>"
        + matrices
        + "<h3>Whatever the batch and layout</h3><p>The share of elements with the same "
        "bits as the plain (M, N) call when the same rows come one at a time, with a row "
        f"stride of N + 8, or as a 3-D batch; shape ({first.rows}, {first.n}), offset 0, "
        "both ops, every dtype.</p>"
        + table(
            ["implementation", *VARIANTS],
            [[label] + [_percent(layouts[label][v]) for v in VARIANTS] for label in labels],
        )
        + "<h3>Parameter gradients</h3><p>The share of <code>dweight</code> and "
        "<code>dbias</code> elements on which two implementations give the same bits "
        "(the inputs of the layouts table, dy N(0, 1), parameters in the input's dtype). "
        "Not correctly rounded: each is a sum over rows of terms that layernorm defines "
        'once (docs/contract.md §3, "dweight and dbias": per-row scalars decided '
        "exactly, float64 sums in one order), so every layernorm backend gives the same "
        "bits.</p>"
        + gradient_matrices
        + "<h3>Correct over the whole float32 range</h3><p>float32 rows whose largest |x| is "
        "the magnitude, eps = 0 (so the statistics alone decide), layer_norm and rms_norm "
        "pooled, random weight and bias; in brackets the worst error in ulps of the "
        "correctly rounded value (hundreds where gamma·u + beta nearly cancels, so that a "
        "small absolute error is many ulps of a small result; NaN/inf: a non-finite "
        "output).</p>" + img_tag(png, "scale range") + table(scale_rows[0], scale_rows[1:])
    )
