"""The state `replicate` installs: a `ModuleState` whose group all-reduces gradients in
buckets, each launched from post-accumulate-grad hooks as soon as its gradients are ready."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._engine.module_state.state import ModuleState

if TYPE_CHECKING:
    from .._engine.grads.buckets import BucketedReducer
    from .._engine.groups.group import ParamGroup
    from .._engine.params.param import ManagedParam


class ReplicateState(ModuleState):
    """What `replicate.state(module)` returns: `mesh`, `mp_policy`, `bucket_cap_mb`,
    `param_names`."""

    api_name = "replicate"
    mesh: DeviceMesh  # set by `replicate`, as is `bucket_cap_mb`
    bucket_cap_mb: float

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None]) -> None:
        """Run `hook(bucket)` in place on each of this module's gradient buckets once it is
        all-reduced over the mesh, before the division that averages it where the collectives
        sum (gloo): to extend the data-parallel dimension over ranks the mesh does not hold, as
        `composable.integrations.torchft.fault_tolerant` does across replica groups. The hook
        runs on the training thread, as the bucket's all-reduce finishes."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: 'hook' must be callable, got {type(hook).__name__}")
        for group in self.groups:
            group.reducer.options.all_reduce_hook = hook

    def _after_unshard(self) -> None:
        # Unsharded parameters are created lazily (and again after a dtype change), so the
        # gradient-ready hooks are attached to whichever object is current.
        for group in self.groups:
            for mp in group.params:
                up = mp.unsharded_param
                if mp.wants_grad and up is not None and mp.hooked_param is not up:
                    up.register_post_accumulate_grad_hook(self._make_grad_ready_hook(group, mp))
                    mp.hooked_param = up

    def _make_grad_ready_hook(self, group: ParamGroup, mp: ManagedParam) -> Callable[[torch.Tensor], None]:
        # Weak references only: the hook lives on the unsharded parameter (in C++), which the
        # state holds; strong ones would make a cycle the garbage collector cannot see and the
        # model would never be freed.
        state_ref, group_ref, mp_ref = weakref.ref(self), weakref.ref(group), weakref.ref(mp)

        def hook(_param: torch.Tensor) -> None:
            state, owner, managed = state_ref(), group_ref(), mp_ref()
            if state is not None and owner is not None and managed is not None and state.requires_gradient_sync:
                # The group's reducer buckets (`bucket_cap_bytes`).
                cast("BucketedReducer", owner.reducer).on_grad_ready(managed)

        return hook

    def final_reduction_needed(self) -> bool:
        # Buckets this rank did not fill may have been filled on another rank: every rank
        # whose forward ran (DDP semantics: all ranks run it) launches every remaining bucket,
        # whatever its own gradients.
        return bool(self.groups) and self.ran_forward_with_grad

    def _launch_reduction(self) -> None:
        for group in self.groups:
            cast("BucketedReducer", group.reducer).flush_buckets()
