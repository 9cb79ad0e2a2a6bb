#!/usr/bin/env python
"""Train a Llama-style byte-level language model with `composable`: the main job.

    python examples/train.py                       # CPU: spawns 2 gloo ranks, ~2 minutes
    torchrun --nproc-per-node 4 examples/train.py --preset 1b --mp bf16 --batch-size 4 --seq-len 2048

The corpus is the Python standard library's own source (see data.py); a held-out split gives
the validation loss. Without a launcher (no RANK/WORLD_SIZE in the environment) this script
spawns `--nproc` local ranks itself (gloo on CPU, NCCL when there are enough GPUs); under
`torchrun` every rank uses the GPU `LOCAL_RANK` (NCCL) or the CPU (gloo).

Outputs under `--out`: `metrics.json` / `metrics.csv` (per-step train loss, lr, grad norm,
tokens/s, memory; validation losses), `loss.png` (train/val curves), `checkpoints/step_N/`
(DCP checkpoints, written atomically: saved to `step_N.tmp/`, renamed after every rank is
done). `--resume` continues from the newest complete checkpoint with exactly the losses an
uninterrupted run would have had (on CPU).

Parallelism (`--parallel`):
  fsdp       fully_shard per transformer block + root (1D mesh over all ranks)
  hsdp       fully_shard on a 2D (replicate, shard) mesh
  replicate  replicate (DDP semantics) on the whole model
  tp         tensor parallelism (ColwiseParallel/RowwiseParallel on mesh["tp"]) x fully_shard on mesh["dp"]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import socket
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # model.py, data.py, parallel.py, ... live next to this file
    sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:  # a checkout that was not pip-installed still runs
    sys.path.append(os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

from composable import ShardedGradScaler, clip_grad_norm_, fully_shard, no_sync  # noqa: E402

# The example's own modules (found through HERE above, under torchrun and mp.spawn alike):
from checkpointing import CKPT_DIR, checkpoint_dirs, load_checkpoint, save_checkpoint  # noqa: E402
from data import VOCAB_SIZE, ByteCorpus, get_batch  # noqa: E402
from model import PRESETS, ModelConfig, Transformer, count_parameters, get_config, lm_loss  # noqa: E402
from parallel import UsageError, build_mesh, parallelize  # noqa: E402
from reporting import memory_string, print_summary, write_outputs  # noqa: E402


# ----------------------------------------------------------------------------- arguments

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parallel", choices=["fsdp", "hsdp", "replicate", "tp"], default="fsdp")
    p.add_argument("--mp", choices=["fp32", "bf16", "fp16"], default=None,
                   help="compute dtype: bf16 = bf16 params / fp32 reduce; fp16 adds ShardedGradScaler (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint() every transformer block")
    p.add_argument("--cpu-offload", action="store_true", help="CPUOffloadPolicy: sharded params, grads and the optimizer step on the CPU")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (no_sync on all but the last)")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm (composable.clip_grad_norm_); 0 disables")
    p.add_argument("--steps", type=int, default=250, help="optimizer steps in total")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's max_seq_len)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup, cosine decay to 10%%)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps, at most 100")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (and at the end); 0: only at the end")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank per evaluation")
    p.add_argument("--ckpt-every", type=int, default=100, help="DCP checkpoint every N steps (and at the end); 0 disables")
    p.add_argument("--keep-ckpts", type=int, default=2, help="complete checkpoints to keep")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--out", default="runs/train", help="output directory")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn when not started by a launcher")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=2, help="--parallel tp: tensor-parallel degree")
    p.add_argument("--hsdp-shard-size", type=int, default=None, help="--parallel hsdp: ranks per shard group (default: world/2, at least 1)")
    m = p.add_argument_group("model size overrides (default: the preset's)")
    m.add_argument("--dim", type=int)
    m.add_argument("--n-layers", type=int)
    m.add_argument("--n-heads", type=int)
    m.add_argument("--ffn-dim", type=int)
    m.add_argument("--vocab-size", type=int, help=f"at least {VOCAB_SIZE} (bytes)")
    m.add_argument("--tie-embeddings", action="store_true", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: stop as if killed after step N
    args = p.parse_args(argv)
    for name in ("grad_accum", "steps", "batch_size", "nproc", "tp_size", "eval_batches", "keep_ckpts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.cpu_offload and args.parallel == "replicate":
        p.error("--cpu-offload needs --parallel fsdp, hsdp or tp (replicate has no offload policy)")
    if args.vocab_size is not None and args.vocab_size < VOCAB_SIZE:
        p.error(f"--vocab-size must be >= {VOCAB_SIZE} for byte-level data")
    try:
        model_config(args)
    except ValueError as e:
        p.error(str(e))
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The preset with the size flags applied; max_seq_len grows to --seq-len if needed."""
    cfg = get_config(args.preset, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, ffn_dim=args.ffn_dim,
                     vocab_size=args.vocab_size, tie_embeddings=args.tie_embeddings)
    if args.seq_len is not None and args.seq_len > cfg.max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=args.seq_len)
    return cfg


