"""The command line of train.py: its flags, the defaults each preset brings, and the checks that
refuse a nonsense value up front (one line naming the flag and the value, exit status 2)
instead of training nonsense or crashing later.

Checks that need the rank's device (does the batch fit in memory?) are in `check_memory`,
which train.py calls on every rank before it builds anything; `cuda_graph_mode` settles
`--cuda-graph` on the rank's device (`auto` -> on or off, and why).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile

import torch

from models.model import PRESET_LR, ModelConfig, config_from_flags
from models.moe import NOT_CAPTURABLE as MOE_NOT_CAPTURABLE
from trainer import fault_tolerance
from trainer.data import VOCAB_SIZE, ByteCorpus
from trainer.flags import build_parser
from trainer.parallel import MOE_EXPERTS, PARAMS_ON_HOST, UsageError, async_tp_problem, tensor_parallel_in, tp_problem
from trainer.pipeline import validate_pp

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
FAULT = re.compile(r"(\d+):(KILL|STOP|TERM|SEGV|EXITHANG):(\d+)")  # EXITHANG: the teardown blocks
CUDA_GRAPH_PARALLEL = ("fsdp", "hsdp", "replicate", "tp")  # what --cuda-graph supports


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.tp_size is None and args.parallel == "tp":
        args.tp_size = 2
    if args.fused_projections is None:
        # Async TP fuses a reduce-scatter only with a single producer matmul (parallel.tp_block_plan).
        args.fused_projections = args.async_tp
    problem = validate(args)
    if problem:
        p.error(problem)
    if args.lr is None:
        args.lr = PRESET_LR[args.preset]
    args.activation_checkpointing = args.ac != "none"  # what the memory estimate and the stages read
    return args


def validate(args: argparse.Namespace) -> str | None:
    """The first problem with the flags as one line, or None. Cheap checks first; the corpus
    is read (cached) only for the sequence length, --out is probed by writing into it."""
    for name in (
        "grad_accum",
        "steps",
        "batch_size",
        "nproc",
        "tp_size",
        "eval_batches",
        "keep_ckpts",
        "seq_len",
        "dim",
        "n_layers",
        "n_heads",
        "ffn_dim",
        "hsdp_shard_size",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"{_flag(name)} must be >= 1, got {value}"
    for name, meaning in (
        ("ckpt_every", "0 disables checkpoints"),
        ("eval_every", "0: only at the end"),
        ("warmup_steps", "0: no warmup"),
        ("stop_after", ""),
    ):
        value = getattr(args, name)
        if value is not None and value < 0:
            return (
                f"{_flag(name)} must be >= 0 ({meaning}), got {value}"
                if meaning
                else f"{_flag(name)} must be >= 0, got {value}"
            )
    for name, low, strict in (
        ("lr", 0.0, True),
        ("max_norm", 0.0, False),
        ("weight_decay", 0.0, False),
        ("timeout", 0.0, True),
        ("moe_capacity_factor", 0.0, True),
    ):
        value = getattr(args, name)
        if value is not None and (not math.isfinite(value) or value < low or (strict and value == low)):
            return f"{_flag(name)} must be a finite number {'>' if strict else '>='} {low:g}, got {value}"
    if args.moe_capacity_factor is not None and not args.moe:
        return f"--moe-capacity-factor {args.moe_capacity_factor:g} needs --moe"
    if args.vocab_size is not None and args.vocab_size < VOCAB_SIZE:
        return f"--vocab-size must be >= {VOCAB_SIZE} for byte-level data, got {args.vocab_size}"
    pp_problem = validate_pp(args) or fault_tolerance.problem(args)
    if pp_problem:
        return pp_problem
    loss_chunk_problem = _loss_chunk_problem(args)
    if loss_chunk_problem:
        return loss_chunk_problem
    if args.tp_size is not None and args.parallel not in ("tp", "hsdp"):
        return f"--tp-size {args.tp_size} needs --parallel tp or hsdp, got --parallel {args.parallel}"
    if args.parallel == "hsdp" and args.tp_size is not None and args.pp > 1:
        return f"--parallel hsdp --tp-size {args.tp_size} with --pp {args.pp}: pipeline stages take --parallel tp"
    if args.cpu_offload == "optimizer-state" and args.optimizer == "muon":
        return "--cpu-offload optimizer-state steps in buckets, and Muon's step communicates: pass --cpu-offload host"
    if args.step_in_backward:
        if args.cpu_offload not in PARAMS_ON_HOST:
            return "--step-in-backward steps CPUOffloadPolicy's host parameters: pass --cpu-offload host"
        if args.mp == "fp16" or args.optimizer == "muon" or args.pp > 1 or args.fault_tolerant:
            return (
                "--step-in-backward takes AdamW, without --mp fp16 (a GradScaler), --pp (pipeline stages) "
                "or --fault-tolerant (its vote to commit comes after backward)"
            )
    if args.cpu_offload in PARAMS_ON_HOST and args.parallel == "replicate":
        return "--cpu-offload needs --parallel fsdp, hsdp or tp (replicate has no offload policy)"
    if args.cuda_graph == "on":
        if not torch.cuda.is_available():
            return "--cuda-graph on: CUDA graphs need a CUDA device, and torch.cuda.is_available() is False"
        unsupported = cuda_graph_unsupported(args, "cuda")
        if unsupported:
            return f"--cuda-graph on: {unsupported}"
    if args.run_id is not None and not RUN_ID.fullmatch(args.run_id):
        return f"--run-id must be letters, digits, '.', '_' or '-' (at most 100, not starting with '.'), got {args.run_id!r}"
    if args.fault is not None and not FAULT.fullmatch(args.fault):
        return f"--fault must be RANK:KILL|STOP|TERM|SEGV|EXITHANG:STEP, got {args.fault!r}"
    try:
        cfg = model_config(args)
    except ValueError as e:
        return str(e)
    seq_len = args.seq_len or cfg.max_seq_len
    tp_problem_line = _tp_flags_problem(args, cfg, seq_len)
    if tp_problem_line:
        return tp_problem_line
    corpus = ByteCorpus.load()
    shortest = min(corpus.train.numel(), corpus.val.numel())
    if seq_len + 1 >= shortest:
        return f"--seq-len must be below {shortest - 1} (the held-out split has {shortest:,} bytes), got {seq_len}"
    return check_out_dir(args.out)


def _loss_chunk_problem(args: argparse.Namespace) -> str | None:
    """Why `--loss-chunk` does not fit the other flags (None when it does): the model's head
    computes the chunked loss in its own forward, on plain weights, from the final hidden states."""
    if args.loss_chunk < 0:
        return f"--loss-chunk must be >= 0 (0: the plain loss), got {args.loss_chunk}"
    if not args.loss_chunk:
        return None
    if tensor_parallel_in(args):
        return (
            f"--loss-chunk {args.loss_chunk} with --parallel {args.parallel}"
            f"{' --tp-size' if args.parallel == 'hsdp' else ''}: the tensor-parallel head's vocabulary-sharded "
            "logits take the plain loss"
        )
    if args.pp > 1:
        return f"--loss-chunk {args.loss_chunk} with --pp {args.pp}: the pipeline's last stage computes the plain loss"
    return None


def _tp_flags_problem(args: argparse.Namespace, cfg: ModelConfig, seq_len: int) -> str | None:
    """--tp-size against the model and sequence (pipeline stages keep the textbook plan, which
    leaves the sequence whole), then --async-tp against the other flags."""
    if tensor_parallel_in(args):
        problem = tp_problem(args.tp_size, cfg.n_heads, cfg.ffn_dim, seq_len if args.pp == 1 else None)
        if problem:
            return problem
    if args.async_tp and args.pp > 1:
        return f"--async-tp with --pp {args.pp}: pipeline stages keep the textbook TP plan; drop one of them"
    if args.parallel == "tp" and args.pp > 1 and args.fused_projections:
        return (
            f"--fused-projections with --parallel tp --pp {args.pp}: pipeline stages keep the textbook TP plan of "
            "separate q/k/v and w1/w3; drop one of them"
        )
    got = None if args.parallel == "tp" else f"--parallel {args.parallel}"
    compiled = args.compile is not False  # None: on with CUDA, which async TP needs anyway
    return async_tp_problem(args.async_tp, "--parallel tp", got, compiled, args.compile_backend)


def cuda_graph_unsupported(args: argparse.Namespace, device_type: str) -> str | None:
    """Why the training step of this run cannot be a CUDA graph, or None when it can."""
    if device_type != "cuda":  # with a GPU too: launch.py trains on the CPU with fewer GPUs than local ranks
        return f"CUDA graphs need a CUDA device, and this rank trains on the {device_type}"
    if args.parallel not in CUDA_GRAPH_PARALLEL:
        return f"--parallel {args.parallel} is not supported (only {', '.join(CUDA_GRAPH_PARALLEL)})"
    if args.cpu_offload == "optimizer-state":
        return "--cpu-offload optimizer-state streams the optimizer state through host memory, which a CUDA graph cannot hold"
    if args.cpu_offload:
        return "--cpu-offload steps the optimizer on the CPU, which a CUDA graph cannot hold"
    if args.parallel == "hsdp" and getattr(args, "tp_size", None) is not None:
        return "--parallel hsdp --tp-size: the 3D mesh's step is not captured"
    if getattr(args, "optimizer", "adamw") == "muon" and getattr(args, "mp", None) == "fp16":
        return (
            "--optimizer muon --mp fp16: the grad scaler reads on the CPU whether it found infs before "
            "Muon's step, which a CUDA graph cannot hold"
        )
    if getattr(args, "pp", 1) > 1:
        return "--pp: a pipeline schedule's step (its sends and receives) is not captured"
    if getattr(args, "fault_tolerant", False):
        return "--fault-tolerant: each step's quorum and vote to commit run on the host, between the GPU's work"
    if _moe_expert_parallel(args) and not getattr(args, "moe_capacity_factor", None):
        return MOE_NOT_CAPTURABLE
    return None


def _moe_expert_parallel(args: argparse.Namespace) -> bool:
    """Whether --moe splits the experts over more than one rank (parallel.expert_mesh's ep)."""
    return getattr(args, "moe", False) and math.gcd(_world_size(args), MOE_EXPERTS) > 1


def _world_size(args: argparse.Namespace) -> int:
    """The run's world size: the process group's on a rank, else the launcher's, else --nproc."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 0)) or getattr(args, "nproc", 1)


def cuda_graph_mode(args: argparse.Namespace, device_type: str) -> tuple[bool, str]:
    """(whether train.py runs its step through composable.graphed_step, why) for --cuda-graph
    on this rank's device, e.g. (True, "auto"), (False, "--pp: a pipeline schedule's step ...").
    `auto` graphs one rank and several alike (measured on one GPU and on two: BENCHMARKS.md),
    expert parallelism at a fixed capacity and the 2D tensor-parallel step too, async TP's
    symmetric-memory GEMMs included (measured on four: the eager 2D step is bound by the host,
    and async TP gains only inside the graph), and leaves fp16 eager (its
    ShardedGradScaler step is not yet proven inside train.py's graph) and `--optimizer muon`
    (its graphed step not yet measured against the eager one). UsageError for `on` with
    a run graphs do not support (validate catches the cases known before the ranks start; a run
    on gloo despite a GPU is found here)."""
    if args.cuda_graph == "off":
        return False, "--cuda-graph off"
    unsupported = cuda_graph_unsupported(args, device_type)
    if args.cuda_graph == "on":
        if unsupported:
            raise UsageError(f"--cuda-graph on: {unsupported}")
        return True, "--cuda-graph on"
    if unsupported:
        return False, unsupported
    if args.mp == "fp16":
        return False, "--mp fp16: not yet proven under a graph; --cuda-graph on to try"
    if getattr(args, "optimizer", "adamw") == "muon":
        return False, "--optimizer muon: not yet measured under a graph; --cuda-graph on to try"
    return True, "auto"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_out_dir(out: str) -> str | None:
    """None if `out` is (or can be made) a directory we can write into; else why not. Probed by
    writing a file, not by `os.access`, which says yes to root on a read-only mount."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out} is a file, not a directory"
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        return f"--out {out} is not writable: {e.strerror or e}"
    return None


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The preset with the size flags applied; max_seq_len grows to --seq-len if needed."""
    return config_from_flags(
        args.preset,
        seq_len=args.seq_len,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        ffn_dim=args.ffn_dim,
        vocab_size=args.vocab_size,
        tie_embeddings=args.tie_embeddings,
        n_experts=MOE_EXPERTS if getattr(args, "moe", False) else None,
        moe_capacity_factor=getattr(args, "moe_capacity_factor", None),
        fused_projections=getattr(args, "fused_projections", None),
    )


if __name__ == "__main__":  # cd examples; python -m trainer.options --flags: check a command line without training
    print(parse_args(sys.argv[1:]))
