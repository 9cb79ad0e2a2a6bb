"""How train.py pipelines the model (`--pp N --pp-schedule NAME --microbatches M`): the (pp, ...)
device mesh, the stage modules of this pipeline rank, data parallelism on each stage, torch's
schedule over `composable.integrations.pipelining.pipeline_stage`, the training step, and a
forward-only evaluation through the stages.

A stage module keeps the whole model's parameter names (`tok_embeddings.weight` on the first
stage, `layers.<global index>.*`, `norm.weight` and `output.weight` on the last), and
`RankModel` gathers this rank's stages under those names: the optimizer, `clip_pipeline_grad_norm_`, the
parameter count and the DCP checkpoints see one module whose state dict is this rank's part of
the whole model's, so a checkpoint of a pipelined run loads into any other layout (`--pp` or
`--parallel` changed) and back.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor.parallel import parallelize_module

from composable import fully_shard, replicate
from composable.integrations.pipelining import clip_pipeline_grad_norm_, pipeline_stage
from models.model import Transformer, lm_loss
from trainer.parallel import (
    PARAMS_ON_HOST,
    UsageError,
    checkpoint_blocks,
    mp_policy_for,
    offload_policy_for,
    parallelize,
    tp_plan,
)

# torch's schedules (those this torch ships) and how many stages each puts on a pipeline rank.
_ALL = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
SCHEDULES: dict[str, int] = {
    name: (1 if name in ("GPipe", "1F1B") else 2) for name in _ALL if hasattr(torch_schedules, "Schedule" + name)
}
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2*pp-1-r


def validate_pp(args: argparse.Namespace) -> str | None:
    """The first problem with the pipelining flags as one line, or None."""
    if args.pp < 1:
        return f"--pp must be >= 1, got {args.pp}"
    if args.pp == 1:
        return None
    if args.pp_schedule not in SCHEDULES:
        return f"--pp-schedule must be one of {', '.join(SCHEDULES)} (this torch's), got {args.pp_schedule!r}"
    if args.microbatches < 1 or args.batch_size % args.microbatches:
        return f"--microbatches must divide --batch-size {args.batch_size}, got {args.microbatches}"
    if args.grad_accum != 1:
        return f"--grad-accum must be 1 with --pp (microbatches are --microbatches), got {args.grad_accum}"
    if args.mp == "fp16":
        return "--mp fp16 is not supported with --pp (a pipeline schedule runs its own backward); use bf16"
    if args.tie_embeddings:
        return "--tie-embeddings is not supported with --pp (the first and last stages would share a weight)"
    return None


def stage_ids(schedule: str, pp_rank: int, pp: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds under `schedule` (torch's layouts)."""
    if SCHEDULES[schedule] == 1:
        return [pp_rank]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(SCHEDULES[schedule])]


