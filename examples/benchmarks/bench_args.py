"""The benchmark's command line: `parse_args` (every flag, checked at parse time with one clear
line per bad value) and the model configuration the flags make (`model_config`)."""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.bench_build import (
    AC_MODES,
    ALL_RUNS,
    DEEPSPEED_RUNS,
    GRAPHED_RUNS,
    HF_MISSING,
    MODELS,
    OFFLOAD_RUNS,
    RUNS,
    STATE_OFFLOAD_RUNS,
    WRAPS,
    hf_available,
)
from benchmarks.bench_deepspeed import deepspeed_problem
from benchmarks.bench_float8 import FLOAT8_MISSING, float8_available
from benchmarks.bench_mesh import MESH_DEFAULT_RUNS, add_mesh_args, mesh_errors
from benchmarks.bench_optim import OPTIMIZERS
from models.model import PRESETS, ModelConfig, config_from_flags, width_overrides
from trainer.parallel import MOE_EXPERTS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags, checked (one `p.error` line for each wrong combination) and with
    what they derive filled in (the model's widths, --runs and --compile defaults)."""
    p = build_parser()
    args = p.parse_args(argv)
    _check_and_derive(p, args)
    return args


def build_parser() -> argparse.ArgumentParser:
    """The flags: the model, what runs and how, what is written, the mesh."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_flags(p)
    _add_run_flags(p)
    _add_output_flags(p)
    add_mesh_args(p)
    return p


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model measured: the preset, which implementation, and its size flags."""
    p.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    p.add_argument(
        "--model",
        default="own",
        choices=MODELS,
        help="'own': examples/models/model.py; 'hf-llama': transformers' LlamaForCausalLM at the preset's shape",
    )
    p.add_argument("--dim", type=int, default=None, help="model width instead of the preset's (see width_overrides)")
    p.add_argument("--n-layers", type=int, default=None, help="number of blocks instead of the preset's")
    p.add_argument(
        "--n-heads", type=int, default=None, help="attention heads (default with --dim: the preset's head dim)"
    )
    p.add_argument("--ffn-dim", type=int, default=None, help="feed-forward width (default with --dim: Llama's 8/3 dim)")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """What runs and how: batch, steps and rounds, the contenders, compilation and the training recipe."""
    p.add_argument("--batch-size", type=int, default=4, help="local (per-GPU) batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument(
        "--rounds", type=int, default=3, help="every run once per round; ratios are medians of per-round ratios"
    )
    p.add_argument(
        "--runs",
        default=None,
        help=f"comma list of {', '.join(ALL_RUNS)} (the *_graphed ones: the whole step in a CUDA graph; the *_offload "
        "ones: CPUOffloadPolicy, the shards, gradients and optimizer step on the host; *_offload_on_device: the bf16 "
        "shards kept on the GPU too; *_step_in_backward: each group's host step during backward (*_speculative: with --max-norm, betting that "
        "the norm clips nothing); *_state_offload: only "
        "the optimizer state on the host, stepped on the GPU; *_prefetch: its copies in during backward; "
        "deepspeed_offload: DeepSpeed ZeRO-3 with ZeRO-Offload and DeepSpeedCPUAdam, needs deepspeed); "
        f"default {','.join(RUNS)}, on a 2D --mesh {','.join(MESH_DEFAULT_RUNS)}",
    )
    p.add_argument(
        "--wrap",
        choices=WRAPS,
        default="separate-ends",
        help="fully_shard/FSDP2 groups: 'separate-ends' = each block, the embeddings, the head, then the "
        "root (torchtitan's wrapping; faster and leaner for both); 'blocks' = each block + the root",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile every block of every contender (before the APIs); default: on for --mesh tp on GPUs "
        "(the TP recipe runs compiled), else off",
    )
    p.add_argument(
        "--async-tp",
        action="store_true",
        help="--mesh tp: both contenders overlap the TP collectives with the matmuls (inductor's micro-pipeline "
        "pass over symmetric memory; CUDA, compiled blocks); turns on --fused-projections unless "
        "--no-fused-projections",
    )
    p.add_argument(
        "--fused-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--model own: every contender's blocks use one wqkv and one w13 linear instead of wq/wk/wv and "
        "w1/w3 (under --mesh tp each backward reduce-scatter then follows one matmul, which async TP fuses); "
        "default: on with --async-tp, else off",
    )
    p.add_argument(
        "--float8",
        action="store_true",
        help="every contender trains with torchao float8 linears (the head and dims not divisible by 16 excepted)",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="mixture-of-experts feed-forwards (examples/models/moe.py, --model own): fully_shard and FSDP2 split the experts "
        "over an expert-parallel dim and shard them over the rest (examples/trainer/parallel.py's shard_experts)",
    )
    p.add_argument(
        "--moe-capacity-factor",
        type=float,
        help="with --moe: fixed expert capacity (train.py's flag of the same name); default: no token dropped",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="fused AdamW; or Muon on the blocks' 2D weights (AdamW on the rest): 'muon' is composable.optim.Muon "
        "(each matrix orthogonalized by one owner rank), 'muon-gathered' the baseline that gathers every matrix "
        "whole on every rank (examples/benchmarks/bench_optim.py)",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    p.add_argument(
        "--max-norm",
        type=float,
        default=0.0,
        help="clip every contender's gradients to this norm (composable.clip_grad_norm_; the *_step_in_backward runs "
        "through step_in_backward's max_norm); 0: no clipping",
    )
    p.add_argument(
        "--ac",
        choices=AC_MODES,
        default="none",
        help="activation checkpointing of every block of every contender: full, or selective (keeps the matmuls)",
    )
    p.add_argument(
        "--loss-chunk",
        type=int,
        default=0,
        metavar="TOKENS",
        help="--model own: every contender's head computes the loss TOKENS tokens at a time, each chunk "
        "checkpointed, so no logits of the whole batch are kept (examples/models/chunked_loss.py); 0: the plain loss",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """What is written besides the table: the JSON, profiles and traces; the CPU-overhead mode."""
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--profile", default="", help="comma list of runs to profile (2 extra steps each, first round)")
    p.add_argument(
        "--trace-dir",
        default=None,
        help="with --profile: write every rank's Chrome trace of each profiled run here (gzipped)",
    )
    p.add_argument("--cpu-overhead", action="store_true", help="measure hook CPU overhead on 64 tiny blocks (no GPU)")


def _check_and_derive(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a wrong value or combination with one line (`p.error`); fill in the derived values."""
    for flag in ("batch_size", "seq_len", "steps", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if not args.max_norm >= 0 or args.max_norm == float("inf"):
        p.error(f"--max-norm must be a finite number >= 0 (0: no clipping), got {args.max_norm}")
    if args.runs is None:
        args.runs = ",".join(RUNS if args.mesh == "dp" else MESH_DEFAULT_RUNS)
    unknown = [run for run in args.runs.split(",") if run not in ALL_RUNS]
    if unknown or not args.runs:
        p.error(f"--runs: unknown run(s) {unknown or [args.runs]}; choose from {', '.join(ALL_RUNS)}")
    graphed = [run for run in args.runs.split(",") if run in GRAPHED_RUNS]
    if graphed and not args.cpu_overhead and not torch.cuda.is_available():
        p.error(f"--runs: {graphed[0]} needs a GPU (CUDA graphs), and torch.cuda.is_available() is False")
    if graphed and args.float8 and "replicate_graphed" in graphed:
        p.error(
            "--runs: replicate_graphed with --float8 is not measured: replicate's float8 weights are cast in every "
            "forward (no float8 all-gather), like the floor's; compare floor_graphed and fully_shard_graphed"
        )
    if graphed and args.warmup < 2:
        p.error(
            f"--warmup must be >= 2 with --runs {graphed[0]} (graphed_step's eager warm-up, then the capture, "
            f"so that every timed step is a replay), got {args.warmup}"
        )
    offloaded = [run for run in args.runs.split(",") if run in OFFLOAD_RUNS + STATE_OFFLOAD_RUNS + DEEPSPEED_RUNS]
    if offloaded and (args.float8 or args.moe or args.model != "own" or args.optimizer != "adamw" or args.mesh != "dp"):
        p.error(
            f"--runs {offloaded[0]} runs with --model own, --mesh dp and --optimizer adamw, without --float8 or --moe "
            f"(got --model {args.model}, --mesh {args.mesh}, --optimizer {args.optimizer}"
            f"{', --float8' if args.float8 else ''}{', --moe' if args.moe else ''})"
        )
    if graphed and args.optimizer != "adamw":
        p.error(f"--optimizer {args.optimizer} is not measured with --runs {graphed[0]}: choose eager or compiled runs")
    loss_chunk_problem = _loss_chunk_problem(args)
    if loss_chunk_problem:
        p.error(loss_chunk_problem)
    if args.moe_capacity_factor is not None and (not args.moe or not args.moe_capacity_factor > 0):
        p.error(f"--moe-capacity-factor {args.moe_capacity_factor:g} needs --moe and a value > 0")
    if args.moe and (graphed or args.float8 or args.model != "own" or args.mesh != "dp"):
        p.error(
            "--moe runs with --model own and --mesh dp (its own expert mesh), eagerly (no graphed runs: routing "
            f"syncs with the host) and without --float8; got --mesh {args.mesh}"
        )
    if args.fused_projections is None:
        # Async TP fuses a reduce-scatter only with a single producer matmul (parallel.tp_block_plan).
        args.fused_projections = args.async_tp
    if args.fused_projections and args.model != "own":
        p.error(
            f"--fused-projections with --model {args.model}: the fused layout is examples/models/model.py's (--model own)"
        )
    if args.model == "hf-llama" and not args.cpu_overhead and not hf_available():
        p.error(HF_MISSING)
    if args.float8 and not args.cpu_overhead and not float8_available():
        p.error(FLOAT8_MISSING)
    for flag in ("dim", "n_layers", "n_heads", "ffn_dim"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    # Record the shape the width flags derive, so the table and the JSON name it.
    args.__dict__.update(width_overrides(args.preset, args.dim, args.n_heads, args.ffn_dim))
    try:
        cfg = model_config(args)
    except ValueError as e:
        p.error(f"--dim/--n-heads: {e}")
    compile_off = "--no-compile" if args.compile is False else "no --compile (off by default without a GPU)"
    if args.compile is None:
        args.compile = args.mesh == "tp" and torch.cuda.is_available() and not args.cpu_overhead
    error = deepspeed_problem(args)  # after --compile's default
    if error:
        p.error(error)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None  # torchrun's
    error = None if args.cpu_overhead else mesh_errors(args, cfg.n_heads, cfg.ffn_dim, world, compile_off)
    if error:
        p.error(error)


def _loss_chunk_problem(args: argparse.Namespace) -> str | None:
    """Why `--loss-chunk` does not fit the other flags (None when it does): the chunked loss is
    our model's head's, on plain (not vocabulary-sharded) weights."""
    if args.loss_chunk < 0:
        return f"--loss-chunk must be >= 0 (0: the plain loss), got {args.loss_chunk}"
    if not args.loss_chunk:
        return None
    if args.model != "own":
        return f"--loss-chunk {args.loss_chunk} needs --model own (the chunked loss is its head's), got --model {args.model}"
    if args.mesh == "tp" or (args.mesh == "hsdp" and args.tp_size is not None):
        return (
            f"--loss-chunk {args.loss_chunk} with a tensor-parallel mesh (--mesh {args.mesh}"
            f"{' --tp-size' if args.mesh == 'hsdp' else ''}): its vocabulary-sharded head takes the plain loss"
        )
    return None


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The preset at exactly `--seq-len`, with the width/depth flags applied (`--dim` alone also
    sets the heads and the ffn width); no vocabulary or tied-embedding flags here."""
    moe = getattr(args, "moe", False)
    return config_from_flags(
        args.preset,
        seq_len=args.seq_len,
        exact_seq_len=True,
        derive_width=True,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        ffn_dim=args.ffn_dim,
        n_experts=MOE_EXPERTS if moe else None,
        # Read only with --moe; 0 (or none) leaves the preset's 0, no token dropped.
        moe_capacity_factor=getattr(args, "moe_capacity_factor", None) if moe else None,
        fused_projections=getattr(args, "fused_projections", None),
    )
