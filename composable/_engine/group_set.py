"""Several parameter groups of one module state: per-parameter meshes (as PyTorch FSDP2).

`fully_shard(block, shard_placement_fn=...)` whose `ShardPlacementResult`s put some parameters
on another mesh (MoE: routed experts on an expert-data-parallel mesh, the rest on the dense
data-parallel mesh) makes one `ParamGroup` per distinct mesh, each gathering and reducing on
its own process groups, as FSDP2 keeps one `FSDPParamGroup` per mesh on one state. The state
holds them as one `GroupSet`, which does what a group does by doing it to every member, so
the hooks, the end of backward and every method drive all of them alike (FSDP2's methods loop
over `_fsdp_param_groups` too).

Knobs set on the set (`reducer.divide_factor = f`, `streams = s`, `all_gather_comm = c`) are
set on every member; reading one gives the first member's value (set alike on all) or the
first that is set (not None). What differs by mesh (a member's shard process group) has no
single value: reading it raises `NotImplementedError`.
"""

from __future__ import annotations

from typing import Any, Iterator

from .group import GroupState, ParamGroup
from .param import ManagedParam


class _FanOut:
    """Attribute writes and method calls go to every member; reads give the first value set."""

    def __init__(self, members: list[Any]) -> None:
        object.__setattr__(self, "_members", members)

    def __setattr__(self, name: str, value: Any) -> None:
        for member in self._members:
            setattr(member, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        values = [getattr(m, name) for m in object.__getattribute__(self, "_members")]
        if callable(values[0]):

            def each(*args: Any, **kwargs: Any) -> None:
                for fn in values:
                    fn(*args, **kwargs)

            return each
        return next((v for v in values if v is not None), None)


class _LayoutView:
    """The members' layouts seen as one: sharded if any is, every replica group, no one shard group."""

    def __init__(self, members: list[ParamGroup]) -> None:
        self._layouts = [g.layout for g in members]

    @property
    def sharded(self) -> bool:
        return any(lay.sharded for lay in self._layouts)

    @property
    def replicate_groups(self) -> tuple:
        return tuple(pg for lay in self._layouts for pg in lay.replicate_groups)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise NotImplementedError(
            f"fully_shard: the module's parameters live on {len(self._layouts)} meshes (shard_placement_fn's "
            f"ShardPlacementResult), each with its own '{name}': this method is not supported with per-parameter meshes"
        )


class GroupSet:
    """The parameter groups of one module state, one per mesh, driven as one group."""

    def __init__(self, groups: list[ParamGroup], params: list[ManagedParam]) -> None:
        assert len(groups) > 1, "one group needs no set"
        members = list(groups)
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "params", params)  # in the module's parameter order
        object.__setattr__(self, "reducer", _FanOut([g.reducer for g in members]))
        object.__setattr__(self, "layout", _LayoutView(members))

    # Knobs a front end or a method sets (streams, all_gather_comm, keep_unsharded_storage,
    # shows_unsharded_between_passes, ...) apply to every member.
    def __setattr__(self, name: str, value: Any) -> None:
        for g in self.members:
            setattr(g, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "members":
            raise AttributeError(name)
        values = [getattr(g, name) for g in self.members]
        return next((v for v in values if v is not None), None)

    def __iter__(self) -> Iterator[ParamGroup]:
        return iter(self.members)

    @property
    def state(self) -> GroupState:
        states = {g.state for g in self.members}
        return states.pop() if len(states) == 1 else GroupState.UNSHARDING

    @property
    def streams(self) -> Any:
        return self.members[0].streams  # one set per device, shared by every member

    @property
    def config(self) -> Any:
        return self.members[0].config  # device, api: the same for every member

    # -- unshard / reshard: every member, collectives started before any is waited for ----------
    def unshard(self, async_op: bool = False) -> None:
        for g in self.members:
            g.unshard(async_op=True)
        if not async_op:
            for g in self.members:
                g.unshard()

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
            if size >= g.layout.shard_world:
                g.reshard()
            else:
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
