"""What `unshard(async_op=True)` of a module's state returns: a handle on its groups' started
all-gathers."""

from __future__ import annotations

from ..groups.group import GroupState, ParamGroup


class UnshardHandle:
    """What `unshard(async_op=True)` returns: `wait()` finishes the all-gathers and registers
    the unsharded parameters (a no-op for a group with nothing to gather or already used)."""

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        groups, self._groups = self._groups, []
        for group in groups:
            if group.state is GroupState.UNSHARDING:  # not yet used by a forward
                group.wait_for_unshard()
