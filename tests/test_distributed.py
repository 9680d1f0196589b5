"""layernorm.distributed on the CPU with gloo, world sizes 2 and 3.

Each world size is one spawned run of ``_dist_worker.py`` per rank (every process pays
for importing torch, so all scenarios share one run); the parent compares the shards they
saved against single-process results: ``layernorm.reference`` (float64 truth),
``torch.nn.functional.layer_norm`` and ``layernorm.layer_norm`` on the full tensor.
A hang fails: the group has a 30 s collective timeout and the parent kills the ranks
after ``TIMEOUT`` seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import layernorm
from layernorm import reference

sys.path.insert(0, str(Path(__file__).parent))
import _dist_worker as worker

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)
TIMEOUT = 150
WORLDS = (2, 3)


def _launch(world: int, outdir: Path) -> list[dict]:
    env = dict(os.environ)
    src = str(Path(layernorm.__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    script = str(Path(worker.__file__))
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(world), str(outdir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"distributed run with world size {world} hung for {TIMEOUT} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{log[-3000:]}"
    results = [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for rank, res in enumerate(results):
        assert "crash" not in res, f"rank {rank} raised:\n{res['crash']}"
    return results


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def run(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    return world, _launch(world, tmp_path_factory.mktemp(f"world{world}"))


def _cat(parts: list) -> torch.Tensor:
    return torch.cat(parts, dim=-1)


def _ref(i: int):
    """The truth for case ``i`` on its (rounded) inputs: y, dx, dw, db as float64 tensors.

    In ``numpy.longdouble`` (80-bit on x86): at an offset of 1e6 a float64 reference
    itself errs by ~1e-10, and by ~1e-7 on a constant row, more than float64 cases allow.
    """
    wide = np.longdouble
    _, dtype, _, shape, _, _, rms, _ = worker.CASES[i]
    x, w, b, g = worker.case_inputs(i)
    np_ = [None if t is None else t.double().numpy() for t in (x, w, b, g)]
    if rms:
        eps = float(torch.finfo(dtype).eps)
        y, _ = reference.rms_norm(np_[0], shape, np_[1], eps, dtype=wide)
        dx, dw = reference.rms_norm_backward(np_[3], np_[0], shape, np_[1], eps, dtype=wide)
        db = None
    else:
        y, _, _ = reference.layer_norm(np_[0], shape, np_[1], np_[2], dtype=wide)
        dx, dw, db = reference.layer_norm_backward(np_[3], np_[0], shape, np_[1], dtype=wide)
    dw, db = (None if w is None else dw), (None if b is None else db)
    return [
        None if a is None else torch.from_numpy(np.asarray(a, np.float64)) for a in (y, dx, dw, db)
    ]


# error allowed against the float64 reference, relative to the largest reference value
TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("i", range(len(worker.CASES)), ids=[c[0] for c in worker.CASES])
def test_forward_backward_match_single_process(run, i):
    _, results = run
    name, dtype, _, shape, _, _, rms, _ = worker.CASES[i]
    outs = [r["cases"][i] for r in results]
    assert all(o["deterministic"] for o in outs), "two identical calls gave different bits"
    x, w, b, _ = worker.case_inputs(i)
    truth = _ref(i)
    for key, ref in zip(("y", "dx", "dw", "db"), truth, strict=True):
        if ref is None:
            assert all(o[key] is None for o in outs)
            continue
        got = _cat([o[key] for o in outs])
        assert got.dtype == dtype and got.shape == ref.shape
        # dweight/dbias sum over rows: their error grows with the row count
        scale = ref.abs().max().item() * (np.sqrt(x.numel() / ref.numel()) if key in "dwdb" else 1)
        err = (got.double() - ref).abs().max().item()
        assert err <= TOL[dtype] * max(scale, 1.0), f"{name} {key}: error {err:.3g}"
    # and against the single-process results on the full tensor, in the same dtype:
    # layernorm's op and torch's own kernel (exact enough without an offset)
    if worker.CASES[i][4] != 0:
        return  # at an offset, the single-process float32 results are the less accurate
    _, g_full = worker.case_inputs(i)[2:]
    for single in (layernorm, torch.nn.functional):
        leaves = [None if t is None else t.clone().requires_grad_() for t in (x, w, b)]
        xs, ws, bs = leaves
        # eps explicit: torch 2.13's rms_norm(eps=None) on bfloat16 uses float32's eps, not
        # bfloat16's (its docs and docs/contract.md §2 say finfo(input.dtype).eps)
        eps = torch.finfo(dtype).eps
        y_single = (
            single.rms_norm(xs, shape, ws, eps) if rms else single.layer_norm(xs, shape, ws, bs)
        )
        y_single.backward(g_full)
        for key, want in zip(
            ("y", "dx", "dw", "db"),
            (y_single, xs.grad, *[None if t is None else t.grad for t in (ws, bs)]),
            strict=True,
        ):
            if want is None:
                continue
            got = _cat([o[key] for o in outs])
            atol = (TOL[dtype] if dtype == torch.bfloat16 else 1e-5) * max(
                want.abs().max().item(), 1.0
            )
            rtol = TOL[dtype] if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got, want.detach(), atol=atol, rtol=rtol, msg=key)


LAYER_NORM_CASES = [i for i, c in enumerate(worker.CASES) if not c[6]]


@pytest.mark.parametrize("i", LAYER_NORM_CASES, ids=[worker.CASES[i][0] for i in LAYER_NORM_CASES])
def test_constant_row_gives_exactly_beta(run, i):
    """Row 0 of every case is constant (0.1, or 0.1 + 1e6): the output is exactly beta."""
    _, results = run
    _, dtype, _, shape, _, _, _, _ = worker.CASES[i]
    _, _, b, _ = worker.case_inputs(i)
    y = _cat([r["cases"][i]["y"] for r in results]).reshape(-1, *shape)[0]
    assert torch.equal(y, torch.zeros(shape, dtype=dtype) if b is None else b)


@pytest.mark.parametrize("name", ["off1e4", "off1e6"])
def test_offset_independent_error(run, name):
    """docs/contract.md §3 across shards: float32 rows N(c, 1), core error < 4e-6 against
    float64."""
    _, results = run
    i = next(k for k, c in enumerate(worker.CASES) if c[0] == name)
    x, *_ = worker.case_inputs(i)
    y = _cat([r["cases"][i]["y"] for r in results])
    y_ref = _ref(i)[0]
    assert (y.double() - y_ref).abs().max().item() < 4e-6
    # torch's own kernel on the full tensor does far worse at this offset (the contrast)
    y_torch = torch.nn.functional.layer_norm(x, x.shape[-1:])
    assert (y_torch.double() - y_ref).abs().max().item() > 1e-4


def test_shard_mismatch_fails_on_every_rank(run):
    world, results = run
    errors = [r["errors"] for r in results]
    patterns = {
        "rows": ("ShardMismatchError", r"the leading \(row\) dims differ.*\[4, 2, 8\]"),
        "widths": ("ShardMismatchError", rf"shard widths \[7, 8.*\] sum to {8 * world - 1}"),
        "weight": ("ValueError", rf"rank\(s\) \[{world - 1}\].*weight shard of shape \[8\]"),
        "dtype": ("ShardMismatchError", "input dtypes differ"),
        "op": ("ShardMismatchError", r"different ops \(layer_norm vs rms_norm\)"),
        "eps": ("ValueError", r"rank\(s\) \[0\].*eps must be non-negative"),
        "shape": ("ShardMismatchError", "normalized_shape differs"),
        "empty_shape": ("NormalizedShapeError", r"normalized_shape to be at least 1-dimensional"),
    }
    for key, (kind, pattern) in patterns.items():
        got = [e[key] for e in errors]
        assert all(g is not None for g in got), f"{key}: some rank did not raise: {got}"
        assert {g[0] for g in got} == {kind}, key
        for _, message in got:
            assert re.search(pattern, message), (key, message)
        if key != "op":  # the same words on every rank (op: each names its own op)
            assert len({g[1] for g in got}) == 1, key
    # the group still works afterwards
    after = _cat([e["after"] for e in errors])
    assert after.shape == (4, 3, 8 * world)
    assert torch.allclose(after.mean(-1), torch.zeros(4, 3, dtype=torch.float64), atol=1e-12)
    assert errors[0]["empty"] == [[0, 8], [0, 8], [0.0] * 8]


def test_modules_and_state_dict_round_trip(run):
    world, results = run
    torch.manual_seed(5)
    full = layernorm.LayerNorm(23)
    full_rms = torch.nn.RMSNorm(23, eps=1e-6)
    with torch.no_grad():
        for p in [*full.parameters(), *full_rms.parameters()]:
            p.copy_(torch.randn(p.shape))
    x = torch.randn(6, 23)
    mods = [r["modules"] for r in results]
    assert mods[0]["sizes"] == layernorm.distributed.shard_sizes(23, world)
    assert mods[0]["local_keys"] == ["bias", "weight"]
    assert f"shard=[0:{mods[0]['sizes'][0]}] of 23 (rank 0 of {world})" in mods[0]["repr"]
    torch.testing.assert_close(_cat([m["y"] for m in mods]), full(x).detach())
    torch.testing.assert_close(_cat([m["y_rms"] for m in mods]), full_rms(x).detach())
    torch.testing.assert_close(
        _cat([m["y_plain"] for m in mods]), layernorm.layer_norm(x.view(3, 2, 23), [2, 23])
    )
    for m in mods:  # every rank gets the full state_dict back, bit for bit
        for key, t in full.state_dict().items():
            assert torch.equal(m["gathered"][key], t)
        assert torch.equal(m["gathered_rms"]["weight"], full_rms.weight)
    torch.nn.LayerNorm(23).load_state_dict(mods[0]["gathered"])


def test_shard_helpers_local():
    ld = pytest.importorskip("layernorm.distributed")
    assert ld.shard_sizes(10, 3) == [4, 4, 2]
    assert ld.shard_sizes(5, 4) == [2, 2, 1, 0]
    assert ld.shard_sizes(0, 2) == [0, 0]
    assert ld.shard_sizes(2, 3) == [1, 1, 0]
    with pytest.raises(ValueError, match="world_size >= 1"):
        ld.shard_sizes(4, 0)
    sd = {"weight": torch.arange(5.0), "bias": -torch.arange(5.0)}
    assert ld.shard_state_dict(sd, [2, 3], 1)["weight"].tolist() == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="last dim should be the full width 6"):
        ld.shard_state_dict(sd, [3, 3], 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ld.layer_norm(torch.randn(2, 3), 3)


def test_dtensor_sharded_last_dim_uses_statistics_exchange(run):
    _, results = run
    gen = torch.Generator().manual_seed(7)
    x, g = torch.randn(2, 5, 23, generator=gen), torch.randn(2, 5, 23, generator=gen)
    w, b = torch.randn(23, generator=gen), torch.randn(23, generator=gen)
    xf, wf, bf = (t.clone().requires_grad_() for t in (x, w, b))
    y = layernorm.layer_norm(xf, 23, wf, bf)
    (y * g).sum().backward()
    xr = x.clone().requires_grad_()
    y_rows = layernorm.rms_norm(xr, 23, w, eps=1e-6)
    y_rows.sum().backward()
    for res in results:
        d = res["dtensor"]
        assert d["is_dtensor"] and d["placements"] == ["S(2)"]
        assert d["bitwise_local"], "the DTensor path is not the statistics exchange"
        torch.testing.assert_close(d["y"], y.detach())
        torch.testing.assert_close(d["dx"], xf.grad)
        torch.testing.assert_close(d["dw"], wf.grad)
        torch.testing.assert_close(d["db"], bf.grad)
        torch.testing.assert_close(d["y_rows"], y_rows.detach())
        torch.testing.assert_close(d["dx_rows"], xr.grad)


def test_library_ops_and_modules_accept_dtensors(run):
    """``import layernorm.distributed`` registers DTensor rules for the custom ops."""
    _, results = run
    gen = torch.Generator().manual_seed(11)
    x, g, r = (torch.randn(len(results) * 2, 3, 17, generator=gen) for _ in range(3))
    w, b = torch.randn(17, generator=gen), torch.randn(17, generator=gen)
    xf, wf, bf = (t.clone().requires_grad_() for t in (x, w, b))
    (layernorm.layer_norm(xf, 17, wf, bf) * g).sum().backward()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_add, h_add = layernorm.add_layer_norm(xa, r, 17, wa)
    (y_add * g).sum().backward()
    for res in results:
        d = res["dtensor_ops"]
        assert d["last"]["placements"] == ["S(2)"] and d["rows"]["placements"] == ["S(0)"]
        for name in ("last", "rows"):
            torch.testing.assert_close(d[name]["y"], layernorm.layer_norm(x, 17, w, b))
            torch.testing.assert_close(d[name]["dx"], xf.grad)
            torch.testing.assert_close(d[name]["dw"], wf.grad)
            torch.testing.assert_close(d[name]["db"], bf.grad)
        torch.testing.assert_close(d["add"]["y"], y_add.detach())
        assert torch.equal(d["add"]["h"], h_add)
        torch.testing.assert_close(d["add"]["dx"], xa.grad)
        torch.testing.assert_close(d["add"]["dw"], wa.grad)
        assert d["add"]["dw_placements"] == ["R"]
        torch.testing.assert_close(d["add"]["rms"], layernorm.rms_norm(x, 17))
        assert d["add"]["bitwise"], "layernorm.layer_norm on Shard(-1) is not the exchange"


def test_training_matches_single_process(run):
    """DDP with layernorm.LayerNorm, and the sequence-parallel helper and hooks, train
    exactly like one process on the whole batch."""
    _, results = run
    single = worker.train_single()
    ddp = np.mean([r["training"]["ddp"] for r in results], axis=0)  # each rank: local mean
    np.testing.assert_allclose(ddp, single, rtol=1e-12)
    for way in ("helper", "hooks"):
        summed = np.sum([r["training"][way] for r in results], axis=0)  # local shares
        np.testing.assert_allclose(summed, single, rtol=1e-12)
        for r in results[1:]:  # parameters identical on every rank, bit for bit
            for a, b in zip(
                results[0]["training"][way + "_params"], r["training"][way + "_params"], strict=True
            ):
                assert torch.equal(a, b)
    assert single[-1] < 0.5 * single[0]  # it did train
    assert results[0]["training"]["norm_params"] == 2


# ---------------------------------------------------------------------------------------
# The statistics combination alone, in one process (no group needed)

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from layernorm.distributed._exchange import _combine, _local_moments  # noqa: E402


@given(
    widths=st.lists(st.integers(0, 40), min_size=1, max_size=5).filter(lambda w: sum(w) > 1),
    offset=st.sampled_from([0.0, -3e3, 1e6]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_chan_combination_matches_the_full_row(widths, offset, dtype, seed):
    """Per-shard (m1, delta, M2) combined in rank order give the full row's mean and M2,
    with an error independent of the offset; a constant row combines exactly."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(widths)
    x = (torch.randn(3, n, generator=gen, dtype=torch.float64) + offset).to(dtype)
    x[0] = 0.1 + offset
    parts = x.split(widths, dim=1)
    stats = torch.stack([_local_moments(p)[2] for p in parts])
    pivot, o, m2 = _combine(stats, widths)
    # the truth in longdouble, relative to the pivot (exact: the values are near it)
    truth = x.numpy().astype(np.longdouble) - pivot.numpy().astype(np.longdouble)[:, None]
    mean = truth.mean(1)
    m2_truth = ((truth - mean[:, None]) ** 2).sum(1)
    spread = np.sqrt(m2_truth / n)
    # o (the mean minus the pivot) and M2 to a few roundings of the spread, not the offset
    tol = 8 * torch.finfo(dtype).eps
    o_err = np.abs(o.numpy() - mean)
    assert (o_err <= tol * spread).all(), o_err
    assert (np.abs(m2.numpy() - m2_truth) <= 4 * tol * m2_truth).all()
    # the constant row: exactly its value, exactly no variance
    assert pivot[0].item() + o[0].item() == x[0, 0].item()
    assert m2[0].item() == 0.0
