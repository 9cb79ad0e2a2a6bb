"""What `unshard(async_op=True)` of a module's state returns: a handle on its group's
started all-gather."""

from __future__ import annotations

from ..groups.group import GroupState, ParamGroup
from ..groups.group_set import GroupSet


class UnshardHandle:
    """What `unshard(async_op=True)` returns: `wait()` finishes the all-gather and registers
    the unsharded parameters (a no-op when there was nothing to gather or it already ran)."""

    def __init__(self, group: ParamGroup | GroupSet | None) -> None:
        self._group = group

    def wait(self) -> None:
        group, self._group = self._group, None
        if group is not None and group.state is GroupState.UNSHARDING:  # not yet used by a forward
            group.wait_for_unshard()
