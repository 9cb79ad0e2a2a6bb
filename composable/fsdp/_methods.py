"""FSDP2's expert methods on `fully_shard.state(module)`: the same names, arguments and meaning
as `torch.distributed.fsdp.FSDPModule`'s (torch 2.11-2.15), over composable's engine.
(torch 2.15's manual backward finalization is the engine's own: `_engine/module_state/finalize.py`.)

Each sets a field of the groups' reducers or gatherers that the engine reads once per collective;
left at its default, a knob costs one attribute read per reduction or gather. A module whose
parameters live on several meshes (per-parameter meshes) has one group per mesh: each method
sets each group, binding collectives to that group's own process groups (as FSDP2 per
`FSDPParamGroup`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.distributed as dist

from .._engine.comm import custom_comms
from .._engine.hooks.contract import check_bool
from .._engine.module_state.reset import reset_iteration
from .strategy import ShardingStrategy

if TYPE_CHECKING:
    from .._engine.groups.group import ParamGroup


class FSDP2Methods:
    """Mixed into `FSDPState`; see `_state.py` for the attributes it reads."""

    groups: "list[ParamGroup]"
    strategy: ShardingStrategy
    unshard_in_backward: bool

    def _fsdp_states(self, recurse: bool) -> list[Any]:  # FSDPState's
        raise NotImplementedError

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
        reset_iteration(self, "reset_iter_state")  # type: ignore[arg-type]

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this module's parameters with `comm`, an FSDP2 `AllGather`
        (`torch.distributed.fsdp._fully_shard._fsdp_api`): `comm.allocate(size, dtype=,
        device=)` makes the gather output and `comm(output, input, group, async_op=)` fills it
        (the input is this rank's slice of the output). Parameters of an all-gather extension
        (float8) keep their own gather."""
        api = "set_custom_all_gather"
        _check_comm(api, comm)
        for group in self._sharded_groups(api):
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's gradients with `comm`, an FSDP2 `ReduceScatter`:
        `comm.allocate` makes its input and output, `comm(output, input, group, op,
        async_op=)` reduces (op is SUM, or AVG where the collectives average)."""
        api = "set_custom_reduce_scatter"
        _check_comm(api, comm)
        for group in self._sharded_groups(api):
            group.reducer.reduce_scatter_comm = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """True: the all-gather output and the reduce-scatter buffers come from the process
        group's own allocator where its backend has one (NCCL: zero-copy transfers over
        SHARP); gloo has none, so plain memory. Not with `set_custom_all_gather` /
        `set_custom_reduce_scatter` (RuntimeError)."""
        api = "set_allocate_memory_from_process_group_for_comm"
        check_bool(api, "enable", enable)
        gather_cls, reduce_cls = custom_comms.ProcessGroupAllocAllGather, custom_comms.ProcessGroupAllocReduceScatter
        for group in self._sharded_groups(api):
            _refuse_custom(api, group, gather_cls, reduce_cls)
            group.all_gather_comm = gather_cls(_shard_group(group)) if enable else None
            reducer = group.reducer
            reducer.reduce_scatter_comm = (
                reduce_cls(reducer.reduce_scatter_group or _shard_group(group)) if enable else None
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """All-gather outputs from symmetric memory (`torch.distributed._symmetric_memory`,
        NCCL), so NCCL takes its symmetric-memory all-gather (copy engine on one node); with
        `set_force_sum_reduction_for_comms(True)` first, the reduce-scatter too (NCCL's
        symmetric reduce-scatter sums only). CUDA with NCCL only (NotImplementedError
        otherwise); not with custom collectives (RuntimeError)."""
        api = "set_symm_mem_for_comm"
        if backend != "NCCL":
            raise ValueError(f"{api}: 'backend' must be 'NCCL', got {backend!r}")
        for group in self._sharded_groups(api):
            _use_symm_mem(api, group, backend)

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
            group.reducer.all_reduce_hook = hook
            group.reducer.all_reduce_hook_stream = stream

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: the collectives only ever sum (ReduceOp.SUM, never AVG), the averaging (or
        `set_gradient_divide_factor`) is a division after them, as NCCL's zero-copy and
        symmetric-memory collectives need. gloo always sums; NCCL in fp32 averages otherwise."""
        check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        for group in self.groups:
            group.reducer.force_sum = enable

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
                group.reducer.reduce_unused = reduce_scatter_unused_params

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
        groups = [group for state in self._fsdp_states(recurse) for group in state.groups]
        for group in groups:  # checked for every group before any changes
            if max_input_buffers > 1 and isinstance(
                group.reducer.reduce_scatter_comm, custom_comms.SymmMemReduceScatter
            ):
                raise ValueError(
                    f"{api}: a symmetric-memory reduce-scatter keeps one input buffer, got {max_input_buffers}"
                )
        for group in groups:
            group.reducer.max_input_buffers = max_input_buffers

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
                reducer.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(group.layout.shard_group))
            if ranks not in made:
                made[ranks] = reducer.reduce_scatter_group or dist.new_group(
                    list(ranks), use_local_synchronization=True, group_desc="composable_reduce_scatter"
                )
            reducer.reduce_scatter_group = made[ranks]

    def _separable_groups(self, api: str, enable: bool, recurse: bool) -> "list[ParamGroup]":
        """The sharded groups `set_separate_reduce_scatter_group` changes. A module on several
        meshes has no one shard group to separate from: refused, as it always was."""
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

    def _sharded_groups(self, api: str) -> "list[ParamGroup]":
        if self.strategy is ShardingStrategy.NO_SHARD:
            raise NotImplementedError(f"{api}: a NO_SHARD module neither all-gathers nor reduce-scatters")
        return self.groups  # none: no parameters here, nothing to set


