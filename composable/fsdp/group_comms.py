"""A parameter group's collectives as FSDP2's communication methods set them (`_state.py`):
which objects count as custom collectives, and the process-group allocator and symmetric
memory set up on one group (one mesh: per-parameter meshes set each of their groups).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from .._engine.comm import custom_comms

if TYPE_CHECKING:
    from .._engine.groups.group import ParamGroup


def check_comm(api: str, comm: Any) -> None:
    """Refuse what is not an FSDP2 `AllGather` / `ReduceScatter` (TypeError)."""
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{api}: 'comm' must be an FSDP2 AllGather/ReduceScatter (allocate() and __call__), got {type(comm).__name__}"
        )


def _shard_group(group: "ParamGroup") -> dist.ProcessGroup:
    # None only in a replicated layout (spmd parameters without a shard mesh), which neither
    # gathers nor reduce-scatters: its collectives are made but never called.
    return cast(dist.ProcessGroup, group.layout.shard_group)


def _refuse_custom(api: str, group: "ParamGroup", gather_cls: type, reduce_cls: type) -> None:
    for current, own in (
        (group.all_gather_comm, gather_cls),
        (group.reducer.options.reduce_scatter_comm, reduce_cls),
    ):
        if current is not None and not isinstance(current, own):
            raise RuntimeError(
                f"{api}: cannot be used together with a custom collective ({type(current).__name__}, "
                "from set_custom_all_gather / set_custom_reduce_scatter or another allocation method)"
            )


def allocate_from_process_group(api: str, group: "ParamGroup", enable: bool) -> None:
    """`set_allocate_memory_from_process_group_for_comm` on one group: its all-gather output
    and reduce-scatter buffers from its process group's allocator (`enable`), or not."""
    gather_cls, reduce_cls = custom_comms.ProcessGroupAllocAllGather, custom_comms.ProcessGroupAllocReduceScatter
    _refuse_custom(api, group, gather_cls, reduce_cls)
    group.all_gather_comm = gather_cls(_shard_group(group)) if enable else None
    reducer = group.reducer
    reducer.options.reduce_scatter_comm = (
        reduce_cls(reducer.options.reduce_scatter_group or _shard_group(group)) if enable else None
    )


def use_symm_mem(api: str, group: "ParamGroup", backend: str) -> None:
    """`set_symm_mem_for_comm` on one group: its all-gather output, and its reduce-scatter's
    buffers where it only sums, from symmetric memory."""
    shard_group = _shard_group(group)
    if group.config.device.type != "cuda" or "nccl" not in str(dist.get_backend(shard_group)):
        raise NotImplementedError(
            f"{api}: symmetric memory needs CUDA with NCCL, got device {group.config.device} "
            f"and backend {dist.get_backend(shard_group)}"
        )
    _refuse_custom(api, group, custom_comms.SymmMemAllGather, custom_comms.SymmMemReduceScatter)
    reducer = group.reducer
    if reducer.options.force_sum and reducer.options.max_input_buffers > 1:
        raise ValueError(
            f"{api}: a symmetric-memory reduce-scatter keeps one input buffer; "
            f"set_reduce_scatter_max_input_buffers is {reducer.options.max_input_buffers}"
        )
    group.all_gather_comm = custom_comms.SymmMemAllGather(shard_group, backend)
    if reducer.options.force_sum:
        rs_group = reducer.options.reduce_scatter_group or shard_group
        reducer.options.reduce_scatter_comm = custom_comms.SymmMemReduceScatter(rs_group, backend)
