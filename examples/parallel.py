"""How train.py lays the model over the ranks: the device mesh, the mixed-precision policy, and
activation checkpointing / tensor parallelism / fully_shard or replicate applied in order."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from composable import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, checkpoint, fully_shard, replicate
from model import Transformer

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(ValueError):
    """Flags that do not fit the world size or the model (reported without a traceback)."""


def build_mesh(args: argparse.Namespace, device_type: str) -> tuple[DeviceMesh, DeviceMesh, int, int]:
    """(mesh for parallelize, data-parallel mesh, data-parallel rank, data-parallel size)."""
    world = dist.get_world_size()
    if args.parallel == "tp":
        if world % args.tp_size:
            raise UsageError(f"--tp-size {args.tp_size} does not divide the world size {world}")
        mesh = init_device_mesh(device_type, (world // args.tp_size, args.tp_size), mesh_dim_names=("dp", "tp"))
        return mesh, mesh["dp"], mesh["dp"].get_local_rank(), mesh["dp"].size()
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
    return MixedPrecisionPolicy() if dtype is None else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def parallelize(model: Transformer, args: argparse.Namespace, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """Apply checkpoint / tensor parallelism / fully_shard or replicate, in that order:
    per block first, then the root (which then manages only the embeddings, final norm and head)."""
    mp_policy = mp_policy_for(args.mp)
    if args.activation_checkpointing:
        for block in model.layers:
            checkpoint(block)
    if args.parallel == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if model.cfg.n_heads % args.tp_size:
            raise UsageError(f"--tp-size {args.tp_size} must divide n_heads {model.cfg.n_heads}")
        # Megatron-style: q/k/v and w1/w3 split by output features (heads), wo/w2 by input
        # features with an all-reduce after. Norms, embeddings and head stay replicated over tp.
        plan = {name: ColwiseParallel() for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")}
        plan.update({name: RowwiseParallel() for name in ("attention.wo", "feed_forward.w2")})
        for block in model.layers:
            parallelize_module(block, mesh["tp"], plan)
    if args.parallel == "replicate":
        replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
        return
    offload = CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy()
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload)

