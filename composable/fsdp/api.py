"""`fully_shard`: FSDP-style per-parameter sharding installed by hooks."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .._engine.dtypes.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    check_policies,
    param_dtype_resolver,
)
from .._engine.groups.build import GroupOptions, ListedModules, build_groups
from .._engine.hooks.contract import (
    answers_state,
    check_composable,
    check_module,
    install_state,
    owning_api,
    state_of,
)
from .._engine.meshes.mesh import check_mesh, default_mesh
from .._engine.params.spmd import DataParallelMeshDims
from ._state import FSDPState, make_post_forward_groups
from .strategy import ShardingStrategy, normalize_reshard, resolve_strategy, spmd_strategy

Policy = set[type[nn.Module]] | Callable[[nn.Module], bool]


def _state(module: nn.Module) -> FSDPState | None:
    """The state `fully_shard` installed on exactly `module`, or None (`TypeError` for a non-module)."""
    return state_of("fully_shard", module)


@answers_state(_state)
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    strategy: ShardingStrategy | None = None,
    policy: Policy | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard `module`'s parameters across `mesh` (FSDP) and return `module` itself.

    Manages the parameters of the subtree that no API applied earlier to a descendant
    manages (minus `ignored_params`): each becomes an `nn.Parameter(DTensor)` with placement
    `Shard(0)` on a 1D mesh, `(Replicate(), Shard(0))` on a 2D mesh (HSDP), `Replicate()` for
    NO_SHARD and 0-d parameters. Forward all-gathers them (one collective per call) and frees
    them after if `reshard_after_forward`; backward gathers again if needed and
    reduce-scatters gradients (averaged over data-parallel ranks) into sharded DTensor `.grad`s.
    Tensor-parallel parameters (DTensors on a TP mesh of the same root, e.g. `mesh["tp"]`)
    have their TP-local tensors sharded the same way; they live on the mesh of the dp dims then
    the tp dims, `(dp, tp)` or HSDP's `(replicate, shard, tp)`, with the TP placements last and
    `_StridedShard` where TP already splits the sharded dim, as in FSDP2.

    `policy` first applies `fully_shard` with the same options to every matching submodule,
    bottom-up. `reshard_after_forward=None` follows `strategy`; the root module keeps its
    parameters after forward since backward needs them at once. An int N (dividing the
    shard world, e.g. the GPUs of one node) keeps each rank's 1/N of the parameters between
    forward and backward, so backward all-gathers within groups of N ranks; 1 means False.
    `shard_placement_fn(param)` returns `Shard(d)` to shard that parameter on dim `d` (uneven
    sizes allowed) or None for `Shard(0)`. Raises `TypeError`/
    `ValueError` for bad arguments and `RuntimeError` for forbidden compositions.

    A list (or tuple) of modules, none inside another, makes one group of the parameters of
    all their subtrees (as FSDP2's `fully_shard([norm, output])`; a weight tied between them is
    one parameter): gathered before the first of them runs in a forward pass (whichever it
    is) and resharded after the last; a pass that runs only some of them ends with the
    root's forward. Backward reduces the group once, after every listed module that ran is
    done. The same state is installed on each (`fully_shard.state(m)`); its `param_names` are
    FQNs as in an `nn.ModuleList` of the modules (`"0.weight"`, `"1.weight"`); `policy`
    applies within each module's subtree. Such a group cannot be the root: a module
    containing them must have `fully_shard` (or `replicate`) too. Returns the list.

    `dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)` (as PyTorch FSDP2): `mesh`
    is the whole SPMD mesh (e.g. dp x cp x tp) and every parameter already is a DTensor on it,
    `Replicate()` on the named dims. Parameters are sharded over the `shard` dim(s) (several
    are flattened into one) and replicated over the `replicate` dim(s) (HSDP; DDP-style with
    no shard dim); they stay DTensors on that mesh, the shard placement composed with the
    others (`_StridedShard` where needed). `strategy` must be left out and an int
    `reshard_after_forward` is `NotImplementedError` there, as in FSDP2.
    """
    api = "fully_shard"
    modules = _check_modules(module)
    mp_policy, offload_policy = check_policies(api, mp_policy, offload_policy)
    for m in modules:
        check_composable(api, m)
    if mesh is None:
        mesh = default_mesh(api, modules[0] if len(modules) == 1 else ListedModules(modules))
    spmd = None
    reshard: bool | int  # an int: the group size backward gathers over
    if dp_mesh_dims is not None:
        spmd, strategy, reshard, reshard_is_default = spmd_strategy(
            api, mesh, dp_mesh_dims, strategy, reshard_after_forward
        )
    else:
        check_mesh(api, mesh, (1, 2))
        strategy, reshard, reshard_is_default = resolve_strategy(mesh.ndim, strategy, reshard_after_forward)
    if strategy is not ShardingStrategy.NO_SHARD and spmd is None:
        reshard = normalize_reshard(api, reshard, mesh.size(mesh.ndim - 1))
    ignored = _check_ignored(ignored_params)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"fully_shard: 'shard_placement_fn' must be a callable(param) -> Shard | None, got {shard_placement_fn!r:.80}"
        )
    if policy is not None:
        matches = _check_policy(policy)
        sub_strategy = None if spmd is not None else strategy
        for m in modules:
            _auto_wrap(
                m,
                matches,
                lambda sub: fully_shard(
                    sub,
                    mesh=mesh,
                    reshard_after_forward=reshard_after_forward,
                    strategy=sub_strategy,
                    mp_policy=mp_policy,
                    offload_policy=offload_policy,
                    ignored_params=ignored,
                    shard_placement_fn=shard_placement_fn,
                    dp_mesh_dims=dp_mesh_dims,
                ),
            )

    options = GroupOptions(
        sharded=strategy is not ShardingStrategy.NO_SHARD,
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
        offload=isinstance(offload_policy, CPUOffloadPolicy),
        pin_memory=getattr(offload_policy, "pin_memory", False),
        compute_shard_on_device=getattr(offload_policy, "compute_shard_on_device", False),
        shard_placement_fn=shard_placement_fn,
        spmd=spmd,
        param_dtype_for=param_dtype_resolver(api, mp_policy),
    )
    groups = build_groups(api, module if isinstance(module, nn.Module) else modules, mesh, ignored, options)
    make_post_forward_groups(api, reshard, groups)
    state = FSDPState(
        module if isinstance(module, nn.Module) else modules,
        groups,
        mesh=mesh,
        strategy=strategy,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard,
        reshard_is_default=reshard_is_default,
        dp_mesh_dims=dp_mesh_dims,
    )
    for m in modules:
        install_state(m, api, state)
    return module


