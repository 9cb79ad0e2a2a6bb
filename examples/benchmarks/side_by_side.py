"""Side-by-side benchmark: composable vs PyTorch's FSDP2 and DDP, one run, same GPUs.

    torchrun --nproc_per_node 2 examples/benchmark.py --preset 1b --batch-size 4
    torchrun --nproc_per_node 2 examples/benchmark.py --preset 1b --batch-size 4 --compile
    torchrun --nproc_per_node 2 examples/benchmark.py --preset 1b --batch-size 4 --model hf-llama
    torchrun --nproc_per_node 2 examples/benchmark.py --preset 1b --dim 4096 --n-layers 16 --compile --float8
    torchrun --nproc_per_node 2 examples/benchmark.py --batch-size 1 --compile \
        --runs floor,floor_graphed,fully_shard,fully_shard_graphed,fsdp2,replicate,replicate_graphed,ddp
    torchrun --nproc_per_node 2 examples/benchmark.py --preset 1b --batch-size 4 --seq-len 8192 --loss-chunk 4096 \
        --runs fully_shard_offload,fsdp2_offload
    torchrun --nproc_per_node 1 examples/benchmark.py --preset 1b --batch-size 4 --seq-len 8192 --max-norm 1.0 \
        --runs fully_shard,fully_shard_offload_step_in_backward,fsdp2_offload,deepspeed_offload
    torchrun --nproc_per_node 4 examples/benchmark.py --preset 1b --batch-size 4 --mesh hsdp --dp-replicate 2
    torchrun --nproc_per_node 4 examples/benchmark.py --preset 1b --batch-size 4 --mesh tp --tp-size 2
    torchrun --nproc_per_node 4 examples/benchmark.py --preset 1b --batch-size 4 --mesh tp --tp-size 2 --async-tp
    torchrun --nproc_per_node 4 examples/benchmark.py --preset 1b --batch-size 4 --mesh tp --tp-size 2 --fused-projections
    python examples/benchmark.py --cpu-overhead        # CPU cost of the hooks, no GPU needed

Runs, one after the other in one process group, once per round: a no-communication floor
(each GPU trains its own copy with autocast), composable.fully_shard, PyTorch FSDP2,
composable.replicate and PyTorch DDP (+autocast), all on the same model (ours, or
HuggingFace's `LlamaForCausalLM` at the same shape with `--model hf-llama`), data and AdamW;
with `--compile` every contender's blocks are compiled; with `--float8` every contender trains
with torchao float8 linears (bench_float8.py; the FSDP-style ones all-gather in float8).
Graphed runs (opt-in through `--runs`, GPU only; with `--float8` the floor and fully_shard ones): `floor_graphed`,
`fully_shard_graphed`, `replicate_graphed` are floor / fully_shard / replicate built the same
way, with AdamW(capturable=True) and the whole step (forward, backward, optimizer step,
zero_grad) through `composable.graphed_step`: eager for all but the last warm-up step, captured
in that one, replayed in every timed step (`make_step`; hence `--warmup` >= 2). A graph removes
the host's overhead from the floor too, so the honest comparison for a graphed contender is
against the graphed floor as well (`fully_shard_graphed/floor_graphed`), not only the eager one.
Their peaks count the graph's private memory pool (it is allocated memory).
`--dim` widens the preset (heads and ffn follow, Llama's rules: `width_overrides`). Prints one table (median step time,
tokens/s per GPU, MFU, peak memory allocated and reserved) and the ratios ours/theirs.
`--mesh hsdp` / `--mesh tp` put fully_shard and FSDP2 on a 2D mesh (HSDP, or TP x FSDP with
train.py's TP recipe, compiled by default on GPUs, `--async-tp` for async TP; bench_mesh.py),
beside the floors. `--fused-projections` (on by default with `--async-tp`) gives every
contender's blocks one wqkv and one w13 linear instead of wq/wk/wv and w1/w3 (examples/models/model.py).
`--runs ...,deepspeed_offload` adds DeepSpeed ZeRO-3 with ZeRO-Offload (bench_deepspeed.py: its engine
takes the model `build` makes and steps it its own way) beside the CPU-offload runs.
`--loss-chunk TOKENS` gives every contender the same chunked loss: the head's matmul and the
cross entropy TOKENS tokens at a time, each chunk checkpointed (examples/models/chunked_loss.py).
Without a GPU it runs on the CPU with gloo (timings only; a smoke test of the wiring).
MFU is always against the bf16 peak. How contenders are built: bench_build.py; the report: bench_report.py; `--cpu-overhead`:
bench_overhead.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.bench_args import model_config, parse_args, width_overrides  # noqa: F401 (the tests' entry points)
from benchmarks.bench_build import (
    DEEPSPEED_RUNS,
    GRAPHED_RUNS,
    OFFLOAD_RUNS,
    STATE_OFFLOAD_RUNS,
    Contender,
    build,
)
from benchmarks.bench_deepspeed import DeepSpeedStep
from benchmarks.bench_mesh import (
    BenchMesh,
    build_mesh,
    tokens_generator,
    tokens_per_gpu,
)
from benchmarks.bench_optim import build_optimizer
from benchmarks.bench_report import report, write_trace
from composable import clip_grad_norm_
from composable.optim import offload_optimizer_state, step_in_backward
from models.model import get_config, lm_loss, model_flops_per_token  # noqa: F401 (get_config, lm_loss: the tests')
from trainer.launch import host_threads_for_offload, init_torchrun_rank

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0}
LR = 1e-4  # every contender's


def train_step(
    c: Contender, opt: torch.optim.Optimizer, tokens: torch.Tensor, max_norm: float = 0.0, loss_chunk: int = 0
) -> torch.Tensor:
    """One step of contender `c` on `tokens` (B, T + 1); the loss before the step. `loss_chunk`
    > 0 (`--loss-chunk`, our model only): its head's chunked loss instead of `lm_loss` of the logits."""
    loss = c.loss(tokens, loss_chunk)
    loss.backward()
    if max_norm > 0:  # --max-norm: the same clipping for every contender (DTensors on any mesh)
        clip_grad_norm_(c.model.parameters(), max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    c.after_step(c.model)  # float8 on FSDP-style runs: the next step's weight scales
    return loss.detach()


def make_step(
    c: Contender,
    opt: torch.optim.Optimizer,
    graphed: bool,
    warmup: int,
    max_norm: float = 0.0,
    loss_chunk: int = 0,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The contender's step: `train_step` (clipping at `max_norm` > 0, the chunked loss with
    `loss_chunk` > 0), or the same through `composable.graphed_step`, which runs eagerly for all
    but the last of the benchmark's `warmup` steps and captures in the last, so that every timed
    step is a replay."""
    if not graphed:
        return lambda tokens: train_step(c, opt, tokens, max_norm, loss_chunk)
    import composable

    return composable.graphed_step(
        lambda tokens: train_step(c, opt, tokens, max_norm, loss_chunk), warmup=max(1, warmup - 1)
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_done(device: torch.device) -> None:
    """Wait for the step's work on the training stream: what a training loop waits for when it
    reads the loss. Copies a contender leaves running on a side stream past its step (the
    optimizer state going back to the host) overlap the next step, which waits for what it
    needs of them; every contender's time still covers all its work in the steady state."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _memory(device: torch.device) -> tuple[float, float]:
    """(allocated, reserved) bytes now; zeros on the CPU, which keeps no such statistics."""
    if device.type != "cuda":
        return 0.0, 0.0
    return float(torch.cuda.memory_allocated(device)), float(torch.cuda.memory_reserved(device))


def prewarm_libraries(device: torch.device) -> None:
    """Allocate the process-lifetime workspaces of the default stream (cuBLAS and cuBLASLt,
    attention) before the first contender: otherwise its peak is charged with them, while every
    later contender finds them allocated already and is not. (cuBLAS's are freed again before
    each contender, `release_stream_workspaces`, which charges every contender alike.)"""
    if device.type != "cuda":
        return
    x = torch.randn(256, 256, device=device, requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        (y @ y).sum().backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            (x @ x).sum().backward()
    q = torch.randn(1, 2, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    torch.cuda.synchronize(device)


def release_stream_workspaces() -> None:
    """Free cuBLAS's workspaces, which it keeps per (handle, stream) for the life of the process
    (32 MiB and more each). A contender that runs matmuls on a stream no earlier one used (a
    graph's capture stream, async TP's side streams) allocates them and leaves them allocated:
    it was charged with them and every later contender was not. Freed before each contender,
    every contender is charged with those of its own streams."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds
    if clear is not None:
        clear()


def forget_dtensor_caches() -> None:
    """Start each contender with DTensor's caches as a fresh training process has them.

    DTensor caches its sharding decisions keyed by the ops' argument specs. An earlier
    contender's entries stay (holding its meshes and specs), and a later contender's specs
    compare equal to them without being the same objects, so every cache hit of the later
    one (several per optimizer op) becomes a field-by-field comparison: replicate's batch-1
    step grew from 0.070 to 0.093 s over 5 rounds while DDP's (plain tensors) did not.
    FSDP2 and fully_shard (DTensor parameters) paid the same."""
    from torch.distributed.tensor import DTensor, _redistribute

    caches = (
        getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None),
        getattr(_redistribute._gen_transform_infos, "cache_clear", None),
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the C++ fast path's
    )
    for clear in caches:
        if clear is not None:
            clear()


def time_run(
    run: str, args: argparse.Namespace, device: torch.device, profile: bool = False, mesh: BenchMesh | None = None
) -> dict:
    """One contender's warm-up and timed steps on this rank (`mesh`: `--mesh`'s, None for dp)."""
    cfg = model_config(args)
    # Peaks are counted above what was allocated before this run's model existed, so that
    # anything an earlier run left behind is not charged to this one.
    gc.collect()
    _sync(device)
    if device.type == "cuda":
        release_stream_workspaces()
        torch.cuda.empty_cache()
    before_alloc, before_reserved = _memory(device)
    if args.compile:
        # Each contender compiles afresh in its warm-up steps (inductor's disk cache keeps that
        # cheap): earlier contenders' graphs and guards must not fill dynamo's per-code cache
        # (a full cache silently falls back to eager) nor be reused across different hooks.
        torch._dynamo.reset()
    forget_dtensor_caches()
    torch.manual_seed(0)
    c = build(
        run,
        cfg,
        device,
        args.wrap,
        args.model,
        args.compile_backend if args.compile else None,
        args.float8,
        args.ac,
        mesh=mesh,
    )
    graphed = run in GRAPHED_RUNS
    engine_step = None
    if run in DEEPSPEED_RUNS:  # DeepSpeed's engine takes the model, with its own optimizer and step
        engine_step = DeepSpeedStep(c, LR, args.batch_size, args.max_norm, getattr(args, "loss_chunk", 0))
        c, opt = engine_step.contender, engine_step.optimizer
    else:
        opt = build_optimizer(c.model, args.optimizer, LR, graphed)
    prefetch = c.model if run.endswith("_prefetch") else None
    state_offload = offload_optimizer_state(opt, prefetch_in_backward=prefetch) if run in STATE_OFFLOAD_RUNS else None
    # The step in backward clips itself, as clip_grad_norm_ would.
    in_backward = None
    if "_step_in_backward" in run:
        speculate = run.endswith("_speculative") and bool(args.max_norm)
        in_backward = step_in_backward(opt, c.model, args.max_norm or None, speculate=speculate)
    max_norm = 0.0 if in_backward is not None else args.max_norm
    loss_chunk = getattr(args, "loss_chunk", 0)
    step_fn = engine_step if engine_step is not None else make_step(c, opt, graphed, args.warmup, max_norm, loss_chunk)
    g = tokens_generator(mesh, device)  # the tp ranks of a group train on the same tokens
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device, generator=g)
    times = []
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = step_fn(tokens)
        _step_done(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    _sync(device)  # what the last step left on side streams, before reading its memory
    if profile and run in args.profile.split(","):
        profile_steps(run, step_fn, tokens, args)
    step_s = statistics.median(times)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 989.0)
    max_alloc, max_reserved = (
        (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
        if device.type == "cuda"
        else (0.0, 0.0)
    )
    tokens_gpu = tokens_per_gpu(mesh, run, args.batch_size, args.seq_len)
    result = {
        "run": run,
        "step_s": step_s,
        "step_range_s": (min(times), max(times)),  # this rank's: a host-bound step jitters
        "tokens_gpu": tokens_gpu,  # a GPU's share of a step's tokens (a tp group shares its batch)
        "tok_s_gpu": tokens_gpu / step_s,
        "mfu_per_tok_s": model_flops_per_token(cfg, args.seq_len) / (peak * 1e12),
        "peak_alloc_gib": (max_alloc - before_alloc) / 2**30,
        "peak_reserved_gib": (max_reserved - before_reserved) / 2**30,
        "left_before_gib": before_alloc / 2**30,
        "host_rss_gib": _host_rss_bytes() / 2**30,
        "loss": float(loss),
    }
    for replaced_step in (state_offload, in_backward, engine_step):
        if replaced_step is not None:
            replaced_step.close()
    teardown(c.model, opt)
    del c, opt, loss, step_fn, state_offload, in_backward, engine_step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _host_rss_bytes() -> int:
    """This process's resident memory now (Linux's /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def teardown(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """End a contender cleanly before the next one (or destroy_process_group) runs: every
    rank done with its collectives (barrier), then DDP's reducer dropped while the process
    group is alive, so none of its work or hooks outlives it (see bench_overhead.py)."""
    dist.barrier()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        del model.reducer, model.logger  # they hold the process group and the gradient hooks
    opt.state.clear()  # MuonAdamW's inner optimizers share this state


def profile_steps(
    run: str, step: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, args: argparse.Namespace
) -> None:
    """Print where device time goes in 2 steps (rank 0): top kernels and communication share.
    With `--trace-dir`, every rank also writes `<run>_b<batch>_rank<r>.json.gz`, a Chrome trace
    of them (trace_overlap.py reads one, trace_nccl.py lines up the ranks' collectives)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tokens.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step(tokens)
        _sync(tokens.device)
    if dist.get_rank() == 0:
        events = prof.key_averages()
        total = sum(e.self_device_time_total for e in events)
        comm = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
        print(f"[profile {run}] device time {total / 2e3:.1f} ms/step, of which NCCL {comm / 2e3:.1f} ms/step")
        print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    if args.trace_dir:
        mesh = "" if getattr(args, "mesh", "dp") == "dp" else f"_{args.mesh}"
        name = f"{run}{mesh}_b{args.batch_size}_rank{dist.get_rank()}.json.gz"
        write_trace(prof, os.path.join(args.trace_dir, name))


def round_order(runs: list[str], r: int) -> list[str]:
    """Contenders in the order round `r` runs them: as given in even rounds, reversed in odd
    ones, so that a place in the round (measured: the second of two ran 1-2% faster at batch 4,
    whichever it was) favours no contender over the rounds."""
    return runs if r % 2 == 0 else runs[::-1]


def _range_ms(res: dict) -> str:
    """The fastest and slowest timed step, in ms: a wide range means a jittery (host-bound) step,
    whose median moves from run to run."""
    lo, hi = res["step_range_s"]
    return f"{lo * 1e3:.0f}-{hi * 1e3:.0f} ms"


def run_rounds(args: argparse.Namespace, device: torch.device) -> list[dict[str, dict]]:
    """Every contender once per round, rounds one after the other, in the initialised process
    group: slow drifts of the host (other tenants, clocks) hit all contenders alike, and each
    ratio is the median of its per-round ratios. Reports on rank 0; returns the rounds."""
    rounds: list[dict[str, dict]] = []
    runs = args.runs.split(",")
    mesh = build_mesh(args, device.type)  # its process groups once, for every contender and round
    for r in range(args.rounds):
        rounds.append(dict.fromkeys(runs))  # results in the given order whatever the running order
        for run in round_order(runs, r):
            res = time_run(run, args, device, profile=r == 0, mesh=mesh)
            agg = torch.tensor([res["step_s"], res["peak_alloc_gib"], res["peak_reserved_gib"]], device=device)
            dist.all_reduce(agg, op=dist.ReduceOp.MAX)  # the slowest rank and the largest peak count
            res["step_s"], res["peak_alloc_gib"], res["peak_reserved_gib"] = agg.tolist()
            res["tok_s_gpu"] = res["tokens_gpu"] / res["step_s"]
            rounds[-1][run] = res
            if dist.get_rank() == 0:
                print(
                    f"[round {r}] [{run}] {res['step_s']:.4f} s/step (rank 0's steps {_range_ms(res)})  "
                    f"{res['tok_s_gpu'] / 1e3:.1f}k tok/s/GPU  "
                    f"peak {res['peak_alloc_gib']:.2f} GiB above the {res['left_before_gib']:.2f} GiB left by earlier runs",
                    flush=True,
                )
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
        report(rounds, args, dist.get_world_size(), name)
    return rounds


def main(args: argparse.Namespace) -> None:
    """Under torchrun: NCCL on the local GPU, or gloo on the CPU where there is none."""
    device = init_torchrun_rank()
    if any(run in OFFLOAD_RUNS + DEEPSPEED_RUNS for run in (args.runs or "").split(",")):
        host_threads_for_offload()
    try:
        prewarm_libraries(device)
        run_rounds(args, device)
        dist.barrier()  # no rank tears the group down while another still communicates
    finally:
        dist.destroy_process_group()


def command_line_main() -> int:
    """`benchmark.py`'s command line: `--cpu-overhead` alone, or the rounds of runs."""
    a = parse_args()
    if a.cpu_overhead:
        from benchmarks.bench_overhead import cpu_overhead_main

        return cpu_overhead_main()
    main(a)
    return 0
