"""The end of backward of one root's tree, owned by `BackwardEnd`: automatic (the root's final
callback finishes every group) or manual (torch 2.15's `FSDPModule.set_manual_backward_finalization`
/ `finalize_backward`, on every supported torch): the end of backward reduces nothing itself;
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

from typing import Iterable, Protocol, Sequence

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

from ..comm.profiling import labelled
from ..comm.streams import CommStreams
from ..groups.group import GroupState, ParamGroup
from ..hooks.contract import check_bool
from ..params.annotated import untyped

# torch 2.15 defines the handle type; subclass it where it exists so `isinstance` checks of
# code written for FSDP2 hold.
_HandleBase: type = getattr(torch_fsdp, "GradientReductionHandle", object)


class TreeMember(Protocol):
    """What the end of backward reads and drives of each module state of a tree. state.py's
    `ModuleState` is one; it imports this file, so the dependency points one way."""

    module: nn.Module
    api_name: str
    groups: list[ParamGroup]  # none: the state manages nothing
    requires_gradient_sync: bool
    manual_finalization: bool  # the root's setting (set_manual_backward_finalization)
    is_last_backward: bool  # the root's setting (set_is_last_backward)
    ran_forward_with_grad: bool  # since the last end of backward

    def final_reduction_needed(self) -> bool: ...

    def finish_backward_of_groups(self, reduce: bool, last: bool = False) -> None: ...

    def end_backward_of_groups(self) -> None: ...

    def clear_pass_bookkeeping(self) -> None: ...


def distinct_streams(groups: Iterable[ParamGroup]) -> list[CommStreams]:
    """The distinct communication streams of `groups` (one set per CUDA device, none on CPU)."""
    found: dict[int, CommStreams] = {}
    for group in groups:
        streams = group.streams
        if streams is not None:
            found.setdefault(id(streams), streams)
    return list(found.values())


class GradientReductionHandle(_HandleBase):  # type: ignore[misc]  # torch 2.15's class, absent from older stubs
    """What `finalize_backward(async_op=True)` returns: `wait()` waits for the launched gradient
    reductions, accumulates them into the sharded gradients and ends the backward iteration.
    Call it before reading the gradients or running the tree again. A second `wait()` does
    nothing; after `reset_iter_state` it raises `RuntimeError` (the reduction was discarded)."""

    def __init__(self, backward_end: "BackwardEnd | None") -> None:
        self._backward_end = backward_end

    def wait(self) -> None:
        backward_end, self._backward_end = self._backward_end, None
        if backward_end is None:
            return
        if backward_end.pending_reduction is not self:
            raise RuntimeError(
                "GradientReductionHandle.wait: this gradient reduction was invalidated (reset_iter_state discarded it)"
            )
        backward_end.end_iteration()


def _name(state: TreeMember) -> str:
    return type(state.module).__name__


def check_mode_change(
    state: TreeMember, is_root: bool | None, backward_end: "BackwardEnd | None", enabled: bool
) -> None:
    """`set_manual_backward_finalization(enabled)` on `state`: on the root only, not during a
    backward, not between a backward and its finalization."""
    api = "set_manual_backward_finalization"
    check_bool(api, "enabled", enabled)
    if is_root is False:
        raise RuntimeError(
            f"{api}: must be called on the root {state.api_name} module (the module run first), "
            f"got {_name(state)}, which is not the root"
        )
    if enabled != state.manual_finalization and torch._C._current_graph_task_id() != -1:
        raise RuntimeError(f"{api}: cannot change the mode (to {enabled}) during backward")
    active = backward_end.manual_active if backward_end is not None else None
    if active is not None and enabled != active:
        raise RuntimeError(
            f"{api}: cannot change the mode (to {enabled}) after backward started; call finalize_backward() first"
        )


class BackwardEnd:
    """The end of backward of one root's tree (made at the root's lazy init, held by its
    `RootContext`): queues the final callback when a backward starts, finishes every group at
    the end of backward or, under manual finalization, in `finalize`, and ends the backward
    iteration (waits for every reduction)."""

    def __init__(self, root: TreeMember, states: Sequence[TreeMember]) -> None:
        for state in states:  # manual finalization may be set on the root only (as FSDP2)
            if state is not root and state.manual_finalization:
                raise RuntimeError(
                    f"set_manual_backward_finalization: must be called on the root {root.api_name} module "
                    f"({_name(root)}), was called on {_name(state)}"
                )
        self.root = root
        self.states = list(states)
        self.callback_queued = False
        self.manual_active: bool | None = None  # manual finalization, as chosen when this backward started
        self.pending_reduction: GradientReductionHandle | None = None  # finalize's, until waited on
        self.finalizing = False  # inside finalize
        self._to_finalize: set[int] = set()  # positions in `states` whose groups finalize must finish

    def shows_unsharded(self) -> bool:
        """Whether a group kept unsharded (`reshard_after_forward` / `reshard_after_backward`
        False) stays registered unsharded between passes: under manual finalization, as FSDP2
        does, until `finalize_backward` (a pipeline schedule's split backward differentiates
        with respect to the parameters the stage module registers: those forward used).
        Otherwise the modules show their sharded parameters between passes."""
        return self.root.manual_finalization and not self.finalizing

    def check_no_pending_reduction(self) -> None:
        """The root's pre-forward: an asynchronous finalization must be waited on first."""
        if self.pending_reduction is not None:
            raise RuntimeError(
                f"{self.root.api_name}: the gradient reduction of finalize_backward(async_op=True) must be waited on "
                "(handle.wait()) before forward"
            )

    def start_backward(self) -> None:
        """A pre-backward of the tree: the first of a backward fixes its mode and queues the
        end-of-backward callback."""
        if self.callback_queued:
            return
        self.callback_queued = True
        if self.manual_active is None:  # the mode of this backward (set_manual_backward_finalization)
            self.manual_active = self.root.manual_finalization
        torch.autograd.Variable._execution_engine.queue_callback(self.final_callback)

    @labelled("composable::final_callback")
    @untyped
    def final_callback(self) -> None:
        """The end of a backward: finish the groups whose post-backward did not (reduce per
        `requires_gradient_sync`, reshard per `reshard_after_backward`), clear every state's
        pass, and with `is_last_backward` wait for every reduction (else the next forward does:
        micro-batches). Under manual finalization a group that would reduce stays as it is and,
        like every group that ran, is left for `finalize`."""
        manual = bool(self.manual_active)
        for index, state in enumerate(self.states):
            if not state.groups:
                continue
            reduce = state.requires_gradient_sync and state.final_reduction_needed()
            if manual and (reduce or state.ran_forward_with_grad):
                self._to_finalize.add(index)
            if not (manual and reduce):
                state.finish_backward_of_groups(reduce, last=True)
        for state in self.states:
            state.clear_pass_bookkeeping()
        self.callback_queued = False
        if manual:
            return  # finalize_backward finishes
        self.manual_active = None
        if self.root.is_last_backward:
            self.end_iteration()

    def finish_outside_autograd(self) -> None:
        """End a backward of the tree that autograd did not end, as the final callback does:
        reduce every group that still holds gradients (per its `requires_gradient_sync`),
        reshard per `reshard_after_backward`, and, with `is_last_backward`, wait for every
        reduction. For callers that compute gradients outside one `backward()` (a pipeline
        schedule's split input/weight backward, or several micro-batch backwards of which only
        the caller knows the last): every state counts as having run with grad since the last
        reduction, so `replicate` launches all its buckets (its ranks all ran, DDP semantics)."""
        for state in self.states:
            state.ran_forward_with_grad = True
        self.final_callback()

    def finalize(self, caller: TreeMember, async_op: bool) -> GradientReductionHandle | None:
        """`finalize_backward` called on `caller` (a state of this tree): reduce, reshard and
        wait, or return the handle that waits (see the module docstring)."""
        self._check_finalize(caller)
        self._finish_groups()
        handle = GradientReductionHandle(self)
        self.pending_reduction = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def _check_finalize(self, caller: TreeMember) -> None:
        api = "finalize_backward"
        if self.pending_reduction is not None:
            raise RuntimeError(f"{api}: the previous gradient reduction must be waited on (handle.wait()) first")
        if caller is not self.root:
            raise RuntimeError(
                f"{api}: must be called on the root {caller.api_name} module (the module run first), got {_name(caller)}"
            )
        manual = self.manual_active if self.manual_active is not None else self.root.manual_finalization
        if not manual:
            raise RuntimeError(
                f"{api}: requires manual backward finalization; call set_manual_backward_finalization(True) before forward"
            )
        if self.callback_queued or torch._C._current_graph_task_id() != -1:
            raise RuntimeError(f"{api}: must be called after backward completes, not during it")
        for index, state in enumerate(self.states):
            if not any(group.layout.replicate_groups for group in state.groups):
                continue
            pending = index in self._to_finalize
            unsharded = any(group.has_unsharded_grads() for group in state.groups)
            to_reduce = state.requires_gradient_sync and (pending or unsharded)
            for reducer in (group.reducer for group in state.groups):  # per-parameter meshes: partial sums of each
                deferred = to_reduce and not reducer.options.requires_all_reduce
                if getattr(reducer, "_partial", None) is not None or deferred:
                    raise RuntimeError(
                        f"{api}: manual backward finalization does not support HSDP's deferred replica all-reduce "
                        f"(set_requires_all_reduce(False)) of module {_name(state)}; call set_requires_all_reduce(True) "
                        "before the backward passes, or use automatic finalization"
                    )

    def _finish_groups(self) -> None:
        """Launch the reductions and reshard, in reverse order of the tree (backward's order)."""
        self.finalizing = True  # groups kept unsharded show their sharded parameters from now on
        try:
            for index in reversed(range(len(self.states))):
                state = self.states[index]
                if not state.groups:
                    continue
                pending = index in self._to_finalize
                if pending:  # it ran with grad since the last reduction (replicate reduces every bucket then)
                    state.ran_forward_with_grad = True
                reduce = state.requires_gradient_sync and state.final_reduction_needed()
                if reduce or pending:
                    state.finish_backward_of_groups(reduce, last=True)
                elif any(group.state is not GroupState.SHARDED for group in state.groups):
                    state.end_backward_of_groups()
                state.ran_forward_with_grad = False
            self._to_finalize.clear()
        finally:
            self.finalizing = False

    def end_iteration(self) -> None:
        """Wait for every launched reduction of the tree and end the backward iteration."""
        groups = [group for state in self.states for group in state.groups]
        for group in groups:
            group.finish_reduce()
        for streams in distinct_streams(groups):
            streams.end_of_backward()
        self.manual_active = None
        self.pending_reduction = None

    def discard(self) -> None:
        """`reset_iter_state`: forget a queued callback, a pending finalization (its handle's
        `wait()` raises) and the mode chosen at the start of the aborted backward."""
        self.callback_queued = False
        self.pending_reduction = None
        self.manual_active = None
        self._to_finalize.clear()
