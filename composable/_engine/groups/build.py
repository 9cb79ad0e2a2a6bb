"""The one construction path both data-parallel front ends call: claim the parameters, move
the module to the compute device, lay the parameters out over the mesh and make the groups
that own them (one per mesh)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..meshes.layout import DataParallelLayout
from ..meshes.mesh import compute_device
from ..optimizer.optim_state import install_step_hook
from ..params.annotated import Annotation, is_annotated, to_storage
from ..params.claim import check_same_device, claim_parameters, mark_managed, mark_replaced
from ..params.param import DTensorSpecLite, ManagedParam, ParamLayout
from ..params.placement_result import MeshInfo, layout_key, own_spmd_dims, placement_of
from ..params.spmd import SpmdDims, check_spmd_param, make_spmd_param
from ..unshard.extension import has_extension
from ..unshard.mixed_dtypes import check_mixed_group, resolve_param_dtypes
from ..whole_model.late_params import watch_subtree
from ..whole_model.replicas import check_same_model, sync_replicas
from .group import GroupConfig, ParamGroup

# One parameter of a group being made: (fqn, its slots, the parameter, its sharded dim).
Member = tuple[str, list[tuple[nn.Module, str]], nn.Parameter, int]


@dataclass(frozen=True)
class GroupOptions:
    """What a front end decides for its group at the call."""

    sharded: bool  # Shard(0) over the mesh's last dim; False: Replicate() everywhere
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    offload: bool = False
    pin_memory: bool = False
    compute_shard_on_device: bool = False  # offload: a compute-dtype copy of the shard stays on the device
    bucket_cap_bytes: int | None = None  # bucketed all-reduce during backward (replicate)
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None  # fully_shard: Shard(d) per parameter
    sync_replicas: bool = False  # broadcast rank 0's values at the call (replicate); every API checks shapes
    spmd: SpmdDims | None = None  # dp_mesh_dims: `mesh` is the whole mesh, parameters DTensors on it (spmd.py)
    # MixedPrecisionPolicy.param_dtype_for: (fqn, original param) -> its compute dtype (None: own)
    param_dtype_for: Callable[[str, nn.Parameter], torch.dtype | None] | None = None


def build_groups(
    api: str,
    module: nn.Module | Sequence[nn.Module],
    mesh: DeviceMesh,
    ignored: set[nn.Parameter],
    options: GroupOptions,
) -> list[ParamGroup]:
    """Manage the parameters of `module`'s subtree that no API applied to a descendant manages
    (minus `ignored`): register their sharded DTensors in every slot and return their groups,
    none when there is nothing to manage. Buffers move to the compute device. Raises
    `RuntimeError` for forbidden compositions and `ValueError` for parameters on several devices.

    A sequence of modules makes one group of the parameters of all their subtrees (a weight
    tied between two of them is one parameter with a slot in each); its FQNs are those the
    parameters would have in an `nn.ModuleList` of the modules: `"0.weight"`, `"1.bias"`.

    Parameters that `options.shard_placement_fn` puts on other meshes (`ShardPlacementResult`)
    make one group per mesh, in order of first use (as FSDP2 keeps one `FSDPParamGroup` per
    mesh); the state drives each in that order."""
    if not isinstance(module, nn.Module):
        module = ListedModules(module)
    claimed = claim_parameters(module, ignored, api)
    originals = [p for _, _, p in claimed]
    check_same_device(api, originals)
    device = compute_device(mesh)
    move_buffers(module, device)
    sources = [_local_on_device(p, device) for p in originals]
    described = [(fqn, src, p.requires_grad) for (fqn, _, p), src in zip(claimed, sources)]
    if options.sync_replicas:
        sync_group = mesh.get_group(0) if options.spmd is None else options.spmd.layout().replicate_groups[0]
        sync_replicas(api, module, described, sync_group, device)
    elif claimed and dist.is_initialized():
        # Ranks that built different models would run collectives of different sizes.
        check_same_model(api, module, described, [mesh.get_group(d) for d in range(mesh.ndim)], device)
    watch_subtree(module, api)
    if not claimed:
        return []
    layout = DataParallelLayout.make(mesh, options.sharded) if options.spmd is None else options.spmd.layout()
    # One group per mesh (shard_placement_fn's ShardPlacementResults), in order of first use, as FSDP2.
    parts: dict[tuple[object, ...], tuple[DataParallelLayout, SpmdDims | None, list[Member]]] = {}
    whole = mesh if options.spmd is None else options.spmd.mesh
    spmd_of: dict[int, SpmdDims] = {}
    by_param = {id(p): src for p, src in zip(originals, sources)}
    notes: dict[int, Annotation] = {}  # spmd_types-annotated parameters, by their storage DTensor
    key: tuple[object, ...]  # ("module",), or the mesh's and its layout's
    for fqn, slots, p in claimed:
        info, dim = _placement(api, fqn, p, layout, whole, options)
        if info is None:
            key, part = ("module",), (layout, options.spmd)
        else:
            if options.spmd is not None and id(info) not in spmd_of:  # once per mesh_info: flattening makes groups
                spmd_of[id(info)] = own_spmd_dims(api, fqn, info)
            spmd = spmd_of.get(id(info))
            own_layout = DataParallelLayout.make(info.mesh, sharded=True) if spmd is None else spmd.layout()
            key, part = (id(whole if spmd is None else spmd.mesh), layout_key(own_layout)), (own_layout, spmd)
        if key not in parts:
            parts[key] = (*part, [])
        if is_annotated(p):  # translated to a DTensor on the storage mesh, as FSDP2 does
            stored, notes_of = to_storage(api, fqn, p, parts[key][1])
            by_param[id(stored)], notes[id(stored)], p = by_param[id(p)], notes_of, stored
        parts[key][2].append((fqn, slots, p, dim))
    for _, spmd, members in parts.values():
        if spmd is not None:
            for fqn, _, p, _ in members:
                check_spmd_param(api, fqn, p, spmd)
    groups = [
        _make_group(api, lay, spmd, members, by_param, notes, device, options) for lay, spmd, members in parts.values()
    ]
    mark_replaced(originals, api)
    install_step_hook()  # refuses optimizers built before this call, holding `originals`
    mark_managed([mp.sharded for g in groups for mp in g.params], api)
    return groups


def _make_group(
    api: str,
    layout: DataParallelLayout,
    spmd: SpmdDims | None,
    members: list[Member],
    sources: dict[int, torch.Tensor],
    notes: dict[int, Annotation],
    device: torch.device,
    options: GroupOptions,
) -> ParamGroup:
    """The group of the parameters on one mesh: their DTensor specs and sharded storage."""
    claimed = [(fqn, slots, p) for fqn, slots, p, _ in members]
    param_dtype, param_dtypes = resolve_param_dtypes(claimed, options.param_dtype, options.param_dtype_for)
    config = GroupConfig(
        layout=layout,
        device=device,
        param_dtype=param_dtype,
        param_dtypes=param_dtypes,
        reduce_dtype=options.reduce_dtype,
        offload=options.offload,
        pin_memory=options.pin_memory,
        compute_shard_on_device=options.offload and options.compute_shard_on_device,
        bucket_cap_bytes=options.bucket_cap_bytes,
        api=api,
    )
    params = [
        make_managed_param(fqn, slots, p, layout, dim, api)
        if spmd is None
        else make_spmd_param(fqn, slots, cast(DTensor, p), layout, spmd, dim)  # check_spmd_param checked it
        for fqn, slots, p, dim in members
    ]
    for mp, (_, _, p, _) in zip(params, members):
        mp.annotation = notes.get(id(p))
        mp.extension = has_extension(p)
        if mp.extension:
            _check_extension(api, mp, layout, options)
    check_mixed_group(api, param_dtypes, layout.sharded, any(mp.extension for mp in params))
    group = ParamGroup(params, [sources[id(p)] for _, _, p, _ in members], config)
    for mp in params:
        mp.register(mp.sharded)
    return group


class ListedModules(nn.Module):
    """A stand-in parent of the modules of one group (`fully_shard([m1, m2])`), made only to
    claim, check and watch their subtrees as one tree: the modules are put into `_modules`
    directly (no registration hooks run, nothing about them changes) and nothing keeps it."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self._modules.update((str(i), m) for i, m in enumerate(modules))


