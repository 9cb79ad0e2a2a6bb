"""The benchmark's report: one table of per-run medians over rounds, the ours/theirs ratios
(throughput, in tokens per GPU-second, as the median of per-round ratios, with their range;
memory from the largest peaks), the JSON file, both naming the mesh; and the Chrome trace of
a profiled run. No collectives here."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import tempfile

import torch

from benchmarks.bench_mesh import describe_mesh

RATIOS = (
    ("fully_shard", "fsdp2"),
    ("replicate", "ddp"),
    ("fully_shard", "floor"),
    # CUDA graphs speed the floor too: a graphed contender is held against both floors.
    ("fully_shard_graphed", "fsdp2"),
    ("fully_shard_graphed", "floor"),
    ("fully_shard_graphed", "floor_graphed"),
    ("replicate_graphed", "ddp"),
    ("replicate_graphed", "floor_graphed"),
    ("floor_graphed", "floor"),
    # CPU offload: against FSDP2's, and what it costs against the same contender without it.
    ("fully_shard_offload", "fsdp2_offload"),
    ("fully_shard_offload", "fully_shard"),
    ("fully_shard_offload_on_device", "fsdp2_offload"),
    ("fully_shard_offload_on_device", "fully_shard"),
    ("fully_shard_offload_on_device", "fully_shard_offload"),
    ("fully_shard_state_offload", "fsdp2_offload"),
    ("fully_shard_state_offload", "fully_shard"),
    ("fully_shard_state_offload", "fully_shard_offload"),
    ("fully_shard_state_offload_prefetch", "fsdp2_offload"),
    ("fully_shard_state_offload_prefetch", "fully_shard"),
    ("fully_shard_state_offload_prefetch", "fully_shard_state_offload"),
    ("fully_shard_offload_step_in_backward", "fsdp2_offload"),
    ("fully_shard_offload_step_in_backward", "fully_shard"),
    ("fully_shard_offload_step_in_backward", "fully_shard_offload"),
    ("fully_shard_offload_step_in_backward_speculative", "fully_shard_offload_step_in_backward"),
    ("fully_shard_offload_step_in_backward_speculative", "fully_shard"),
    ("fully_shard_offload_on_device_step_in_backward", "fsdp2_offload"),
    ("fully_shard_offload_on_device_step_in_backward", "fully_shard"),
    ("fully_shard_offload_on_device_step_in_backward", "fully_shard_offload_on_device"),
    ("fsdp2_offload", "fsdp2"),
    # DeepSpeed's ZeRO-Offload (bench_deepspeed.py): each of ours against it, and its own cost
    # against no offload.
    ("fully_shard_offload", "deepspeed_offload"),
    ("fully_shard_offload_on_device", "deepspeed_offload"),
    ("fully_shard_offload_step_in_backward", "deepspeed_offload"),
    ("fully_shard_offload_step_in_backward_speculative", "deepspeed_offload"),
    ("fully_shard_offload_on_device_step_in_backward", "deepspeed_offload"),
    ("fully_shard_state_offload", "deepspeed_offload"),
    ("fully_shard_state_offload_prefetch", "deepspeed_offload"),
    ("deepspeed_offload", "fully_shard"),
    ("fsdp2_offload", "deepspeed_offload"),
)


def describe(args: argparse.Namespace) -> str:
    """The settings line under which a table was measured."""
    compiled = f"blocks compiled ({args.compile_backend})" if args.compile else "eager"
    changed = [f"{k}={getattr(args, k)}" for k in ("dim", "n_layers", "n_heads", "ffn_dim") if getattr(args, k, None)]
    shape = f" ({' '.join(changed)})" if changed else ""
    float8 = ", float8 (torchao)" if getattr(args, "float8", False) else ""
    ac = f", {args.ac} activation checkpointing" if getattr(args, "ac", "none") != "none" else ""
    optimizer = f", optimizer {args.optimizer}" if getattr(args, "optimizer", "adamw") != "adamw" else ""
    optimizer += f", clipped at {args.max_norm:g}" if getattr(args, "max_norm", 0.0) else ""
    optimizer += f", loss in chunks of {args.loss_chunk} tokens" if getattr(args, "loss_chunk", 0) else ""
    return (
        f"model {args.model}, preset {args.preset}{shape}{float8}{ac}{optimizer}, local batch {args.batch_size}, seq {args.seq_len}, "
        f"wrap {args.wrap}, {compiled}, {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}"
    )


def report(rounds: list[dict[str, dict]], args: argparse.Namespace, world: int, device_name: str) -> dict:
    """Print the table and the ratios of `rounds` (one dict run -> result per round); write
    them with the settings to `args.out` if given. Returns the ratios."""
    runs = list(rounds[0])
    med = {run: statistics.median(rd[run]["step_s"] for rd in rounds) for run in runs}
    peak = {run: max(rd[run]["peak_alloc_gib"] for rd in rounds) for run in runs}
    reserved = {run: max(rd[run]["peak_reserved_gib"] for rd in rounds) for run in runs}
    print(f"\n{device_name} x{world}, mesh {describe_mesh(args, world)}, {describe(args)}")
    w = max(12, *map(len, runs))  # fully_shard_graphed is 19 wide
    # The host's memory matters where a run keeps its state there: the process's resident set at
    # the end of each run (a high-water mark over the contenders run before it too).
    host = {run: max(rd[run].get("host_rss_gib", 0.0) for rd in rounds) for run in runs}
    host_column = any("_offload" in run for run in runs)
    print(
        f"{'run':<{w}} {'s/step':>8} {'tok/s/GPU':>10} {'MFU':>6} {'alloc GiB':>10} {'reserved GiB':>13}"
        + (f" {'host GiB':>9}" if host_column else "")
    )
    tokens = {run: _tokens(rounds[0][run], args) for run in runs}
    for run in runs:
        tok = tokens[run] / med[run]
        mfu = tok * rounds[0][run]["mfu_per_tok_s"]
        print(
            f"{run:<{w}} {med[run]:>8.4f} {tok:>10.0f} {mfu:>6.1%} {peak[run]:>10.2f} {reserved[run]:>13.2f}"
            + (f" {host[run]:>9.2f}" if host_column else "")
        )
    ratios = {}
    for ours, theirs in RATIOS:
        if ours in med and theirs in med:
            # Tokens per GPU-second: under --mesh tp a floor's GPU trains tp times the tokens of a TP one.
            scale = tokens[ours] / tokens[theirs]
            per_round = sorted(scale * rd[theirs]["step_s"] / rd[ours]["step_s"] for rd in rounds)
            r = ratios[f"{ours}/{theirs}"] = {
                "throughput": statistics.median(per_round),
                "throughput_range": [per_round[0], per_round[-1]],
                "peak_alloc": _ratio(peak[ours], peak[theirs]),
                "peak_reserved": _ratio(reserved[ours], reserved[theirs]),
            }
            print(
                f"{ours}/{theirs}: throughput {r['throughput']:.3f}x (rounds {per_round[0]:.3f}-{per_round[-1]:.3f}), "
                f"peak allocated {r['peak_alloc']:.3f}x, reserved {r['peak_reserved']:.3f}x"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "world": world,
                    "device": device_name,
                    "mesh": describe_mesh(args, world),
                    "args": vars(args),
                    "rounds": rounds,
                    "ratios": ratios,
                },
                f,
                indent=2,
            )
    return ratios


def _tokens(result: dict, args: argparse.Namespace) -> float:
    """A GPU's tokens per step of a run (results written before meshes: local batch x seq)."""
    return result.get("tokens_gpu", args.batch_size * args.seq_len)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")  # no memory statistics on the CPU


def write_trace(prof: torch.profiler.profile, path: str) -> None:
    """`prof`'s Chrome trace, gzipped, at `path` (examples/trace_overlap.py reads it); its
    directory is created if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        prof.export_chrome_trace(tmp.name)
    with open(tmp.name, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(tmp.name)
