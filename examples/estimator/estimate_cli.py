"""Scale on paper: per-rank peak memory and per-step communication of a training setup, at any
world size, on one CPU process, in seconds.

    python examples/estimate.py --dim 8192 --n-layers 80 --n-heads 64 --ffn-dim 28672 \\
        --world-size 64 --parallel hsdp --hsdp-shard-size 8 --batch-size 2 --seq-len 8192
    python examples/estimate.py --preset 1b --world-size 2 --batch-size 4 --json
    python examples/estimate.py --preset 1b --world-size 1024 --plot scale.png --plot-layouts fsdp,hsdp,replicate
    python examples/estimate.py --benchmark b4.json     # benchmark.py --out b4.json's setup, beside its measurement

Communication comes from the real engine: the model is built on the meta device, laid out
with `fully_shard` / `replicate` / `checkpoint` / tensor parallelism exactly as train.py does,
and run for one step as rank 0 of the fake process group on fake tensors, under CommDebugMode
(estimate_comm.py). Memory comes from an analytic model of the engine (estimate_memory.py),
time from assumed link bandwidths and achieved FLOP/s (estimate_time.py, `--bandwidth`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from estimator.estimate_comm import CommEstimate, estimate_comm
from estimator.estimate_memory import MemoryEstimate, estimate_memory, n_params
from estimator.estimate_setup import OFFLOADS, OPTIMIZER_STATES, PARALLEL, Setup, UsageError, config_from_hf
from estimator.estimate_time import DEFAULT_TFLOPS, Links, TimeEstimate, estimate_time, parse_bandwidth
from models.model import PRESETS, config_from_flags

GiB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset, overridden field by field, or a HuggingFace Llama config)")
    m.add_argument("--preset", default="1b", help=f"one of {', '.join(PRESETS)} (default 1b)")
    for flag in ("dim", "n-layers", "n-heads", "ffn-dim", "vocab"):
        m.add_argument(f"--{flag}", type=int, default=None)
    m.add_argument("--tie-embeddings", action="store_true")
    m.add_argument(
        "--hf-model", default=None, help="HuggingFace name or local dir of a Llama config (needs transformers)"
    )
    t = p.add_argument_group("training setup")
    t.add_argument("--world-size", type=int, default=8)
    t.add_argument("--parallel", default="fsdp", help=f"one of {', '.join(PARALLEL)}")
    t.add_argument("--hsdp-shard-size", type=int, default=None, help="hsdp: ranks per shard group (default world/2)")
    t.add_argument("--tp-size", type=int, default=1, help="tp: tensor-parallel ranks")
    t.add_argument("--reshard-after-forward", default="default", help="default | true | false (blocks)")
    t.add_argument(
        "--wrap",
        default="blocks",
        help="fully_shard groups: blocks (each block + the root, benchmark.py's default) | separate-ends "
        "(also the embeddings and the head on their own)",
    )
    t.add_argument("--batch-size", type=int, default=1, help="local batch per data-parallel rank")
    t.add_argument("--seq-len", type=int, default=2048)
    t.add_argument("--mp", default="bf16", help="fp32 | bf16 | fp16 (low precision: fp32 gradient reduction)")
    t.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZER_STATES)}")
    t.add_argument("--activation-checkpointing", action="store_true")
    t.add_argument(
        "--cpu-offload",
        nargs="?",
        const="host",
        default=None,
        choices=OFFLOADS,
        help="train.py's --cpu-offload: host (the value without one) | compute-shard-on-device | optimizer-state",
    )
    t.add_argument("--pp", type=int, default=1, help="pipeline stages (train.py --pp): per-stage estimate")
    t.add_argument("--pp-schedule", default="1F1B", help="--pp: torch's Schedule<NAME>")
    t.add_argument("--microbatches", type=int, default=None, help="--pp: microbatches per step (default --batch-size)")
    t.add_argument(
        "--benchmark",
        default=None,
        help="a benchmark.py --out results file: estimate its setup (model, batch, --mesh, world) and print "
        "the estimate beside the measurement (estimate_bench.py); the model and setup flags are not read",
    )
    h = p.add_argument_group("hardware (assumptions: see examples/estimator/estimate_time.py)")
    h.add_argument(
        "--bandwidth",
        default="",
        help="nvlink=GB/s,inter=GB/s,latency_us=us (default nvlink=360,inter=45,latency_us=10)",
    )
    h.add_argument("--gpus-per-node", type=int, default=8)
    h.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS, help="achieved TFLOP/s per GPU")
    h.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory to check the peak against")
    o = p.add_argument_group("output")
    o.add_argument(
        "--json", nargs="?", const="-", default=None, help="write JSON to this path ('-' or no value: stdout, no table)"
    )
    o.add_argument("--plot", default=None, help="write a PNG of memory and communication against world size")
    o.add_argument("--plot-worlds", default="8,16,32,64,128,256,512,1024")
    o.add_argument("--plot-layouts", default=None, help="comma list of layouts for --plot (default: --parallel's)")
    return p.parse_args(argv)


def _reshard(value: str) -> bool | None:
    table = {"default": None, "true": True, "false": False}
    if value.lower() not in table:
        raise UsageError(f"--reshard-after-forward must be default, true or false, got {value!r}")
    return table[value.lower()]


def setup_from_args(a: argparse.Namespace) -> Setup:
    """The Setup the flags describe; UsageError names a bad flag and its value."""
    if a.hf_model:
        cfg = config_from_hf(a.hf_model, a.seq_len)
    else:
        if a.preset not in PRESETS:
            raise UsageError(f"--preset must be one of {', '.join(PRESETS)}, got {a.preset!r}")
        for flag in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab"):
            if getattr(a, flag) is not None and getattr(a, flag) < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
        try:
            # No MoE or fused-projection flags here; --tie-embeddings absent: the preset's.
            cfg = config_from_flags(
                a.preset,
                seq_len=a.seq_len,
                dim=a.dim,
                n_layers=a.n_layers,
                n_heads=a.n_heads,
                ffn_dim=a.ffn_dim,
                vocab_size=a.vocab,
                tie_embeddings=a.tie_embeddings or None,
            )
        except ValueError as e:
            raise UsageError(str(e).removeprefix("ModelConfig: ")) from None
    return Setup(
        cfg,
        a.world_size,
        a.parallel,
        a.hsdp_shard_size,
        a.tp_size,
        _reshard(a.reshard_after_forward),
        a.batch_size,
        a.seq_len,
        a.mp,
        a.activation_checkpointing,
        a.cpu_offload,
        a.optimizer,
        a.wrap,
    )


def run(s: Setup, links: Links, tflops: float) -> tuple[MemoryEstimate, CommEstimate, TimeEstimate]:
    comm = estimate_comm(s)
    return estimate_memory(s), comm, estimate_time(s, comm, links, tflops)


def to_json(s: Setup, mem: MemoryEstimate, comm: CommEstimate, tim: TimeEstimate, links: Links, tflops: float) -> dict:
    setup = {k: v for k, v in asdict(s).items() if k != "cfg"}
    return {
        "model": {**asdict(s.cfg), "parameters": n_params(s.cfg)},
        "setup": setup,
        "memory_bytes": mem.as_dict(),
        "communication": {
            "per_kind": comm.by_kind(),
            "collectives": comm.total_count,
            "sent_bytes": comm.sent_bytes,
            "commdebugmode_counts": comm.debug_mode_counts,
            "extrapolated": comm.extrapolated,
        },
        "time": {
            "compute_s": tim.compute_s,
            "comm_s": tim.comm_s,
            "exposed_s": tim.exposed_s,
            "per_kind_s": tim.per_kind_s,
            "hides": tim.hides,
            "assumptions": dict(**asdict(links), achieved_tflops=tflops),
        },
    }


def print_report(
    s: Setup,
    mem: MemoryEstimate,
    comm: CommEstimate,
    tim: TimeEstimate,
    links: Links,
    tflops: float,
    gpu_gib: float,
    seconds: float,
) -> None:
    c = s.cfg
    print(
        f"model   {n_params(c) / 1e9:.2f}B parameters (dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads, "
        f"ffn {c.ffn_dim}, vocab {c.vocab_size}{', tied' if c.tie_embeddings else ''})"
    )
    print(f"setup   {s.describe()}")
    how = "extrapolated from 1- and 2-layer runs" if comm.extrapolated else "one step of the full model"
    print(f"engine  collectives from the real engine on the fake process group ({how}), {seconds:.1f} s\n")
    print(f"memory per rank, GiB     {'at peak':>9} {'held':>9}")
    rows = [
        ("parameters", mem.parameters, mem.held_parameters),
        ("gradients", mem.gradients, mem.held_gradients),
        ("optimizer state", mem.optimizer, mem.held_optimizer),
        ("all-gather/reduce buffers", mem.buffers, None),
        ("activations", mem.activations, None),
    ]
    for name, at_peak, held in rows:
        print(f"  {name:<25}{at_peak / GiB:>8.2f} {'' if held is None else f'{held / GiB:>9.2f}'}")
    fits = "fits" if mem.peak <= gpu_gib * GiB else "does NOT fit"
    print(f"  {'peak':<25}{mem.peak / GiB:>8.2f}   ({mem.peak_at}; {fits} in {gpu_gib:g} GiB)")
    if mem.host:
        what = "optimizer state" if s.offload == "optimizer-state" else "parameters, gradients, optimizer state"
        print(f"  host memory (offloaded {what}): {mem.host / GiB:.2f} GiB")
    print("\ncommunication per rank per step (sent = received: ring volumes)")
    print(f"  {'kind':<16}{'count':>7}{'payload GiB':>13}{'sent GiB':>10}{'time ms':>9}")
    for kind, row in comm.by_kind().items():
        print(
            f"  {kind:<16}{row['count']:>7}{row['payload_bytes'] / GiB:>13.2f}{row['sent_bytes'] / GiB:>10.2f}"
            f"{tim.per_kind_s.get(kind, 0) * 1e3:>9.1f}"
        )
    print(f"  {'total':<16}{comm.total_count:>7}{'':>13}{comm.sent_bytes / GiB:>10.2f}{tim.comm_s * 1e3:>9.1f}")
    print(
        f"\ntime    (assumed: NVLink {links.nvlink_gbps:g} GB/s, inter-node {links.inter_gbps:g} GB/s, "
        f"{links.gpus_per_node} GPUs/node, {tflops:g} TFLOP/s achieved; --bandwidth, --tflops)"
    )
    print(f"  compute {tim.compute_s * 1e3:.1f} ms, communication {tim.comm_s * 1e3:.1f} ms: {tim.verdict()}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        bench = None
        if a.benchmark:
            from estimator import estimate_bench

            bench = estimate_bench.load(a.benchmark)
            s = estimate_bench.setup_from_benchmark(bench)
            a.tflops = estimate_bench.floor_tflops(bench, s) or a.tflops
        else:
            s = setup_from_args(a)
        links = parse_bandwidth(a.bandwidth, a.gpus_per_node)
        if a.tflops <= 0:
            raise UsageError(f"--tflops must be > 0, got {a.tflops}")
        start = time.perf_counter()
        mem, comm, tim = run(s, links, a.tflops)
        elapsed = time.perf_counter() - start
        pipe = None
        if a.pp != 1:
            from estimator.estimate_pipeline import estimate_pipeline

            pipe = estimate_pipeline(s, a.pp, a.microbatches or a.batch_size, a.pp_schedule)
        if a.plot:
            from estimator.estimate_plot import plot_scaling

            plot_scaling(s, a.plot, a.plot_worlds, a.plot_layouts or s.parallel, links, a.tflops)
    except UsageError as e:
        print(f"estimate.py: error: {e}", file=sys.stderr)
        return 2
    except NotImplementedError as e:  # the engine refuses the combination: say so, no traceback
        print(f"estimate.py: error: the engine does not support this setup: {e}", file=sys.stderr)
        return 2
    data = to_json(s, mem, comm, tim, links, a.tflops)
    if pipe is not None:
        data["pipeline"] = pipe
    if bench is not None:
        data["benchmark"] = estimate_bench.compare(bench, s, links, a.tflops)
    if a.json in (None,) or a.json != "-":
        print_report(s, mem, comm, tim, links, a.tflops, a.gpu_gib, elapsed)
        if pipe is not None:
            from estimator.estimate_pipeline import print_pipeline

            print()
            print_pipeline(pipe)
        if bench is not None:
            estimate_bench.print_comparison(data["benchmark"], bench, estimate_bench.floor_tflops(bench, s) is not None)
    if a.json == "-":
        print(json.dumps(data, indent=2))
    elif a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=2)
    return 0
