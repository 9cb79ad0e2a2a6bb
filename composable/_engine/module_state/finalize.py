"""Manual backward finalization (torch 2.15's `FSDPModule.set_manual_backward_finalization` /
`finalize_backward`, on every supported torch): the end of backward reduces nothing itself;
the caller finalizes once, after all the backward passes of one logical backward (a pipeline
schedule's microbatches), optionally asynchronously.

With manual finalization active (chosen when a backward starts, from the root's setting):
- the end of each backward finishes the groups whose gradients it does not reduce (no gradient
  sync: stash them and reshard per `reshard_after_backward`) and leaves every group that would
  have reduced there pending: unreduced, unsharded as it was;
- `finalize_backward` reduces every pending group and every group holding gradients (per its
  current `requires_gradient_sync`), reshards per `reshard_after_backward`, and waits for the
  reductions, or with `async_op=True` returns a `GradientReductionHandle` whose `wait()` does.
Until that handle is waited on, a forward or another finalization raises.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp

from ..groups.group import GroupState
from ..groups.group_set import members
from ..hooks.contract import check_bool

# The states and root context of state.py (which imports this file): `ModuleState`, `RootContext`.
ModuleState = Any
RootContext = Any

# torch 2.15 defines the handle type; subclass it where it exists so `isinstance` checks of
# code written for FSDP2 hold.
_HandleBase: type = getattr(torch_fsdp, "GradientReductionHandle", object)


class GradientReductionHandle(_HandleBase):
    """What `finalize_backward(async_op=True)` returns: `wait()` waits for the launched gradient
    reductions, accumulates them into the sharded gradients and ends the backward iteration.
    Call it before reading the gradients or running the tree again. A second `wait()` does
    nothing; after `reset_iter_state` it raises `RuntimeError` (the reduction was discarded)."""

    def __init__(self, root: "ModuleState | None") -> None:
        self._root = root

    def wait(self) -> None:
        root, self._root = self._root, None
        if root is None:
            return
        context = root.root_context
        if context is None or context.pending_reduction is not self:
            raise RuntimeError(
                "GradientReductionHandle.wait: this gradient reduction was invalidated (reset_iter_state discarded it)"
            )
        end_backward_iteration(root)


class BackwardFinalization:
    """The methods of manual finalization on a module's state (mixed into `ModuleState`)."""

    api_name: str
    is_root: bool | None
    root_context: "RootContext | None"
    manual_finalization: bool

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: the end of backward no longer reduces gradients or waits for reductions; call
        `finalize_backward` after all the backward passes of one logical backward (each with
        `set_requires_gradient_sync(False)`, then True before finalizing). Call it on the root
        (the module run first) before backward: RuntimeError on another module, during a
        backward, or to change the mode between a backward and its finalization. Supersedes
        `set_is_last_backward`. As torch 2.15's `FSDPModule.set_manual_backward_finalization`."""
        api = "set_manual_backward_finalization"
        check_bool(api, "enabled", enabled)
        if self.is_root is False:
            raise RuntimeError(
                f"{api}: must be called on the root {self.api_name} module (the module run first), "
                f"got {_name(self)}, which is not the root"
            )
        if enabled != self.manual_finalization and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(f"{api}: cannot change the mode (to {enabled}) during backward")
        context = self.root_context
        active = context.manual_active if context is not None else None
        if active is not None and enabled != active:
            raise RuntimeError(
                f"{api}: cannot change the mode (to {enabled}) after backward started; call finalize_backward() first"
            )
        self.manual_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Finish the backward iteration under manual finalization: reduce the gradients of
        every group that holds some (per its current `requires_gradient_sync`), reshard per
        `reshard_after_backward`, and wait for the reductions. `async_op=True`: return a
        `GradientReductionHandle` without waiting; `wait()` it before using the gradients or
        running this tree again. A no-op before the root's first forward. RuntimeError on a
        module other than the root, without `set_manual_backward_finalization(True)`, during
        backward, while an earlier handle is not waited on, and with HSDP's deferred replica
        all-reduce (`set_requires_all_reduce(False)`) in play. As torch 2.15's
        `FSDPModule.finalize_backward`."""
        check_bool("finalize_backward", "async_op", async_op)
        if self.is_root is None:  # never ran: nothing to finalize
            return GradientReductionHandle(None) if async_op else None
        root: Any = self
        _check_finalize(root)
        _finish_groups(root)
        handle = GradientReductionHandle(root)
        assert root.root_context is not None
        root.root_context.pending_reduction = handle
        if async_op:
            return handle
        handle.wait()
        return None


def _name(state: Any) -> str:
    return type(state.module).__name__


def shows_unsharded(state: "ModuleState") -> bool:
    """Whether a group kept unsharded (`reshard_after_forward` / `reshard_after_backward`
    False) stays registered unsharded between passes: under manual finalization, as FSDP2
    does, until `finalize_backward` (a pipeline schedule's split backward differentiates with
    respect to the parameters the stage module registers: those forward used). Otherwise the
    modules show their sharded parameters between passes."""
    context = state.root_context
    return context is not None and context.root.manual_finalization and not context.finalizing


def check_manual_on_root(root: "ModuleState", states: list["ModuleState"]) -> None:
    """Lazy init of `root`: manual finalization may be set on the root only (as FSDP2)."""
    for state in states:
        if state is not root and state.manual_finalization:
            raise RuntimeError(
                f"set_manual_backward_finalization: must be called on the root {root.api_name} module "
                f"({_name(root)}), was called on {_name(state)}"
            )


def check_no_pending_reduction(root: "ModuleState", context: "RootContext") -> None:
    """The root's pre-forward: an asynchronous finalization must be waited on first."""
    if context.pending_reduction is not None:
        raise RuntimeError(
            f"{root.api_name}: the gradient reduction of finalize_backward(async_op=True) must be waited on "
            "(handle.wait()) before forward"
        )


