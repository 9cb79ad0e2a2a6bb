"""Several parameter groups of one module state: per-parameter meshes (as PyTorch FSDP2).

`fully_shard(block, shard_placement_fn=...)` whose `ShardPlacementResult`s put some parameters
on another mesh (MoE: routed experts on an expert-data-parallel mesh, the rest on the dense
data-parallel mesh) makes one `ParamGroup` per distinct mesh, each gathering and reducing on
its own process groups, as FSDP2 keeps one `FSDPParamGroup` per mesh on one state. The state
holds them as one `GroupSet`, so the hooks, the end of backward and every method drive all of
them alike (FSDP2's methods loop over `_fsdp_param_groups` too).

A `GroupSet` offers by name exactly what the engine and the front ends do to a state's group,
and nothing else (anything else is an `AttributeError`):
- the group's steps (`unshard`, `reshard`, `reduce_grads`, ...) run on every member, in order;
  `state` and `has_unsharded_grads` combine the members';
- knobs (`keep_unsharded_storage`, `shows_unsharded_between_passes`, `all_gather_comm`,
  `streams`, and the reducer's: `reducer.divide_factor`, `reducer.force_sum`, ...) are set on
  every member; reading one gives the value the members share;
- `layout` is the members' layouts seen as one: sharded if any is, every replica group.
What differs by mesh has no single value: a member's shard process group, or a knob the members
hold different values of (one process group's allocator each). Reading it raises
`NotImplementedError` naming it, one line. Methods that bind collectives to one process group
run once per member instead (`fsdp/_state.py`); code that needs each member's own value loops
over `members(group)`.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch.distributed as dist

from ..params.param import ManagedParam
from .group import GroupState, ParamGroup


def per_mesh_error(meshes: int, name: str) -> NotImplementedError:
    """What asking several meshes for their one `name` raises."""
    return NotImplementedError(
        f"fully_shard: the module's parameters live on {meshes} meshes (shard_placement_fn's "
        f"ShardPlacementResult), each with its own '{name}': this method is not supported with per-parameter meshes"
    )


class _OnEachMember:
    """A knob every member holds (each member's object that `owner._holders()` gives): setting
    it sets it on each; reading it gives the value they share, `per_mesh_error` where they
    differ."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        values = [getattr(holder, self.name) for holder in obj._holders()]
        first = values[0]
        if all(v is first or v == first for v in values[1:]):
            return first
        raise per_mesh_error(len(values), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        for holder in obj._holders():
            setattr(holder, self.name, value)


class ReducerSet:
    """The members' gradient reducers as one: the knobs FSDP2's methods set (see
    `reduce_options.py`), `share_comm_ctx`'s streams, and what the state asks of them."""

    def __init__(self, members: list[ParamGroup]) -> None:
        self._members = members

    def _holders(self) -> list[Any]:
        return [g.reducer for g in self._members]  # read each time: always the members' own

    divide_factor = _OnEachMember()  # set_gradient_divide_factor
    requires_all_reduce = _OnEachMember()  # set_requires_all_reduce
    force_sum = _OnEachMember()  # set_force_sum_reduction_for_comms
    reduce_unused = _OnEachMember()  # set_reduce_scatter_unused_params
    max_input_buffers = _OnEachMember()  # set_reduce_scatter_max_input_buffers
    reduce_scatter_comm = _OnEachMember()  # set_custom_reduce_scatter
    reduce_scatter_group = _OnEachMember()  # set_separate_reduce_scatter_group(False)
    all_reduce_hook = _OnEachMember()  # set_all_reduce_hook
    all_reduce_hook_stream = _OnEachMember()
    streams = _OnEachMember()  # share_comm_ctx

    def drop_discarded_sums(self) -> None:
        for reducer in self._holders():
            reducer.drop_discarded_sums()

    def discard(self) -> None:
        for reducer in self._holders():
            reducer.discard()


class LayoutSet:
    """The members' layouts seen as one: sharded if any is, every replica group, no one shard group."""

    def __init__(self, members: list[ParamGroup]) -> None:
        self._members = members

    @property
    def sharded(self) -> bool:
        return any(g.layout.sharded for g in self._members)

    @property
    def replicate_groups(self) -> tuple[dist.ProcessGroup, ...]:
        return tuple(pg for g in self._members for pg in g.layout.replicate_groups)

    @property
    def shard_group(self) -> NoReturn:
        raise per_mesh_error(len(self._members), "shard_group")


class GroupSet:
    """The parameter groups of one module state, one per mesh, driven as one group."""

    def __init__(self, groups: list[ParamGroup], params: list[ManagedParam]) -> None:
        assert len(groups) > 1, "one group needs no set"
        self.members = list(groups)
        self.params = params  # in the module's parameter order
        self.reducer = ReducerSet(self.members)
        self.layout = LayoutSet(self.members)

    def _holders(self) -> list[ParamGroup]:
        return self.members

    keep_unsharded_storage = _OnEachMember()  # set_keep_unsharded_storage
    shows_unsharded_between_passes = _OnEachMember()  # as_fsdp_module
    all_gather_comm = _OnEachMember()  # set_custom_all_gather
    streams = _OnEachMember()  # one set per device, shared by every member; share_comm_ctx sets it

    @property
    def state(self) -> GroupState:
        states = {g.state for g in self.members}
        return states.pop() if len(states) == 1 else GroupState.UNSHARDING

    # -- unshard / reshard: every member, in order (as FSDP2's pre-forward, group by group) -------
    def unshard(self, async_op: bool = False) -> None:
        for g in self.members:
            g.unshard(async_op=async_op)

    def wait_for_unshard(self) -> None:
        for g in self.members:
            g.wait_for_unshard()

    def reshard(self) -> None:
        for g in self.members:
            g.reshard()

    def register_sharded(self) -> None:
        for g in self.members:
            g.register_sharded()

    def keep_unsharded(self) -> None:
        for g in self.members:
            g.keep_unsharded()

    def reshard_to(self, size: int) -> None:
        """`reshard_after_forward=size`: each member keeps 1/size where its mesh is wider, and
        reshards fully where `size` is its whole shard world (as FSDP2 per group)."""
        for g in self.members:
            g.reshard_to(size)

    def refresh_sharded_params(self) -> None:
        for g in self.members:
            g.refresh_sharded_params()

    # -- gradients --------------------------------------------------------------------------
    def has_unsharded_grads(self) -> bool:
        return any(g.has_unsharded_grads() for g in self.members)

    def stash_grads(self) -> None:
        for g in self.members:
            g.stash_grads()

    def reduce_grads(self) -> None:
        for g in self.members:
            g.reduce_grads()

    def finish_reduce(self) -> None:
        for g in self.members:
            g.finish_reduce()


def members(group: ParamGroup | GroupSet | None) -> list[ParamGroup]:
    """The parameter groups behind a state's `group`: none, itself, or a set's members."""
    if group is None:
        return []
    return list(group.members) if isinstance(group, GroupSet) else [group]
