#!/usr/bin/env python
"""Train a Llama-style byte-level language model with `composable`: the main job.

    python examples/train.py                       # CPU: spawns 2 gloo ranks, ~2 minutes
    torchrun --nproc-per-node 4 examples/train.py --preset 1b --mp bf16 --batch-size 4 --seq-len 2048

The corpus is the Python standard library's own source (see data.py); a held-out split gives
the validation loss. Without a launcher (no RANK/WORLD_SIZE in the environment) this script
spawns `--nproc` local ranks itself and supervises them (launch.py); under `torchrun` every
rank uses the GPU `LOCAL_RANK` (NCCL) or the CPU (gloo).

Every run writes into its own `<out>/<run id>/` (runs.py): `metrics.csv` (a line per step, as
it goes), `metrics.json` (per-step train loss, lr, grad norm, tokens/s, memory; validation
losses; the summary), `loss.png`, and `checkpoints/step_N/` (checkpointing.py: DCP, atomic,
checksummed; the newest `--keep-ckpts` of this run are kept). `--resume` continues from the
newest intact checkpoint with exactly the losses an uninterrupted run would have had (on CPU),
and refuses a checkpoint of another model or seed. `--timeout` bounds every wait for another
rank: a rank that dies or stalls ends the job with a line naming it (watchdog.py).

Parallelism (`--parallel`; parallel.py):
  fsdp       fully_shard on the embeddings, the head, every transformer block, then the root
  hsdp       the same on a 2D (replicate, shard) mesh; with --tp-size, a 3D (replicate, shard, tp) mesh: the
             tp recipe below on mesh["tp"], then HSDP on (replicate, shard)
  replicate  replicate (DDP semantics) on the whole model
  tp         torchtitan's tensor-parallel recipe on mesh["tp"] (sequence-parallel norms, vocabulary-sharded
             head and its vocabulary-parallel loss, fused AdamW on CUDA), then fully_shard on mesh["dp"]; --async-tp
             overlaps its collectives with the matmuls (CUDA, compiled blocks) and turns on
             --fused-projections (one wqkv and one w13 linear per block, which its backward needs)
`--pp N --pp-schedule NAME --microbatches M` (pipeline.py) splits the model into stages over a
leading "pp" mesh dim, each stage parallelized as above, run by torch's Schedule<NAME>.

CUDA graphs (`--cuda-graph auto|on|off`, default auto; train_step.py): on CUDA with fsdp, hsdp,
replicate or tp (--async-tp too), without --cpu-offload, --optimizer muon or hsdp's --tp-size (and, for auto, without --mp fp16), on one rank or several, each
training step runs through `composable.graphed_step`: two eager steps, then one captured step
replayed every step, which takes the host's per-step overhead away at small per-GPU batches.
`--optimizer muon` (muon_adamw.py): Muon on the blocks' matrices, AdamW on the rest, one optimizer.
The optimizer of a graphed step is a fused, capturable AdamW with a tensor learning rate set in place every
step. The first lines of the output say which mode runs and why ("cuda graph: on (auto)",
"cuda graph: off (...)").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from composable import ShardedGradScaler, graphed_step
from composable.optim import offload_optimizer_state
from models.model import ModelConfig, Transformer, count_parameters
from trainer.checkpointing import checkpoint_dirs, load_newest_intact, rank0_then_broadcast, save_checkpoint
from trainer.data import ByteCorpus, get_batch
from trainer.fault_tolerance import committed, next_step, serve_lighthouse
from trainer.fault_tolerance import start as start_fault_tolerance
from trainer.launch import exit_process, host_threads_for_offload, run_rank, spawn_local
from trainer.memory_check import check_memory, host_memory_bytes
from trainer.options import FAULT, cuda_graph_mode, model_config, parse_args
from trainer.parallel import PARAMS_ON_HOST, UsageError, build_mesh
from trainer.pipeline import build_parallel_model, build_pp_mesh
from trainer.reporting import MetricsLog, ProgressBar, memory_string, print_summary, steady_throughput, write_plot
from trainer.runs import Run, identity, identity_differences, mismatch_message, open_run
from trainer.schedule import build_optimizer, evaluate, lr_at, world_mean
from trainer.train_step import TrainStep, build_graph_optimizer, checkpoint_ready, make_train_step, set_lr
from trainer.watchdog import Watchdog

__all__ = ["checkpoint_dirs", "main", "parse_args", "train"]


# ----------------------------------------------------------------------------- launching


def main(argv: list[str] | None = None) -> int:
    """Entry point: run under a launcher's environment, or spawn `--nproc` local ranks."""
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_rank(args, train)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: no hostname resolution
    return spawn_local(_spawned_rank, args)