def _check_comm(api: str, comm: Any) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{api}: 'comm' must be an FSDP2 AllGather/ReduceScatter (allocate() and __call__), got {type(comm).__name__}"
        )


def _shard_group(group: "ParamGroup") -> dist.ProcessGroup:
    # None only in a replicated layout (spmd parameters without a shard mesh), which neither
    # gathers nor reduce-scatters: its collectives are made but never called.
    return cast(dist.ProcessGroup, group.layout.shard_group)


def _use_symm_mem(api: str, group: "ParamGroup", backend: str) -> None:
    """`set_symm_mem_for_comm` on one group: its all-gather (and, summing only, its
    reduce-scatter) from symmetric memory over its own shard group."""
    shard_group = _shard_group(group)
    if group.config.device.type != "cuda" or "nccl" not in str(dist.get_backend(shard_group)):
        raise NotImplementedError(
            f"{api}: symmetric memory needs CUDA with NCCL, got device {group.config.device} "
            f"and backend {dist.get_backend(shard_group)}"
        )
    _refuse_custom(api, group, custom_comms.SymmMemAllGather, custom_comms.SymmMemReduceScatter)
    reducer = group.reducer
    if reducer.force_sum and reducer.max_input_buffers > 1:
        raise ValueError(
            f"{api}: a symmetric-memory reduce-scatter keeps one input buffer; "
            f"set_reduce_scatter_max_input_buffers is {reducer.max_input_buffers}"
        )
    group.all_gather_comm = custom_comms.SymmMemAllGather(shard_group, backend)
    if reducer.force_sum:
        rs_group = reducer.reduce_scatter_group or shard_group
        reducer.reduce_scatter_comm = custom_comms.SymmMemReduceScatter(rs_group, backend)


def _refuse_custom(api: str, group: "ParamGroup", gather_cls: type, reduce_cls: type) -> None:
    for current, own in (
        (group.all_gather_comm, gather_cls),
        (group.reducer.reduce_scatter_comm, reduce_cls),
    ):
        if current is not None and not isinstance(current, own):
            raise RuntimeError(
                f"{api}: cannot be used together with a custom collective ({type(current).__name__}, "
                "from set_custom_all_gather / set_custom_reduce_scatter or another allocation method)"
            )
