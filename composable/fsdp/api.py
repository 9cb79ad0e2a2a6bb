"""`fully_shard`: FSDP-style per-parameter sharding installed by hooks."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .._claim import check_same_device, claim_parameters, mark_replaced
from .._contract import attach_state_accessor, check_composable, check_module, install_state, owning_api
from .._mesh import check_mesh, compute_device, default_mesh
from ..mixed_precision import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, check_policies
from ._param import DTensorSpecLite, ManagedParam, ParamLayout, shard_placements
from ._param_group import GroupConfig, ParamGroup
from ._state import FSDPState
from .strategy import ShardingStrategy, resolve_strategy

Policy = set[type[nn.Module]] | Callable[[nn.Module], bool]


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    strategy: ShardingStrategy | None = None,
    policy: Policy | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard `module`'s parameters across `mesh` (FSDP) and return `module` itself.

    Manages the parameters of the subtree that no API applied earlier to a descendant
    manages (minus `ignored_params`): each becomes an `nn.Parameter(DTensor)` with placement
    `Shard(0)` on a 1D mesh, `(Replicate(), Shard(0))` on a 2D mesh (HSDP), `Replicate()` for
    NO_SHARD and 0-d parameters. Forward all-gathers them (one collective per call) and frees
    them after if `reshard_after_forward`; backward gathers again if needed and
    reduce-scatters gradients (averaged over data-parallel ranks) into sharded DTensor `.grad`s.

    `policy` first applies `fully_shard` with the same options to every matching submodule,
    bottom-up. `reshard_after_forward=None` follows `strategy`; the root module keeps its
    parameters after forward since backward needs them at once. Raises `TypeError`/
    `ValueError` for bad arguments and `RuntimeError` for forbidden compositions.
    """
    api = "fully_shard"
    check_module(api, module)
    check_policies(api, mp_policy, offload_policy)
    check_composable(api, module)
    if mesh is None:
        mesh = default_mesh(api, module)
    check_mesh(api, mesh, (1, 2))
    strategy, reshard, reshard_is_default = resolve_strategy(mesh.ndim, strategy, reshard_after_forward)
    ignored = _check_ignored(ignored_params)
    if policy is not None:
        _auto_wrap(module, _check_policy(policy), mesh=mesh, reshard_after_forward=reshard_after_forward, strategy=strategy,
                   mp_policy=mp_policy, offload_policy=offload_policy, ignored_params=ignored)

    claimed = claim_parameters(module, ignored, api)
    originals = [p for _, _, p in claimed]
    check_same_device(api, originals)
    device = compute_device(mesh)
    _move_buffers(module, device)
    sharded = strategy is not ShardingStrategy.NO_SHARD
    config = GroupConfig(
        mesh=mesh, device=device, sharded=sharded, hsdp=sharded and mesh.ndim == 2,
        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
        offload=isinstance(offload_policy, CPUOffloadPolicy),
        pin_memory=getattr(offload_policy, "pin_memory", False),
    )
    group = None
    if claimed:
        shard_world, shard_rank = (mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)) if sharded else (1, 0)
        params = [make_managed_param(fqn, slots, p, mesh, sharded, shard_world, shard_rank) for fqn, slots, p in claimed]
        group = ParamGroup(params, [_on_device(p, device) for p in originals], config)
        for mp in params:
            mp.register(mp.sharded_param)
        mark_replaced(originals, "fully_shard")
    state = FSDPState(module, group, mesh=mesh, strategy=strategy, mp_policy=mp_policy, offload_policy=offload_policy,
                      reshard_after_forward=reshard, reshard_is_default=reshard_is_default)
    install_state(module, api, state)
    return module


