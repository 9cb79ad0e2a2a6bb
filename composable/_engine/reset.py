"""Recovering from an exception that aborted a forward or backward (FSDP2's `reset_iter_state`)."""

from __future__ import annotations

from .state import ModuleState, TrainingState


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
    for state in context.states if context is not None else [root]:
        if state.group is not None:
            state.group.reducer.discard()
            state.group.reshard()
        state.training_state = TrainingState.IDLE
        state._forward_index = None
        state._ran_forward_with_grad = False
        state._forward_pending.clear()
        state._backward_pending, state._backward_untracked = 0, False
    if context is not None:
        context.forward_order.clear()
        context.final_callback_queued = False
    for streams in root._tree_streams():
        streams.end_of_backward()
