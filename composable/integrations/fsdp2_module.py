"""FSDP2's module interface (`torch.distributed.fsdp.FSDPModule`) over composable's `fully_shard`.

Frameworks written for PyTorch FSDP2 find sharded modules with `isinstance(m, FSDPModule)` and
call FSDP2's methods on them (`m.set_requires_gradient_sync(False)` for gradient accumulation,
`m.set_gradient_divide_factor(1.0)`, `m.unshard()`, ...). composable's core never swaps classes:
its state, `fully_shard.state(m)`, has those methods. This opt-in adapter does what FSDP2 does
and the core does not: `as_fsdp_module(m)` swaps `m.__class__` for a subclass of
`(ComposableFSDPModule, type(m))`, where `ComposableFSDPModule` derives from FSDP2's
`FSDPModule` and forwards each method to `fully_shard.state(m)`, named `FSDP<Cls>` as FSDP2 names
it: every public method of torch 2.11-2.15's `FSDPModule` has its counterpart there (docs/fsdp2_methods.md). A method a
later torch adds, and FSDP2's private ones, raise `NotImplementedError` naming the method
(`UNSUPPORTED_METHODS` lists them). Parameter names and `state_dict()` are unchanged;
`restore_class(m)` undoes the swap.

`fsdp2_fully_shard` answers as FSDP2's `fully_shard` does: `fsdp2_fully_shard.state(m)`, a second
application refused with FSDP2's error type and words (`AlreadyShardedError`), containers without
a `forward` (`ModuleList`, `ModuleDict`) refused with `ValueError`. One decided difference:
`copy.deepcopy` of a sharded module works (FSDP2 raises), as in composable's core.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable, Literal, Sequence, cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

import composable
from composable import fully_shard
from composable._engine.dtypes.policies import check_policies
from composable._engine.hooks.contract import answers_state

__all__ = [
    "AlreadyShardedError",
    "ComposableFSDPModule",
    "UNSUPPORTED_METHODS",
    "as_fsdp_module",
    "as_fsdp_modules",
    "restore_class",
    "fsdp2_fully_shard",
]


class AlreadyShardedError(RuntimeError, AssertionError):
    """`fsdp2_fully_shard` applied twice to one module: a `RuntimeError` as composable's forbidden
    compositions are, and an `AssertionError` as FSDP2 raises it, so code written for either catches it."""


class ComposableFSDPModule(FSDPModule):
    """Mixin placed before the module's own class: FSDP2's methods, run by composable's state."""

    _composable_orig_cls: type[nn.Module]  # set on each generated subclass

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Constructing the class anew (a container sliced, `type(m)(...)`) builds the original
        # class, as FSDP2 does; allocation without arguments (copy.deepcopy, pickle's protocol 2)
        # keeps the adapted class so the copy keeps the interface.
        if args or kwargs:
            orig = cls._composable_orig_cls
            module = orig.__new__(orig)
            type(module).__init__(module, *args, **kwargs)
            return module
        return object.__new__(cls)

    def _composable_state(self, method: str) -> Any:
        state = fully_shard.state(cast(nn.Module, self))  # the mixin is always on an nn.Module
        if state is None:
            raise RuntimeError(
                f"{method}: {type(self).__name__} has FSDP2's interface but composable's fully_shard does not "
                "manage it (it was constructed anew, or fully_shard was never applied to it)"
            )
        return state

    # FSDP2's methods, same names and arguments, forwarded to composable's state.
    def unshard(self, async_op: bool = False) -> Any:
        return self._composable_state("unshard").unshard(async_op=async_op)

    def reshard(self) -> None:
        self._composable_state("reshard").reshard()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        _reject_torch_pipeline_stage(sys._getframe(1), cast(nn.Module, self))
        self._composable_state("set_is_last_backward").set_is_last_backward(is_last_backward)

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        self._composable_state("set_manual_backward_finalization").set_manual_backward_finalization(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> Any:
        return self._composable_state("finalize_backward").finalize_backward(async_op=async_op)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        self._composable_state("set_keep_unsharded_storage").set_keep_unsharded_storage(keep, recurse=recurse)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self._composable_state("set_requires_gradient_sync").set_requires_gradient_sync(
            requires_gradient_sync, recurse=recurse
        )

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        self._composable_state("set_requires_all_reduce").set_requires_all_reduce(requires_all_reduce, recurse=recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        self._composable_state("set_reshard_after_forward").set_reshard_after_forward(
            reshard_after_forward, recurse=recurse
        )

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        self._composable_state("set_reshard_after_backward").set_reshard_after_backward(
            reshard_after_backward, recurse=recurse
        )

    def set_modules_to_forward_prefetch(self, modules: Sequence[nn.Module | FSDPModule]) -> None:
        self._composable_state("set_modules_to_forward_prefetch").set_modules_to_forward_prefetch(modules)

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module | FSDPModule]) -> None:
        self._composable_state("set_modules_to_backward_prefetch").set_modules_to_backward_prefetch(modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        self._composable_state("set_gradient_divide_factor").set_gradient_divide_factor(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:  # FSDP2's older name
        self.set_gradient_divide_factor(factor)

    def reset_iter_state(self) -> None:
        self._composable_state("reset_iter_state").reset_iter_state()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        self._composable_state("set_unshard_in_backward").set_unshard_in_backward(unshard_in_backward)

    def set_post_optim_event(self, event: torch.Event) -> None:
        self._composable_state("set_post_optim_event").set_post_optim_event(event)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        self._composable_state("set_all_reduce_hook").set_all_reduce_hook(hook, stream=stream)

    def set_custom_all_gather(self, comm: Any) -> None:
        self._composable_state("set_custom_all_gather").set_custom_all_gather(comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        self._composable_state("set_custom_reduce_scatter").set_custom_reduce_scatter(comm)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        self._composable_state("set_force_sum_reduction_for_comms").set_force_sum_reduction_for_comms(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        self._composable_state("set_reduce_scatter_unused_params").set_reduce_scatter_unused_params(
            reduce_scatter_unused_params, recurse=recurse
        )

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        self._composable_state("set_reduce_scatter_max_input_buffers").set_reduce_scatter_max_input_buffers(
            max_input_buffers, recurse=recurse
        )

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        self._composable_state("set_separate_reduce_scatter_group").set_separate_reduce_scatter_group(
            enable, recurse=recurse
        )

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        state = self._composable_state("set_allocate_memory_from_process_group_for_comm")
        state.set_allocate_memory_from_process_group_for_comm(enable)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        self._composable_state("set_symm_mem_for_comm").set_symm_mem_for_comm(backend)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Skip FSDPModule._apply (it needs FSDP2's own state); composable's hooks adopt the result.
        # The next class after FSDPModule is the module's own (an nn.Module), unknown to the checker.
        return super(FSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]  # torch's FSDPModule: a bare mixin


def _reject_torch_pipeline_stage(caller: FrameType, module: nn.Module) -> None:
    """torch's own pipeline stages before 2.15 call `set_is_last_backward` first in each
    microbatch's backward and, after the last, reach into FSDP2's private state
    (`fully_shard.state(m)`'s `_state_ctx`, which a composable module does not have): fail
    there, before any gradient, with the stage that works (the engine already refuses such a
    stage at the first forward; this catches a module whose first forward ran outside it).
    `ComposablePipelineStage` (a subclass) is let through."""
    if caller.f_code.co_name != "backward_maybe_with_nosync":
        return
    if caller.f_globals.get("__name__") != "torch.distributed.pipelining.stage":
        return
    from .pipelining import ComposablePipelineStage

    stage = caller.f_locals.get("self")
    if not isinstance(stage, ComposablePipelineStage):
        raise RuntimeError(
            f"torch.distributed.pipelining: {type(stage).__name__} cannot drive composable's FSDP2 module adapter "
            f"(module {type(module).__name__}; it reaches into FSDP2's private state): build the stage with "
            "composable.integrations.pipelining.pipeline_stage(module, stage_index, num_stages, device, group=...)"
        )


def _unsupported(name: str) -> Any:
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{name}: PyTorch FSDP2's FSDPModule.{name} has no composable counterpart "
            f"(module {type(self).__name__}); see composable.fully_shard.state(module) for what it offers"
        )

    method.__name__ = name
    return method


# Every other FSDPModule method of the installed torch (FSDP2's private ones, and public ones a
# later release adds) fails loudly instead of reaching FSDP2's missing state.
UNSUPPORTED_METHODS: tuple[str, ...] = tuple(
    name
    for name, value in vars(FSDPModule).items()
    if callable(value) and not name.startswith("__") and name not in vars(ComposableFSDPModule)
)
for _name in UNSUPPORTED_METHODS:
    setattr(ComposableFSDPModule, _name, _unsupported(_name))

_classes: dict[type[nn.Module], type[nn.Module]] = {}


def as_fsdp_module(module: nn.Module) -> nn.Module:
    """Give `module`, which `fully_shard` manages, FSDP2's module interface; returns `module`.

    Afterwards `isinstance(module, torch.distributed.fsdp.FSDPModule)` holds and FSDP2's methods
    (`set_requires_gradient_sync`, `set_gradient_divide_factor`, `unshard`, ...) act on
    `fully_shard.state(module)`. Idempotent. Raises `TypeError` for a non-module and
    `ValueError` when `fully_shard` does not manage `module`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"as_fsdp_module: argument 'module' must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, ComposableFSDPModule):
        return module
    if fully_shard.state(module) is None:
        raise ValueError(
            f"as_fsdp_module: composable's fully_shard does not manage module {type(module).__name__}; apply it first"
        )
    cls = type(module)
    adapted = _classes.get(cls)
    if adapted is None:
        adapted = type(f"FSDP{cls.__name__}", (ComposableFSDPModule, cls), {"_composable_orig_cls": cls})
        adapted.__module__ = cls.__module__
        _classes[cls] = adapted
    module.__class__ = adapted
    _show_unsharded_between_passes(module, True)
    return module


def _show_unsharded_between_passes(module: nn.Module, show: bool) -> None:
    """FSDP2 keeps the unsharded parameters registered after a forward that does not reshard
    (`reshard_after_forward=False`) until backward reshards; composable's core shows the
    sharded ones meanwhile (docs/migrating.md). The adapter does as FSDP2."""
    state = fully_shard.state(module)
    for group in state.groups if state is not None else []:
        group.shows_unsharded_between_passes = show


def as_fsdp_modules(root: nn.Module) -> nn.Module:
    """`as_fsdp_module` on every module of `root`'s tree that `fully_shard` manages; returns `root`."""
    for module in root.modules():
        if fully_shard.state(module) is not None:
            as_fsdp_module(module)
    return root


def restore_class(module: nn.Module) -> nn.Module:
    """Undo `as_fsdp_module`: `module` gets its own class back; returns `module`."""
    if isinstance(module, ComposableFSDPModule):
        setattr(module, "__class__", type(module)._composable_orig_cls)
        _show_unsharded_between_passes(module, False)
    return module


def _policies(mp_policy: Any, offload_policy: Any) -> tuple[composable.MixedPrecisionPolicy, composable.OffloadPolicy]:
    """FSDP2's (or composable's) policies as composable's: same fields, same meaning."""
    mp, offload = check_policies("fully_shard", mp_policy, offload_policy)
    return mp, offload


@answers_state(fully_shard.state)  # as FSDP2's `fully_shard.state`
def fsdp2_fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Any = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """PyTorch FSDP2's `fully_shard` signature, sharding with composable's `fully_shard`.

    Takes FSDP2's policy objects (`torch.distributed.fsdp.MixedPrecisionPolicy`,
    `OffloadPolicy`, `CPUOffloadPolicy`) as well as composable's, and gives the sharded
    module(s) FSDP2's module interface (`as_fsdp_module`), so a framework that calls FSDP2's
    `fully_shard` and then FSDP2's methods can be handed this function instead; `dp_mesh_dims`
    (full-DTensor meshes) is passed on.

    As FSDP2's: `ValueError` for a container without a `forward` (`nn.ModuleList`,
    `nn.ModuleDict`: nothing would call its hooks; the core refuses it), and `AlreadyShardedError` (an
    `AssertionError`, FSDP2's type, and a `RuntimeError`) for a module it already manages.
    `fsdp2_fully_shard.state(module)` is `composable.fully_shard.state(module)`.
    """
    for m in module if isinstance(module, (list, tuple)) else [module]:
        _check_not_sharded(m)
    mp, offload = _policies(
        mp_policy if mp_policy is not None else composable.MixedPrecisionPolicy(),
        offload_policy if offload_policy is not None else composable.OffloadPolicy(),
    )
    result = fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp,
        offload_policy=offload,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
    )
    for m in result if isinstance(result, (list, tuple)) else [result]:
        as_fsdp_module(m)
    return result


def _check_not_sharded(module: nn.Module) -> None:
    """A second application, refused as FSDP2 refuses it (containers without a forward: the core
    refuses them as FSDP2 does)."""
    if fully_shard.state(module) is not None:
        raise AlreadyShardedError(
            f"fully_shard: argument 'module' ({type(module).__name__}) is already sharded. Each distinct "
            "composable distributed API can only be applied to a module once."
        )
