"""The main job's training, once `main_job.train` has settled the run, the device and the meshes
(a `Job`): the model and what steps it (`build`), the resume from a checkpoint, the loop of steps
with its evaluations, checkpoints and metrics, and the summary."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from composable import ShardedGradScaler, fully_shard, graphed_step
from composable.optim import HostStepInBackward, offload_optimizer_state, step_in_backward
from models.model import ModelConfig, Transformer, count_parameters
from trainer.checkpointing import checkpoint_dirs, load_newest_intact, save_checkpoint
from trainer.data import ByteCorpus, get_batch
from trainer.fault_tolerance import committed, next_step, serve_lighthouse
from trainer.fault_tolerance import start as start_fault_tolerance
from trainer.launch import host_threads_for_offload
from trainer.options import FAULT, cuda_graph_mode
from trainer.parallel import PARAMS_ON_HOST, UsageError
from trainer.pipeline import build_parallel_model
from trainer.reporting import MetricsLog, ProgressBar, memory_string, print_summary, steady_throughput, write_plot
from trainer.runs import Run, identity_differences, mismatch_message
from trainer.schedule import build_optimizer, evaluate, lr_at, world_mean
from trainer.train_step import TrainStep, build_graph_optimizer, checkpoint_ready, make_train_step, set_lr
from trainer.watchdog import Watchdog


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


@dataclasses.dataclass
class Built:
    """What `build` made: the parallelised model, its optimizer and scaler, and how it steps."""

    model: nn.Module
    n_params: int
    pipeline: Any  # pipeline.Pipeline under --pp, else None
    optimizer: torch.optim.Optimizer
    scaler: ShardedGradScaler
    graphs: bool  # the step runs as a CUDA graph
    graphs_why: str
    lighthouse: Any  # the torchft lighthouse address under --fault-tolerant, else None
    in_backward: HostStepInBackward | None = None  # --step-in-backward: it also clips (--max-norm)


@dataclasses.dataclass
class Tally:
    """The loop's running totals, which the summary reads."""

    train_time: float = 0.0
    train_tokens: int = 0
    first_step_done: float | None = None  # seconds from the start to the end of this process's first step
    busy_steps: set[int] = dataclasses.field(default_factory=set)  # steps that evaluated or saved a checkpoint


