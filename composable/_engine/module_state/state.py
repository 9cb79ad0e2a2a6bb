"""The per-module state shared by `fully_shard` and `replicate`: hooks that drive its parameter
groups through forward and backward (one group per mesh, each driven in turn, as FSDP2 loops
over its `FSDPParamGroup`s), root detection and lazy init; the end of backward belongs to the
tree's `BackwardEnd` (finalize.py), which the root's lazy init makes and the first pre-backward starts.

Order of events for one module (root marked *):
  pre_forward   lazy init*, refresh sharded params*, unshard (+ prefetch), cast inputs,
                attach the post-backward function to the inputs
  post_forward  reshard if `reshard_after_forward` (or no backward can follow), attach
                pre-backward hooks to the outputs, cast outputs
  pre_backward  (first output gradient) queue the root's final callback, unshard
  post_backward (all input gradients done) reshard, launch gradient reduction
  final*        reshard and reduce groups whose post_backward never fired, wait for reductions, reset
During backward a re-run forward (activation checkpointing) neither reshards nor re-hooks.

One state may drive one group for several modules (`fully_shard([norm, head])`, as FSDP2): hooks on each; the
first of them to run in the root's forward unshards, the last to finish reshards (a pass that ran only some of
them is finished by the root's post_forward; one called outside the root's forward is a pass of its own), and
the group reduces once, after the post-backward of every listed module that ran.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from ..comm.profiling import labelled
from ..comm.streams import CommStreams
from ..dtypes.policies import MixedPrecisionPolicy
from ..grads.grad_dtype import set_unsharded_grad_dtypes
from ..groups.build import ListedModules
from ..groups.group import ParamGroup
from ..hooks.autograd import any_requires_grad, attach_post_backward, attach_pre_backward, cast_floating, run_eagerly
from ..hooks.compile_boundary import keep_hooks_outside_graphs
from ..hooks.contract import check_bool, keep_post_hook_last, param_states, register_api_pre_hook
from ..hooks.pipeline_guard import check_pipeline_stage
from ..params.annotated import restore_annotations, resumed, untyped
from ..params.wrappers import offset_free_state_dict
from ..whole_model.late_params import check_no_late_params
from . import finalize
from .finalize import GradientReductionHandle
from .root_context import RootContext, TrainingState
from .unshard_handle import UnshardHandle


class ModuleState:
    """State one parameter-owning API installs on one module."""

    api_name = "composable"

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        groups: list[ParamGroup],
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | int,
        reshard_is_default: bool,
    ) -> None:
        self.modules: tuple[nn.Module, ...] = (module,) if isinstance(module, nn.Module) else tuple(module)
        self.module = self.modules[0]
        self._single_module = isinstance(module, nn.Module)  # else FQNs as in an nn.ModuleList of them
        self.groups = groups  # one per mesh (per-parameter meshes: several); none: nothing managed
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self._reshard_is_default = reshard_is_default
        self.reshard_after_backward = True  # False: keep the unsharded parameters until the next forward
        self.is_last_backward = True  # root: False lets the end of backward leave reductions in flight
        self.manual_finalization = False  # root: set_manual_backward_finalization
        self.unshard_in_backward = True  # False: backward computes without gathering (set_unshard_in_backward)
        self.training_state = TrainingState.IDLE
        self.requires_gradient_sync = True
        self.is_root: bool | None = None  # decided at lazy init
        self.root_context: RootContext[ModuleState] | None = None  # shared by the states of one root's tree
        self.forward_prefetch: list[ModuleState] = []
        self.backward_prefetch: list[ModuleState] = []
        self._forward_index: int | None = None  # position in the root's forward order
        self.ran_forward_with_grad = False  # since the last end of backward
        # Several modules only: positions of those yet to run in this pass; post-backward functions
        # attached and not run yet; whether one ran with grad but no input needing grad (nothing
        # tells when its gradients are done: the end of backward reduces).
        self._forward_pending: set[int] = set()
        self._backward_pending = 0
        self._backward_untracked = False
        # Bound methods (not closures), so `copy.deepcopy(model)` rebinds them to the copy's state.
        # Pre-hook before the user's, post-hook after theirs (see `contract.register_api_pre_hook`).
        self._hook_handles = []
        self._post_hook_ids: list[int] = []  # per listed module: its post-forward hook, kept last
        for m in self.modules:
            keep_hooks_outside_graphs(m, self.api_name)
            post_hook = m.register_forward_hook(self._post_forward, always_call=False)
            self._post_hook_ids.append(post_hook.id)
            self._hook_handles += [
                register_api_pre_hook(m, self._pre_forward),
                post_hook,
                # State dicts see (and load into) the sharded DTensors, even between forward and backward.
                m.register_state_dict_pre_hook(lambda *_: self.reshard()),
                m.register_state_dict_post_hook(offset_free_state_dict),  # picklable values
                m.register_load_state_dict_pre_hook(lambda *_: self.reshard()),
            ]

    # -- public helpers ---------------------------------------------------------------------
    @property
    def param_names(self) -> list[str]:
        """The FQNs of the managed parameters, in the module's order (per-parameter meshes
        interleave their groups' parameters); a list of modules names them as an
        `nn.ModuleList` of the modules would."""
        managed = {mp.fqn for group in self.groups for mp in group.params}
        tree = self.module if self._single_module else ListedModules(self.modules)
        walk = dict.fromkeys(name for name, _ in tree.named_parameters(remove_duplicate=False))
        return [name for name in walk if name in managed]

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gather this module's parameters and register the unsharded ones. With
        `async_op=True` the all-gather is only started: returns a handle whose `wait()`
        finishes it; the next forward uses what it gathered (no second all-gather)."""
        check_bool("unshard", "async_op", async_op)
        for group in self.groups:
            group.unshard(async_op=async_op)
        return UnshardHandle(self.groups) if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded DTensors again."""
        for group in self.groups:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally (more memory: a full
        gradient per parameter is held) and communicates nothing; the next backward with
        True reduces everything accumulated."""
        check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        check_bool("set_requires_gradient_sync", "recurse", recurse)
        targets = param_states(self.modules) if recurse else [self]
        for state in targets:
            state.requires_gradient_sync = requires_gradient_sync

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: the end of backward no longer reduces gradients or waits for reductions; call
        `finalize_backward` after all the backward passes of one logical backward (each with
        `set_requires_gradient_sync(False)`, then True before finalizing). Call it on the root
        (the module run first) before backward: RuntimeError on another module, during a
        backward, or to change the mode between a backward and its finalization. Supersedes
        `set_is_last_backward`. As torch 2.15's `FSDPModule.set_manual_backward_finalization`."""
        backward_end = self.root_context.backward_end if self.root_context is not None else None
        finalize.check_mode_change(self, self.is_root, backward_end, enabled)
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
        if self.is_root is None or self.root_context is None:  # never ran: nothing to finalize
            return GradientReductionHandle(None) if async_op else None
        return self.root_context.backward_end.finalize(self, async_op)

    # -- lazy init ----------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(
                f"{self.api_name}: the group of modules [{', '.join(type(m).__name__ for m in self.modules)}] ran forward outside any module that an API manages; "
                f"as with FSDP2, a group of several modules cannot be the root: apply {self.api_name} to a module "
                f"containing them too (e.g. {self.api_name}(model)) and run that"
            )
        check_pipeline_stage(self.api_name, self.module)  # a torch stage that reduces per microbatch: fail now
        context = RootContext[ModuleState](self, param_states(self.module))  # checks manual finalization
        self.is_root = True
        for state in context.states:
            state.root_context = context
            if state is not self:
                state.is_root = False
        # The root's parameters are needed again right at the start of backward.
        if self._reshard_is_default:
            self.reshard_after_forward = False

    # -- forward ------------------------------------------------------------------------------
    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    # The hooks run eagerly even when the module is compiled (`module.compile()` traces
    # `_call_impl`, hooks included): they swap registered parameters and launch collectives,
    # nothing to trace; the compiled forward between them sees the unsharded parameters as
    # graph inputs, the same objects every step, so nothing recompiles.
    @run_eagerly
    @labelled("composable::pre_forward")
    @untyped
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._in_backward():
            # Activation checkpointing re-runs the forward inside backward: gather if needed
            # and keep the parameters until this module's own post_backward reshards them.
            for group in self.groups:
                group.unshard()
            with resumed():
                return self._cast_inputs(args, kwargs)
        grouped = len(self.modules) > 1
        keep_post_hook_last(module, self._post_hook_ids[self.modules.index(module)])
        # Several modules: only the first of this pass (whichever it is) starts the pass.
        first = not grouped or self.training_state is not TrainingState.FORWARD
        if first:
            self._lazy_init()
            if self.is_root:
                self._root_pre_forward()
            self.training_state = TrainingState.FORWARD
            if grouped:
                self._forward_pending = set(range(len(self.modules)))
        self.ran_forward_with_grad |= torch.is_grad_enabled()
        for group in self.groups:
            group.unshard()  # a no-op for the later modules of a pass
        if self.groups and first:
            self._after_unshard()
            for other in self.forward_prefetch:
                for group in other.groups:
                    group.unshard(async_op=True)
        with resumed():  # spmd_types: the module's parameters and inputs keep their types
            args, kwargs = self._cast_inputs(args, kwargs)
            for group in self.groups:
                restore_annotations(group.params)
            if torch.is_grad_enabled():
                if grouped:  # the group reduces after the last of its post-backwards (see `_post_backward`)
                    if any_requires_grad((args, kwargs)):
                        self._backward_pending += 1
                    else:
                        self._backward_untracked = True
                args, kwargs = attach_post_backward(self, args, kwargs)
        return args, kwargs

    def _root_pre_forward(self) -> None:
        check_no_late_params(self.module)
        context = self.root_context
        assert context is not None
        context.backward_end.check_no_pending_reduction()
        context.forward_order.clear()
        for state in context.states:
            for group in state.groups:
                group.finish_reduce()  # in case a previous backward did not finish
                group.refresh_sharded_params()
        for streams in self._tree_streams():
            streams.start_of_iteration()

    @run_eagerly
    @labelled("composable::post_forward")
    @untyped
    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self._in_backward():
            return output
        backward_follows = torch.is_grad_enabled() and any_requires_grad(output)
        if len(self.modules) > 1 and self._others_pending(module):
            # Not the last listed module of this pass: the group stays unsharded for the others.
            # Backward may reach this module first, so its output gradient unshards too.
            if backward_follows:
                output = attach_pre_backward(self, output)
        else:
            if self.is_root:  # before the root's own: backward reaches the root first
                output = self._finish_open_passes(module, output, backward_follows)
            output = self._finish_forward(module, output, backward_follows)
            if self.is_root:
                for streams in self._tree_streams():
                    streams.release_gather_buffers()
        if self.mp_policy.output_dtype is not None:
            with resumed():
                output = cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _others_pending(self, module: nn.Module) -> bool:
        """Several modules: mark `module` done in this pass; whether others are still to run.
        A pass lasts at most as long as the root's forward: a listed module called outside it
        (a head called per chunk of the loss, `generate`) is a pass of its own."""
        self._forward_pending.discard(self.modules.index(module))
        context = self.root_context
        in_root_forward = context is not None and context.root.training_state is TrainingState.FORWARD
        return in_root_forward and self.training_state is TrainingState.FORWARD and bool(self._forward_pending)

    def _finish_open_passes(self, module: nn.Module, output: Any, backward_follows: bool) -> Any:
        """Root: a group of several modules whose pass ran only some of them (the rest may run
        later, e.g. a head called per chunk of the loss, or not at all) ends its pass with the
        root's, as FSDP2 does: resharded per its policy, unsharded again by the gradient of the
        root's output."""
        for state in self.root_context.states if self.root_context is not None else []:
            if state._forward_pending and state.training_state is TrainingState.FORWARD:
                output = state._finish_forward(module, output, backward_follows)
        return output

    def _finish_forward(self, module: nn.Module, output: Any, backward_follows: bool) -> Any:
        """The end of this state's forward pass: reshard (per policy), hook the start of its
        backward on `output`, remember the order for backward prefetching."""
        # In eval mode a backward rarely follows (a validation forward without no_grad): reshard
        # so the sharded parameters are registered again (state_dict, checkpointing); a
        # backward that does follow gathers them again in pre_backward.
        reshard = self.reshard_after_forward
        for group in self.groups:
            if reshard is True or not backward_follows or not module.training:
                group.reshard()
            elif reshard is False:  # keep the storage for backward, but show the sharded parameters meanwhile
                if not self._shows_unsharded():
                    group.register_sharded()
            else:  # an int: keep 1/N, so backward gathers within N ranks (each group: where its mesh is wider)
                group.reshard_to(reshard)
        if backward_follows:
            output = attach_pre_backward(self, output)
            context = self.root_context
            if context is not None:  # backward runs in reverse: remember who to prefetch
                self._forward_index = len(context.forward_order)
                context.forward_order.append(self)
        self.training_state = TrainingState.IDLE
        self._forward_pending.clear()
        return output

    def _tree_streams(self) -> list[CommStreams]:
        """The distinct communication streams of the groups in the tree (root only)."""
        states = self.root_context.states if self.root_context is not None else []
        return finalize.distinct_streams(group for state in states for group in state.groups)

    def _cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    # -- backward -----------------------------------------------------------------------------
    @labelled("composable::pre_backward")
    @untyped
    def _pre_backward(self) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        context = self.root_context
        if context is not None:
            context.backward_end.start_backward()  # the first pre-backward queues the end of backward
        self.training_state = TrainingState.PRE_BACKWARD
        for group in self.groups:
            group.reducer.drop_discarded_sums()  # zero_grad since a no-sync backward
        if self.unshard_in_backward:
            for group in self.groups:
                group.unshard()
        for group in self.groups:
            set_unsharded_grad_dtypes(group, reducing=self.requires_gradient_sync)
        for other in self.backward_prefetch or self._implicit_backward_prefetch():
            if other.training_state is not TrainingState.PRE_BACKWARD and other.unshard_in_backward:
                for group in other.groups:
                    group.unshard(async_op=True)

    def _implicit_backward_prefetch(self) -> list["ModuleState"]:
        """The state whose forward finished just before this one's: its backward comes next."""
        context = self.root_context
        index = self._forward_index
        if context is None or index is None or index == 0 or index > len(context.forward_order) - 1:
            return []
        previous = context.forward_order[index - 1]
        return [previous] if previous is not self and previous.groups else []

    @labelled("composable::post_backward")
    @untyped
    def _post_backward(self) -> None:
        if len(self.modules) > 1:
            self._backward_pending -= 1
            if self._backward_pending > 0 or self._backward_untracked:
                return  # gradients of other listed modules may still come: the last (or the end of backward) reduces
        self.training_state = TrainingState.POST_BACKWARD
        if self.groups:
            self.finish_backward_of_groups(reduce=self.requires_gradient_sync)

    def finish_backward_of_groups(self, reduce: bool, last: bool = False) -> None:
        """Reshard, then reduce if `reduce` (FSDP2's order: the reduction reads gradients, not the
        parameters, so their storage is not held while it allocates); no gradient sync: stash the
        gradients first. `last`: no all-gather comes before the optimizer step: free what waits one."""
        if not self.requires_gradient_sync:
            for group in self.groups:
                group.stash_grads()
        self.end_backward_of_groups()
        if reduce:
            if last:
                for streams in finalize.distinct_streams(self.groups):
                    streams.release_gather_buffers()
            self._launch_reduction()

    def end_backward_of_groups(self) -> None:
        """Reshard, or with `reshard_after_backward=False` keep the unsharded storage (the next
        forward gathers nothing, unless an optimizer step changed the shards meanwhile) while
        the modules show the sharded parameters."""
        for group in self.groups:
            if self.reshard_after_backward:
                group.reshard()
            elif not self._shows_unsharded():
                group.keep_unsharded()

    def _after_unshard(self) -> None:
        """Hook for subclasses: the unsharded parameters exist now."""

    def final_reduction_needed(self) -> bool:
        """Whether the end of backward must still launch this state's reductions."""
        return any(group.has_unsharded_grads() for group in self.groups)

    def _launch_reduction(self) -> None:
        for group in self.groups:
            group.reduce_grads()

    def _shows_unsharded(self) -> bool:
        """Whether a group kept unsharded stays registered unsharded between passes (finalize.py)."""
        return self.root_context is not None and self.root_context.backward_end.shows_unsharded()

    def clear_pass_bookkeeping(self) -> None:
        """Forget this iteration's pass: the end of backward, or `reset_iter_state` after an abort."""
        self.training_state = TrainingState.IDLE
        self._forward_index, self.ran_forward_with_grad = None, False
        self._backward_pending, self._backward_untracked = 0, False
        self._forward_pending.clear()
