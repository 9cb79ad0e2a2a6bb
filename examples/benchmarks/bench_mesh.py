"""The benchmark's `--mesh`: the device mesh the sharded contenders run on.

- `dp` (default): every rank data-parallel, the 1D world mesh fully_shard/FSDP2 default to;
  every contender runs.
- `hsdp`: a 2D (replicate, shard) mesh of `--dp-replicate` x world/`--dp-replicate` ranks;
  fully_shard and FSDP2 shard over "shard" and replicate over "replicate" (HSDP placements
  `(Replicate(), Shard(0))`). With `--tp-size`, a 3D (replicate, shard, tp) mesh: the model
  tensor-parallel on "tp" with train.py's recipe first, then HSDP over (replicate, shard), as
  torchtitan's dp_replicate x dp_shard x tp; the FSDP-style contenders' eager and compiled steps.
- `tp`: a 2D (dp, tp) mesh of world/`--tp-size` x `--tp-size` ranks; the model is
  tensor-parallel on "tp" with train.py's recipe (examples/trainer/parallel.py's
  `apply_tensor_parallel`: sequence-parallel norms, embeddings and head included, the loss
  shard by shard, vocab_parallel_loss.py), then fully_shard / FSDP2 shard over "dp"; on GPUs the blocks are
  compiled unless `--no-compile`, and `--async-tp` turns on async TP for both contenders (and
  with it `--fused-projections`: the blocks' wqkv / w13, whose backward reduce-scatters async
  TP can fuse with their one matmul). The ranks of one tp group train on the same tokens, so a
  GPU's share of a step is local batch x seq / tp tokens.

The floors stay one GPU's own full copy without communication on every mesh (the same number
as with `dp`). `replicate` and `ddp` replicate over the whole world whatever the mesh, so they
are measured with `--mesh dp` only. `fully_shard_graphed` runs on every mesh: under `tp` its
graph holds the tensor-parallel collectives too (`graphed_step` captures a 2D step).
`--model hf-llama` and `--float8` stay with `dp` and `hsdp` (the TP plan is our model's;
torchao's float8 needs its own TP styles).
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.vocab_parallel_loss import compile_kernels
from trainer.parallel import apply_tensor_parallel, async_tp_problem, enable_async_tp, tp_problem

MESHES = ("dp", "hsdp", "tp")
DEFAULT_SECOND_DIM = 2  # --dp-replicate / --tp-size when the mesh needs them and they are not given
# The runs each mesh measures: the floors (no mesh at all) and the FSDP-style contenders.
MESH_RUNS = {
    "dp": None,  # every run
    "hsdp": ("floor", "fully_shard", "fsdp2", "floor_graphed", "fully_shard_graphed"),
    "tp": ("floor", "fully_shard", "fsdp2", "floor_graphed", "fully_shard_graphed"),
}
MESH_DEFAULT_RUNS = ("floor", "fully_shard", "fsdp2")  # `--runs`' default on a 2D mesh


class BenchMesh(NamedTuple):
    """The mesh of a run: `kind` one of MESHES; `mesh` the 2D DeviceMesh (None for dp: the APIs'
    default world mesh, as before meshes were an option); `dp_mesh` what fully_shard/FSDP2 get."""

    kind: str
    mesh: DeviceMesh | None
    dp_mesh: DeviceMesh | None

    @property
    def tp(self) -> int:
        return self.mesh["tp"].size() if self.has_tp else 1

    @property
    def has_tp(self) -> bool:
        return self.mesh is not None and "tp" in (self.mesh.mesh_dim_names or ())

    def data_rank(self) -> int:
        """The rank whose tokens this rank trains on: the tp ranks of a group share theirs."""
        if not self.has_tp:
            return dist.get_rank()
        if self.kind == "tp":
            return self.mesh["dp"].get_local_rank()  # type: ignore[index]
        shard = self.mesh["shard"]  # type: ignore[index]
        return self.mesh["replicate"].get_local_rank() * shard.size() + shard.get_local_rank()  # type: ignore[index]


def tokens_per_gpu(mesh: BenchMesh | None, run: str, batch: int, seq: int) -> float:
    """Tokens one GPU's step of `run` accounts for: a tp group's batch is shared by its tp
    ranks; a floor holds the whole model and its batch on every mesh."""
    tp = 1 if mesh is None or run.startswith("floor") else mesh.tp
    return batch * seq / tp


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mesh",
        choices=MESHES,
        default="dp",
        help="'dp': 1D data parallel; 'hsdp': 2D (replicate, shard); 'tp': 2D (dp, tp), blocks tensor-parallel",
    )
    p.add_argument(
        "--dp-replicate",
        type=int,
        default=None,
        help=f"--mesh hsdp: replicas (the outer dim; default {DEFAULT_SECOND_DIM}), each sharded over world/replicas",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=None,
        help=f"--mesh tp: tensor-parallel ranks (default {DEFAULT_SECOND_DIM}); --mesh hsdp: a third, tensor-parallel "
        "dim of this size (default none)",
    )


def mesh_errors(
    args: argparse.Namespace, n_heads: int, ffn_dim: int, world: int | None, compile_off: str = "--no-compile"
) -> str | None:
    """The one-line error for `args`' mesh flags (None when they fit); fills in the default
    second dim. `world`: the world size where known (torchrun's WORLD_SIZE), else checked at
    `build_mesh`; `compile_off`: what left the blocks uncompiled, should `--async-tp` need them."""
    three_d = args.mesh == "hsdp" and args.tp_size is not None
    for flag, kind in (("dp_replicate", "hsdp"), ("tp_size", "tp")):
        value = getattr(args, flag)
        name = "--" + flag.replace("_", "-")
        if value is not None and args.mesh != kind and not (three_d and flag == "tp_size"):
            return f"{name} {value} needs --mesh {kind}, got --mesh {args.mesh}"
        if args.mesh == kind or (three_d and flag == "tp_size"):
            value = DEFAULT_SECOND_DIM if value is None else value
            setattr(args, flag, value)
            if value < 1:
                return f"{name} must be >= 1, got {value}"
            if world is not None and world % value:
                return f"{name} {value} must divide the world size {world} (--mesh {kind})"
    if three_d and world is not None and world % (args.dp_replicate * args.tp_size):
        return (
            f"--dp-replicate {args.dp_replicate} x --tp-size {args.tp_size} must divide the world size {world} "
            "(--mesh hsdp with --tp-size)"
        )
    if three_d:
        refused = [run for run in args.runs.split(",") if run not in MESH_DEFAULT_RUNS]
        if refused:
            return (
                f"--runs {refused[0]} with --mesh hsdp --tp-size: only {', '.join(MESH_DEFAULT_RUNS)} run on a 3D mesh"
            )
    allowed = MESH_RUNS[args.mesh]
    if allowed is not None:
        refused = [run for run in args.runs.split(",") if run not in allowed]
        if refused:
            return (
                f"--runs {refused[0]} with --mesh {args.mesh}: only {', '.join(allowed)} run on a 2D mesh "
                f"(replicate and ddp replicate over the whole world); "
                f"measure {refused[0]} with --mesh dp"
            )
    if args.mesh == "tp" or three_d:
        where = "--mesh tp" if args.mesh == "tp" else "--mesh hsdp --tp-size"
        if args.model != "own":
            return f"--model {args.model} with {where}: the TP plan (examples/trainer/parallel.py) is for --model own"
        if getattr(args, "float8", False):
            return f"--float8 with {where}: torchao's float8 needs its own TP styles; use --mesh dp or hsdp"
        problem = tp_problem(args.tp_size, n_heads, ffn_dim, args.seq_len)
        if problem:
            return problem
    got = None if args.mesh == "tp" else f"--mesh {args.mesh}"
    async_tp = getattr(args, "async_tp", False)
    return async_tp_problem(async_tp, "--mesh tp", got, bool(args.compile), args.compile_backend, compile_off)


def build_mesh(args: argparse.Namespace, device_type: str) -> BenchMesh:
    """The mesh `args` asks for over the initialised world (one process group per dim, made
    once for all contenders and rounds). ValueError when a size does not divide the world."""
    if args.mesh == "dp":
        return BenchMesh("dp", None, None)
    world = dist.get_world_size()
    inner = args.dp_replicate if args.mesh == "hsdp" else args.tp_size
    flag = "--dp-replicate" if args.mesh == "hsdp" else "--tp-size"
    if world % inner:
        raise ValueError(f"{flag} {inner} must divide the world size {world} (--mesh {args.mesh})")
    if args.mesh == "hsdp" and args.tp_size is not None:
        tp = args.tp_size
        if world % (inner * tp):
            raise ValueError(f"--dp-replicate {inner} x --tp-size {tp} must divide the world size {world}")
        names = ("replicate", "shard", "tp")
        mesh = init_device_mesh(device_type, (inner, world // (inner * tp), tp), mesh_dim_names=names)
        if args.compile:
            compile_kernels(args.compile_backend)
        return BenchMesh("hsdp", mesh, mesh["replicate", "shard"])
    if args.mesh == "hsdp":
        mesh = init_device_mesh(device_type, (inner, world // inner), mesh_dim_names=("replicate", "shard"))
        return BenchMesh("hsdp", mesh, mesh)
    mesh = init_device_mesh(device_type, (world // inner, inner), mesh_dim_names=("dp", "tp"))
    if getattr(args, "async_tp", False):
        enable_async_tp(mesh["tp"])  # once, for both contenders: their compiled blocks both get it
    if args.compile:
        compile_kernels(args.compile_backend)  # the vocabulary-parallel loss's, for both contenders too
    return BenchMesh("tp", mesh, mesh["dp"])


def describe_mesh(args: argparse.Namespace, world: int) -> str:
    """`dp 4`, `hsdp 2 replicas x 2 shards`, `dp 2 x tp 2`: the mesh a table was measured on,
    with `, fused projections` after it under `--fused-projections` (it changes the TP plan)."""
    mesh = getattr(args, "mesh", "dp")
    fused = ", fused projections" if getattr(args, "fused_projections", False) else ""
    if mesh == "hsdp" and getattr(args, "tp_size", None) is not None:
        shards = world // (args.dp_replicate * args.tp_size)
        return f"hsdp {args.dp_replicate} replicas x {shards} shards x tp {args.tp_size}{fused}"
    if mesh == "hsdp":
        return f"hsdp {args.dp_replicate} replicas x {world // args.dp_replicate} shards{fused}"
    if mesh == "tp":
        return f"dp {world // args.tp_size} x tp {args.tp_size}{fused}"
    return f"dp {world}{fused}"


def tensor_parallel(model: nn.Module, bench_mesh: BenchMesh) -> None:
    """`model` (ours) tensor-parallel on the tp dim with train.py's recipe (no-op without a tp dim)."""
    if bench_mesh.has_tp:
        apply_tensor_parallel(model, bench_mesh.mesh["tp"])  # type: ignore[arg-type]


def tokens_generator(bench_mesh: BenchMesh | None, device: torch.device) -> torch.Generator:
    """The generator of a rank's tokens: seeded by its data rank (tp ranks of a group alike)."""
    rank = dist.get_rank() if bench_mesh is None else bench_mesh.data_rank()
    return torch.Generator(device=device).manual_seed(rank)
