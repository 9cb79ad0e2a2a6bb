"""The state `fully_shard` installs on a module: a `ModuleState` plus FSDP's options."""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._engine.contract import get_state
from .._engine.group import ParamGroup
from .._engine.state import ModuleState
from ..mixed_precision import MixedPrecisionPolicy, OffloadPolicy
from .strategy import ShardingStrategy


class FSDPState(ModuleState):
    """What `fully_shard.state(module)` returns.

    Attributes: `mesh`, `mp_policy`, `offload_policy`, `strategy`, `reshard_after_forward`,
    `param_names` (FQNs relative to the module of the parameters this call manages).
    """

    api_name = "fully_shard"

    def __init__(
        self,
        module: nn.Module,
        group: ParamGroup | None,
        *,
        mesh: DeviceMesh,
        strategy: ShardingStrategy,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        reshard_after_forward: bool,
        reshard_is_default: bool,
    ) -> None:
        super().__init__(module, group, mp_policy, reshard_after_forward, reshard_is_default)
        self.mesh = mesh
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
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"set_requires_all_reduce: 'requires_all_reduce' must be a bool, got {requires_all_reduce!r}")
        for module in self.module.modules() if recurse else [self.module]:
            state = get_state(module, "fully_shard")
            if state is not None and state.group is not None:
                state.group.reducer.requires_all_reduce = requires_all_reduce


def _states_of(api: str, modules: Iterable[nn.Module]) -> list[ModuleState]:
    states = []
    for module in modules:
        state = get_state(module, "fully_shard") if isinstance(module, nn.Module) else None
        if state is None:
            raise ValueError(f"{api}: every module must have fully_shard applied, got {type(module).__name__}")
        states.append(state)
    return states
