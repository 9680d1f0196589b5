"""One rank of the distributed tests: ``python _dist_worker.py RANK WORLD OUTDIR``.

Joins a gloo group through a file store in OUTDIR, runs every scenario, and saves
what it computed to ``OUTDIR/rank{RANK}.pt``; ``test_distributed.py`` compares the
shards against single-process results. The inputs come from :func:`case_inputs`,
which the parent calls too: seeded CPU generators give the same bits in every process.
"""

from __future__ import annotations

import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import layernorm
import layernorm.distributed as ld

# name, dtype, leading shape, normalized_shape, offset, weight/bias, rms, widths per world
# (None: the default split); every case also gets a constant row (row 0).
CASES = [
    ("f32", torch.float32, (5, 3), (37,), 0.0, True, False, {2: [1, 36], 3: [10, 0, 27]}),
    ("f64", torch.float64, (6,), (37,), 0.0, True, False, {2: [20, 17], 3: [12, 13, 12]}),
    ("bf16", torch.bfloat16, (9,), (64,), 0.0, True, False, {2: None, 3: [5, 40, 19]}),
    ("f32_2d", torch.float32, (2, 4), (3, 11), 0.0, True, False, {2: [4, 7], 3: [3, 3, 5]}),
    ("f32_long", torch.float32, (3,), (9000,), 0.0, True, False, {2: [4500, 4500], 3: None}),
    ("f32_nobias", torch.float32, (4,), (20,), 0.0, False, False, {2: None, 3: None}),
    ("off1e4", torch.float32, (16,), (256,), 1e4, False, False, {2: [100, 156], 3: None}),
    ("off1e6", torch.float32, (16,), (256,), 1e6, False, False, {2: [100, 156], 3: [1, 200, 55]}),
    ("f64_off1e6", torch.float64, (8,), (100,), 1e6, False, False, {2: None, 3: None}),
    ("rms_f32", torch.float32, (5,), (37,), 0.0, True, True, {2: [1, 36], 3: [10, 0, 27]}),
    ("rms_f64", torch.float64, (5,), (37,), 0.0, True, True, {2: None, 3: None}),
    ("rms_bf16", torch.bfloat16, (5,), (64,), 0.0, True, True, {2: [33, 31], 3: None}),
]
TRAIN_STEPS = 6


def widths(case, world: int) -> list[int]:
    n = case[3][-1]
    return case[7][world] or ld.shard_sizes(n, world)


def case_inputs(i: int):
    """The full ``x``, ``weight``, ``bias`` (or None) and upstream gradient ``g`` of case ``i``."""
    _, dtype, lead, shape, offset, affine, rms, _ = CASES[i]
    gen = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(*lead, *shape, generator=gen, dtype=torch.float64) + offset
    x = x.to(dtype)
    x.view(-1, *shape)[0] = 0.1 + offset  # a constant row (offset: still constant)
    w = (torch.randn(shape, generator=gen, dtype=torch.float64) + 1).to(dtype) if affine else None
    b = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        if affine and not rms
        else None
    )
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, b, g


def _slice(t, sizes, rank):
    start = sum(sizes[:rank])
    return None if t is None else t[..., start : start + sizes[rank]].contiguous()


def run_case(i: int, rank: int, world: int) -> dict:
    _, _, _, shape, _, _, rms, _ = CASES[i]
    sizes = widths(CASES[i], world)
    x, w, b, g = case_inputs(i)
    outs = []
    for _ in range(2):  # twice: the results must be bitwise identical
        xs = _slice(x, sizes, rank).requires_grad_()
        ws = None if w is None else _slice(w, sizes, rank).requires_grad_()
        bs = None if b is None else _slice(b, sizes, rank).requires_grad_()
        y = ld.rms_norm(xs, shape, ws) if rms else ld.layer_norm(xs, shape, ws, bs)
        y.backward(_slice(g, sizes, rank))
        outs.append(
            {
                "y": y.detach(),
                "dx": xs.grad,
                "dw": None if ws is None else ws.grad,
                "db": None if bs is None else bs.grad,
            }
        )
    same = all(
        (a is None and c is None) or torch.equal(a, c)
        for k in outs[0]
        for a, c in [(outs[0][k], outs[1][k])]
    )
    return {**outs[0], "deterministic": same}


