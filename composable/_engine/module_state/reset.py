"""Ending an iteration outside autograd: recovering from an exception that aborted a forward or
backward (FSDP2's `reset_iter_state`), and finishing a backward that autograd did not end."""

from __future__ import annotations

from .finalize import discard_finalization
from .root_context import TrainingState
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
        discard_finalization(context)  # a pending finalize_backward handle is invalidated
    for streams in root._tree_streams():
        streams.end_of_backward()


def finish_backward(root: ModuleState) -> None:
    """End a backward of `root`'s tree that autograd did not end, as its end-of-backward
    callback does: reduce every group that still holds gradients (per its
    `requires_gradient_sync`), reshard per `reshard_after_backward`, and, with
    `is_last_backward`, wait for every reduction. For callers that compute gradients outside
    one `backward()` (a pipeline schedule's split input/weight backward, or several
    micro-batch backwards of which only the caller knows the last): every state of the tree
    counts as having run with grad since the last reduction, so `replicate` launches all its
    buckets (its ranks all ran, DDP semantics). A no-op unless `root` is a root that ran."""
    if root.root_context is None or not root.is_root:
        return
    for state in root.root_context.states:
        state._ran_forward_with_grad = True
    root._final_callback()
