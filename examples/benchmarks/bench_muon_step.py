"""The optimizer step alone on a sharded preset: Muon against fused AdamW, interleaved.

The preset's blocks and root are `fully_shard`-ed over every rank (bf16 compute, fp32 parameters:
the benchmark's model), every parameter gets a random gradient, and each contender steps
`--steps` times per round; the rounds alternate the contenders. What a Muon step costs beyond
AdamW's is what Muon adds to a training step, without the forward and backward around it
(`benchmark.py --optimizer muon` measures it in the step; `bench_muon_floor.py` gives the floor).

`torchrun --standalone --nproc-per-node 2 examples/bench_muon_step.py --preset 1b`
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from composable import MixedPrecisionPolicy, fully_shard
from models.model import PRESETS, Transformer, get_config
from trainer.muon_adamw import build_muon_adamw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="then rank 0's GPU kernels in one Muon step, by time")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    with device:
        model = Transformer(get_config(args.preset))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    contenders = {
        "adamw": torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
        "muon": build_muon_adamw(model, 1e-4, weight_decay=0.01, fused=True),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, opt in contenders.items():
            opt.step()
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            torch.cuda.synchronize()
            if round_:
                times[name].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        med = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"{args.preset}, {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}: optimizer step "
            + ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in med.items())
            + f"; Muon adds {(med['muon'] - med['adamw']) * 1e3:.1f} ms"
        )
    if args.profile:
        _profile(contenders["muon"], rank)
    dist.destroy_process_group()


def _profile(opt: torch.optim.Optimizer, rank: int) -> None:
    """Rank 0's GPU time in one step of `opt`, by kernel (CUDA time totals, the largest first)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
