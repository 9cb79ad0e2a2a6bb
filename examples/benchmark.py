"""Side-by-side benchmark: composable vs PyTorch's FSDP2 and DDP, one run, same GPUs.

    torchrun --nproc_per_node 4 examples/benchmark.py --preset 1b --batch-size 4
    python examples/benchmark.py --cpu-overhead        # hook overhead, 2 local gloo ranks

GPU mode runs, one after the other in one process group: a no-communication floor (each GPU
trains its own copy with autocast, nothing communicated), composable.fully_shard, PyTorch
FSDP2, composable.replicate and PyTorch DDP (+autocast), all on the same model, data and
AdamW, and prints one table (median step time, tokens/s per GPU, MFU, peak memory allocated
and reserved) with ratios ours/theirs. `--cpu-overhead` measures per-step CPU cost of the
hooks on 64 tiny blocks under a world-2 gloo group (ours, FSDP2, bare model).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # uninstalled checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import composable  # noqa: E402
from model import Transformer, get_config, lm_loss, model_flops_per_token  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0}
WRAPS = ("blocks", "separate-ends")  # how fully_shard/FSDP2 group the model: see `sharding_units`


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1b")
    p.add_argument("--batch-size", type=int, default=4, help="local (per-GPU) batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="every run once per round; ratios are medians of per-round ratios")
    p.add_argument("--runs", default="floor,fully_shard,fsdp2,replicate,ddp", help="comma list")
    p.add_argument("--wrap", choices=WRAPS, default="blocks",
                   help="fully_shard/FSDP2 groups: 'blocks' = each block + the root (embeddings, norm, head); "
                        "'separate-ends' = also the embeddings and the head on their own, as torchtitan does, so "
                        "the head's reduce-scatter overlaps the blocks' backward and the root's last one is smaller")
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--profile", default="", help="comma list of runs to profile (2 extra steps each, first round)")
    p.add_argument("--trace-dir", default=None, help="with --profile: write rank 0's Chrome trace of each profiled run here (gzipped)")
    p.add_argument("--cpu-overhead", action="store_true", help="measure hook CPU overhead on 64 tiny blocks (gloo, 2 ranks)")
    return p.parse_args(argv)


# -- GPU runs -------------------------------------------------------------------------------------
def sharding_units(model: Transformer, wrap: str) -> list[nn.Module]:
    """The modules `fully_shard` (ours or FSDP2) is applied to, bottom-up, the root last."""
    ends = [model.tok_embeddings, model.output] if wrap == "separate-ends" else []
    return [*ends, *model.layers, model]


def build(run: str, cfg, device: torch.device, wrap: str = "blocks") -> tuple[nn.Module, Callable[[], object]]:
    """The model for `run`, parallelised (`wrap`: see `sharding_units`), materialised on
    `device`; and an autocast factory."""
    from contextlib import nullcontext

    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    if run in ("floor", "ddp"):
        model = Transformer(cfg).to(device)
        if run == "ddp":
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
        return model, autocast
    with torch.device("meta"):
        model = Transformer(cfg)
    if run == "fully_shard":
        mpp = composable.MixedPrecisionPolicy(**bf16)
        for module in sharding_units(model, wrap):
            composable.fully_shard(module, mp_policy=mpp)
    elif run == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mpp = MixedPrecisionPolicy(**bf16)
        for module in sharding_units(model, wrap):
            fully_shard(module, mp_policy=mpp)
    elif run == "replicate":
        composable.replicate(model, mp_policy=composable.MixedPrecisionPolicy(**bf16))
    else:
        raise ValueError(f"unknown run {run!r}")
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    return model, nullcontext


def train_step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, autocast: Callable[[], object]) -> torch.Tensor:
    with autocast():
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def time_run(run: str, args: argparse.Namespace, device: torch.device, profile: bool = False) -> dict:
    cfg = get_config(args.preset, max_seq_len=args.seq_len)
    # Peaks are counted above what was allocated before this run's model existed, so that
    # anything an earlier run left behind is not charged to this one.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before_alloc, before_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.manual_seed(0)
    model, autocast = build(run, cfg, device, args.wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device, generator=g)
    times = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = train_step(model, opt, tokens, autocast)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if profile and run in args.profile.split(","):
        profile_steps(run, model, opt, tokens, autocast, args)
    step_s = statistics.median(times)
    tok_s = args.batch_size * args.seq_len / step_s
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 989.0)
    result = dict(
        run=run, step_s=step_s, tok_s_gpu=tok_s, mfu_per_tok_s=model_flops_per_token(cfg, args.seq_len) / (peak * 1e12),
        peak_alloc_gib=(torch.cuda.max_memory_allocated() - before_alloc) / 2**30,
        peak_reserved_gib=(torch.cuda.max_memory_reserved() - before_reserved) / 2**30,
        left_before_gib=before_alloc / 2**30,
        loss=float(loss),
    )
    del model, opt, loss
    gc.collect()
    torch.cuda.empty_cache()
    return result


def profile_steps(run: str, model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, autocast: Callable[[], object],
                  args: argparse.Namespace) -> None:
    """Print where device time goes in 2 steps (rank 0): top kernels and communication share.

    With `--trace-dir`, rank 0 also writes `<run>_b<batch>.json.gz`, a Chrome trace of the
    2 steps (`examples/trace_overlap.py` reads it).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            train_step(model, opt, tokens, autocast)
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        events = prof.key_averages()
        total = sum(e.self_device_time_total for e in events)
        comm = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
        print(f"[profile {run}] device time {total / 2e3:.1f} ms/step, of which NCCL {comm / 2e3:.1f} ms/step")
        print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
        if args.trace_dir:
            _write_trace(prof, os.path.join(args.trace_dir, f"{run}_b{args.batch_size}.json.gz"))


