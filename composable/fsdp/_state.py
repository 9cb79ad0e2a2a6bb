"""The state `fully_shard` installs on a module: a `ModuleState` plus FSDP's options."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._engine.dtypes.policies import MixedPrecisionPolicy, OffloadPolicy
from .._engine.groups.group import ParamGroup
from .._engine.hooks.contract import check_bool, get_state
from .._engine.module_state.state import ModuleState
from ._methods import FSDP2Methods
from .strategy import ShardingStrategy, check_reshard_type, normalize_reshard


def make_post_forward_groups(api: str, reshard: bool | int, groups: list[ParamGroup]) -> None:
    """For an int `reshard_after_forward`: make the process groups backward all-gathers within,
    on each parameter group (each mesh of per-parameter meshes) whose shard world it splits.
    Creating process groups is collective: called at the same point on every rank."""
    if isinstance(reshard, bool):
        return
    for group in groups:
        if normalize_reshard(api, reshard, group.layout.shard_world) not in (True, False):
            group.layout.post_forward_group(reshard)


class FSDPState(FSDP2Methods, ModuleState):
    """What `fully_shard.state(module)` returns.

    Attributes: `mesh`, `mp_policy`, `offload_policy`, `strategy`, `reshard_after_forward`,
    `param_names` (FQNs relative to the module of the parameters this call manages).
    Every public method of PyTorch FSDP2's `FSDPModule` is here under its own name
    (FSDP2's expert communication methods in `_methods.py`).
    """

    api_name = "fully_shard"

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        groups: list[ParamGroup],
        *,
        mesh: DeviceMesh,
        strategy: ShardingStrategy,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        reshard_after_forward: bool | int,
        reshard_is_default: bool,
        dp_mesh_dims: object = None,
    ) -> None:
        super().__init__(module, groups, mp_policy, reshard_after_forward, reshard_is_default)
        self.mesh = mesh
        self.dp_mesh_dims = dp_mesh_dims  # None, or the DataParallelMeshDims naming `mesh`'s data-parallel dims
        self.strategy = strategy
        self.offload_policy = offload_policy

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """In this module's pre-forward, start gathering these modules' parameters too."""
        self.forward_prefetch = _states_of("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """In this module's pre-backward, start gathering these modules' parameters too."""
        self.backward_prefetch = _states_of("set_modules_to_backward_prefetch", modules)

    def set_requires_all_reduce(self, requires_all_reduce: bool, recurse: bool = True) -> None:
        """HSDP gradient accumulation with less communication: with False, gradients are still
        reduce-scattered within the shard group every backward (so only sharded gradients are
        held, not full ones) but the all-reduce across replicas is deferred to the next
        backward with True, which reduces the accumulated sum once."""
        check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.reducer.requires_all_reduce = requires_all_reduce

    def _fsdp_states(self, recurse: bool) -> list["FSDPState"]:
        """This module's fully_shard state and, with `recurse`, every one below it."""
        modules = [sub for m in self.modules for sub in m.modules()] if recurse else self.modules
        found = {id(s): s for m in modules if (s := get_state(m, "fully_shard")) is not None}
        return list(found.values())  # once each: a state of several modules sits on each

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Change `reshard_after_forward` (bool, or an int N dividing the shard world: see
        `fully_shard`) of this module's state (and, with `recurse`, of every fully_shard state
        below it). Call it on every rank: an int makes its process groups the first time.
        An int where a state was made with `dp_mesh_dims` is `NotImplementedError` (as at the
        `fully_shard` call), and nothing changes."""
        api = "set_reshard_after_forward"
        check_reshard_type(api, reshard_after_forward)
        check_bool(api, "recurse", recurse)
        states = self._fsdp_states(recurse)
        if not isinstance(reshard_after_forward, bool):  # checked for every state before any changes
            for state in states:
                if state.dp_mesh_dims is not None:
                    raise NotImplementedError(
                        f"{api}: an int 'reshard_after_forward' ({reshard_after_forward}) is not supported on a module "
                        f"sharded with 'dp_mesh_dims' ({type(state.module).__name__}), as at fully_shard"
                    )
        for state in states:
            if state.strategy is ShardingStrategy.NO_SHARD:
                continue  # nothing sharded: nothing to reshard
            value = normalize_reshard(api, reshard_after_forward, state.mesh.size(state.mesh.ndim - 1))
            make_post_forward_groups(api, value, state.groups)
            state.reshard_after_forward = value
            state._reshard_is_default = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, recurse: bool = True) -> None:
        """False: after backward keep the unsharded parameters (the modules still show the
        sharded ones) so the next forward gathers nothing: for micro-batches without an
        optimizer step between them. If the sharded parameters change meanwhile (an optimizer
        step), the next forward notices and gathers them again."""
        api = "set_reshard_after_backward"
        check_bool(api, "reshard_after_backward", reshard_after_backward)
        check_bool(api, "recurse", recurse)
        for state in self._fsdp_states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce this module's gradients as a sum divided by `factor` instead of the average
        over the data-parallel ranks (on gloo and NCCL alike)."""
        api = "set_gradient_divide_factor"
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"{api}: 'factor' must be a number, got {factor!r}")
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"{api}: 'factor' must be a finite number > 0, got {factor!r}")
        for group in self.groups:
            group.reducer.divide_factor = float(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the end of the next backwards leaves gradient reductions in flight (they
        finish at the next forward), for micro-batches that do not step the optimizer; set it
        True again before the backward whose gradients the optimizer uses."""
        api = "set_is_last_backward"
        check_bool(api, "is_last_backward", is_last_backward)
        self.is_last_backward = is_last_backward
        if self.root_context is not None:
            self.root_context.root.is_last_backward = is_last_backward


def _states_of(api: str, modules: Iterable[nn.Module]) -> list[ModuleState]:
    states = []
    for module in modules:
        state = get_state(module, "fully_shard") if isinstance(module, nn.Module) else None
        if state is None:
            raise ValueError(f"{api}: every module must have fully_shard applied, got {type(module).__name__}")
        states.append(state)
    return states
