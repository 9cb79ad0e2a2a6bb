"""`shard_placement_fn` results: a `Shard`, None, or PyTorch FSDP2's `ShardPlacementResult`
(a placement and the mesh to shard that parameter over)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.tensor import Shard

from .layout import DataParallelLayout

try:  # torch >= 2.13: FSDP2's own class, so one shard_placement_fn serves both libraries
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # older torch: the same fields

    @dataclass
    class ShardPlacementResult:  # type: ignore[no-redef]
        """The placement (`Shard(d)` or None for `Shard(0)`) and the mesh information
        (anything with a `mesh`: the data-parallel mesh, shard dim last) of one parameter."""

        placement: Shard | None
        mesh_info: object


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    return [] if group is None else dist.get_process_group_ranks(group)


def placement_of(api: str, fqn: str, result: object, layout: DataParallelLayout) -> object:
    """The placement a `shard_placement_fn` result asks for. A `ShardPlacementResult` whose
    mesh shards and replicates over the group's own ranks gives its placement; another mesh
    (a per-parameter mesh, e.g. experts on their own expert-data-parallel mesh) is
    `NotImplementedError` naming the parameter and the way that works: `fully_shard` on the
    module holding those parameters, with that mesh."""
    if not isinstance(result, ShardPlacementResult):
        return result
    mesh = getattr(result.mesh_info, "mesh", None)
    if mesh is None or not hasattr(mesh, "get_group"):
        raise TypeError(f"{api}: 'shard_placement_fn' returned a ShardPlacementResult without a mesh for '{fqn}'")
    shard = _ranks(mesh.get_group(mesh.ndim - 1))
    replicate = [_ranks(mesh.get_group(d)) for d in range(mesh.ndim - 1)]
    if shard != _ranks(layout.shard_group) or replicate != [_ranks(g) for g in layout.replicate_groups]:
        raise NotImplementedError(
            f"{api}: 'shard_placement_fn' put '{fqn}' on its own mesh {mesh} (ShardPlacementResult), not the "
            "group's: per-parameter meshes are not supported; apply fully_shard to the module holding those "
            "parameters with that mesh first (e.g. fully_shard(block.experts, mesh=expert_dp_mesh))"
        )
    return result.placement