def _catch(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


def _empty_rows(n: int) -> list:
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    y = ld.layer_norm(x, n, w)
    y.sum().backward()
    return [list(y.shape), list(x.grad.shape), w.grad.tolist()]


def run_errors(rank: int, world: int) -> dict:
    x = torch.randn(4, 3, 8, dtype=torch.float64)  # 8 = the width of every rank
    n = 8 * world
    last = rank == world - 1
    return {
        "rows": _catch(lambda: ld.layer_norm(x[:, :2] if last else x, n)),
        "widths": _catch(lambda: ld.layer_norm(x[..., :7] if rank == 0 else x, n)),
        "weight": _catch(lambda: ld.layer_norm(x, n, torch.ones(9 if last else 8))),
        "dtype": _catch(lambda: ld.layer_norm(x.float() if last else x, n)),
        "op": _catch(lambda: ld.rms_norm(x, n) if last else ld.layer_norm(x, n)),
        "eps": _catch(lambda: ld.layer_norm(x, n, eps=-1.0 if rank == 0 else 1e-5)),
        "shape": _catch(lambda: ld.layer_norm(x, [n + 1] if last else [n])),
        "empty_shape": _catch(lambda: ld.layer_norm(x, [] if last else [n])),
        # the group still works after all of that, zero rows included
        "after": ld.layer_norm(x, n),
        "empty": _empty_rows(n),
    }


def run_modules(rank: int, world: int) -> dict:
    torch.manual_seed(5)
    full = layernorm.LayerNorm(23)
    full_rms = torch.nn.RMSNorm(23, eps=1e-6)
    with torch.no_grad():
        for p in [*full.parameters(), *full_rms.parameters()]:
            p.copy_(torch.randn(p.shape))
    x = torch.randn(6, 23)
    m = ld.LayerNorm.from_full(full)
    m_rms = ld.RMSNorm.from_full(full_rms, shard_sizes=[23] + [0] * (world - 1))
    plain = ld.LayerNorm([2, 23], elementwise_affine=False)
    return {
        "y": m(m.shard(x)),
        "y_rms": m_rms(m_rms.shard(x)),
        "y_plain": plain(plain.shard(x.view(3, 2, 23))),
        "gathered": ld.gather_state_dict(m),
        "gathered_rms": ld.gather_state_dict(m_rms),
        "local_keys": sorted(m.state_dict()),
        "repr": repr(m),
        "sizes": m.shard_sizes,
    }


def run_dtensor(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(7)
    x, g = torch.randn(2, 5, 23, generator=gen), torch.randn(2, 5, 23, generator=gen)
    w, b = torch.randn(23, generator=gen), torch.randn(23, generator=gen)
    xd = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    bf = b.clone().requires_grad_()  # a plain full tensor: replicated
    y = ld.layer_norm(xd, 23, wd, bf)
    (y * distribute_tensor(g, mesh, [Shard(2)])).sum().backward()
    # the same local computation without DTensor: stats exchange on the mesh's group
    local = ld.layer_norm(
        xd.to_local().detach(),
        23,
        wd.to_local().detach(),
        _slice(b, ld.shard_sizes(23, world), rank),  # the shard convention is DTensor's
        group=mesh.get_group(0),
    )
    xr = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()  # rows sharded: local
    yr = ld.rms_norm(xr, 23, distribute_tensor(w, mesh, [Replicate()]), eps=1e-6)
    yr.sum().backward()
    return {
        "y": y.full_tensor().detach(),
        "placements": [str(p) for p in y.placements],
        "is_dtensor": isinstance(y, DTensor),
        "bitwise_local": torch.equal(y.to_local(), local),
        "dx": xd.grad.full_tensor(),
        "dw": wd.grad.full_tensor(),
        "db": bf.grad,
        "y_rows": yr.full_tensor().detach(),
        "dx_rows": xr.grad.full_tensor(),
    }


def run_dtensor_ops(rank: int, world: int) -> dict:
    """``layernorm.layer_norm``/``LayerNorm``/``add_layer_norm`` on DTensors (the op rules)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(11)
    x, g, r = (torch.randn(world * 2, 3, 17, generator=gen) for _ in range(3))
    module = layernorm.LayerNorm(17)
    with torch.no_grad():
        module.weight.copy_(torch.randn(17, generator=gen))
        module.bias.copy_(torch.randn(17, generator=gen))
    out = {}
    for name, placement in (("last", Shard(2)), ("rows", Shard(0))):
        module.zero_grad()
        xd = distribute_tensor(x, mesh, [placement]).requires_grad_()
        y = module(xd)
        (y * distribute_tensor(g, mesh, [placement])).sum().backward()
        out[name] = {
            "placements": [str(p) for p in y.placements],
            "y": y.full_tensor().detach(),
            "dx": xd.grad.full_tensor(),
            "dw": module.weight.grad.clone(),
            "db": module.bias.grad.clone(),
        }
    xd = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    wd = distribute_tensor(module.weight.detach(), mesh, [Replicate()]).requires_grad_()
    y, h = layernorm.add_layer_norm(xd, distribute_tensor(r, mesh, [Shard(2)]), 17, wd)
    (y * distribute_tensor(g, mesh, [Shard(2)])).sum().backward()
    out["add"] = {
        "y": y.full_tensor().detach(),
        "h": h.full_tensor().detach(),
        "dx": xd.grad.full_tensor(),
        "dw": wd.grad.full_tensor(),
        "dw_placements": [str(p) for p in wd.grad.placements],
        "rms": layernorm.rms_norm(xd.detach(), 17).full_tensor(),
        "bitwise": torch.equal(
            layernorm.layer_norm(xd.detach(), 17).to_local(),
            ld.layer_norm(xd.to_local().detach(), 17, group=mesh.get_group(0)),
        ),
    }
    return out


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), layernorm.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()


def train_data():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(12, 8, generator=gen, dtype=torch.float64), torch.randn(
        12, 1, generator=gen, dtype=torch.float64
    )


def train_single() -> list[float]:
    """The baseline: one process, the whole batch, mean squared error, SGD."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, t = train_data()
    losses = []
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        loss = ((model(x) - t) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run_training(rank: int, world: int) -> dict:
    x, t = train_data()
    rows = torch.arange(12).tensor_split(world)[rank]  # the same count on every rank
    xs, ts = x[rows], t[rows]
    out = {}
    # DDP: local mean loss, DDP averages the gradients over the ranks.
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        loss = ((ddp(xs) - ts) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["ddp"] = losses
    # Sequence/data parallel by hand: local share of the global loss, summed gradients.
    for way in ("helper", "hooks"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if way == "hooks":
            ld.register_grad_allreduce_hooks(model)
        losses = []
        for _ in range(TRAIN_STEPS):
            opt.zero_grad()
            loss = ((model(xs) - ts) ** 2).sum() / len(x)
            loss.backward()
            if way == "helper":
                ld.allreduce_param_grads(model)
            opt.step()
            losses.append(loss.item())
        out[way] = losses
        out[way + "_params"] = [p.detach().clone() for p in model.parameters()]
    out["norm_params"] = len(ld.norm_parameters(model))
    return out


def main() -> None:
    rank, world, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group(
        "gloo",
        init_method=f"file://{outdir}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    results: dict = {}
    try:
        results["cases"] = [run_case(i, rank, world) for i in range(len(CASES))]
        results["errors"] = run_errors(rank, world)
        results["modules"] = run_modules(rank, world)
        results["dtensor"] = run_dtensor(rank, world)
        results["dtensor_ops"] = run_dtensor_ops(rank, world)
        results["training"] = run_training(rank, world)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{outdir}/rank{rank}.pt")
    # Every rank is done before any tears its gloo connections down: a rank whose peer
    # has already gone can abort in gloo's teardown ("terminate called without an active
    # exception", seen once in a CI run).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
