"""Collectives that allocate their buffers elsewhere: FSDP2's `AllGather` / `ReduceScatter`
interface (`allocate(size, *, dtype, device)` then `__call__`), as its
`set_allocate_memory_from_process_group_for_comm` and `set_symm_mem_for_comm` install them.

A group uses such an object in place of its default all-gather (flat gather output) or
reduce-scatter (input and output): `allocate` makes the buffer, `__call__` runs the collective
on it. Knows nothing about modules.
"""

from __future__ import annotations

import math
from typing import Any, Sequence, cast

import torch
import torch.distributed as dist

try:  # FSDP2's interface: a user's custom collective subclasses these
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - every supported torch has them

    class AllGather:  # type: ignore[no-redef]  # typed as torch's class; the stand-in for an older torch
        pass

    class ReduceScatter:  # type: ignore[no-redef]  # typed as torch's class; the stand-in for an older torch
        pass


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _ProcessGroupAlloc:
    """Buffers from the process group's own allocator where its backend has one (NCCL: zero-copy
    transfers over SHARP), plain `torch.empty` otherwise (gloo)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        backend = self._group._get_backend(device)
        supports = getattr(backend, "supports_tensor_alloc", None)
        if supports is not None and supports(device):
            return backend.allocate_tensor(math.prod(int(s) for s in size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)


class _SymmMemAlloc:
    """Buffers from the symmetric-memory pool of `backend` (NCCL), reused across calls; the
    collectives rendezvous on them, so NCCL takes its symmetric-memory algorithms."""

    def __init__(self, group: dist.ProcessGroup, backend: str) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self._group = group
        self._symm_mem = symm_mem
        symm_mem.set_backend(cast(Any, backend))  # a name its Literal type lists: callers check it
        dist.barrier(group=group)  # the communicator exists before the first rendezvous

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with torch.cuda.use_mem_pool(self._symm_mem.get_mem_pool(device)):
            return torch.empty(*size, dtype=dtype, device=device)


class ProcessGroupAllocAllGather(_ProcessGroupAlloc, AllGather):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class ProcessGroupAllocReduceScatter(_ProcessGroupAlloc, ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        return _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class SymmMemAllGather(_SymmMemAlloc, AllGather):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        self._symm_mem.rendezvous(output_tensor, group=group.group_name)  # in place: the input is a slice of it
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class SymmMemReduceScatter(_SymmMemAlloc, ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self._symm_mem.rendezvous(input_tensor, group=group.group_name)
        self._symm_mem.rendezvous(output_tensor, group=group.group_name)
        return _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


BUILT_IN = (ProcessGroupAllocAllGather, ProcessGroupAllocReduceScatter, SymmMemAllGather, SymmMemReduceScatter)