def _check_modules(module: object) -> tuple[nn.Module, ...]:
    """The module, or the modules of a list/tuple: non-empty, all modules, each once, none
    inside another (`TypeError`/`ValueError` naming fully_shard, 'module' and the value)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        # Nothing calls a container's forward, so its hooks would never gather its parameters.
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: argument 'module' is a "
            f"{type(module).__name__}; shard each member, or pass list(container) to shard its members as one group"
        )
    if not isinstance(module, (list, tuple)):
        return (check_module("fully_shard", module),)
    if not module:
        raise ValueError(
            f"fully_shard: argument 'module' must be an nn.Module or a non-empty list of them, got {module!r}"
        )
    for i, m in enumerate(module):
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard: argument 'module' must be an nn.Module or a list of nn.Modules, got a "
                f"{type(module).__name__} holding {type(m).__name__} at index {i}: {m!r:.80}"
            )
    positions = {id(m): i for i, m in reversed(list(enumerate(module)))}  # first index of each
    for i, m in enumerate(module):
        if positions[id(m)] != i:
            raise ValueError(
                f"fully_shard: argument 'module' lists the same {type(m).__name__} twice (indices {positions[id(m)]} "
                f"and {i}); list each module once"
            )
    for i, m in enumerate(module):
        for sub in m.modules():
            j = positions.get(id(sub), i)
            if j != i:
                raise ValueError(
                    f"fully_shard: argument 'module' lists {type(sub).__name__} (index {j}) inside "
                    f"{type(m).__name__} (index {i}); list only the outer one (its subtree is in the group)"
                )
    return tuple(module)


def _check_ignored(ignored_params: object) -> set[nn.Parameter]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset)) or not all(isinstance(p, torch.Tensor) for p in ignored_params):
        raise TypeError(
            f"fully_shard: 'ignored_params' must be a set of nn.Parameter or None, got {ignored_params!r:.80}"
        )
    return set(ignored_params)


def _check_policy(policy: object) -> Callable[[nn.Module], bool]:
    if isinstance(policy, (set, frozenset)):
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"fully_shard: 'policy' set must hold nn.Module classes, got {bad!r}")
        classes = tuple(policy)
        return lambda m: isinstance(m, classes)
    if callable(policy) and not isinstance(policy, type):
        return policy
    raise TypeError(
        f"fully_shard: 'policy' must be a set of nn.Module classes or a callable(module) -> bool, got {policy!r:.80}"
    )


def _auto_wrap(root: nn.Module, matches: Callable[[nn.Module], bool], apply: Callable[[nn.Module], object]) -> None:
    """`apply` fully_shard (with the root's options) to every matching proper submodule,
    children before parents."""
    # Subtrees an API already manages (applied earlier, e.g. `replicate` on a child) are
    # skipped whole: their parameters are taken.
    managed = {id(m) for owner in root.modules() if owner is not root and owning_api(owner) for m in owner.modules()}
    targets = [m for m in root.modules() if m is not root and id(m) not in managed and matches(m)]
    for sub in reversed(targets):  # pre-order reversed: descendants before ancestors
        if owning_api(sub) is None:
            apply(sub)
