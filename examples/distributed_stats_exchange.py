"""Layer norm of a hidden dim sharded across ranks: exchange statistics, or gather rows?

Run with::

    torchrun --nproc-per-node 2 examples/distributed_stats_exchange.py

Each rank holds an ``(M, N / world)`` float32 slice of ``(M, N)`` activations. Two ways
to normalize them:

- **stats**: :func:`layernorm.distributed.layer_norm`, which exchanges three floats per
  row (plus a 19-int shape header) and never moves the activations;
- **gather**: all-gather the full rows (``M * N`` floats land on every rank), run
  :func:`layernorm.layer_norm` (or, faster but offset-sensitive,
  :func:`torch.nn.functional.layer_norm`) on them and keep this rank's columns.

For each size it prints, per rank and forward pass, the bytes each rank sends, the
median time of the collective alone, and the median time of the whole forward, both
ways, after checking the two give the same result. Backward: the statistics way sends
two floats per row; gathering would reduce-scatter ``M * N`` gradient floats.
Times come from ``time.perf_counter`` around the call, after a barrier, median of
``--reps`` repetitions, the slowest rank's median. Use ``--backend nccl`` on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

import layernorm
import layernorm.distributed as ld

HEADER_BYTES = 19 * 8  # the shape agreement of layernorm.distributed, int64s


def _median_time(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    local = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return local.item()


def _gather_rows(shard: torch.Tensor) -> torch.Tensor:
    world = dist.get_world_size()
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard)
    return torch.cat(parts, dim=-1)


def measure(m: int, n: int, reps: int, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = ld.shard_sizes(n, world)
    start = sum(sizes[:rank])
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(m, n, generator=gen) + 3.0).to(device)
    weight, bias = (
        torch.randn(n, generator=gen).to(device),
        torch.randn(n, generator=gen).to(device),
    )
    cols = slice(start, start + sizes[rank])
    shard, w, b = x[:, cols].contiguous(), weight[cols].contiguous(), bias[cols].contiguous()

    def by_stats():
        return ld.layer_norm(shard, n, w, b)

    def by_gather():
        return layernorm.layer_norm(_gather_rows(shard), n, weight, bias)[:, cols]

    def by_gather_torch():  # torch's fused kernel on the gathered rows: the fast usual way
        return torch.nn.functional.layer_norm(_gather_rows(shard), (n,), weight, bias)[:, cols]

    torch.testing.assert_close(by_stats(), by_gather(), atol=1e-5, rtol=1e-5)
    stats = torch.empty(3, m, device=device)
    stats_out = torch.empty(world * 3 * m, device=device)
    all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    exchange_stats = lambda: all_gather_flat(stats_out, stats.view(-1))  # noqa: E731
    return {
        "M": m,
        "N": n,
        "world": world,
        "stats_bytes_sent": 3 * 4 * m + HEADER_BYTES,
        "gather_bytes_sent": 4 * m * sizes[rank],
        "stats_collective_s": _median_time(exchange_stats, reps, device),
        "gather_collective_s": _median_time(lambda: _gather_rows(shard), reps, device),
        "stats_forward_s": _median_time(by_stats, reps, device),
        "gather_forward_s": _median_time(by_gather, reps, device),
        "gather_torch_forward_s": _median_time(by_gather_torch, reps, device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="1024x1024,4096x1024,1024x8192,8192x4096", help="MxN,MxN,..."
    )
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    rows = []
    for size in args.sizes.split(","):
        m, n = (int(s) for s in size.lower().split("x"))
        rows.append(measure(m, n, args.reps, device))
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(
            f"# {world} ranks, {args.backend}, torch {torch.__version__}, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"threads/rank {torch.get_num_threads()}"
        )
        print(
            "| M x N | bytes sent/rank: stats | gather | collective: stats | gather | "
            "forward: stats | gather | gather + torch LN | speedup vs gather | vs gather + torch LN |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['M']} x {r['N']} | {r['stats_bytes_sent']:,} | {r['gather_bytes_sent']:,} | "
                f"{r['stats_collective_s'] * 1e3:.3f} ms | {r['gather_collective_s'] * 1e3:.3f} ms | "
                f"{r['stats_forward_s'] * 1e3:.3f} ms | {r['gather_forward_s'] * 1e3:.3f} ms | "
                f"{r['gather_torch_forward_s'] * 1e3:.3f} ms | "
                f"{r['gather_forward_s'] / r['stats_forward_s']:.2f}x | "
                f"{r['gather_torch_forward_s'] / r['stats_forward_s']:.2f}x |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "world": world, "rows": rows}, f, indent=1)
    dist.barrier()  # nobody tears gloo down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
