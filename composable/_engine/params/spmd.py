"""Full-SPMD meshes (`dp_mesh_dims`): the caller passes the whole dense mesh (e.g. dp x cp x
tp) and names its data-parallel dims; parameters already are DTensors on that mesh with
`Replicate()` on the data-parallel dims and their TP/CP/EP placements on the others.

The group shards each parameter's local tensor (what the non-data-parallel placements leave
on this rank) over the shard dim(s), flattened into one when several are named (dp_shard x cp),
and all-reduces gradients over the replicate dim(s) (HSDP, or DDP with no shard dim). The
sharded parameter is a DTensor on the same mesh with the shard placement on the shard dim
(`_StridedShard` where a later dim already shards that tensor dim, so the global order stays
right); several shard dims present one flattened dim, as PyTorch FSDP2 does. The unsharded
parameter keeps the original spec, so the module computes with DTensors on the whole mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..meshes.layout import DataParallelLayout, LayoutKind
from .param import DTensorSpecLite, ManagedParam, ParamLayout

try:  # the class torch's FSDP2 takes (torch >= 2.13): one object works with both libraries
    from torch.distributed.fsdp import DataParallelMeshDims as DataParallelMeshDims
except ImportError:  # older torch: the same dataclass, same meaning

    @dataclass
    class DataParallelMeshDims:  # type: ignore[no-redef]  # typed as torch's class; the stand-in for an older torch
        """Which dims of a full SPMD mesh are data parallel: `shard` (FSDP shards over them,
        several are flattened into one) and `replicate` (HSDP / DDP replicate over them)."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self) -> None:
            if self.shard is None and self.replicate is None:
                raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

        @property
        def shard_names(self) -> tuple[str, ...]:
            return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            if self.replicate is None:
                return ()
            return (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate)


@dataclass(frozen=True)
class SpmdDims:
    """`dp_mesh_dims` resolved against the whole mesh, once per call."""

    mesh: DeviceMesh  # the whole SPMD mesh the parameters live on
    shard_names: tuple[str, ...]
    replicate_names: tuple[str, ...]
    shard_mesh: DeviceMesh | None  # 1D: the shard dims (flattened when several)
    replicate_mesh: DeviceMesh | None  # 1D: the replicate dims (flattened when several)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return dim_names(self.mesh)

    @property
    def shard_indices(self) -> list[int]:
        return [self.dim_names.index(n) for n in self.shard_names]

    @property
    def dp_indices(self) -> frozenset[int]:
        names = self.dim_names
        return frozenset(names.index(n) for n in self.shard_names + self.replicate_names)

    def layout(self) -> DataParallelLayout:
        """The group's process groups: reduce-scatter over the shard mesh, all-reduce over
        the replicate mesh."""
        replicate_groups = () if self.replicate_mesh is None else (self.replicate_mesh.get_group(0),)
        if self.shard_mesh is None:
            assert self.replicate_mesh is not None  # `dp_mesh_dims` names a shard dim, a replicate dim or both
            kind, shard_group, world, rank, layout_mesh = LayoutKind.REPLICATE, None, 1, 0, self.replicate_mesh
        else:
            shard_group = self.shard_mesh.get_group(0)
            kind = LayoutKind.HSDP if replicate_groups else LayoutKind.SHARD
            world, rank, layout_mesh = dist.get_world_size(shard_group), dist.get_rank(shard_group), self.shard_mesh
        dp_world = world * math.prod(dist.get_world_size(g) for g in replicate_groups)
        return DataParallelLayout(layout_mesh, kind, shard_group, replicate_groups, world, rank, dp_world)


def dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The dim names of a mesh `dp_mesh_dims` resolved against (`resolve_dp_mesh_dims` checks
    it has them), or of one of its named sub-meshes."""
    return cast("tuple[str, ...]", mesh.mesh_dim_names)


def _names(api: str, field: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{api}: 'dp_mesh_dims.{field}' must be a mesh dim name or a tuple of them, got {value!r}")
    return tuple(names)


def resolve_dp_mesh_dims(api: str, mesh: DeviceMesh, dims: object, *, allow_shard: bool = True) -> SpmdDims:
    """Check `dims` against `mesh` and make the flattened shard / replicate meshes.

    Raises `TypeError` for a `dims` that is not a DataParallelMeshDims, `ValueError` for an
    unnamed mesh, an unknown, repeated or overlapping dim name, or no data-parallel dim; with
    `allow_shard=False` (replicate) a shard dim is a `ValueError` too. Collective the first
    time a set of dims is flattened (a process group is made)."""
    if not hasattr(dims, "shard") or not hasattr(dims, "replicate"):
        raise TypeError(
            f"{api}: 'dp_mesh_dims' must be a DataParallelMeshDims(shard=..., replicate=...), got {dims!r:.80}"
        )
    shard = _names(api, "shard", dims.shard)
    replicate = _names(api, "replicate", dims.replicate)
    if not shard and not replicate:
        raise ValueError(f"{api}: 'dp_mesh_dims' names no dim: set shard=, replicate= or both, got {dims!r}")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"{api}: 'dp_mesh_dims' needs a mesh with named dims (init_device_mesh(..., mesh_dim_names=...)), "
            f"got a mesh of shape {tuple(mesh.shape)} without names"
        )
    for name in shard + replicate:
        if name not in names:
            raise ValueError(f"{api}: 'dp_mesh_dims' names the dim {name!r}, which 'mesh' does not have: {names}")
    for field, group in (("shard", shard), ("replicate", replicate)):
        if len(set(group)) != len(group):
            raise ValueError(f"{api}: 'dp_mesh_dims.{field}' names a dim twice: {group}")
        order = [names.index(n) for n in group]
        if order != sorted(order):
            raise ValueError(f"{api}: 'dp_mesh_dims.{field}' must name dims in the mesh's order {names}, got {group}")
    both = sorted(set(shard) & set(replicate))
    if both:
        raise ValueError(f"{api}: 'dp_mesh_dims' names {both} as both shard and replicate dims")
    if shard and not allow_shard:
        raise ValueError(
            f"{api}: 'dp_mesh_dims' may only name replicate dims (replicate does not shard), got shard={dims.shard!r}"
        )
    return SpmdDims(mesh, shard, replicate, _flat(mesh, shard), _flat(mesh, replicate))


def _flat(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh | None:
    """The 1D mesh over `names`: the dim itself, or the dims flattened (PyTorch FSDP2's name)."""
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def check_spmd_param(api: str, fqn: str, param: torch.Tensor, spmd: SpmdDims) -> DTensor:
    """`ValueError` unless `param` is a DTensor on the whole mesh with `Replicate()` on every
    data-parallel dim."""
    if not isinstance(param, DTensor):
        raise ValueError(
            f"{api}: with 'dp_mesh_dims' every parameter must be a DTensor on the whole mesh (e.g. "
            f"distribute_tensor / distribute_module), got a plain tensor for '{fqn}'"
        )
    if param.device_mesh != spmd.mesh:
        raise ValueError(
            f"{api}: parameter '{fqn}' is a DTensor on the mesh {param.device_mesh}, not on 'mesh' {spmd.mesh} "
            "(with 'dp_mesh_dims' parameters live on the whole mesh passed)"
        )
    names = spmd.dim_names
    for i in sorted(spmd.dp_indices):
        if not isinstance(param.placements[i], Replicate):
            raise ValueError(
                f"{api}: parameter '{fqn}' must be Replicate() on the data-parallel dim {names[i]!r}, "
                f"got {param.placements[i]!r} (placements {tuple(param.placements)})"
            )
    return param


def sharded_placements(param: DTensor, spmd: SpmdDims, dim: int) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """Mesh and placements of the sharded parameter: the original placements with the shard
    placement on the shard dim (`_StridedShard(dim, sf)` when later dims shard tensor dim
    `dim` sf ways between them); several shard dims are shown as one flattened dim, a
    0-d parameter stays replicated."""
    mesh, orig = spmd.mesh, tuple(param.placements)
    if spmd.shard_mesh is None or param.dim() == 0:
        return mesh, orig
    placements = list(orig)
    for idx in spmd.shard_indices:
        split = math.prod(
            mesh.size(j)
            for j, pl in enumerate(orig)
            if j > idx and isinstance(pl, (Shard, _StridedShard)) and pl.dim == dim
        )
        placements[idx] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    if len(spmd.shard_names) == 1:
        return mesh, tuple(placements)
    # dp_shard x cp: one flattened dim where the first shard dim was, the other dims as they are.
    first = spmd.shard_indices[0]
    meshes, shown = [], []
    for i, name in enumerate(spmd.dim_names):
        if i == first:
            meshes.append(spmd.shard_mesh)
            shown.append(placements[i])
        elif name not in spmd.shard_names:
            meshes.append(mesh[name])
            shown.append(placements[i])
    return concatenate(meshes), tuple(shown)


def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are the given 1D sub-meshes of one root mesh, in order."""
    concat = getattr(DeviceMesh, "_concatenate", None)
    if concat is not None:
        return cast(DeviceMesh, concat(meshes))  # torch's private classmethod, found by name
    root = meshes[0]._get_root_mesh()  # older torch: slice the root by (flattened) dim names
    return root[tuple(dim_names(m)[0] for m in meshes)]


def grad_to_local(grad: torch.Tensor, unsharded: DTensorSpecLite | None, dp_indices: frozenset[int]) -> torch.Tensor:
    """The unsharded gradient as a local tensor the group reduces: pending reductions over the
    non-data-parallel dims (TP's Partial) are completed, those over the data-parallel dims are
    left to the group's reduce-scatter / all-reduce (no redundant all-reduce)."""
    if not isinstance(grad, DTensor):
        return grad
    assert unsharded is not None  # a DTensor gradient is a tensor-parallel parameter's, which has its spec
    want = unsharded.placements
    target = tuple(grad.placements[i] if i in dp_indices else want[i] for i in range(len(want)))
    if target != tuple(grad.placements):
        grad = grad.redistribute(unsharded.mesh, target)
    return grad.to_local()


def make_spmd_param(
    fqn: str, slots: list[tuple[nn.Module, str]], param: DTensor, layout: DataParallelLayout, spmd: SpmdDims, dim: int
) -> ManagedParam:
    """Layout and specs of one parameter on the whole mesh: its local tensor is split on `dim`
    over the shard world; the unsharded parameter keeps the original spec."""
    replicated = not layout.sharded or param.dim() == 0
    param_layout = ParamLayout.make(param._local_tensor.shape, layout.shard_world, layout.shard_rank, replicated, dim)
    mesh, placements = sharded_placements(param, spmd, dim) if not replicated else (spmd.mesh, tuple(param.placements))
    unsharded = DTensorSpecLite(param.device_mesh, tuple(param.placements), param.shape)
    managed = ManagedParam(
        fqn, slots, param_layout, param.requires_grad, spec=DTensorSpecLite(mesh, placements, param.shape), tp=unsharded
    )
    managed.dp_dims = spmd.dp_indices
    return managed