def run_training(args: argparse.Namespace, job: Job, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Build, resume, train `--steps` steps; returns the summary with the per-step history."""
    run, seq_len, device, dp_size = job.run, job.seq_len, job.device, job.dp_size
    rank, world = dist.get_rank(), dist.get_world_size()
    built = build(args, job, stack)
    corpus = ByteCorpus.load()
    tokens_per_step = args.batch_size * seq_len * args.grad_accum * dp_size
    start_step, history = resume(args, job, built) if run.resume else (0, [])
    metrics = MetricsLog(run.path, history) if rank == 0 else None
    if metrics is not None:
        stack.callback(metrics.close)

    title = (
        f"{args.preset} ({built.n_params / 1e6:.2f}M params), --parallel {args.parallel}"
        f"{built.pipeline.title if built.pipeline else ''}"
        f", {world} ranks ({device.type}), "
        f"--mp {args.mp}, {tokens_per_step} tokens/step"
    )
    job.say(f"train.py: {title}")
    job.say(
        f"  mesh {tuple(job.mesh.shape)} {job.mesh.mesh_dim_names}, data: {corpus.n_files} stdlib files, "
        f"{corpus.train.numel() / 1e6:.1f}M train / {corpus.val.numel() / 1e6:.1f}M val bytes, run: {run.path}"
    )
    job.say(f"  cuda graph: {'on' if built.graphs else 'off'} ({built.graphs_why})")

    tally = Tally()
    stopped = _train_steps(args, job, built, corpus, history, start_step, metrics, tokens_per_step, tally)
    if stopped is not None:
        return stopped
    summary = _summary(args, job, built, history, start_step, tokens_per_step, tally)
    if metrics is not None:
        metrics.write_json(history, summary)
        write_plot(run.path, history, title, job.say)
        if job.verbose:
            print_summary(summary, run.path)
    return {**summary, "history": history}


def build(args: argparse.Namespace, job: Job, stack: contextlib.ExitStack) -> Built:
    """The model laid out over the meshes, its optimizer and gradient scaler; the lighthouse first."""
    device = job.device
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
        model = Transformer(job.cfg)
    n_params = count_parameters(model)
    model, pipeline = build_parallel_model(model, args, job.mesh, job.dp_mesh, device, meta_init)
    # Fused AdamW: the TP recipe's optimizer, and an offloaded run's host step (6x the unfused one's speed).
    fused = (args.parallel == "tp" or bool(args.cpu_offload)) and device.type == "cuda"
    optimizer = build_graph_optimizer(model, args, device) if graphs else build_optimizer(model, args, fused)
    if args.cpu_offload == "optimizer-state":  # its state on the host between steps, stepped on the GPU
        # Its copies in during backward where fully_shard manages the blocks (0.97x no offload's
        # speed against 0.79x, BENCHMARKS.md "CPU offload"), into the memory backward's activations
        # leave; with activation checkpointing those are small beside the state, and holding all of
        # it at the step would undo the saving. replicate's model has no module to follow.
        sharded = any(fully_shard.state(m) is not None for m in model.modules())
        prefetch = model if sharded and not args.activation_checkpointing else None
        offload_optimizer_state(optimizer, prefetch_in_backward=prefetch)
    # Each group's host step as its gradients land, beside the rest of backward; with --max-norm
    # the norms are taken as they land and the groups step once the total is known.
    in_backward = step_in_backward(optimizer, model, args.max_norm or None) if args.step_in_backward else None
    scaler = ShardedGradScaler(enabled=args.mp == "fp16")
    return Built(model, n_params, pipeline, optimizer, scaler, graphs, graphs_why, lighthouse, in_backward)


def resume(args: argparse.Namespace, job: Job, built: Built) -> tuple[int, list[dict[str, Any]]]:
    """The step to start from and the history so far: from the run's newest intact checkpoint of
    this job's identity, or (0, []) when it has none."""
    run, warn = job.run, job.warn

    def accept(state: dict[str, Any], path: str) -> None:
        diffs = identity_differences(state.get("identity", {}), job.ident)
        if diffs:
            raise UsageError(mismatch_message(f"checkpoint {path}", diffs))
        if state["step"] > args.steps:
            raise UsageError(
                f"--steps {args.steps} is below the step of checkpoint {path} ({state['step']}); "
                f"pass --steps {state['step']} or more to continue this run"
            )

    job.watchdog.progress(0, "checkpoint load")
    with checkpoint_ready(built.optimizer):  # keeps this run's lr tensor and optimizer flags
        loaded = load_newest_intact(run.path, built.model, built.optimizer, accept, warn)
    if loaded is None:
        return 0, []
    state, path = loaded
    start_step, history = state["step"], state["history"]
    if state.get("scaler"):
        built.scaler.load_state_dict(state["scaler"])
    job.say(f"resumed from {path} (step {start_step})")
    if start_step == args.steps:
        warn(
            f"run {run.run_id} is already at step {start_step} = --steps: nothing to train (a larger --steps continues it)"
        )
    return start_step, history


def _train_steps(
    args: argparse.Namespace,
    job: Job,
    built: Built,
    corpus: ByteCorpus,
    history: list[dict[str, Any]],
    start_step: int,
    metrics: MetricsLog | None,
    tokens_per_step: int,
    tally: Tally,
) -> dict[str, Any] | None:
    """The steps from `start_step` to `--steps`, each appended to `history` (and to `metrics` on
    rank 0), evaluating and checkpointing on schedule; the result of a `--stop-after` stop, else None."""
    rank = dist.get_rank()
    fault = FAULT.fullmatch(args.fault) if args.fault else None
    run_step, manager = _step_runner(args, job, built, start_step)
    bar = ProgressBar(args.steps, start_step, job.verbose)
    last_val = next((h["val_loss"] for h in reversed(history) if h.get("val_loss") is not None), None)
    if job.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(job.device)
    built.model.train()
    step = start_step
    while step < args.steps:
        step = next_step(manager, step)
        job.watchdog.progress(step, "forward/backward")
        # --fault (tests, bench_ft_recovery.py): die or stall here, saying so first.
        if fault and fault[2] != "EXITHANG" and int(fault[1]) == rank and int(fault[3]) == step:
            time.sleep(0.2)  # let the heartbeat of this step land first, as it would in a real stall
            print(
                f"train.py: --fault: rank {rank} sends itself SIG{fault[2]} at step {step}", file=sys.stderr, flush=True
            )
            os.kill(os.getpid(), getattr(signal, "SIG" + fault[2]))
        timed = _timed_step(args, job, built, corpus, run_step, manager, step, tokens_per_step, tally)
        if timed is None:  # a group died during it: taken again
            step -= 1
            continue
        record, mem = timed
        last_val = _after_step(args, job, built, corpus, history, metrics, bar, record, mem, last_val, tally)
        if args.stop_after is not None and step >= args.stop_after:
            bar.close()
            return {"history": history, "stopped_at": step, "run_dir": job.run.path, "run_id": job.run.run_id}
    bar.close()
    job.watchdog.progress(args.steps, "done")
    return None


def _step_runner(args: argparse.Namespace, job: Job, built: Built, start_step: int) -> tuple[TrainStep, Any]:
    """(the function that takes one training step on a batch's inputs and targets and returns its
    loss sum and gradient norm, the torchft Manager or None): the pipeline's step under --pp, else
    `make_train_step`'s, stepping through the Manager under --fault-tolerant (which joins the
    quorum at `start_step`); as a CUDA graph (`graphed_step`) when `built.graphs`."""
    model, optimizer, pipeline = built.model, built.optimizer, built.pipeline
    hsdp_accum = args.parallel == "hsdp" and args.grad_accum > 1
    # --fault-tolerant: the train step steps through the Manager; checkpoints take the optimizer.
    stepper, manager = (
        start_fault_tolerance(model, optimizer, args, start_step, built.lighthouse)
        if built.lighthouse is not None
        else (optimizer, None)
    )
    train_step = (
        pipeline.make_train_step(optimizer, args, job.device)
        if pipeline
        else make_train_step(model, stepper, built.scaler, args, hsdp_accum, built.in_backward)
    )
    # Two eager steps (lazy init, compilation, NCCL set-up), then captured once and replayed.
    return (graphed_step(train_step, warmup=2) if built.graphs else train_step), manager


def _timed_step(
    args: argparse.Namespace,
    job: Job,
    built: Built,
    corpus: ByteCorpus,
    run_step: TrainStep,
    manager: Any,
    step: int,
    tokens_per_step: int,
    tally: Tally,
) -> tuple[dict[str, Any], str] | None:
    """Step `step` at its scheduled learning rate on its batch, timed to the end of its work on the
    device: (its history record, with `val_loss` None, and the memory line for the progress bar),
    its time and tokens added to `tally`. None, and nothing added, when the Manager did not commit
    it (a group died during it)."""
    device, seq_len = job.device, job.seq_len
    t0 = time.perf_counter()
    lr = lr_at(step, args)
    set_lr(built.optimizer, lr)  # in place when graphed: the graph reads the lr tensor at every replay
    # The step's batch depends only on (seed, step, data-parallel rank); micro-batches are
    # slices of it, so --grad-accum 2 --batch-size 4 sees the data of --batch-size 8.
    xs, ys = get_batch(
        corpus.train,
        args.batch_size * args.grad_accum,
        seq_len,
        seed=args.seed,
        step=step,
        rank=job.dp_rank,
        device=device,
    )
    loss_sum, norm = run_step(xs, ys)  # tensors: read here, outside a graph
    grad_norm = None if norm is None else norm.item()
    train_loss = world_mean(loss_sum)  # also waits for the step to finish
    if not committed(manager, step):
        return None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    if tally.first_step_done is None:
        tally.first_step_done = t0 + dt - job.t_start
    tally.train_time += dt
    tally.train_tokens += tokens_per_step
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
    return record, mem


def _after_step(
    args: argparse.Namespace,
    job: Job,
    built: Built,
    corpus: ByteCorpus,
    history: list[dict[str, Any]],
    metrics: MetricsLog | None,
    bar: ProgressBar,
    record: dict[str, Any],
    mem: str,
    last_val: float | None,
    tally: Tally,
) -> float | None:
    """What follows step `record["step"]`: the held-out evaluation when it is due (every
    --eval-every steps and at the last; its loss into `record`), `record` appended to `history`
    (and to `metrics`, whose JSON is rewritten on an evaluating or checkpointing step), such a
    step marked busy in `tally`, the progress bar, and the checkpoint when one is due (every
    --ckpt-every steps and at the last). Returns the newest held-out loss (`last_val` if none now)."""
    step, train_loss = record["step"], record["loss"]
    evaluating = step == args.steps or (args.eval_every and step % args.eval_every == 0)
    if evaluating:
        job.watchdog.progress(step, "evaluation")
        eval_loss = built.pipeline.forward_loss if built.pipeline is not None else None
        record["val_loss"] = last_val = evaluate(
            built.model, corpus, args, job.seq_len, job.dp_rank, job.device, eval_loss
        )
        job.say(f"step {step:>5}: train loss {train_loss:.4f}  val loss {last_val:.4f}")
    history.append(record)
    saving = args.ckpt_every and (step % args.ckpt_every == 0 or step == args.steps)
    if evaluating or saving:
        tally.busy_steps.add(step)
    if metrics is not None:
        metrics.append(record)
        if evaluating or saving:
            metrics.write_json(history)
    bar.update(
        f"loss {train_loss:.3f}"
        + (f" val {last_val:.3f}" if last_val is not None else "")
        + f" | {record['tokens_per_s']:,.0f} tok/s | {mem}"
    )
    if saving:
        _save(args, job, built, step, history)
    return last_val


def _save(args: argparse.Namespace, job: Job, built: Built, step: int, history: list[dict[str, Any]]) -> None:
    """Checkpoint the model, the optimizer and what a resume needs to go on exactly."""
    job.watchdog.progress(step, "checkpoint save")
    trainer_state = {
        "step": step,
        "history": history,
        "scaler": built.scaler.state_dict() if built.scaler.is_enabled() else None,
        "args": vars(args),
        "identity": job.ident,
        "data_position": {"seed": args.seed, "next_step": step + 1},
    }
    with checkpoint_ready(built.optimizer):  # a graphed run's checkpoint holds a plain lr, as an eager one's
        path = save_checkpoint(job.run.path, step, built.model, built.optimizer, trainer_state, args.keep_ckpts)
    job.say(f"step {step:>5}: checkpoint {path}")


def _summary(
    args: argparse.Namespace,
    job: Job,
    built: Built,
    history: list[dict[str, Any]],
    start_step: int,
    tokens_per_step: int,
    tally: Tally,
) -> dict[str, Any]:
    """The run in figures: losses, throughput (steady and over all steps), time, memory, where it wrote."""
    world = dist.get_world_size()
    wall = time.perf_counter() - job.t_start
    final = history[-1] if history else {}
    steady = steady_throughput(history, start_step + 1, tokens_per_step, tally.busy_steps)
    return {
        "params": built.n_params,
        "preset": args.preset,
        "parallel": args.parallel,
        "pp": args.pp,
        "mp": args.mp,
        "world_size": world,
        "device": job.device.type,
        "compile": args.compile,
        "cuda_graph": built.graphs,
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
        "tokens_per_s_all_steps": tally.train_tokens / tally.train_time if tally.train_time else None,
        "time_to_first_step_s": tally.first_step_done,
        "train_time_s": tally.train_time,
        "wall_time_s": wall,
        "peak_mem_gib": max((h["mem_gib"] for h in history), default=None),
        "run_id": job.run.run_id,
        "run_dir": job.run.path,
        "checkpoints": [path for _, path in checkpoint_dirs(job.run.path)],
    }