def make_managed_param(fqn: str, slots: list, param: torch.Tensor, mesh: DeviceMesh, sharded: bool, shard_world: int, shard_rank: int) -> ManagedParam:
    """Layout and DTensor specs of one parameter. A tensor-parallel DTensor parameter on a
    mesh `tp` is sharded (its TP-local tensor, on dim 0) over `mesh`; the sharded parameter
    lives on the 2D parent mesh of the two, the unsharded one stays a TP DTensor."""
    if not isinstance(param, DTensor):
        layout = ParamLayout.make(param.shape, shard_world, shard_rank, replicated=not sharded)
        placements = shard_placements(mesh.ndim, layout.replicated, hsdp=sharded and mesh.ndim == 2)
        return ManagedParam(fqn, slots, layout, param.requires_grad, spec=DTensorSpecLite(mesh, placements, param.shape))
    spmd_mesh, placements = tp_parent_placements(fqn, param, mesh, sharded)
    layout = ParamLayout.make(param._local_tensor.shape, shard_world, shard_rank, replicated=param.dim() == 0)
    tp = DTensorSpecLite(param.device_mesh, tuple(param.placements), param.shape)
    return ManagedParam(fqn, slots, layout, param.requires_grad, spec=DTensorSpecLite(spmd_mesh, placements, param.shape), tp=tp)


def tp_parent_placements(fqn: str, param: DTensor, dp_mesh: DeviceMesh, sharded: bool) -> tuple[DeviceMesh, tuple]:
    """The 2D (dp, tp) parent mesh and the sharded parameter's placements on it."""
    tp_mesh = param.device_mesh
    if dp_mesh.ndim != 1 or tp_mesh.ndim != 1 or not sharded:
        raise NotImplementedError(
            f"fully_shard: tensor-parallel parameter '{fqn}' needs a 1D sharded data-parallel mesh and a 1D TP mesh "
            f"(got dp {dp_mesh.ndim}D, tp {tp_mesh.ndim}D, sharded={sharded})"
        )
    root = dp_mesh._get_root_mesh()
    if tp_mesh._get_root_mesh() != root or root.ndim != 2 or root.mesh_dim_names is None:
        raise ValueError(f"fully_shard: 'mesh' and the tensor-parallel mesh of '{fqn}' must be the two dims of one named 2D mesh, e.g. mesh['dp'] and mesh['tp']")
    names = list(root.mesh_dim_names)
    dp_dim, tp_dim = names.index(dp_mesh.mesh_dim_names[0]), names.index(tp_mesh.mesh_dim_names[0])
    tp_placement = param.placements[0]
    # Shard(0) over tp nests inside the dp shards: a strided shard keeps the global order.
    dp_placement = _StridedShard(0, split_factor=tp_mesh.size()) if tp_placement == Shard(0) else Shard(0)
    if param.dim() == 0:
        dp_placement = Replicate()
    placements = [None, None]
    placements[dp_dim], placements[tp_dim] = dp_placement, tp_placement
    return root, tuple(placements)


def _on_device(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(param, DTensor):
        param = param._local_tensor
    return param if param.device.type == "meta" else param.detach().to(device)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device.type != "meta" and buf.device != device:
                sub._buffers[name] = buf.to(device)


def _check_ignored(ignored_params: object) -> set[nn.Parameter]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset)) or not all(isinstance(p, torch.Tensor) for p in ignored_params):
        raise TypeError(f"fully_shard: 'ignored_params' must be a set of nn.Parameter or None, got {ignored_params!r:.80}")
    return set(ignored_params)


def _check_policy(policy: object) -> Callable[[nn.Module], bool]:
    if isinstance(policy, (set, frozenset)):
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"fully_shard: 'policy' set must hold nn.Module classes, got {bad!r}")
        classes = tuple(policy)
        return lambda m: isinstance(m, classes)
    if callable(policy) and not isinstance(policy, type):
        return policy  # type: ignore[return-value]
    raise TypeError(f"fully_shard: 'policy' must be a set of nn.Module classes or a callable(module) -> bool, got {policy!r:.80}")


def _auto_wrap(root: nn.Module, matches: Callable[[nn.Module], bool], **options: object) -> None:
    """Apply fully_shard to every matching proper submodule, children before parents."""
    # Subtrees an API already manages (applied earlier, e.g. `replicate` on a child) are
    # skipped whole: their parameters are taken.
    managed = {id(m) for owner in root.modules() if owner is not root and owning_api(owner) for m in owner.modules()}
    targets = [m for m in root.modules() if m is not root and id(m) not in managed and matches(m)]
    for sub in reversed(targets):  # pre-order reversed: descendants before ancestors
        if owning_api(sub) is None:
            fully_shard(sub, **options)  # type: ignore[arg-type]


attach_state_accessor(fully_shard, "fully_shard")