def _check_extension(api: str, mp: ManagedParam, layout: DataParallelLayout, options: GroupOptions) -> None:
    """What the all-gather extension is supported with (`NotImplementedError` naming the rest)."""
    why = (
        "a sharded layout (not NO_SHARD, nor 'dp_mesh_dims' with replicate dims alone)" if not layout.sharded
        else "no CPU offload" if options.offload
        else "sharding on dim 0" if mp.layout.dim != 0
        else f"dim 0 divisible by the shard world size {layout.shard_world}" if mp.layout.rows % layout.shard_world
        else None
    )  # fmt: skip
    if why is not None:
        raise NotImplementedError(f"{api}: parameter '{mp.fqn}' implements the all-gather extension, which needs {why}")


def _placement(
    api: str, fqn: str, param: nn.Parameter, layout: DataParallelLayout, whole: DeviceMesh, options: GroupOptions
) -> tuple[MeshInfo | None, int]:
    """(the mesh_info of the parameter's own mesh, or None for the module's; the dim it is
    sharded on) as `options.shard_placement_fn` asks (None: Shard(0) on the module's mesh)."""
    fn = options.shard_placement_fn
    if fn is None or not layout.sharded:
        return None, 0
    placement, own = placement_of(api, fqn, fn(param), layout, whole)
    if placement is None or param.dim() == 0:
        return own, 0
    if not isinstance(placement, Shard) or type(placement) is not Shard:
        raise TypeError(f"{api}: 'shard_placement_fn' must return a Shard or None, got {placement!r} for '{fqn}'")
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        raise ValueError(
            f"{api}: 'shard_placement_fn' returned {placement!r} for '{fqn}' of shape {tuple(param.shape)}: no such dim"
        )
    return own, dim


