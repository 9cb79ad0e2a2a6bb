"""The data-parallel layout of one parameter group: which mesh dims shard and which replicate.

One object decides it once, at the API call, instead of booleans spread over the engine:
- SHARD   1D mesh, placements `Shard(0)`: all-gather to unshard, reduce-scatter gradients;
- HSDP    2D mesh, `(Replicate(), Shard(0))`: as SHARD over dim 1, then all-reduce over dim 0;
- REPLICATE any mesh, `Replicate()` on every dim (NO_SHARD, `replicate`): no all-gather,
          gradients all-reduced over every dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

_POST_FORWARD_GROUPS: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup, int]] = {}


def _shard_fibers(mesh: DeviceMesh) -> list[list[int]]:
    """The global ranks of every shard-dim fiber of `mesh`'s root mesh (the same list on every
    rank): its last dim's fibers for a root mesh, the fibers of the named dim for a sub-mesh
    such as mesh["dp"] of a (dp, tp) mesh."""
    root = mesh._get_root_mesh()
    if root is mesh or root.mesh_dim_names is None or mesh.mesh_dim_names is None:
        if root is not mesh:
            raise NotImplementedError(
                "fully_shard: an int 'reshard_after_forward' on a sub-mesh needs named mesh dims (init_device_mesh(..., mesh_dim_names=...))"
            )
        tensor, dim = mesh.mesh, mesh.ndim - 1
    else:
        tensor, dim = root.mesh, list(root.mesh_dim_names).index(mesh.mesh_dim_names[-1])
    return tensor.movedim(dim, -1).reshape(-1, tensor.shape[dim]).tolist()


class LayoutKind(Enum):
    SHARD = "shard"
    HSDP = "hsdp"
    REPLICATE = "replicate"


@dataclass(frozen=True)
class DataParallelLayout:
    """Mesh, process groups, worlds and ranks of one group's data parallelism."""

    mesh: DeviceMesh
    kind: LayoutKind
    shard_group: dist.ProcessGroup | None  # None: nothing is sharded
    replicate_groups: tuple[dist.ProcessGroup, ...]  # all-reduced over (after any reduce-scatter)
    shard_world: int  # ranks one parameter is split over (1: replicated)
    shard_rank: int
    dp_world: int  # ranks gradients are averaged over

    @staticmethod
    def make(mesh: DeviceMesh, sharded: bool) -> "DataParallelLayout":
        """The layout of a group on `mesh`: sharded over its last dim (and replicated over the
        first of a 2D mesh) when `sharded`, replicated over every dim otherwise.
        `DeviceMesh.get_group` costs microseconds per call, so the groups are looked up here once."""
        if sharded:
            shard_group = mesh.get_group(mesh.ndim - 1)
            replicate_groups: tuple[dist.ProcessGroup, ...] = (mesh.get_group(0),) if mesh.ndim == 2 else ()
            kind = LayoutKind.HSDP if mesh.ndim == 2 else LayoutKind.SHARD
            shard_world, shard_rank = dist.get_world_size(shard_group), dist.get_rank(shard_group)
        else:
            shard_group, kind, shard_world, shard_rank = None, LayoutKind.REPLICATE, 1, 0
            replicate_groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
        dp_world = shard_world * math.prod(dist.get_world_size(pg) for pg in replicate_groups)
        return DataParallelLayout(mesh, kind, shard_group, replicate_groups, shard_world, shard_rank, dp_world)

    @property
    def sharded(self) -> bool:
        return self.kind is not LayoutKind.REPLICATE

    def placements(self, replicated: bool, dim: int = 0) -> tuple[Placement, ...]:
        """DTensor placements of a sharded parameter (sharded on `dim`); `replicated` for one
        that cannot be split (0-d) even in a sharded layout."""
        inner: Placement = Replicate() if replicated or not self.sharded else Shard(dim)
        if self.mesh.ndim == 1:
            return (inner,)
        return (Replicate(), inner)

    def post_forward_group(self, size: int) -> tuple[dist.ProcessGroup, int]:
        """(group, rank in it) of this rank's `size` consecutive ranks of the shard dim: where
        backward all-gathers when `reshard_after_forward=size`. Made once per shard group and
        size, and reused by every parameter group on it. Creating process groups is
        collective, so every rank creates every such group of the whole (root) mesh, in the
        same order, whichever part of it its own mesh is."""
        assert self.shard_group is not None, "only a sharded layout reshards to a group size"
        key = (id(self.shard_group), size)
        found = _POST_FORWARD_GROUPS.get(key)
        if found is None:
            me, made = dist.get_rank(), None
            for ranks in _shard_fibers(self.mesh):
                for start in range(0, len(ranks), size):
                    chunk = ranks[start : start + size]
                    group = dist.new_group(chunk)
                    if me in chunk:
                        made = (group, chunk.index(me))
            assert made is not None, "this rank is in no shard fiber of its own mesh"
            # The shard group is kept alive with them, so its id cannot name another group later.
            found = _POST_FORWARD_GROUPS[key] = (self.shard_group, *made)
        return found[1], found[2]

    # Process groups and meshes are handles to shared runtime objects: a deep copy of the
    # model (`copy.deepcopy`) shares the layout instead of copying them.
    def __deepcopy__(self, memo: dict[int, Any]) -> "DataParallelLayout":
        return self