def _spawned_rank(local_rank: int, store_port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(args.nproc),
        LOCAL_WORLD_SIZE=str(args.nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    # Share the cores between the ranks: oversubscribed threads make every rank slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    exit_process(run_rank(args, train, external_store_port=store_port))


# ----------------------------------------------------------------------------- optimizer


def train(args: argparse.Namespace, watchdog: Watchdog | None = None) -> dict[str, Any]:
    """Train on the initialised default process group; returns the summary (with the
    per-step history under "history") on every rank."""
    t_start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    watchdog = watchdog or Watchdog(None, rank, world, args.timeout)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if args.mp is None:
        args.mp = "bf16" if device.type == "cuda" else "fp32"
    if args.compile is None:  # the fast path on GPUs; on a CPU compiling costs more than it saves
        args.compile = device.type == "cuda"
    verbose = rank == 0 and not args.quiet
    from tqdm.auto import tqdm

    # tqdm's default lock is a multiprocessing one: a semaphore that a rank ended by os._exit
    # (after a failed collective) leaves behind, for the resource tracker to warn about.
    tqdm.set_lock(threading.RLock())
    say = tqdm.write if verbose else (lambda *_: None)
    # Warnings (a damaged checkpoint, a skipped run) are shown even with --quiet.
    warn = (lambda m: print(f"train.py: {m}", file=sys.stderr, flush=True)) if rank == 0 else (lambda *_: None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    mesh, dp_mesh, dp_rank, dp_size = (build_pp_mesh if args.pp > 1 else build_mesh)(args, device.type)
    cfg = model_config(args)
    seq_len = args.seq_len or cfg.max_seq_len
    if device.type == "cuda":
        available, where = torch.cuda.get_device_properties(device).total_memory, f"GPU {device.index} has"
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        available, where = host_memory_bytes() // local, f"this host has per rank ({local} ranks)"
    if available:
        rank0_then_broadcast(lambda: check_memory(args, cfg, seq_len, dp_size, available, where))
    ident = identity(args, cfg)
    locks: list[Any] = []

    def choose_run() -> Run:
        run, lock = open_run(args, ident)
        locks.append(lock)  # rank 0 holds the run's lock until this function returns
        return run

    run = rank0_then_broadcast(choose_run)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [lock.release() for lock in locks])
        for note in run.notes:
            warn(note)
        job = Job(
            run, cfg, seq_len, device, mesh, dp_mesh, dp_rank, dp_size, ident, watchdog, say, warn, verbose, t_start
        )
        return _train(args, job, stack)


@dataclasses.dataclass
class Job:
    """What `train` settled before the model exists: where the run writes, the model's config,
    the device and meshes, and how to report."""

    run: Run
    cfg: ModelConfig
    seq_len: int
    device: torch.device
    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    dp_rank: int
    dp_size: int
    ident: dict[str, Any]  # runs.identity: what a checkpoint must share with this job
    watchdog: Watchdog
    say: Callable[[str], Any]  # progress messages (rank 0, not with --quiet)
    warn: Callable[[str], Any]  # warnings (rank 0, always, to stderr)
    verbose: bool
    t_start: float


def _train(args: argparse.Namespace, job: Job, stack: contextlib.ExitStack) -> dict[str, Any]:
    run, cfg, seq_len, device, mesh, dp_rank, dp_size = (
        job.run,
        job.cfg,
        job.seq_len,
        job.device,
        job.mesh,
        job.dp_rank,
        job.dp_size,
    )
    watchdog, say, warn, verbose = job.watchdog, job.say, job.warn, job.verbose
    rank, world = dist.get_rank(), dist.get_world_size()
    # First: a lighthouse this job starts (--lighthouse start:PORT) is up while the other groups,
    # started alongside, build their models, and a port in use fails before any work.
    lighthouse = serve_lighthouse(args, stack) if args.fault_tolerant else None
    graphs, graphs_why = cuda_graph_mode(args, device.type)  # before the model: `on` may be refused
    if args.cpu_offload in PARAMS_ON_HOST and device.type == "cuda":
        host_threads_for_offload()  # the optimizer steps on the host
    # Same seed on every rank: identical initial weights before sharding. On a GPU the model
    # is built on the meta device and materialised shard by shard after parallelize (a 1B
    # model never exists unsharded); on the CPU it is built whole, so the initial weights do
    # not depend on the world size or the parallelism.
    torch.manual_seed(args.seed)
    meta_init = device.type == "cuda"
    with torch.device("meta") if meta_init else contextlib.nullcontext():
        model = Transformer(cfg)
    n_params = count_parameters(model)
    model, pipeline = build_parallel_model(model, args, mesh, job.dp_mesh, device, meta_init)
    # Fused AdamW: the TP recipe's optimizer, and an offloaded run's host step (6x the unfused one's speed).
    fused = (args.parallel == "tp" or bool(args.cpu_offload)) and device.type == "cuda"
    optimizer = build_graph_optimizer(model, args, device) if graphs else build_optimizer(model, args, fused)
    if args.cpu_offload == "optimizer-state":  # its state on the host between steps, stepped on the GPU
        offload_optimizer_state(optimizer)
    scaler = ShardedGradScaler(enabled=args.mp == "fp16")

    corpus = ByteCorpus.load()
    tokens_per_step = args.batch_size * seq_len * args.grad_accum * dp_size
    eval_loss = pipeline.forward_loss if pipeline is not None else None
    history: list[dict[str, Any]] = []
    start_step = 0
    if run.resume:

        def accept(state: dict[str, Any], path: str) -> None:
            diffs = identity_differences(state.get("identity", {}), job.ident)
            if diffs:
                raise UsageError(mismatch_message(f"checkpoint {path}", diffs))
            if state["step"] > args.steps:
                raise UsageError(
                    f"--steps {args.steps} is below the step of checkpoint {path} ({state['step']}); "
                    f"pass --steps {state['step']} or more to continue this run"
                )

        watchdog.progress(0, "checkpoint load")
        with checkpoint_ready(optimizer):  # keeps this run's lr tensor and optimizer flags
            loaded = load_newest_intact(run.path, model, optimizer, accept, warn)
        if loaded is not None:
            state, path = loaded
            start_step, history = state["step"], state["history"]
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            say(f"resumed from {path} (step {start_step})")
            if start_step == args.steps:
                warn(
                    f"run {run.run_id} is already at step {start_step} = --steps: nothing to train (a larger --steps continues it)"
                )
    metrics = MetricsLog(run.path, history) if rank == 0 else None
    if metrics is not None:
        stack.callback(metrics.close)

    title = (
        f"{args.preset} ({n_params / 1e6:.2f}M params), --parallel {args.parallel}{pipeline.title if pipeline else ''}"
        f", {world} ranks ({device.type}), "
        f"--mp {args.mp}, {tokens_per_step} tokens/step"
    )
    say(f"train.py: {title}")
    say(
        f"  mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, data: {corpus.n_files} stdlib files, "
        f"{corpus.train.numel() / 1e6:.1f}M train / {corpus.val.numel() / 1e6:.1f}M val bytes, run: {run.path}"
    )
    say(f"  cuda graph: {'on' if graphs else 'off'} ({graphs_why})")

    fault = FAULT.fullmatch(args.fault) if args.fault else None
    hsdp_accum = args.parallel == "hsdp" and args.grad_accum > 1
    # --fault-tolerant: the train step steps through the Manager; checkpoints take the optimizer.
    stepper, manager = (
        start_fault_tolerance(model, optimizer, args, start_step, lighthouse)
        if lighthouse is not None
        else (optimizer, None)
    )
    train_step = (
        pipeline.make_train_step(optimizer, args, device)
        if pipeline
        else make_train_step(model, stepper, scaler, args, hsdp_accum)
    )
    # Two eager steps (lazy init, compilation, NCCL set-up), then captured once and replayed.
    run_step: TrainStep = graphed_step(train_step, warmup=2) if graphs else train_step
    bar = ProgressBar(args.steps, start_step, verbose)
    train_time, train_tokens = 0.0, 0
    first_step_done: float | None = None  # seconds from the start to the end of this process's first step
    busy_steps: set[int] = set()  # steps that ran an evaluation or saved a checkpoint
    last_val = next((h["val_loss"] for h in reversed(history) if h.get("val_loss") is not None), None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    step = start_step
    while step < args.steps:
        step = next_step(manager, step)
        watchdog.progress(step, "forward/backward")
        if (
            fault and fault[2] != "EXITHANG" and int(fault[1]) == rank and int(fault[3]) == step
        ):  # tests: die or stall here
            time.sleep(0.2)  # let the heartbeat of this step land first, as it would in a real stall
            os.kill(os.getpid(), getattr(signal, "SIG" + fault[2]))
        t0 = time.perf_counter()
        lr = lr_at(step, args)
        set_lr(optimizer, lr)  # in place when graphed: the graph reads the lr tensor at every replay
        # The step's batch depends only on (seed, step, data-parallel rank); micro-batches are
        # slices of it, so --grad-accum 2 --batch-size 4 sees the data of --batch-size 8.
        xs, ys = get_batch(
            corpus.train,
            args.batch_size * args.grad_accum,
            seq_len,
            seed=args.seed,
            step=step,
            rank=dp_rank,
            device=device,
        )
        loss_sum, norm = run_step(xs, ys)  # tensors: read here, outside a graph
        grad_norm = None if norm is None else norm.item()
        train_loss = world_mean(loss_sum)  # also waits for the step to finish
        if not committed(manager, step):  # a group died during it: taken again
            step -= 1
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if first_step_done is None:
            first_step_done = t0 + dt - job.t_start
        train_time += dt
        train_tokens += tokens_per_step
        mem_gib, mem = memory_string(device)
        record: dict[str, Any] = {
            "step": step,
            "loss": train_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / dt,
            "mem_gib": mem_gib,
            "time_s": dt,
            "val_loss": None,
        }
        evaluating = step == args.steps or (args.eval_every and step % args.eval_every == 0)
        if evaluating:
            watchdog.progress(step, "evaluation")
            record["val_loss"] = last_val = evaluate(model, corpus, args, seq_len, dp_rank, device, eval_loss)
            say(f"step {step:>5}: train loss {train_loss:.4f}  val loss {last_val:.4f}")
        history.append(record)
        saving = args.ckpt_every and (step % args.ckpt_every == 0 or step == args.steps)
        if evaluating or saving:
            busy_steps.add(step)
        if metrics is not None:
            metrics.append(record)
            if evaluating or saving:
                metrics.write_json(history)
        bar.update(
            f"loss {train_loss:.3f}"
            + (f" val {last_val:.3f}" if last_val is not None else "")
            + f" | {tokens_per_step / dt:,.0f} tok/s | {mem}"
        )
        if saving:
            watchdog.progress(step, "checkpoint save")
            trainer_state = {
                "step": step,
                "history": history,
                "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                "args": vars(args),
                "identity": job.ident,
                "data_position": {"seed": args.seed, "next_step": step + 1},
            }
            with checkpoint_ready(optimizer):  # a graphed run's checkpoint holds a plain lr, as an eager one's
                path = save_checkpoint(run.path, step, model, optimizer, trainer_state, args.keep_ckpts)
            say(f"step {step:>5}: checkpoint {path}")
        if args.stop_after is not None and step >= args.stop_after:
            bar.close()
            return {"history": history, "stopped_at": step, "run_dir": run.path, "run_id": run.run_id}
    bar.close()
    watchdog.progress(args.steps, "done")

    wall = time.perf_counter() - job.t_start
    final = history[-1] if history else {}
    steady = steady_throughput(history, start_step + 1, tokens_per_step, busy_steps)
    summary = {
        "params": n_params,
        "preset": args.preset,
        "parallel": args.parallel,
        "pp": args.pp,
        "mp": args.mp,
        "world_size": world,
        "device": device.type,
        "compile": args.compile,
        "cuda_graph": graphs,
        "steps": args.steps,
        "resumed_from": start_step or None,
        "final_train_loss": final.get("loss"),
        "final_val_loss": final.get("val_loss"),
        "first_train_loss": history[0]["loss"] if history else None,
        # Steady state (reporting.steady_throughput says which steps count); compile warm-up
        # shows in the time to the first step and in the figure over all steps.
        "tokens_per_s": steady["tokens_per_s"],
        "tokens_per_s_per_rank": steady["tokens_per_s"] / world if steady["tokens_per_s"] else None,
        "throughput_steps": steady["steps"],
        "tokens_per_s_all_steps": train_tokens / train_time if train_time else None,
        "time_to_first_step_s": first_step_done,
        "train_time_s": train_time,
        "wall_time_s": wall,
        "peak_mem_gib": max((h["mem_gib"] for h in history), default=None),
        "run_id": run.run_id,
        "run_dir": run.path,
        "checkpoints": [path for _, path in checkpoint_dirs(run.path)],
    }
    if metrics is not None:
        metrics.write_json(history, summary)
        write_plot(run.path, history, title, say)
        if verbose:
            print_summary(summary, run.path)
    return {**summary, "history": history}
