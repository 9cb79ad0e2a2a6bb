"""A tiny pipelined model for the pipelining tests: blocks split into stages, the stage-to-rank
maps of torch's schedules, and one training step that drives a schedule on this rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import schedules as S

from composable.integrations.pipelining import pipeline_stage

DIM = 8
BATCH = 8  # per data-parallel rank
MICROBATCHES = 4
# Every schedule this torch ships, with how many stages each pipeline rank holds.
SCHEDULES: dict[str, int] = {
    name: (1 if name in ("ScheduleGPipe", "Schedule1F1B") else 2)
    for name in (
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
        "ScheduleDualPipeV",
    )
    if hasattr(S, name)
}
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.lin(x)))


class Stage(nn.Module):
    """The blocks of one pipeline stage; their FQNs are `blocks.<global index>`."""

    def __init__(self, blocks: dict[str, Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def full_model(n_blocks: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(n_blocks)])


def stage_ids(schedule: str, pp_rank: int, pp: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds under `schedule` (torch's layouts)."""
    per_rank = SCHEDULES[schedule]
    if per_rank == 1:
        return [pp_rank]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def stage_module(model: nn.Sequential, stage: int, n_stages: int) -> Stage:
    """A fresh copy of the blocks of `stage` (the reference keeps its own)."""
    per = len(model) // n_stages
    ids = range(stage * per, (stage + 1) * per)
    copied = {str(i): Block() for i in ids}
    for i in ids:
        copied[str(i)].load_state_dict(model[i].state_dict())
    return Stage(copied)


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedules' loss, computed in fp32 as a mixed-precision job computes its loss: torch
    2.11's mse_loss cannot differentiate a bf16 output against an fp32 target ("Found dtype
    Float but expected BFloat16", in one process too; FSDP2's stages fail alike)."""
    return F.mse_loss(output.float(), target)


def make_schedule(name: str, stages: list[nn.Module], n_stages: int, pp_group: Any, device: str = "cpu") -> Any:
    """`name` over this rank's stage modules (`stages[k]` is stage `ids[k]`), mse loss."""
    pp_rank = pp_group.rank() if pp_group is not None else 0
    pp = n_stages // SCHEDULES[name]
    ids = stage_ids(name, pp_rank, pp)
    built = [pipeline_stage(m, i, n_stages, device, group=pp_group) for m, i in zip(stages, ids)]
    cls = getattr(S, name)
    if SCHEDULES[name] == 1:
        return cls(built[0], n_microbatches=MICROBATCHES, loss_fn=mse_loss)
    return cls(built, n_microbatches=MICROBATCHES, loss_fn=mse_loss)


def run_step(schedule: Any, name: str, ids: list[int], n_stages: int, x: torch.Tensor, y: torch.Tensor) -> list:
    """One schedule step on this rank; the microbatch losses where the last stage lives."""
    losses: list = []
    first, last = 0 in ids, n_stages - 1 in ids
    kwargs: dict[str, Any] = {}
    if last:
        kwargs.update(target=y, losses=losses)
    if first:
        schedule.step(x, **kwargs)
    else:
        schedule.step(**kwargs)
    return losses
