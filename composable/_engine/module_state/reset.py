"""Ending an iteration outside autograd after an exception aborted a forward or backward
(FSDP2's `reset_iter_state`). A backward that autograd did not end is finished by the tree's
`BackwardEnd.finish_outside_autograd` (finalize.py)."""

from __future__ import annotations

from .finalize import distinct_streams
from .state import ModuleState


def reset_iteration(root: ModuleState, api: str) -> None:
    """Wait for the collectives in flight, reshard every group of `root`'s tree, discard the
    launched reductions (the failed iteration's gradients, HSDP partial sums and no-sync sums
    are lost) and clear the iteration's bookkeeping, so the next iteration runs normally.
    RuntimeError when `root` is not the root of its tree."""
    if root.is_root is False:
        raise RuntimeError(
            f"{api}: module {type(root.module).__name__} is not the root of its tree; call it on the module run first"
        )
    context = root.root_context
    states = context.states if context is not None else [root]
    for state in states:
        for group in state.groups:
            group.reducer.discard()
            group.reshard()
        state.clear_pass_bookkeeping()
    if context is not None:
        context.forward_order.clear()
        context.backward_end.discard()  # a pending finalize_backward handle is invalidated
    for streams in distinct_streams(group for state in states for group in state.groups):
        streams.end_of_backward()