def make_managed_param(
    fqn: str,
    slots: list[tuple[nn.Module, str]],
    param: torch.Tensor,
    layout: DataParallelLayout,
    dim: int = 0,
    api: str = "fully_shard",
) -> ManagedParam:
    """Layout and DTensor specs of one parameter. A tensor-parallel DTensor parameter on a
    mesh `tp` is sharded (its TP-local tensor, on `dim`) over the data-parallel mesh's shard
    dim and replicated over its replicate dim; the sharded parameter lives on the parent mesh
    of the two (dp dims, then tp dims), the unsharded one stays a TP DTensor."""
    world, rank = layout.shard_world, layout.shard_rank
    if not isinstance(param, DTensor):
        param_layout = ParamLayout.make(param.shape, world, rank, replicated=not layout.sharded, dim=dim)
        spec = DTensorSpecLite(layout.mesh, layout.placements(param_layout.replicated, param_layout.dim), param.shape)
        return ManagedParam(fqn, slots, param_layout, param.requires_grad, spec=spec)
    spmd_mesh, placements = tp_parent_placements(fqn, param, layout, dim, api)
    replicated = param.dim() == 0 or not layout.sharded
    param_layout = ParamLayout.make(param._local_tensor.shape, world, rank, replicated=replicated, dim=dim)
    tp = DTensorSpecLite(param.device_mesh, tuple(param.placements), param.shape)
    return ManagedParam(
        fqn, slots, param_layout, param.requires_grad, spec=DTensorSpecLite(spmd_mesh, placements, param.shape), tp=tp
    )


def tp_parent_placements(
    fqn: str, param: DTensor, layout: DataParallelLayout, dim: int = 0, api: str = "fully_shard"
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The parent mesh of the data-parallel mesh and the TP mesh of `param` ((dp, tp), HSDP's
    (replicate, shard, tp), (dp, cp, tp) ...) and the sharded parameter's placements on it, as
    FSDP2 makes them: `Replicate()` on a replicate dim (every dp dim when nothing is sharded),
    the dp shard of the TP-local tensor (on `dim`) on the shard dim, the TP placements on the
    tp dims."""
    dp_mesh, tp_mesh = layout.mesh, param.device_mesh
    # Tensor dim `dim` already split over tp: the dp shard nests inside those pieces, and a
    # strided shard keeps the global order (split by the TP shards' count, as FSDP2's).
    split = math.prod(
        tp_mesh.size(i)
        for i, pl in enumerate(param.placements)
        if isinstance(pl, (Shard, _StridedShard)) and pl.dim == dim
    )
    shard: Placement = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    if param.dim() == 0 or not layout.sharded:
        shard = Replicate()
    # `DataParallelLayout.make`: a sharded layout shards over the last dp dim, replicates over the others.
    replicate = dp_mesh.ndim if not layout.sharded else dp_mesh.ndim - 1
    joined = (Replicate(),) * replicate + ((shard,) if layout.sharded else ()) + tuple(param.placements)
    mesh, order = _parent_mesh(api, fqn, dp_mesh, tp_mesh)
    return mesh, tuple(joined[i] for i in order)


def _parent_mesh(api: str, fqn: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> tuple[DeviceMesh, list[int]]:
    """The mesh whose dims are those of `dp_mesh` and `tp_mesh`, and for each of its dims the
    index of that dim in the dp dims followed by the tp dims. The named dims of their common
    root mesh, in the root's order, where both were sliced from one; else their concatenation."""
    names = (dp_mesh.mesh_dim_names or ()) + (tp_mesh.mesh_dim_names or ())
    root = dp_mesh._get_root_mesh()
    root_names = list(root.mesh_dim_names or ())
    if (
        tp_mesh._get_root_mesh() == root
        and len(names) == dp_mesh.ndim + tp_mesh.ndim
        and len(set(names)) == len(names)
        and all(n in root_names for n in names)
    ):
        order = sorted(range(len(names)), key=lambda i: root_names.index(names[i]))
        ordered = tuple(names[i] for i in order)
        return (root if list(ordered) == root_names else root[ordered]), order
    # Two meshes cut separately from one world mesh (torchtitan's ParallelDims unflattens dp
    # and tp apart): their concatenation, the mesh FSDP2 puts such parameters on too.
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except Exception as error:
        raise ValueError(
            f"{api}: 'mesh' and the tensor-parallel mesh of '{fqn}' must be dims of one mesh, "
            f"e.g. mesh['dp'] and mesh['tp'] ({error})"
        ) from None
    return mesh, list(range(dp_mesh.ndim + tp_mesh.ndim))


def _local_on_device(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(param, DTensor):
        param = param._local_tensor
    return param if param.device.type == "meta" else param.detach().to(device)


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers are never sharded: they just move to the compute device (meta ones stay)."""
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device.type != "meta" and buf.device != device:
                sub._buffers[name] = buf.to(device)