def _check_finalize(root: "ModuleState") -> None:
    api = "finalize_backward"
    context = root.root_context
    if context is not None and context.pending_reduction is not None:
        raise RuntimeError(f"{api}: the previous gradient reduction must be waited on (handle.wait()) first")
    if not root.is_root or context is None:
        raise RuntimeError(
            f"{api}: must be called on the root {root.api_name} module (the module run first), got {_name(root)}"
        )
    manual = context.manual_active if context.manual_active is not None else root.manual_finalization
    if not manual:
        raise RuntimeError(
            f"{api}: requires manual backward finalization; call set_manual_backward_finalization(True) before forward"
        )
    if context.final_callback_queued or torch._C._current_graph_task_id() != -1:
        raise RuntimeError(f"{api}: must be called after backward completes, not during it")
    for state in context.states:
        group = state.group
        if group is None or not group.layout.replicate_groups:
            continue
        to_reduce = state.requires_gradient_sync and (state.finalize_pending or group.has_unsharded_grads())
        for reducer in (g.reducer for g in members(group)):  # per-parameter meshes: partial sums of each
            deferred = to_reduce and not getattr(reducer, "requires_all_reduce", True)
            if getattr(reducer, "_partial", None) is not None or deferred:
                raise RuntimeError(
                    f"{api}: manual backward finalization does not support HSDP's deferred replica all-reduce "
                    f"(set_requires_all_reduce(False)) of module {_name(state)}; call set_requires_all_reduce(True) "
                    "before the backward passes, or use automatic finalization"
                )


def _finish_groups(root: "ModuleState") -> None:
    """Launch the reductions and reshard, in reverse order of the tree (backward's order)."""
    context = root.root_context
    assert context is not None
    context.finalizing = True  # groups kept unsharded show their sharded parameters from now on
    try:
        for state in reversed(context.states):
            if state.group is None:
                continue
            pending = state.finalize_pending
            if pending:  # it ran with grad since the last reduction (replicate reduces every bucket then)
                state._ran_forward_with_grad = True
            reduce = state.requires_gradient_sync and state._final_reduction_needed()
            if reduce or pending:
                state._finish_backward_of_group(reduce, last=True)
            elif state.group.state is not GroupState.SHARDED:
                state._end_backward_of_group()
            state.finalize_pending = False
            state._ran_forward_with_grad = False
    finally:
        context.finalizing = False


def finish_groups_at_end_of_backward(context: "RootContext") -> bool:
    """The end of a backward (the root's final callback): finish the groups whose post-backward
    did not (reduce per `requires_gradient_sync`, reshard per `reshard_after_backward`). Under
    manual finalization a group that would reduce stays as it is and, like every group that
    ran, is left for `finalize_backward`. Returns whether manual finalization is active."""
    manual = bool(context.manual_active)
    for state in context.states:
        if state.group is None:
            continue
        reduce = state.requires_gradient_sync and state._final_reduction_needed()
        if manual and (reduce or state._ran_forward_with_grad):
            state.finalize_pending = True
        if not (manual and reduce):
            state._finish_backward_of_group(reduce, last=True)
    return manual


def end_backward_iteration(root: "ModuleState") -> None:
    """Wait for every launched reduction of `root`'s tree and end the backward iteration."""
    context = root.root_context
    assert context is not None
    for state in context.states:
        if state.group is not None:
            state.group.finish_reduce()
    for streams in root._tree_streams():
        streams.end_of_backward()
    context.manual_active = None
    context.pending_reduction = None


def discard_finalization(context: "RootContext") -> None:
    """`reset_iter_state`: forget a pending finalization (its handle's `wait()` raises) and the
    mode chosen at the start of the aborted backward."""
    context.pending_reduction = None
    context.manual_active = None
    for state in context.states:
        state.finalize_pending = False
