"""QLoRA throughput and memory: composable's `fully_shard` against PyTorch's FSDP2 on the same
NF4 + LoRA Llama (examples/qlora.py's model), in interleaved rounds.

Each round builds each contender afresh (same seed, same data), runs `--warmup` untimed steps,
then `--steps` timed ones, and records tokens/s (all ranks), the peak memory allocated during
the warm-up and timed steps (a graphed step takes its memory while it is captured), and the
weight bytes on the rank (NF4 data + scalers, adapters), also those of the LoRA layers' base
weights alone (what NF4 quantizes: a quarter of bf16 plus the scalers). The order of the
contenders alternates between rounds so that neither always runs on a warmer machine.
Rank 0 prints one line per contender and round, then the medians. On GPUs:

    torchrun --nproc-per-node 8 examples/bench_qlora.py --shape 1b --rounds 3

`--bf16-lora` adds composable with unquantized bf16 base weights (the memory baseline);
`--graphed` adds composable with the whole step as one CUDA graph (`composable.graphed_step`).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist

from trainer.qlora import base_weight_bytes, build_llama, init_distributed, make_step, run_steps, shard, weight_bytes


def run_once(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Build, warm up and time one contender; its tokens/s, peak GiB and weight MiB."""
    api, nf4 = ("fsdp2", True) if name == "fsdp2" else ("composable", name != "bf16_lora")
    model = shard(build_llama(args.shape, torch.bfloat16, device, nf4=nf4), api)
    if device.type == "cuda":
        # From before the warm-up: a graphed step allocates its memory while being captured
        # (the last warm-up step) and its replays allocate nothing.
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    step = make_step(model, device, graphed_warmup=args.warmup if name.endswith("_graphed") else None)
    vocab = model.config.vocab_size
    run_steps(step, vocab, args.warmup, args.batch, args.seq, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    run_steps(step, vocab, args.steps, args.batch, args.seq, device)  # its `.item()` per step synchronizes
    elapsed = time.perf_counter() - start
    result = {
        "tokens_per_s": args.steps * args.batch * args.seq * dist.get_world_size() / elapsed,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"),
        "weights_mib": weight_bytes(model) / 2**20,
        "base_mib": base_weight_bytes(model) / 2**20,
    }
    del model, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--bf16-lora", action="store_true", help="also composable with bf16 base weights")
    parser.add_argument(
        "--graphed", action="store_true", help="also composable with the whole step as one CUDA graph (graphed_step)"
    )
    args = parser.parse_args()
    if args.graphed and args.warmup < 2:
        parser.error(f"--graphed needs --warmup >= 2 (eager warm-up, then the capture), got {args.warmup}")
    device = init_distributed()
    if args.graphed and device.type != "cuda":
        parser.error("--graphed needs CUDA (graphed_step captures a CUDA graph)")
    names = (
        ["composable", "fsdp2"]
        + (["bf16_lora"] if args.bf16_lora else [])
        + (["composable_graphed"] if args.graphed else [])
    )
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run_once(name, args, device))
            if dist.get_rank() == 0:
                got = results[name][-1]
                print(
                    f"round {r} {name:>10}: {got['tokens_per_s']:9.0f} tokens/s, peak {got['peak_gib']:.2f} GiB, "
                    f"weights {got['weights_mib']:.1f} MiB per rank (LoRA base weights {got['base_mib']:.1f})",
                    flush=True,
                )
    if dist.get_rank() == 0:
        print(f"median of {args.rounds} rounds, {args.shape}, bf16 compute, {dist.get_world_size()} ranks:")
        for name, runs in results.items():
            med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            print(
                f"  {name:>10}: {med['tokens_per_s']:9.0f} tokens/s, peak {med['peak_gib']:.2f} GiB, "
                f"weights {med['weights_mib']:.1f} MiB per rank (LoRA base weights {med['base_mib']:.1f})"
            )
        for name in names:
            if name != "fsdp2":
                speed = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results[name], results["fsdp2"])]
                peak = [a["peak_gib"] / b["peak_gib"] for a, b in zip(results[name], results["fsdp2"])]
                print(
                    f"  {name} / fsdp2: tokens/s {statistics.median(speed):.3f}x (rounds {min(speed):.3f}-"
                    f"{max(speed):.3f}), peak {statistics.median(peak):.3f}x"
                )
    dist.destroy_process_group()
