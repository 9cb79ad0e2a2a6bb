"""How train.py lays the model over the ranks: the device mesh, the mixed-precision policy, and
torch.compile / activation checkpointing / tensor parallelism / fully_shard or replicate applied
in order."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from composable import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, checkpoint, fully_shard, replicate
from models.model import Transformer
from models.vocab_parallel_loss import compile_kernels
from trainer.fault_tolerance import replica_group

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
MOE_EXPERTS = 4  # --moe: experts per block


class UsageError(ValueError):
    """Flags that do not fit the world size or the model (reported without a traceback)."""


def tensor_parallel_in(args: argparse.Namespace) -> bool:
    """Whether the run's mesh has a tensor-parallel dim: --parallel tp, or hsdp with --tp-size."""
    return args.parallel == "tp" or (args.parallel == "hsdp" and getattr(args, "tp_size", None) is not None)


def build_mesh(args: argparse.Namespace, device_type: str) -> tuple[DeviceMesh, DeviceMesh, int, int]:
    """(mesh for parallelize, data-parallel mesh, data-parallel rank, data-parallel size)."""
    world = dist.get_world_size()
    if args.parallel == "hsdp" and tensor_parallel_in(args):
        # (replicate, shard, tp), torchtitan's dp_replicate x dp_shard x tp: HSDP over the first two.
        if world % args.tp_size:
            raise UsageError(f"--tp-size {args.tp_size} does not divide the world size {world}")
        dp = world // args.tp_size
        shard = args.hsdp_shard_size or max(1, dp // 2)
        if dp % shard:
            raise UsageError(f"--hsdp-shard-size {shard} does not divide world/--tp-size = {dp}")
        names = ("replicate", "shard", "tp")
        mesh = init_device_mesh(device_type, (dp // shard, shard, args.tp_size), mesh_dim_names=names)
        dp_rank = mesh["replicate"].get_local_rank() * shard + mesh["shard"].get_local_rank()
        return mesh, mesh["replicate", "shard"], dp_rank, dp
    if args.parallel == "tp":
        if world % args.tp_size:
            raise UsageError(f"--tp-size {args.tp_size} does not divide the world size {world}")
        mesh = init_device_mesh(device_type, (world // args.tp_size, args.tp_size), mesh_dim_names=("dp", "tp"))
        return mesh, mesh["dp"], mesh["dp"].get_local_rank(), mesh["dp"].size()
    if args.parallel == "hsdp" and getattr(args, "fault_tolerant", False):
        # One replica group: its ranks are the shard dim; the Manager extends the replicate dim.
        if args.hsdp_shard_size not in (None, world):
            raise UsageError(
                f"--fault-tolerant shards over the group's {world} ranks: --hsdp-shard-size {args.hsdp_shard_size} must be {world} or left out"
            )
        mesh = init_device_mesh(device_type, (1, world), mesh_dim_names=("replicate", "shard"))
        return mesh, mesh, replica_group(args) * world + dist.get_rank(), world
    if args.parallel == "hsdp":
        shard = args.hsdp_shard_size or max(1, world // 2)
        if world % shard:
            raise UsageError(f"--hsdp-shard-size {shard} does not divide the world size {world}")
        mesh = init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        return mesh, mesh, dist.get_rank(), world
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    return mesh, mesh, dist.get_rank(), world


def mp_policy_for(name: str) -> MixedPrecisionPolicy:
    dtype = DTYPES[name]
    # Gradients are reduced in fp32 whatever the compute dtype: cheap insurance for the sum.
    return (
        MixedPrecisionPolicy() if dtype is None else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    )


# The --cpu-offload values that keep the sharded parameters on the host (CPUOffloadPolicy); the
# other one, optimizer-state, keeps them on the GPU and offloads only the optimizer's state.
PARAMS_ON_HOST = ("host", "compute-shard-on-device")


def offload_policy_for(cpu_offload: str | None) -> OffloadPolicy:
    """The offload policy of a `--cpu-offload` value (none without one, or for `optimizer-state`)."""
    if cpu_offload not in PARAMS_ON_HOST:
        return OffloadPolicy()
    return CPUOffloadPolicy(compute_shard_on_device=cpu_offload == "compute-shard-on-device")


def sharding_units(model: Transformer) -> list[nn.Module]:
    """The modules `fully_shard` is applied to, bottom-up, the root last: the embeddings and
    the head each on their own (as torchtitan does, and benchmark.py's `--wrap separate-ends`:
    measured faster and leaner than leaving them to the root), then every block,
    then the root, which keeps only the final norm. The head's gradients are reduce-scattered
    while the blocks' backward runs instead of in the root's last, exposed reduce-scatter.
    Tied embeddings are one parameter used at both ends of the model: a group of its own on
    either end would free it while the other end still needs it, so the root keeps it."""
    ends = [] if model.cfg.tie_embeddings else [model.tok_embeddings, model.output]
    return [*ends, *model.layers, model]


def colwise_names(fused: bool = False) -> tuple[str, ...]:
    """A block's column-parallel linears: q/k/v and w1/w3, or with fused projections
    (`ModelConfig.fused_projections`) wqkv and w13, whose row layouts keep a contiguous split
    of them correct for any tp dividing the heads and the feed-forward width (model.py)."""
    if fused:
        return ("attention.wqkv", "feed_forward.w13")
    return ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")


def tp_plan(fused: bool = False) -> dict[str, ParallelStyle]:
    """The textbook tensor-parallel plan of one block, without sequence parallelism: q/k/v and
    w1/w3 (or `fused` wqkv and w13) split by output features (heads), wo/w2 by input features
    with an all-reduce after; norms, embeddings and head replicated over tp. Pipeline stages
    (pipeline.py) keep it (the activations they send between stages are whole sequences);
    `apply_tensor_parallel` is the recipe train.py runs, and estimate_comm.py counts."""
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in colwise_names(fused)}
    plan.update({name: RowwiseParallel() for name in ("attention.wo", "feed_forward.w2")})
    return plan


def tp_block_plan(fused: bool = False) -> dict[str, ParallelStyle]:
    """torchtitan's tensor-parallel plan of one block, with sequence parallelism.

    Between the matmuls the residual stream is split over tp by sequence (`Shard(1)`): each
    rank keeps and normalises T/tp tokens (`SequenceParallel` norms, their weights replicated
    over tp with `Partial` gradients that DTensor all-reduces over tp). `PrepareModuleInput`
    all-gathers the normed sequence once before the attention and once before the
    feed-forward; q/k/v and w1/w3 split the heads / hidden features (`ColwiseParallel`, no
    communication), and wo/w2 (`RowwiseParallel`) reduce-scatter their partial sums back to
    sequence shards instead of all-reducing them. Per block and direction that is one
    all-gather and one reduce-scatter per sub-layer, the bytes of the textbook plan's one
    all-reduce, with activations and norm work cut by tp.

    `fused` (the model's `fused_projections`): wqkv and w13 instead of q/k/v and w1/w3. The
    backward of each all-gather is a reduce-scatter of the gathered input's gradient, which
    is then one matmul instead of a sum of two or three: the shape inductor's async TP pass
    fuses (`--async-tp`)."""
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # (x, rope): x arrives sequence-sharded, the rotary table is a plain buffer.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    plan.update({name: ColwiseParallel() for name in colwise_names(fused)})
    return plan


def tp_ends_plan() -> dict[str, ParallelStyle]:
    """The recipe's ends: the embedding table split by vocabulary rows (`RowwiseParallel`: each
    rank looks up its rows, the partial lookups reduce-scatter straight into sequence shards);
    the final norm sequence-parallel; the head split by vocabulary columns (`ColwiseParallel`
    after an all-gather of the sequence), its logits left as a DTensor sharded on the
    vocabulary, which `model.lm_loss` reduces shard by shard (vocab_parallel_loss.py) without ever gathering
    them (the fp32 logits are the largest activation of the step)."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """The recipe (`tp_ends_plan`, `tp_block_plan` on every block) on `tp_mesh`, before any
    data-parallel API. Every rank of a tp group must feed the same tokens, and the sequence
    length must be a multiple of the tp size (`tp_problem`). The block plan follows the
    model's `fused_projections`."""
    parallelize_module(model, tp_mesh, tp_ends_plan())
    for block in model.layers:
        parallelize_module(block, tp_mesh, tp_block_plan(model.cfg.fused_projections))


def tp_problem(tp: int, n_heads: int, ffn_dim: int, seq_len: int | None, flag: str = "--tp-size") -> str | None:
    """Why a tp degree does not fit the model, as one line naming `flag` (None when it fits):
    it splits the heads (and with them the kv heads: each has as many), the feed-forward
    width and the sequence (`seq_len`, where known) into equal parts."""
    for what, size in (("n_heads", n_heads), ("ffn_dim", ffn_dim), ("the sequence length", seq_len)):
        if size is not None and size % tp:
            return f"{flag} {tp} must divide {what} ({size}): the recipe splits it evenly over the tp ranks"
    return None


def async_tp_problem(
    async_tp: bool, needs: str, got: str | None, compiled: bool, backend: str, off: str = "--no-compile"
) -> str | None:
    """Why `--async-tp` cannot run, as one line (None when it can or is off). `needs` / `got`:
    the flag that turns tensor parallelism on and what was given instead (None: it is on);
    `compiled`: whether the blocks will be compiled, with `backend`; `off`: what turned
    compiling off, for the message."""
    if not async_tp:
        return None
    if got is not None:
        return f"--async-tp needs {needs}, got {got}"
    if not compiled or backend != "inductor":
        state = off if not compiled else f"--compile-backend {backend}"
        return (
            f"--async-tp needs the blocks compiled by inductor (--compile --compile-backend inductor: its "
            f"micro-pipeline pass does the overlap), got {state}"
        )
    if not torch.cuda.is_available():
        return "--async-tp needs CUDA (symmetric memory on the tp group), and torch.cuda.is_available() is False"
    return None


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Async tensor parallelism: inductor's micro-pipeline pass splits each all-gather + matmul
    and matmul + reduce-scatter of the compiled blocks into chunks that overlap, over
    symmetric memory on the tp group. Needs CUDA and blocks compiled with inductor (the
    callers' flag checks say so). Global for the process: every compiled block after this."""
    import warnings

    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():
        # torch >= 2.15 enables symmetric memory for every group by itself and deprecates this call.
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def checkpoint_blocks(blocks: Iterable[nn.Module], ac: str) -> None:
    """`--ac`: "full" checkpoints every block; "selective" keeps the outputs of its matmuls
    (torchtitan's op-level policy) and recomputes the rest; "none" does nothing."""
    if ac == "none":
        return
    options = {"context_fn": checkpoint.save_matmuls()} if ac == "selective" else {}
    for block in blocks:
        checkpoint(block, **options)


def parallelize(model: Transformer, args: argparse.Namespace, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """Apply torch.compile / checkpoint / tensor parallelism / fully_shard or replicate, in
    that order: per block first, then the root (see `sharding_units`)."""
    mp_policy = mp_policy_for(args.mp)
    if args.compile:
        # Per block, as torchtitan does: the blocks are where the time goes, and our hooks run
        # eagerly around each compiled block. `compile()` is lazy (it traces at the first call),
        # so the APIs applied below change nothing the compiled code depends on.
        for block in model.layers:
            block.compile(backend=args.compile_backend)
    checkpoint_blocks(model.layers, args.ac)
    if tensor_parallel_in(args):
        cfg = model.cfg
        problem = tp_problem(args.tp_size, cfg.n_heads, cfg.ffn_dim, getattr(args, "seq_len", None) or cfg.max_seq_len)
        if problem:
            raise UsageError(problem)
        apply_tensor_parallel(model, mesh["tp"])
        if args.compile:
            compile_kernels(args.compile_backend)  # the vocabulary-parallel loss's three passes
        if getattr(args, "async_tp", False):
            # Parse time refused what it could see; the rank's own device and compile are known only now.
            problem = async_tp_problem(True, "--parallel tp", None, args.compile, args.compile_backend)
            if problem or mesh.device_type != "cuda":
                raise UsageError(problem or f"--async-tp needs CUDA, and this rank trains on the {mesh.device_type}")
            enable_async_tp(mesh["tp"])
    if args.parallel == "replicate":
        replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
        return
    offload = offload_policy_for(args.cpu_offload)
    if model.cfg.n_experts:
        if args.parallel != "fsdp":
            raise UsageError(f"--moe runs with --parallel fsdp, got --parallel {args.parallel}")
        mesh_ep = expert_mesh(dp_mesh.device_type, model.cfg.n_experts)
        shard_experts(model, mesh_ep, fully_shard, mp_policy=mp_policy, offload_policy=offload)
    for module in sharding_units(model):
        fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload)


def expert_mesh(device_type: str, n_experts: int, ep: int | None = None) -> DeviceMesh:
    """The world as (edp, ep): experts split over `ep` ranks (default: as many as divide both
    the world and the experts), each rank's experts sharded over `edp`."""
    world = dist.get_world_size()
    ep = math.gcd(world, n_experts) if ep is None else ep
    if world % ep or n_experts % ep:
        raise UsageError(
            f"expert parallelism over {ep} ranks must divide the world {world} and the {n_experts} experts"
        )
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("edp", "ep"))


def shard_experts(model: Transformer, mesh: DeviceMesh, shard: Callable[..., Any], **options: Any) -> None:
    """Expert parallelism over `mesh["ep"]` (each rank keeps its experts, DTensors `Shard(0)` on
    it; tokens travel), then
    `shard` (composable's or FSDP2's `fully_shard`) of every block's experts over `mesh["edp"]`,
    before the blocks (bottom-up). Experts scale their gradients for the tokens they see from
    the whole ep group (moe.py), so the edp average is the mean over every rank's batch."""
    for block in model.layers:
        experts = block.feed_forward.experts
        experts.split(mesh["ep"])
        shard(experts, mesh=mesh["edp"], **options)
