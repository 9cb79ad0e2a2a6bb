"""One launched gradient reduction (`Reduction`) and how its flat buffer is laid out and read.

Presence: a rank that has no gradient for a parameter (a data-dependent branch) feeds
negative zeros in its place. A sum is -0.0 only where every addend is -0.0 (x + -0.0 == x, and
an exact cancellation rounds to +0.0), so after the collective a parameter whose whole region
of the output is -0.0 had a gradient on no rank, and any other had one somewhere. That keeps
the reduction's buffers exactly FSDP2's (no extra elements, no extra collective), so every
backend sums the same values in the same order; a region that really sums to -0.0 everywhere
is read as "no gradient" (its value is zero either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..comm import collectives as comm

if TYPE_CHECKING:
    from ..params.param import ManagedParam


@dataclass
class Reduction:
    """One launched reduction: its works, its flat output and what maps back to whom."""

    params: list["ManagedParam"]
    present: list[bool]
    offsets: list[int]
    output: torch.Tensor  # 1D, reduce dtype
    works: list[dist.Work | comm.Done] = field(default_factory=list)  # those still running (asynchronous ones)
    all_reduced: bool = True  # False: HSDP partial, not yet reduced across replicas
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    event: "torch.cuda.Event | None" = None  # CUDA: recorded on the reduce stream when done
    divided: bool = False  # averaging applied (by ReduceOp.AVG, or the division after a SUM)
    assigned: list[bool] = field(default_factory=list)  # sharded grads already pointed at `output`
    host_output: torch.Tensor | None = None  # offload from CUDA: `output` copied to pinned memory (before `event`)


MISSING = -0.0  # what a rank reduces in place of a gradient it does not have (see the module's note)


def had_a_gradient_somewhere(output: torch.Tensor, regions: list[tuple[int, int]]) -> list[bool]:
    """For each (offset, numel) region of a finished reduction's `output`: whether any rank
    contributed a gradient there, i.e. not every element is -0.0. One host sync for all."""
    if not regions:
        return []
    marks = torch.stack([_all_missing(output.narrow(0, off, n)) for off, n in regions])
    return [not m for m in marks.tolist()]


def _all_missing(region: torch.Tensor) -> torch.Tensor:
    return (torch.signbit(region) & (region == 0)).all()


def region_offsets(params: list["ManagedParam"]) -> list[int]:
    """Where each parameter's region starts in a flat buffer holding `params` one after another."""
    offsets, off = [], 0
    for mp in params:
        offsets.append(off)
        off += mp.layout.region_numel
    return offsets
