"""The command line of train.py: its flags, the defaults each preset brings, and the checks that
refuse a nonsense value up front (one line naming the flag and the value, exit status 2)
instead of training nonsense or crashing later.

Checks that need the rank's device (does the batch fit in memory?) are in `check_memory`,
which train.py calls on every rank before it builds anything; `cuda_graph_mode` settles
`--cuda-graph` on the rank's device (`auto` -> on or off, and why).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import tempfile
from typing import NoReturn

import torch

from models.model import PRESET_LR, PRESETS, ModelConfig, get_config
from models.moe import NOT_CAPTURABLE as MOE_NOT_CAPTURABLE
from trainer import fault_tolerance
from trainer.data import VOCAB_SIZE, ByteCorpus
from trainer.parallel import MOE_EXPERTS, PARAMS_ON_HOST, UsageError, async_tp_problem, tensor_parallel_in, tp_problem
from trainer.pipeline import SCHEDULES, validate_pp

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
FAULT = re.compile(r"(\d+):(KILL|STOP|TERM|SEGV|EXITHANG):(\d+)")  # EXITHANG: the teardown blocks
CUDA_GRAPH_PARALLEL = ("fsdp", "hsdp", "replicate", "tp")  # what --cuda-graph supports


class _Parser(argparse.ArgumentParser):
    """argparse that reports an error as one line (no usage block): the line names the flag,
    the value and what would be accepted, which is what a user needs to fix the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help states its default itself: a
    default of None stands for one settled later (by the device, the preset, another flag),
    which only the help's own words can say."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _per_preset(field: str) -> str:
    """A model field's value in each preset, e.g. "tiny 128, small 256, 1b 2048"."""
    return ", ".join(f"{name} {getattr(cfg, field)}" for name, cfg in PRESETS.items())


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags (parse_args parses with it and checks the values)."""
    p = _Parser(
        prog="train.py",
        description="Train a Llama-style byte-level language model with composable.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--parallel",
        choices=["fsdp", "hsdp", "replicate", "tp"],
        default="fsdp",
        help="fsdp: fully_shard on every block and the root; hsdp: the same on a 2D mesh (--hsdp-shard-size); "
        "replicate: the whole model on every rank; tp: tensor parallel (--tp-size) x FSDP",
    )
    p.add_argument(
        "--mp",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="compute dtype: bf16 = bf16 params / fp32 reduce; fp16 adds ShardedGradScaler (default: bf16 on GPU, fp32 on CPU)",
    )
    p.add_argument(
        "--ac",
        choices=["none", "full", "selective"],
        default="none",
        help="activation checkpointing of every transformer block: full (checkpoint()), or selective "
        "(checkpoint(context_fn=save_matmuls()): keeps the matmul outputs, recomputes the rest)",
    )
    p.add_argument(
        "--activation-checkpointing", dest="ac", action="store_const", const="full", help="the same as --ac full"
    )
    p.add_argument(
        "--cpu-offload",
        nargs="?",
        const="host",
        default=None,
        choices=["host", "compute-shard-on-device", "optimizer-state"],
        help="host (the value without one): CPUOffloadPolicy, the sharded fp32 params, their grads and the optimizer "
        "state on the CPU and the optimizer step there, the GPU holding none of them between steps, as FSDP2's; "
        "compute-shard-on-device: the same, and the GPU keeps each group's shard in the compute dtype, copied from "
        "the host once a step instead of for each all-gather (2 bytes a parameter over the shard group); "
        "optimizer-state: only the optimizer state on the host, streamed through the GPU to step there "
        "(composable.optim.offload_optimizer_state) (default: no offload)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile every transformer block with block.compile() before the APIs are applied (default: on with CUDA, off on CPU)",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend for --compile (aot_eager: no code generation)",
    )
    p.add_argument(
        "--cuda-graph",
        choices=["auto", "on", "off"],
        default="auto",
        help="run each training step as a replayed CUDA graph (composable.graphed_step: no host overhead per "
        "step, for small per-GPU batches); auto: on with CUDA and --parallel fsdp, hsdp or replicate, without "
        "--cpu-offload or --mp fp16; on: also fp16, and an unsupported run is refused",
    )
    p.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per optimizer step (no_sync on all but the last)"
    )
    p.add_argument(
        "--max-norm", type=float, default=1.0, help="gradient clipping norm (composable.clip_grad_norm_); 0 disables"
    )
    p.add_argument("--steps", type=int, default=250, help="optimizer steps in total")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="the model: tiny trains in minutes on 2 CPU cores, 1b is the 953M-parameter benchmark model; "
        "the model size overrides below change it",
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's max_seq_len)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate: linear warmup, cosine decay to 10%% (default: the preset's: "
        + ", ".join(f"{k} {v:g}" for k, v in PRESET_LR.items())
        + ")",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="default: 10%% of --steps, at least 10 (half of a shorter run), at most 100",
    )
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    p.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: composable.optim.Muon on the blocks' weight matrices (expert stacks included), AdamW on "
        "embeddings, head and norms, one learning rate for both (Muon's scaled to AdamW's RMS)",
    )
    p.add_argument(
        "--eval-every", type=int, default=50, help="validation loss every N steps (and at the end); 0: only at the end"
    )
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank per evaluation")
    p.add_argument(
        "--ckpt-every", type=int, default=100, help="DCP checkpoint every N steps (and at the end); 0 disables"
    )
    p.add_argument("--keep-ckpts", type=int, default=2, help="complete checkpoints of this run to keep")
    p.add_argument(
        "--out", default="runs/train", help="output directory; every run writes into its own <out>/<run id>/"
    )
    p.add_argument(
        "--run-id",
        default=None,
        help="name of this run's directory under --out (default: a new one, date-time-random); "
        "with --resume: the run to continue",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint: of --run-id, or else of the newest run in --out "
        "trained with the same model flags and --seed",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a rank waits for the others in any collective before the job ends naming the rank "
        "that stalled; must exceed the longest single step or checkpoint write",
    )
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn when not started by a launcher")
    p.add_argument("--seed", type=int, default=0, help="seeds the model's initialisation and the batches drawn")
    p.add_argument(
        "--tp-size",
        type=int,
        default=None,
        help="--parallel tp: tensor-parallel degree (default 2); --parallel hsdp: a third mesh dim, tensor-parallel "
        "over this many ranks, HSDP over the rest (default: none)",
    )
    p.add_argument(
        "--async-tp",
        action="store_true",
        help="--parallel tp: overlap the TP collectives with the matmuls (inductor's micro-pipeline pass over "
        "symmetric memory; needs CUDA and --compile); turns on --fused-projections unless --no-fused-projections",
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages of torch's pipelining)")
    p.add_argument("--pp-schedule", default="1F1B", help=f"--pp: torch's Schedule<NAME>, one of {', '.join(SCHEDULES)}")
    p.add_argument("--microbatches", type=int, default=2, help="--pp: microbatches per step (divides --batch-size)")
    p.add_argument(
        "--hsdp-shard-size",
        type=int,
        default=None,
        help="--parallel hsdp: ranks per shard group (default: half the data-parallel ranks, at least 1)",
    )
    f = p.add_argument_group("fault tolerance (torchft; docs/fault-tolerance.md)")
    f.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="this launch is one torchft replica group (--parallel hsdp over its ranks): the groups average "
        "gradients through a torchft Manager, a lost group drops out and a restarted one heals from a live one",
    )
    f.add_argument(
        "--lighthouse",
        default=None,
        help="--fault-tolerant: the lighthouse, HOST:PORT of one running (default: $TORCHFT_LIGHTHOUSE), or start:PORT "
        "on replica group 0: its rank 0 serves one on PORT while it runs, the other groups given HOST:PORT",
    )
    f.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="--lighthouse start:PORT: the groups a quorum needs (default 1: any survivor trains on)",
    )
    f.add_argument(
        "--replica-group",
        type=int,
        default=None,
        help="--fault-tolerant: this group's index (default: $REPLICA_GROUP_ID, else 0)",
    )
    m = p.add_argument_group("model size overrides (default: the preset's)")
    m.add_argument("--dim", type=int, help=f"model width (default: the preset's: {_per_preset('dim')})")
    m.add_argument(
        "--n-layers", type=int, help=f"transformer blocks (default: the preset's: {_per_preset('n_layers')})"
    )
    m.add_argument(
        "--n-heads", type=int, help=f"attention heads, dividing --dim (default: the preset's: {_per_preset('n_heads')})"
    )
    m.add_argument(
        "--ffn-dim", type=int, help=f"feed-forward hidden width (default: the preset's: {_per_preset('ffn_dim')})"
    )
    m.add_argument(
        "--moe",
        action="store_true",
        help=f"mixture-of-experts feed-forwards ({MOE_EXPERTS} experts, top 2): experts split over an expert-parallel "
        "dim and sharded over the rest (--parallel fsdp)",
    )
    m.add_argument(
        "--moe-capacity-factor",
        type=float,
        help="with --moe: each rank sends each expert at most this many times an even share of its routed tokens "
        "(the rest are dropped, as Switch Transformer): fixed shapes, no host synchronisation, a step a CUDA graph "
        "can capture (default: no token dropped)",
    )
    m.add_argument(
        "--fused-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one wqkv and one w13 linear per block instead of wq/wk/wv and w1/w3 (model.py): under --parallel tp "
        "each backward reduce-scatter then follows a single matmul, which --async-tp needs to fuse it "
        "(default: on with --async-tp, else off)",
    )
    m.add_argument(
        "--vocab-size",
        type=int,
        help=f"at least {VOCAB_SIZE} (bytes) (default: the preset's: {_per_preset('vocab_size')})",
    )
    m.add_argument(
        "--tie-embeddings",
        action="store_true",
        default=None,
        help=f"the output head shares the token embedding's weight (default: the preset's: {_per_preset('tie_embeddings')})",
    )
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar or messages (warnings and errors still go to stderr)"
    )
    p.add_argument(
        "--stop-after", type=int, default=None, help=argparse.SUPPRESS
    )  # tests: stop as if killed after step N
    p.add_argument(
        "--fault", default=None, help=argparse.SUPPRESS
    )  # tests: RANK:KILL|STOP|TERM|SEGV:STEP, a rank signals itself; RANK:EXITHANG:0, its teardown blocks
    return p


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
    if args.tp_size is not None and args.parallel not in ("tp", "hsdp"):
        return f"--tp-size {args.tp_size} needs --parallel tp or hsdp, got --parallel {args.parallel}"
    if args.parallel == "hsdp" and args.tp_size is not None and args.pp > 1:
        return f"--parallel hsdp --tp-size {args.tp_size} with --pp {args.pp}: pipeline stages take --parallel tp"
    if args.cpu_offload == "optimizer-state" and args.optimizer == "muon":
        return "--cpu-offload optimizer-state steps in buckets, and Muon's step communicates: pass --cpu-offload host"
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
    if getattr(args, "optimizer", "adamw") == "muon":
        return "--optimizer muon: Muon's step (its all-to-alls to the matrices' owners) is not captured"
    if getattr(args, "pp", 1) > 1:
        return "--pp: a pipeline schedule's step (its sends and receives) is not captured"
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
    ShardedGradScaler step is not yet proven inside train.py's graph). UsageError for `on` with
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
    cfg = get_config(
        args.preset,
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
    if args.seq_len is not None and args.seq_len > cfg.max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=args.seq_len)
    return cfg


if __name__ == "__main__":  # python examples/options.py --flags: check a command line without training
    print(parse_args(sys.argv[1:]))