# ----------------------------------------------------------------------------- launching

def main(argv: list[str] | None = None) -> int:
    """Entry point: run under a launcher's environment, or spawn `--nproc` local ranks."""
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_rank(args)
    port = _free_port()
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: no hostname resolution
    try:
        mp.spawn(_spawned_rank, args=(args, port), nprocs=args.nproc, join=True)
    except mp.ProcessExitedException as e:  # the rank already printed why
        return e.exit_code or 1
    except mp.ProcessRaisedException as e:
        print(f"train.py: a rank failed:\n{e}", file=sys.stderr)
        return 1
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_rank(local_rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Share the cores between the ranks: oversubscribed threads make every rank slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    code = _run_rank(args)
    if code:
        sys.exit(code)


def _run_rank(args: argparse.Namespace) -> int:
    """Initialise the default process group from the environment, train, tear down."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ["WORLD_SIZE"])
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=torch.device("cuda", local_rank) if use_cuda else None)
    try:
        train(args)
    except (NotImplementedError, UsageError) as e:  # a combination that is not supported: say so plainly
        if dist.get_rank() == 0:
            print(f"train.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- optimizer

def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # No weight decay on gains (1D): decaying RMSNorm weights towards 0 only hurts.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to `--lr`, then cosine decay to 10% of it at `--steps` (1-based step)."""
    warmup = args.warmup_steps if args.warmup_steps is not None else min(100, max(1, args.steps // 10))
    if step <= warmup:
        return args.lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------- training

@torch.no_grad()
def evaluate(model: nn.Module, corpus: ByteCorpus, args: argparse.Namespace, seq_len: int, dp_rank: int, device: torch.device) -> float:
    """Mean loss over `--eval-batches` fixed held-out batches per data-parallel rank."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(args.eval_batches):
        x, y = get_batch(corpus.val, args.batch_size, seq_len, seed=args.seed, step=i, rank=dp_rank, split_id=1, device=device)
        total += lm_loss(model(x), y)
    model.train(was_training)
    return _world_mean(total / args.eval_batches)


def _world_mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)  # SUM (gloo has no AVG); tp ranks of one dp rank hold equal values
    return value.item() / dist.get_world_size()


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train on the initialised default process group; returns the summary (with the
    per-step history under "history") on every rank."""
    t_start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if args.mp is None:
        args.mp = "bf16" if device.type == "cuda" else "fp32"
    verbose = rank == 0 and not args.quiet
    from tqdm.auto import tqdm

    say = tqdm.write if verbose else (lambda *_: None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    mesh, dp_mesh, dp_rank, dp_size = build_mesh(args, device.type)
    cfg = model_config(args)
    seq_len = args.seq_len or cfg.max_seq_len

    # Same seed on every rank: identical initial weights before sharding. On a GPU the model
    # is built on the meta device and materialised shard by shard after parallelize (a 1B
    # model never exists unsharded); on the CPU it is built whole, so the initial weights do
    # not depend on the world size or the parallelism.
    torch.manual_seed(args.seed)
    meta_init = device.type == "cuda"
    with torch.device("meta") if meta_init else contextlib.nullcontext():
        model = Transformer(cfg)
    n_params = count_parameters(model)
    parallelize(model, args, mesh, dp_mesh)
    if meta_init:
        # Materialise the shards where they will live: on the CPU when offloading (as
        # torchtitan does), else on the GPU. The rotary tables always go to the GPU.
        model.to_empty(device="cpu" if args.cpu_offload else device)
        model.init_weights(buffer_device=device)
    optimizer = build_optimizer(model, args)
    scaler = ShardedGradScaler(enabled=args.mp == "fp16")

    corpus = ByteCorpus.load()
    tokens_per_step = args.batch_size * seq_len * args.grad_accum * dp_size
    history: list[dict[str, Any]] = []
    start_step = 0
    if args.resume:
        found = checkpoint_dirs(args.out)
        if found:
            step, path = found[-1]
            state = load_checkpoint(path, model, optimizer)
            start_step, history = state["step"], state["history"]
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            say(f"resumed from {path} (step {start_step})")
        else:
            say(f"--resume: no checkpoint under {os.path.join(args.out, CKPT_DIR)}; starting from scratch")

    title = (f"{args.preset} ({n_params / 1e6:.2f}M params), --parallel {args.parallel}, {world} ranks ({device.type}), "
             f"--mp {args.mp}, {tokens_per_step} tokens/step")
    say(f"train.py: {title}")
    say(f"  mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, data: {corpus.n_files} stdlib files, "
        f"{corpus.train.numel() / 1e6:.1f}M train / {corpus.val.numel() / 1e6:.1f}M val bytes, out: {args.out}")

    hsdp_accum = args.parallel == "hsdp" and args.grad_accum > 1
    bar = tqdm(total=args.steps, initial=start_step, disable=not verbose, unit="step", dynamic_ncols=True, leave=True)
    train_time, train_tokens = 0.0, 0
    last_val = next((h["val_loss"] for h in reversed(history) if h.get("val_loss") is not None), None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    for step in range(start_step + 1, args.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        # The step's batch depends only on (seed, step, data-parallel rank); micro-batches are
        # slices of it, so --grad-accum 2 --batch-size 4 sees the data of --batch-size 8.
        xs, ys = get_batch(corpus.train, args.batch_size * args.grad_accum, seq_len, seed=args.seed, step=step, rank=dp_rank, device=device)
        for micro, (x, y) in enumerate(zip(xs.chunk(args.grad_accum), ys.chunk(args.grad_accum))):
            last = micro == args.grad_accum - 1
            # Gradient accumulation: no communication on all but the last micro-batch. HSDP
            # keeps reduce-scattering (only sharded gradients are held) and defers just the
            # all-reduce across replicas; the others skip all communication (no_sync).
            if hsdp_accum:
                fully_shard.state(model).set_requires_all_reduce(last)
                ctx = contextlib.nullcontext()
            else:
                ctx = contextlib.nullcontext() if last else no_sync(model)
            with ctx:
                loss = lm_loss(model(x), y) / args.grad_accum
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        grad_norm = None
        if args.max_norm > 0:
            scaler.unscale_(optimizer)  # clip the true gradients (no-op unless fp16)
            grad_norm = clip_grad_norm_(model.parameters(), args.max_norm).item()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        train_loss = _world_mean(loss_sum)  # also waits for the step to finish
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        train_time += dt
        train_tokens += tokens_per_step
        mem_gib, mem = memory_string(device)
        record: dict[str, Any] = {"step": step, "loss": train_loss, "lr": lr, "grad_norm": grad_norm,
                                  "tokens_per_s": tokens_per_step / dt, "mem_gib": mem_gib, "time_s": dt, "val_loss": None}
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            record["val_loss"] = last_val = evaluate(model, corpus, args, seq_len, dp_rank, device)
            say(f"step {step:>5}: train loss {train_loss:.4f}  val loss {last_val:.4f}")
        history.append(record)
        bar.set_postfix_str(f"loss {train_loss:.3f}" + (f" val {last_val:.3f}" if last_val is not None else "")
                            + f" | {tokens_per_step / dt:,.0f} tok/s | {mem}", refresh=False)
        bar.update(1)
        if args.ckpt_every and (step % args.ckpt_every == 0 or step == args.steps):
            trainer_state = {"step": step, "history": history, "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                             "args": vars(args), "data_position": {"seed": args.seed, "next_step": step + 1}}
            path = save_checkpoint(args.out, step, model, optimizer, trainer_state, args.keep_ckpts)
            say(f"step {step:>5}: checkpoint {path}")
        if args.stop_after is not None and step >= args.stop_after:
            bar.close()
            return {"history": history, "stopped_at": step}
    bar.close()

    wall = time.perf_counter() - t_start
    final = history[-1] if history else {}
    summary = {
        "params": n_params, "preset": args.preset, "parallel": args.parallel, "mp": args.mp, "world_size": world,
        "device": device.type, "steps": args.steps, "resumed_from": start_step or None,
        "final_train_loss": final.get("loss"), "final_val_loss": final.get("val_loss"),
        "first_train_loss": history[0]["loss"] if history else None,
        "tokens_per_s": train_tokens / train_time if train_time else None,
        "tokens_per_s_per_rank": train_tokens / train_time / world if train_time else None,
        "train_time_s": train_time, "wall_time_s": wall, "peak_mem_gib": max((h["mem_gib"] for h in history), default=None),
        "checkpoints": [path for _, path in checkpoint_dirs(args.out)],
    }
    if rank == 0:
        write_outputs(args.out, history, summary, title, say)
        if verbose:
            print_summary(summary, args.out)
    return {**summary, "history": history}

if __name__ == "__main__":
    sys.exit(main())
