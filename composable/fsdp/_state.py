"""The state `fully_shard` installs on a module: a `ModuleState` plus FSDP's options, and
FSDP2's expert methods with the same names, arguments and meaning as
`torch.distributed.fsdp.FSDPModule`'s (torch 2.11-2.15), each setting a field of the group's
reducer or gatherer that the engine reads once per collective (left at its default, a knob
costs one attribute read per reduction or gather). torch 2.15's manual backward finalization
is the engine's own: `_engine/module_state/finalize.py`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._engine.comm import custom_comms
from .._engine.dtypes.policies import MixedPrecisionPolicy, OffloadPolicy
from .._engine.groups.group import ParamGroup
from .._engine.hooks.contract import check_bool, get_state
from .._engine.module_state.reset import reset_iteration
from .._engine.module_state.state import ModuleState
from .group_comms import allocate_from_process_group, check_comm, use_symm_mem
from .strategy import ShardingStrategy, check_reshard_type, normalize_reshard


def make_post_forward_groups(api: str, reshard: bool | int, groups: list[ParamGroup]) -> None:
    """For an int `reshard_after_forward`: make the process groups backward all-gathers within,
    on each parameter group (each mesh of per-parameter meshes) whose shard world it splits.
    Creating process groups is collective: called at the same point on every rank."""
    if isinstance(reshard, bool):
        return
    for group in groups:
        if normalize_reshard(api, reshard, group.layout.shard_world) not in (True, False):
            group.layout.post_forward_group(reshard)


class FSDPState(ModuleState):
    """What `fully_shard.state(module)` returns.

    Attributes: `mesh`, `mp_policy`, `offload_policy`, `strategy`, `reshard_after_forward`,
    `param_names` (FQNs relative to the module of the parameters this call manages).
    Every public method of PyTorch FSDP2's `FSDPModule` is here under its own name (the
    module-level ones, `unshard`, `reshard`, ..., on `ModuleState`).
    """

    api_name = "fully_shard"

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        groups: list[ParamGroup],
        *,
        mesh: DeviceMesh,
        strategy: ShardingStrategy,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        reshard_after_forward: bool | int,
        reshard_is_default: bool,
        dp_mesh_dims: object = None,
    ) -> None:
        super().__init__(module, groups, mp_policy, reshard_after_forward, reshard_is_default)
        self.mesh = mesh
        self.dp_mesh_dims = dp_mesh_dims  # None, or the DataParallelMeshDims naming `mesh`'s data-parallel dims
        self.strategy = strategy
        self.offload_policy = offload_policy

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """In this module's pre-forward, start gathering these modules' parameters too."""
        self.forward_prefetch = _states_of("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """In this module's pre-backward, start gathering these modules' parameters too."""
        self.backward_prefetch = _states_of("set_modules_to_backward_prefetch", modules)

    def set_requires_all_reduce(self, requires_all_reduce: bool, recurse: bool = True) -> None:
        """HSDP gradient accumulation with less communication: with False, gradients are still
        reduce-scattered within the shard group every backward (so only sharded gradients are
        held, not full ones) but the all-reduce across replicas is deferred to the next
        backward with True, which reduces the accumulated sum once."""
        check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.reducer.options.requires_all_reduce = requires_all_reduce

    def _fsdp_states(self, recurse: bool) -> list["FSDPState"]:
        """This module's fully_shard state and, with `recurse`, every one below it."""
        modules = [sub for m in self.modules for sub in m.modules()] if recurse else self.modules
        found = {id(s): s for m in modules if (s := get_state(m, "fully_shard")) is not None}
        return list(found.values())  # once each: a state of several modules sits on each

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Change `reshard_after_forward` (bool, or an int N dividing the shard world: see
        `fully_shard`) of this module's state (and, with `recurse`, of every fully_shard state
        below it). Call it on every rank: an int makes its process groups the first time.
        An int where a state was made with `dp_mesh_dims` is `NotImplementedError` (as at the
        `fully_shard` call), and nothing changes."""
        api = "set_reshard_after_forward"
        check_reshard_type(api, reshard_after_forward)
        check_bool(api, "recurse", recurse)
        states = self._fsdp_states(recurse)
        if not isinstance(reshard_after_forward, bool):  # checked for every state before any changes
            for state in states:
                if state.dp_mesh_dims is not None:
                    raise NotImplementedError(
                        f"{api}: an int 'reshard_after_forward' ({reshard_after_forward}) is not supported on a module "
                        f"sharded with 'dp_mesh_dims' ({type(state.module).__name__}), as at fully_shard"
                    )
        for state in states:
            if state.strategy is ShardingStrategy.NO_SHARD:
                continue  # nothing sharded: nothing to reshard
            value = normalize_reshard(api, reshard_after_forward, state.mesh.size(state.mesh.ndim - 1))
            make_post_forward_groups(api, value, state.groups)
            state.reshard_after_forward = value
            state._reshard_is_default = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, recurse: bool = True) -> None:
        """False: after backward keep the unsharded parameters (the modules still show the
        sharded ones) so the next forward gathers nothing: for micro-batches without an
        optimizer step between them. If the sharded parameters change meanwhile (an optimizer
        step), the next forward notices and gathers them again."""
        api = "set_reshard_after_backward"
        check_bool(api, "reshard_after_backward", reshard_after_backward)
        check_bool(api, "recurse", recurse)
        for state in self._fsdp_states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce this module's gradients as a sum divided by `factor` instead of the average
        over the data-parallel ranks (on gloo and NCCL alike)."""
        api = "set_gradient_divide_factor"
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"{api}: 'factor' must be a number, got {factor!r}")
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"{api}: 'factor' must be a finite number > 0, got {factor!r}")
        for group in self.groups:
            group.reducer.options.divide_factor = float(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the end of the next backwards leaves gradient reductions in flight (they
        finish at the next forward), for micro-batches that do not step the optimizer; set it
        True again before the backward whose gradients the optimizer uses."""
        api = "set_is_last_backward"
        check_bool(api, "is_last_backward", is_last_backward)
        self.is_last_backward = is_last_backward
        if self.root_context is not None:
            self.root_context.root.is_last_backward = is_last_backward

    # -- gathering ----------------------------------------------------------------------------
    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not all-gather this module's parameters (its group stays
        sharded), for modules whose backward needs no parameter values, e.g. an embedding
        (its weight gradient needs only the indices). Gradients are still reduced. A forward
        re-run by activation checkpointing still gathers (it needs the values)."""
        check_bool("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward)
        self.unshard_in_backward = unshard_in_backward

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """True: `reshard` registers the sharded parameters again but keeps the unsharded
        parameters' storage (more memory: a full copy of the parameters stays), so the unsharded
        parameters keep their data pointers across reshard and unshard (CUDA graph capture).
        With `recurse`, also on every fully_shard module below this one. As torch 2.15's
        `FSDPModule.set_keep_unsharded_storage`."""
        api = "set_keep_unsharded_storage"
        check_bool(api, "keep", keep)
        check_bool(api, "recurse", recurse)
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.keep_unsharded_storage = keep

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's all-gathers (CUDA: the all-gather and reduce streams) wait on
        `event`, recorded after the optimizer step, instead of on everything queued on the
        current stream, which may hold unrelated work. Used once: pass a new event each
        iteration. On CPU (no streams) there is nothing to order: it does nothing."""
        if not isinstance(event, (torch.Event, torch.cuda.Event)):
            raise TypeError(f"set_post_optim_event: 'event' must be a torch.Event, got {type(event).__name__}")
        for state in self._fsdp_states(recurse=True):  # the tree's streams (one set per device)
            for group in state.groups:
                if group.streams is not None:
                    group.streams.post_optim_event = event

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: wait for the collectives in flight,
        reshard every group of the tree, discard the launched reductions (the failed
        iteration's gradients, HSDP partial sums and no-sync sums are lost: restart a sequence
        of micro-batches) and clear the iteration's bookkeeping; the next iteration runs
        normally. Call it on the root (the module run first): elsewhere RuntimeError."""
        reset_iteration(self, "reset_iter_state")

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this module's parameters with `comm`, an FSDP2 `AllGather`
        (`torch.distributed.fsdp._fully_shard._fsdp_api`): `comm.allocate(size, dtype=,
        device=)` makes the gather output and `comm(output, input, group, async_op=)` fills it
        (the input is this rank's slice of the output). Parameters of an all-gather extension
        (float8) keep their own gather."""
        api = "set_custom_all_gather"
        check_comm(api, comm)
        for group in self._sharded_groups(api):
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's gradients with `comm`, an FSDP2 `ReduceScatter`:
        `comm.allocate` makes its input and output, `comm(output, input, group, op,
        async_op=)` reduces (op is SUM, or AVG where the collectives average)."""
        api = "set_custom_reduce_scatter"
        check_comm(api, comm)
        for group in self._sharded_groups(api):
            group.reducer.options.reduce_scatter_comm = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """True: the all-gather output and the reduce-scatter buffers come from the process
        group's own allocator where its backend has one (NCCL: zero-copy transfers over
        SHARP); gloo has none, so plain memory. Not with `set_custom_all_gather` /
        `set_custom_reduce_scatter` (RuntimeError)."""
        api = "set_allocate_memory_from_process_group_for_comm"
        check_bool(api, "enable", enable)
        # Per-parameter meshes: each group its own process group's allocator (as FSDP2 makes
        # them per FSDPParamGroup).
        for group in self._sharded_groups(api):
            allocate_from_process_group(api, group, enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """All-gather outputs from symmetric memory (`torch.distributed._symmetric_memory`,
        NCCL), so NCCL takes its symmetric-memory all-gather (copy engine on one node); with
        `set_force_sum_reduction_for_comms(True)` first, the reduce-scatter too (NCCL's
        symmetric reduce-scatter sums only). CUDA with NCCL only (NotImplementedError
        otherwise); not with custom collectives (RuntimeError)."""
        api = "set_symm_mem_for_comm"
        if backend != "NCCL":
            raise ValueError(f"{api}: 'backend' must be 'NCCL', got {backend!r}")
        for group in self._sharded_groups(api):  # per-parameter meshes: each on its own
            use_symm_mem(api, group, backend)

    # -- reducing -----------------------------------------------------------------------------
    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Run `hook(reduce_output)` on this rank's reduced gradients of this module, in place,
        once per reduction: after the reduce-scatter (1D mesh; e.g. your own all-reduce over
        another set of ranks) or after HSDP's all-reduce; before the division that averages
        them where the collectives sum (gloo, `set_force_sum_reduction_for_comms`,
        `set_gradient_divide_factor`). `stream` (CUDA, not with HSDP): run the hook there."""
        api = "set_all_reduce_hook"
        if not callable(hook):
            raise TypeError(f"{api}: 'hook' must be callable, got {type(hook).__name__}")
        groups = self._sharded_groups(api)
        if stream is not None and any(group.layout.replicate_groups for group in groups):
            raise ValueError(
                f"{api}: 'stream' cannot be set when using HSDP (the hook runs on its all-reduce's stream)"
            )
        for group in groups:
            group.reducer.options.all_reduce_hook = hook
            group.reducer.options.all_reduce_hook_stream = stream

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: the collectives only ever sum (ReduceOp.SUM, never AVG), the averaging (or
        `set_gradient_divide_factor`) is a division after them, as NCCL's zero-copy and
        symmetric-memory collectives need. gloo always sums; NCCL in fp32 averages otherwise."""
        check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        for group in self.groups:
            group.reducer.options.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: every parameter that requires grad takes part in the reduction with a zero
        gradient where it got none, so after backward it has a (zero) gradient even when no
        rank used it. Ranks using different parameters (mixture of experts, conditional
        branches) need nothing: composable always reduces the same buffer on every rank."""
        api = "set_reduce_scatter_unused_params"
        check_bool(api, "reduce_scatter_unused_params", reduce_scatter_unused_params)
        check_bool(api, "recurse", recurse)
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.reducer.options.reduce_unused = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """CUDA: how many reduce-scatter input buffers may be in flight (1, the default: the
        next reduction's copy-in waits for the previous reduce-scatter). More lets backward
        go on while a slow reduce-scatter runs, at the price of that much more memory."""
        api = "set_reduce_scatter_max_input_buffers"
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"{api}: 'max_input_buffers' must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"{api}: 'max_input_buffers' must be >= 1, got {max_input_buffers}")
        check_bool(api, "recurse", recurse)
        # Per-parameter meshes: each group of a state has its own reduce-scatter comm.
        groups = [group for state in self._fsdp_states(recurse) for group in state.groups]
        for group in groups:  # checked for every group before any changes
            if max_input_buffers > 1 and isinstance(
                group.reducer.options.reduce_scatter_comm, custom_comms.SymmMemReduceScatter
            ):
                raise ValueError(
                    f"{api}: a symmetric-memory reduce-scatter keeps one input buffer, got {max_input_buffers}"
                )
        for group in groups:
            group.reducer.options.max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """True: reduce-scatter on a process group of its own over the same ranks (one per set
        of ranks, shared by the modules), so that it can run concurrently with backward's
        all-gathers; False: back to the shared group. Collective over each shard group: call
        it on every rank."""
        api = "set_separate_reduce_scatter_group"
        check_bool(api, "enable", enable)
        check_bool(api, "recurse", recurse)
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._separable_groups(api, enable, recurse):
            reducer = group.reducer
            if not enable:
                reducer.options.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(group.layout.shard_group))
            if ranks not in made:
                made[ranks] = reducer.options.reduce_scatter_group or dist.new_group(
                    list(ranks), use_local_synchronization=True, group_desc="composable_reduce_scatter"
                )
            reducer.options.reduce_scatter_group = made[ranks]

    def _separable_groups(self, api: str, enable: bool, recurse: bool) -> list[ParamGroup]:
        """The sharded groups `set_separate_reduce_scatter_group` changes. A module on several
        meshes has no one shard group to separate from: refused, before anything changes."""
        found = []
        for state in self._fsdp_states(recurse):
            sharded = [group for group in state.groups if group.layout.sharded]
            if enable and sharded and len(state.groups) > 1:
                raise NotImplementedError(
                    f"{api}: the module's parameters live on {len(state.groups)} meshes (shard_placement_fn's "
                    "ShardPlacementResult), each with its own 'shard_group': this method is not supported with "
                    "per-parameter meshes"
                )
            found += sharded
        return found

    def _sharded_groups(self, api: str) -> list[ParamGroup]:
        if self.strategy is ShardingStrategy.NO_SHARD:
            raise NotImplementedError(f"{api}: a NO_SHARD module neither all-gathers nor reduce-scatters")
        return self.groups  # none: no parameters here, nothing to set


def _states_of(api: str, modules: Iterable[nn.Module]) -> list[ModuleState]:
    states = []
    for module in modules:
        state = get_state(module, "fully_shard") if isinstance(module, nn.Module) else None
        if state is None:
            raise ValueError(f"{api}: every module must have fully_shard applied, got {type(module).__name__}")
        states.append(state)
    return states
