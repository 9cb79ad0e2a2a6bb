"""Parameters sharded on a dim > 0 (`shard_placement_fn` returning `Shard(d)`, d > 0).

A rank region of the flat buffers holds that rank's local shard in its natural layout, contiguous
(as FSDP2 hands out `to_local()` and its gradient), then padding up to `chunk_rows` rows along
the sharded dim. The unsharded parameter is contiguous in its natural layout too; these two
functions move between the two (the all-gather's copy-out and the reduce-scatter's copy-in), with
two copies whatever the world size: the ranks holding `chunk_rows` rows as one strided copy, the
one rank holding fewer (uneven sizes) as a second.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class RegionLayout(Protocol):
    """What these functions read of `param.ParamLayout` (sizes in elements)."""

    shape: torch.Size
    dim: int
    rows: int
    row_numel: int
    chunk_rows: int

    @property
    def region_numel(self) -> int: ...


def _split(lay: RegionLayout, full: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(ranks holding `chunk_rows` rows, rows of the one partial rank, `full` as (before, rows, after))."""
    before = math.prod(lay.shape[: lay.dim])
    whole = lay.rows // lay.chunk_rows if lay.chunk_rows else 0
    return whole, lay.rows - whole * lay.chunk_rows, full.reshape(before, lay.rows, -1)


def regions_to_full(lay: RegionLayout, regions: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the rank-major `regions` (1D, `region_numel` elements per rank) into `full`, the
    contiguous parameter (written through: `full` must be contiguous)."""
    whole, part, out = _split(lay, full)
    per_rank = regions.view(-1, lay.region_numel)
    before, after = out.shape[0], out.shape[2]
    if whole:
        shard = per_rank[:whole].view(whole, before, lay.chunk_rows, after)
        out[:, : whole * lay.chunk_rows].view(before, whole, lay.chunk_rows, after).copy_(shard.transpose(0, 1))
    if part:
        out[:, whole * lay.chunk_rows :].copy_(per_rank[whole, : part * lay.row_numel].view(before, part, after))


def full_to_regions(lay: RegionLayout, full: torch.Tensor, world: int) -> torch.Tensor:
    """The inverse of `regions_to_full`: `world` zero-padded rank-major regions of `full` (any
    layout, any dtype), as a (world, region_numel) tensor."""
    out = full.new_zeros((world, lay.region_numel))
    whole, part, src = _split(lay, full)
    before, after = src.shape[0], src.shape[2]
    if whole:
        shard = src[:, : whole * lay.chunk_rows].view(before, whole, lay.chunk_rows, after)
        out[:whole].view(whole, before, lay.chunk_rows, after).copy_(shard.transpose(0, 1))
    if part:
        out[whole, : part * lay.row_numel].view(before, part, after).copy_(src[:, whole * lay.chunk_rows :])
    return out