def _write_trace(prof, path: str) -> None:  # type: ignore[no-untyped-def]
    import gzip
    import shutil
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        prof.export_chrome_trace(tmp.name)
    with open(tmp.name, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(tmp.name)


def gpu_main(args: argparse.Namespace) -> None:
    """Every contender once per round, rounds one after the other: slow drifts of the host
    (other tenants, clocks) hit all contenders alike, and each ratio is the median of its
    per-round ratios."""
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    device = torch.device("cuda", local)
    runs = args.runs.split(",")
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        rounds.append({})
        for run in runs:
            res = time_run(run, args, device, profile=r == 0)
            agg = torch.tensor([res["step_s"], res["peak_alloc_gib"], res["peak_reserved_gib"]], device=device)
            dist.all_reduce(agg, op=dist.ReduceOp.MAX)  # the slowest rank and the largest peak count
            res["step_s"], res["peak_alloc_gib"], res["peak_reserved_gib"] = agg.tolist()
            res["tok_s_gpu"] = args.batch_size * args.seq_len / res["step_s"]
            rounds[-1][run] = res
            if dist.get_rank() == 0:
                print(f"[round {r}] [{run}] {res['step_s']:.4f} s/step  {res['tok_s_gpu'] / 1e3:.1f}k tok/s/GPU  peak {res['peak_alloc_gib']:.2f} GiB above the {res['left_before_gib']:.2f} GiB left by earlier runs", flush=True)
    if dist.get_rank() == 0:
        report(rounds, args, dist.get_world_size(), torch.cuda.get_device_name(device))
    dist.destroy_process_group()


RATIOS = (("fully_shard", "fsdp2"), ("replicate", "ddp"), ("fully_shard", "floor"))


def report(rounds: list[dict[str, dict]], args: argparse.Namespace, world: int, device_name: str) -> None:
    """One table of per-run medians over rounds, then ours/theirs ratios: throughput as the
    median of per-round ratios (with their range), memory from the largest peaks."""
    runs = list(rounds[0])
    med = {run: statistics.median(rd[run]["step_s"] for rd in rounds) for run in runs}
    peak = {run: max(rd[run]["peak_alloc_gib"] for rd in rounds) for run in runs}
    reserved = {run: max(rd[run]["peak_reserved_gib"] for rd in rounds) for run in runs}
    print(f"\n{device_name} x{world}, preset {args.preset}, local batch {args.batch_size}, seq {args.seq_len}, "
          f"wrap {args.wrap}, {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}")
    print(f"{'run':<12} {'s/step':>8} {'tok/s/GPU':>10} {'MFU':>6} {'alloc GiB':>10} {'reserved GiB':>13}")
    for run in runs:
        tok = args.batch_size * args.seq_len / med[run]
        mfu = tok * rounds[0][run]["mfu_per_tok_s"]
        print(f"{run:<12} {med[run]:>8.4f} {tok:>10.0f} {mfu:>6.1%} {peak[run]:>10.2f} {reserved[run]:>13.2f}")
    ratios = {}
    for ours, theirs in RATIOS:
        if ours in med and theirs in med:
            per_round = sorted(rd[theirs]["step_s"] / rd[ours]["step_s"] for rd in rounds)
            ratios[f"{ours}/{theirs}"] = dict(throughput=statistics.median(per_round), throughput_range=[per_round[0], per_round[-1]],
                                              peak_alloc=peak[ours] / peak[theirs], peak_reserved=reserved[ours] / reserved[theirs])
            r = ratios[f"{ours}/{theirs}"]
            print(f"{ours}/{theirs}: throughput {r['throughput']:.3f}x (rounds {per_round[0]:.3f}-{per_round[-1]:.3f}), "
                  f"peak allocated {r['peak_alloc']:.3f}x, reserved {r['peak_reserved']:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(world=world, device=device_name, args=vars(args), rounds=rounds, ratios=ratios), f, indent=2)


# -- CPU hook overhead ------------------------------------------------------------------------------
class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


def _overhead_rank(rank: int, world: int, port: int, steps: int, queue) -> None:  # type: ignore[no-untyped-def]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = _time_hook_runs(steps)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _no_communication_hook(_state: object, bucket: "dist.GradBucket") -> "torch.futures.Future[torch.Tensor]":
    """DDP comm hook for the fake process group (whose all-reduce futures carry no value):
    hands the bucket back untouched, so DDP's own CPU work is what is timed."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks the hook's annotations by identity; `from __future__ import annotations` made them strings.
_no_communication_hook.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


OVERHEAD_RUNS = ("bare", "fully_shard", "fsdp2", "replicate", "ddp")


def _time_hook_runs(steps: int, fake: bool = False) -> dict:
    """Median step time (forward, backward, SGD step) of 64 tiny blocks + root under each of
    OVERHEAD_RUNS; `fully_shard`/FSDP2 wrap every block and the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for run in OVERHEAD_RUNS:
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(*[TinyBlock() for _ in range(64)])
        if run == "fully_shard":
            for block in model:
                composable.fully_shard(block, mesh=mesh)
            composable.fully_shard(model, mesh=mesh)
        elif run == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif run == "replicate":
            composable.replicate(model, mesh=mesh)
        elif run == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
            if fake:
                model.register_comm_hook(None, _no_communication_hook)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(2, 8)
        times = []
        for step in range(steps + 5):
            dist.barrier()
            start = time.perf_counter()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if step >= 5:
                times.append(time.perf_counter() - start)
        out[run] = statistics.median(times)
    return out


def fake_overhead(steps: int = 30, world: int = 8) -> dict:
    """Pure CPU cost of the hooks: the fake process group communicates nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return _time_hook_runs(steps, fake=True)
    finally:
        dist.destroy_process_group()


def _print_overhead(title: str, out: dict) -> None:
    print(title)
    for run, t in out.items():
        print(f"  {run:<12} {t * 1e3:8.2f} ms")
    for ours, theirs in (("fully_shard", "fsdp2"), ("replicate", "ddp")):
        print(f"  overhead over the bare model: {ours} {1e3 * (out[ours] - out['bare']):.2f} ms vs {theirs} {1e3 * (out[theirs] - out['bare']):.2f} ms "
              f"(step time ratio {ours}/{theirs} {out[ours] / out[theirs]:.3f}x)")


def cpu_overhead_main(steps: int = 30) -> dict:
    import socket

    torch.set_num_threads(1)
    _print_overhead(f"fake process group, world 8, 64 tiny blocks + root, one process (median of {steps} steps):", fake_overhead(steps))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_overhead_rank, args=(2, port, steps, queue), nprocs=2, start_method="spawn")
    out = queue.get()
    _print_overhead(f"gloo, world 2, 64 tiny blocks + root (median of {steps} steps; includes gloo latency):", out)
    return out


if __name__ == "__main__":
    a = parse_args()
    if a.cpu_overhead:
        cpu_overhead_main()
    else:
        gpu_main(a)
