"""The flags of train.py, in groups (layout, recipe, run, mesh, fault tolerance, model), and the
parser that reports a bad value as one line; `options.parse_args` parses with it and checks the values."""

from __future__ import annotations

import argparse
from typing import NoReturn

from models.model import PRESET_LR, PRESETS
from trainer.data import VOCAB_SIZE
from trainer.parallel import MOE_EXPERTS
from trainer.pipeline import SCHEDULES


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
    _add_layout_flags(p)
    _add_recipe_flags(p)
    _add_run_flags(p)
    _add_mesh_flags(p)
    _add_fault_tolerance_flags(p)
    _add_model_flags(p)
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


def _add_layout_flags(p: argparse.ArgumentParser) -> None:
    """How the model is laid out and run: parallelism, precision, activation checkpointing,
    offload, compilation, CUDA graphs."""
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
        "--step-in-backward",
        action="store_true",
        help="with --cpu-offload host or compute-shard-on-device: each group's host optimizer step runs during "
        "backward, as its gradients reach the host (composable.optim.step_in_backward); with --max-norm, "
        "the gradients' norms are taken as they land and the groups step once the total norm is known",
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
        "--cpu-offload, --mp fp16 or --optimizer muon; on: also fp16 or Muon, and an unsupported run is refused",
    )


def _add_recipe_flags(p: argparse.ArgumentParser) -> None:
    """The training recipe: micro-batches, clipping, steps, the preset, batch and sequence,
    the learning rate and its warmup, weight decay, the optimizer."""
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
        "--loss-chunk",
        type=int,
        default=0,
        metavar="TOKENS",
        help="the head computes the loss TOKENS tokens of a micro-batch at a time, each chunk checkpointed, so "
        "that the micro-batch's logits are never all kept (examples/models/chunked_loss.py); 0: the plain loss",
    )
    p.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: composable.optim.Muon on the blocks' weight matrices (expert stacks included), AdamW on "
        "embeddings, head and norms, one learning rate for both (Muon's scaled to AdamW's RMS)",
    )


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The run around the steps: evaluation, checkpoints, the output directory and run id,
    resume, the collective timeout, local ranks, the seed."""
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


def _add_mesh_flags(p: argparse.ArgumentParser) -> None:
    """The mesh's degrees beyond data parallelism: tensor, pipeline, HSDP shard groups."""
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


def _add_fault_tolerance_flags(p: argparse.ArgumentParser) -> None:
    """--fault-tolerant and its lighthouse (torchft)."""
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
        "--heartbeat-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="--lighthouse start:PORT: how long a silent group still counts as alive, which is about what a lost "
        "group costs the others: their next quorum waits for it (default: torchft's, 5 s; each Manager beats every 0.1 s)",
    )
    f.add_argument(
        "--replica-group",
        type=int,
        default=None,
        help="--fault-tolerant: this group's index (default: $REPLICA_GROUP_ID, else 0)",
    )


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model's size and shape, overriding the preset's."""
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
