"""How fast each group of a 2D (dp, tp) mesh moves an all-gather and a reduce-scatter alone:
whether a collective that runs long in a training trace is slow links or a rank waiting for
a late peer (examples/trace_overlap.py, trace_nccl.py).

    torchrun --standalone --nproc-per-node 4 examples/bench_links.py [--tp-size 2] [--mib 64]

Per group (the tp group, the dp group and the whole world, each as rank 0 sees it), after 3
untimed calls, the mean of `--iters` calls timed with CUDA events (wall time on the CPU):
an all-gather into a `--mib` MiB bf16 buffer and a reduce-scatter of a `2 x --mib` MiB fp32
one, with nccl-tests' bus bandwidth, size / time x (n-1)/n. NCCL on GPUs, gloo on the CPU.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MiB = 2**20


def timed_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Mean milliseconds of `fn` over `iters` calls, after 3 untimed ones, every rank starting together."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / iters


def measure(mesh: DeviceMesh, mib: float, iters: int) -> list[dict[str, object]]:
    """One row per group of `mesh` ("tp", "dp", then "world"): its ranks, and the all-gather's
    and reduce-scatter's milliseconds and bus bandwidth (GB/s) alone."""
    device = torch.device(mesh.device_type, torch.cuda.current_device() if mesh.device_type == "cuda" else 0)
    groups = [("tp", mesh["tp"].get_group()), ("dp", mesh["dp"].get_group()), ("world", dist.group.WORLD)]
    rows: list[dict[str, object]] = []
    for name, group in groups:
        n = dist.get_world_size(group)
        gathered = torch.empty(int(mib * MiB) // 2 // n * n, dtype=torch.bfloat16, device=device)
        shard = gathered.chunk(n)[0].clone()
        scattered = torch.empty(int(2 * mib * MiB) // 4 // n * n, dtype=torch.float32, device=device)
        reduced = scattered.chunk(n)[0].clone()
        gather_ms = timed_ms(lambda: dist.all_gather_into_tensor(gathered, shard, group=group), iters, device)
        scatter_ms = timed_ms(lambda: dist.reduce_scatter_tensor(reduced, scattered, group=group), iters, device)
        share = (n - 1) / n
        rows.append(
            {
                "group": name,
                "ranks": dist.get_process_group_ranks(group),
                "all_gather_ms": gather_ms,
                "all_gather_busbw_gbs": gathered.nbytes * share / gather_ms / 1e6,
                "reduce_scatter_ms": scatter_ms,
                "reduce_scatter_busbw_gbs": scattered.nbytes * share / scatter_ms / 1e6,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-size", type=int, default=2, help="ranks of a tp group (the inner mesh dimension)")
    p.add_argument(
        "--mib", type=float, default=64.0, help="the all-gather's output in MiB (the reduce-scatter's input is twice)"
    )
    p.add_argument("--iters", type=int, default=20, help="timed calls per collective")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's, known before any group exists
    if args.tp_size < 1 or world % args.tp_size:
        raise SystemExit(f"bench_links.py: --tp-size {args.tp_size} must divide the world size {world}")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(
        "cuda" if cuda else "cpu", (world // args.tp_size, args.tp_size), mesh_dim_names=("dp", "tp")
    )
    for row in measure(mesh, args.mib, args.iters):
        if dist.get_rank() == 0:
            print(
                f"{row['group']:<5} ranks {row['ranks']}: all_gather {row['all_gather_ms']:.3f} ms "
                f"({row['all_gather_busbw_gbs']:.0f} GB/s bus), reduce_scatter {row['reduce_scatter_ms']:.3f} ms "
                f"({row['reduce_scatter_busbw_gbs']:.0f} GB/s bus)",
                flush=True,
            )
    dist.destroy_process_group()
