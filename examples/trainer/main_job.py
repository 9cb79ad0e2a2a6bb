"""Train a Llama-style byte-level language model with `composable`: the main job.

    python examples/train.py                       # CPU: spawns 2 gloo ranks, ~2 minutes
    torchrun --nproc-per-node 4 examples/train.py --preset 1b --mp bf16 --batch-size 4 --seq-len 2048

The corpus is the Python standard library's own source (see data.py); a held-out split gives
the validation loss. Without a launcher (no RANK/WORLD_SIZE in the environment) the job
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
replicate or tp (--async-tp too), without --cpu-offload or hsdp's --tp-size (and, for auto, without --mp fp16 or --optimizer muon), on one rank or several, each
training step runs through `composable.graphed_step`: two eager steps, then one captured step
replayed every step, which takes the host's per-step overhead away at small per-GPU batches.
`--optimizer muon` (muon_adamw.py): Muon on the blocks' matrices, AdamW on the rest, one optimizer.
The optimizer of a graphed step is a fused, capturable AdamW (beside Muon with --optimizer muon) with a tensor
learning rate set in place every step. The first lines of the output say which mode runs and why ("cuda graph: on (auto)",
"cuda graph: off (...)").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpointing import checkpoint_dirs, rank0_then_broadcast
from trainer.launch import exit_process, run_rank, spawn_local
from trainer.memory_check import check_memory, host_memory_bytes
from trainer.options import model_config, parse_args
from trainer.parallel import build_mesh
from trainer.pipeline import build_pp_mesh
from trainer.runs import Run, identity, open_run
from trainer.training_loop import Job, run_training
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


# ----------------------------------------------------------------------------- the job on each rank


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
        return run_training(args, job, stack)
