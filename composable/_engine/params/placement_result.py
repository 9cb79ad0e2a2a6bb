"""`shard_placement_fn` results: a `Shard`, None, or PyTorch FSDP2's `ShardPlacementResult`
(a placement and the mesh to shard that parameter over)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ..meshes.layout import DataParallelLayout
from .spmd import SpmdDims, resolve_dp_mesh_dims

try:  # torch >= 2.13: FSDP2's own class, so one shard_placement_fn serves both libraries
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as ShardPlacementResult
except ImportError:  # older torch: the same fields

    @dataclass
    class ShardPlacementResult:  # type: ignore[no-redef]  # typed as torch's class; the stand-in for an older torch
        """The placement (`Shard(d)` or None for `Shard(0)`) and the mesh information
        (anything with a `mesh`: the data-parallel mesh, shard dim last) of one parameter."""

        placement: Shard | None
        mesh_info: object


class MeshInfo(Protocol):
    """What `placement_of` checks a `mesh_info` has (torch's FSDPMeshInfo and its kin)."""

    mesh: DeviceMesh


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    return [] if group is None else dist.get_process_group_ranks(group)


def mesh_key(mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """What makes two data-parallel meshes the same for a group: the ranks of the shard dim (the
    last) and of each replicate dim, as FSDP2 groups parameters by their process groups."""
    return tuple(tuple(_ranks(mesh.get_group(d))) for d in range(mesh.ndim))


def layout_key(layout: DataParallelLayout) -> tuple[tuple[int, ...], ...]:
    return (*(tuple(_ranks(g)) for g in layout.replicate_groups), tuple(_ranks(layout.shard_group)))


def placement_of(
    api: str, fqn: str, result: object, layout: DataParallelLayout, whole_mesh: DeviceMesh
) -> tuple[object, MeshInfo | None]:
    """(placement, mesh_info) of a `shard_placement_fn` result: a `Shard` or None goes on the
    group's own mesh (mesh_info None); a `ShardPlacementResult` gives its placement and its
    `mesh_info` (anything with a `mesh`: torch's FSDPMeshInfo/HSDPMeshInfo, with `spmd_mesh`
    and `dp_mesh_dims` under `dp_mesh_dims`), or None where that mesh shards and replicates
    over the group's own ranks (and, under `dp_mesh_dims`, lies in `whole_mesh`, the
    module's). Raises `TypeError` for a result without a DeviceMesh and `ValueError` for a
    mesh that does not contain this rank, is not 1D/2D or is on another device type."""
    if not isinstance(result, ShardPlacementResult):
        return result, None
    info = result.mesh_info
    mesh = getattr(info, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{api}: 'shard_placement_fn' returned a ShardPlacementResult without a DeviceMesh 'mesh_info.mesh' "
            f"for '{fqn}', got {type(mesh).__name__}"
        )
    where = f"{api}: 'shard_placement_fn' put '{fqn}' on mesh {mesh}"
    if mesh.device_type != layout.mesh.device_type:
        raise ValueError(
            f"{where} of device type '{mesh.device_type}', not the module mesh's '{layout.mesh.device_type}'"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(f"{where}: a per-parameter mesh must be 1D (shard) or 2D (replicate, shard), got {mesh.ndim}D")
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(f"{where}, which does not contain this rank (global rank {dist.get_rank()})")
    shard_dim = getattr(info, "shard_mesh_dim", mesh.ndim - 1)
    if shard_dim != mesh.ndim - 1:
        raise NotImplementedError(f"{where} sharded over mesh dim {shard_dim}: only the last dim shards")
    spmd_mesh = getattr(info, "spmd_mesh", None)
    same = layout.sharded and mesh_key(mesh) == layout_key(layout) and (spmd_mesh is None or spmd_mesh == whole_mesh)
    return result.placement, None if same else cast(MeshInfo, info)


def own_spmd_dims(api: str, fqn: str, info: object) -> SpmdDims:
    """Under `dp_mesh_dims`: the data-parallel dims of a parameter's own whole mesh (e.g. the
    sparse mesh of routed experts), from its mesh_info's `spmd_mesh` and `dp_mesh_dims`, as
    torch's `_get_mesh_info(mesh, dp_mesh_dims)` makes them. `ValueError` for a mesh_info
    without them."""
    spmd_mesh, dims = getattr(info, "spmd_mesh", None), getattr(info, "dp_mesh_dims", None)
    if spmd_mesh is None or dims is None:
        raise ValueError(
            f"{api}: with 'dp_mesh_dims', 'shard_placement_fn' must give '{fqn}' a mesh_info with 'spmd_mesh' and "
            f"'dp_mesh_dims' (torch's _get_mesh_info(mesh, dp_mesh_dims)), got {type(info).__name__}"
        )
    return resolve_dp_mesh_dims(api, spmd_mesh, dims)