def build_pp_mesh(args: argparse.Namespace, device_type: str) -> tuple[DeviceMesh, DeviceMesh, int, int]:
    """(mesh with a leading "pp" dim, data-parallel mesh, data-parallel rank, data-parallel size)."""
    world, pp = dist.get_world_size(), args.pp
    rest = world // pp
    if world % pp:
        raise UsageError(f"--pp {pp} does not divide the world size {world}")
    if args.parallel == "tp":
        if rest % args.tp_size:
            raise UsageError(f"--tp-size {args.tp_size} does not divide world/--pp = {rest}")
        mesh = init_device_mesh(
            device_type, (pp, rest // args.tp_size, args.tp_size), mesh_dim_names=("pp", "dp", "tp")
        )
        return mesh, mesh["dp"], mesh["dp"].get_local_rank(), mesh["dp"].size()
    if args.parallel == "hsdp":
        shard = args.hsdp_shard_size or max(1, rest // 2)
        if rest % shard:
            raise UsageError(f"--hsdp-shard-size {shard} does not divide world/--pp = {rest}")
        mesh = init_device_mesh(device_type, (pp, rest // shard, shard), mesh_dim_names=("pp", "replicate", "shard"))
        dp_rank = mesh["replicate"].get_local_rank() * shard + mesh["shard"].get_local_rank()
        return mesh, mesh["replicate", "shard"], dp_rank, rest
    mesh = init_device_mesh(device_type, (pp, rest), mesh_dim_names=("pp", "dp"))
    return mesh, mesh["dp"], mesh["dp"].get_local_rank(), rest


class TransformerStage(nn.Module):
    """Stage `index` of `n_stages` of a Transformer (its modules, not copies): the embeddings on
    the first stage, an even share of the blocks, the final norm and head on the last."""

    def __init__(self, model: Transformer, index: int, n_stages: int) -> None:
        super().__init__()
        n = model.cfg.n_layers
        if n < n_stages:
            raise UsageError(f"--pp with {n_stages} stages needs at least as many layers, got --n-layers {n}")
        lo, hi = index * n // n_stages, (index + 1) * n // n_stages
        self.first, self.last = index == 0, index == n_stages - 1
        self.tok_embeddings = model.tok_embeddings if self.first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        self.norm = model.norm if self.last else None
        self.output = model.output if self.last else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h, self.rope)
        return self.output(self.norm(h)) if self.output is not None else h


class RankModel(nn.Module):
    """This pipeline rank's stages as one module under the whole model's names (see above)."""

    def __init__(self, stages: list[TransformerStage]) -> None:
        super().__init__()
        for name in ("tok_embeddings", "norm", "output"):
            found = [getattr(s, name) for s in stages if getattr(s, name) is not None]
            if found:
                setattr(self, name, found[0])
        self.layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})


def parallelize_stage(stage: TransformerStage, args: argparse.Namespace, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """parallel.parallelize for one stage: compile / checkpoint / tp per block, then fully_shard
    (embeddings, head, every block, the stage) or replicate. Parameters stay gathered from the
    first forward of a step to its end (`reshard_after_forward=False`, as torchtitan does under
    pipelining): a schedule runs each stage's forward once per microbatch."""
    blocks = list(stage.layers.values())
    if args.compile:
        for block in blocks:
            block.compile(backend=args.compile_backend)
    checkpoint_blocks(blocks, args.ac)
    if args.parallel == "tp":
        for block in blocks:
            parallelize_module(block, mesh["tp"], tp_plan())
    mp_policy = mp_policy_for(args.mp)
    if args.parallel == "replicate":
        replicate(stage, mesh=dp_mesh, mp_policy=mp_policy)
        return
    offload = offload_policy_for(args.cpu_offload)
    ends = [m for m in (stage.tok_embeddings, stage.output) if m is not None]
    for module in [*ends, *blocks, stage]:
        fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False)


class Pipeline:
    """This rank's stages of the model, their schedule and the training step over it."""

    def __init__(self, model: Transformer, args: argparse.Namespace, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
        self.pp_group = mesh["pp"].get_group()
        pp, pp_rank = args.pp, self.pp_group.rank()
        self.name = args.pp_schedule
        self.n_stages = pp * SCHEDULES[self.name]
        self.ids = stage_ids(self.name, pp_rank, pp)
        self.owner = {i: r for r in range(pp) for i in stage_ids(self.name, r, pp)}
        if args.parallel == "tp" and model.cfg.n_heads % args.tp_size:
            raise UsageError(f"--tp-size {args.tp_size} must divide n_heads {model.cfg.n_heads}")
        self.stages = [TransformerStage(model, i, self.n_stages) for i in self.ids]
        for stage in self.stages:
            parallelize_stage(stage, args, mesh, dp_mesh)
        self.model = RankModel(self.stages)
        self.device = model.rope.device
        self.microbatches = args.microbatches
        self.dim = model.cfg.dim
        self.title = f" x --pp {pp} ({self.name}, {self.microbatches} microbatches)"  # for the run's title line

    def build_schedule(self, device: torch.device) -> Any:
        """torch's schedule over `pipeline_stage`s (after the parameters are materialised)."""
        built = [
            pipeline_stage(m, i, self.n_stages, device, group=self.pp_group) for m, i in zip(self.stages, self.ids)
        ]
        cls = getattr(torch_schedules, "Schedule" + self.name)
        arg = built[0] if SCHEDULES[self.name] == 1 else built
        return cls(arg, n_microbatches=self.microbatches, loss_fn=lm_loss)

    def refresh_rope(self, model: Transformer) -> None:
        for stage in self.stages:
            stage.rope = model.rope

    def make_train_step(
        self, optimizer: torch.optim.Optimizer, args: argparse.Namespace, device: torch.device
    ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]:
        """`step(xs, ys) -> (loss, grad_norm)` as train_step.make_train_step's: one schedule step
        over the batch (split into --microbatches), clipping with the whole model's norm
        (over pp too), the optimizer step. `loss` is this data-parallel rank's mean loss on
        every pipeline rank."""
        schedule = self.build_schedule(device)
        first, last, max_norm = 0 in self.ids, self.n_stages - 1 in self.ids, args.max_norm

        def step(xs: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = dict(target=ys, losses=losses) if last else {}
            # Contiguous: torch 2.11's stages check the first stage's input strides against the
            # microbatch they traced with, and `tokens[:, :-1]` is a strided view.
            schedule.step(xs.contiguous(), **kwargs) if first else schedule.step(**kwargs)
            loss = torch.zeros((), device=device)
            if last:  # equal microbatches: their mean is the batch's mean loss
                loss = torch.stack([v.detach().float() for v in losses]).mean()
            dist.all_reduce(loss, group=self.pp_group)  # only the last stage's rank adds to it
            norm = clip_pipeline_grad_norm_(self.model.parameters(), max_norm, self.pp_group) if max_norm > 0 else None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss, norm

        return step

    @torch.no_grad()
    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of (x, y) through every stage in order, activations sent between pipeline
        ranks; the same value on every pipeline rank. Forward only (evaluation)."""
        me = self.pp_group.rank()
        peer = lambda r: dist.get_global_rank(self.pp_group, r)  # noqa: E731
        shape = (*x.shape, self.dim)
        h: torch.Tensor = x
        loss = torch.zeros((), device=x.device)
        for i in range(self.n_stages):
            mine, prev = self.owner[i] == me, self.owner.get(i - 1)
            if mine and i > 0 and prev != me:
                h = torch.empty(shape, device=x.device)
                dist.recv(h, src=peer(prev))
            if mine:
                h = self.stages[self.ids.index(i)](h)
                if i == self.n_stages - 1:
                    loss = lm_loss(h, y).float()
                elif self.owner[i + 1] != me:
                    dist.send(h.float().contiguous(), dst=peer(self.owner[i + 1]))
        dist.all_reduce(loss, group=self.pp_group)
        return loss


def build_parallel_model(
    model: Transformer,
    args: argparse.Namespace,
    mesh: DeviceMesh,
    dp_mesh: DeviceMesh,
    device: torch.device,
    meta_init: bool,
) -> tuple[nn.Module, Pipeline | None]:
    """`model` parallelized per --parallel (parallel.py), or with --pp this rank's stages of it
    (each parallelized so) and their union under the whole model's names; materialised where
    it was built on the meta device: the shards where they will live (on the CPU when
    offloading, as torchtitan does, else on `device`; the rotary tables always on `device`).
    A pipeline's stages of other ranks stay on meta."""
    pipeline = Pipeline(model, args, mesh, dp_mesh) if args.pp > 1 else None
    if pipeline is None:
        parallelize(model, args, mesh, dp_mesh)
    if meta_init:
        for part in pipeline.stages if pipeline else [model]:
            part.to_empty(device="cpu" if args.cpu_offload in PARAMS_ON_HOST else device)
        model.init_weights(buffer_device=device)
    if pipeline is None:
        return model, None
    pipeline.refresh_rope(model)
    return pipeline.model, pipeline
