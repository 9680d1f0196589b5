"""The report's "the same bits everywhere" section (layernorm.report.same_bits): its shares
are the oracle's verdicts counted, its agreement matrix is a symmetric matrix of shares,
and its scale-range plot and table are written. Tiny cases only; the numba and torch
backends must come out 100% correctly rounded, torch's own below."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import _oracle
from _triton_interpreter import HAS_TRITON, import_for_the_interpreter
from layernorm.checks import backends_to_check
from layernorm.report import same_bits

pytest.importorskip("matplotlib")
pytest.importorskip("numba")

OURS = ("layernorm (torch)", "layernorm (numba)")
TINY = [
    same_bits.Case(op, dtype, 3, 96, offset)
    for op in same_bits.OPS
    for dtype in same_bits.DTYPES
    for offset in (0.0, 100.0)
]


@pytest.fixture(scope="module")
def found():
    return same_bits.implementations(["torch", "numba"])


@pytest.fixture(scope="module")
def tally(found):
    return same_bits.measure(found, TINY)


def test_shares_are_the_oracles_verdicts_counted(found, tally):
    for label in (*OURS, "torch.nn.functional", "decomposition"):
        assert set(tally.correct[label]) == {
            (op, d) for op in same_bits.OPS for d in same_bits.DTYPES
        }
    for op in same_bits.OPS:
        for dtype in same_bits.DTYPES:
            for label in OURS:
                assert tally.share(label, op, dtype) == 1.0, (label, op, dtype)
    # torch's own float32 layer_norm is not correctly rounded: recount one case by hand
    case = TINY[1]
    assert (case.op, case.dtype, case.offset) == ("layer_norm", torch.float32, 100.0)
    x, w, b = case.inputs(1)  # measure seeds each case by its index
    y = found["torch.nn.functional"](x, w, b, case.eps, False)
    got = y.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    hits = 0
    for i, z in enumerate(x.double().numpy()):
        want, zero = _oracle.forward(
            z, w.double().numpy(), b.double().numpy(), 1e-5, False, "float32"
        )
        assert not zero.any()
        hits += int((got[i] == want).sum())
    assert hits < x.numel()
    share_of_case = next(r for c, r in tally.per_case if c == case)["torch.nn.functional"][0]
    assert share_of_case == hits / x.numel()
    assert tally.share("torch.nn.functional", "layer_norm", torch.float32) < 0.9


def test_agreement_matrix_is_symmetric_with_ones_on_the_diagonal(tally):
    labels = list(tally.correct)
    for dtype in same_bits.DTYPES:
        assert tally.total[dtype] == 2 * 2 * 3 * 96
        m = np.array([[tally.agreement(dtype, a, b) for b in labels] for a in labels])
        assert (m == m.T).all() and (np.diag(m) == 1).all() and (m >= 0).all()
        assert tally.agreement(dtype, *OURS) == 1.0
        # agreeing with a correctly rounded backend is being correctly rounded (no exact
        # zeros among these inputs)
        correct = np.mean([tally.share("torch.nn.functional", op, dtype) for op in same_bits.OPS])
        assert tally.agreement(dtype, "torch.nn.functional", OURS[0]) == pytest.approx(correct)
    assert tally.agreement(torch.float32, "torch.nn.functional", OURS[1]) < 0.9


def test_scale_range_plot_and_table(tmp_path, found):
    cases = [
        same_bits.Case(op, torch.float32, 2, 64, magnitude=s, eps=0.0)
        for s in (1e-38, 1.0, 3e38)
        for op in same_bits.OPS
    ]
    tally = same_bits.measure(found, cases)
    png, rows = same_bits.plot_scale_share(tmp_path / "scale.png", tally)
    assert png.stat().st_size > 10_000
    assert rows[0] == ["magnitude", *found]
    assert [r[0] for r in rows[1:]] == ["1e-38", "1e+00", "3e+38"]
    column = {label: [r[1 + i] for r in rows[1:]] for i, label in enumerate(found)}
    for label in OURS:
        assert column[label] == ["100% (0)"] * 3
    # torch's own float32 statistics underflow at 1e-38 and overflow at 3e38 (eps = 0)
    for cell in (column["torch.nn.functional"][0], column["torch.nn.functional"][2]):
        assert cell.endswith("(NaN/inf)") or not cell.startswith("100%")
    worst = max(r["torch.nn.functional"][1] for c, r in tally.per_case if c.magnitude == 3e38)
    assert worst > 1 or math.isinf(worst)


def test_percent_never_rounds_up_to_all_or_none():
    assert same_bits._percent(1.0) == "100%" and same_bits._percent(0.0) == "0%"
    assert same_bits._percent(1 - 1e-7) == "99.999%"
    assert same_bits._percent(0.5) == "50.000%"


def test_absent_backends_say_why():
    absent = same_bits.absent_backends(["torch"])
    assert absent["numba"] == "not among the backends checked here"
    assert set(absent) == {"numba", "triton"} and all(absent.values())


def test_report_section_inline_plot_and_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(same_bits, "cases", lambda quick: TINY[0:6:2])
    monkeypatch.setattr(
        same_bits,
        "scale_cases",
        lambda quick: [same_bits.Case("rms_norm", torch.float32, 1, 32, magnitude=1e30, eps=0.0)],
    )
    page = same_bits.report_section(tmp_path, quick=True, names=["torch", "numba"])
    assert page.startswith("<h2>The same bits everywhere</h2>")
    assert page.count("data:image/png;base64,") == 1 and (tmp_path / "scale_correct.png").exists()
    # shares, a matrix per dtype, layouts, a gradient matrix per dtype, scale
    assert page.count("<table>") == 1 + 3 + 1 + 3 + 1
    assert "<h3>Parameter gradients</h3>" in page
    assert "layernorm (triton):" in page  # absent, with its reason


def test_the_section_runs_triton_in_its_interpreter_and_leaves_no_trace():
    if not HAS_TRITON or torch.cuda.is_available():
        pytest.skip("needs triton installed and no GPU (the interpreter is for CPU tensors)")
    import_for_the_interpreter()  # as the triton tests do; the section would do the same
    from layernorm.backends import triton_

    if not triton_._triton_interprets():
        pytest.skip("triton was imported compiled in this process")
    before = os.environ.get("TRITON_INTERPRET")
    with same_bits.triton_interpreter():
        assert os.environ["TRITON_INTERPRET"] == "1" and "triton" in backends_to_check()
        found = same_bits.implementations()
        tally = same_bits.measure(found, TINY[2:3])  # bfloat16 layer_norm
    assert os.environ.get("TRITON_INTERPRET") == before
    assert ("triton" in backends_to_check()) == (before == "1")
    assert "layernorm (triton)" in found
    # correctly rounded (docs/contract.md §3), so every element, and numba's bits
    assert tally.share("layernorm (triton)", "layer_norm", torch.bfloat16) == 1.0
    assert tally.agreement(torch.bfloat16, "layernorm (triton)", "layernorm (numba)") == 1.0
    assert tally.total[torch.bfloat16] == 3 * 96


def test_the_report_page_carries_the_section(tmp_path, monkeypatch):
    from layernorm.report import page

    for name in ("_compiled_section", "_claims_section"):
        monkeypatch.setattr(page, name, lambda: "")
    monkeypatch.setattr(page, "_math_section", lambda out: "")
    monkeypatch.setattr(same_bits, "cases", lambda quick: TINY[:1])
    scale = [same_bits.Case("layer_norm", torch.float32, 1, 32, magnitude=1e-30, eps=0.0)]
    monkeypatch.setattr(same_bits, "scale_cases", lambda quick: scale)
    html = page.write_report(tmp_path, quick=True, bench=False, experiments=False).read_text()
    assert "<h2>The same bits everywhere</h2>" in html and "failed:" not in html
    assert (tmp_path / "scale_correct.png").exists()


def test_our_backends_give_the_same_bits_whatever_the_batch_and_layout(found):
    some = [same_bits.Case(op, torch.float32, 4, 96, 100.0) for op in same_bits.OPS]
    layouts = same_bits.invariance(found, some)
    assert set(layouts) == set(found)
    for label in OURS:
        assert layouts[label] == dict.fromkeys(same_bits.VARIANTS, 1.0)
    assert all(0 <= v <= 1 for row in layouts.values() for v in row.values())


def test_our_backends_give_the_same_parameter_gradients(found):
    # docs/contract.md §3, "dweight and dbias": the same bits on every backend
    some = [same_bits.Case(op, d, 40, 96, 10.0) for op in same_bits.OPS for d in same_bits.DTYPES]
    counts = same_bits.gradient_agreement(found, some)
    assert set(counts) == set(same_bits.DTYPES)
    for total, agree in counts.values():
        assert total == 3 * 96  # layer_norm's dweight and dbias, rms_norm's dweight
        assert agree[OURS] == agree[OURS[::-1]] == total
        assert all(agree[(label, label)] == total for label in found)
