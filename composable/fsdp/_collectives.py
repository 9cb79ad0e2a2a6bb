"""Flat, batched collectives and the copies around them. Knows nothing about modules.

All functions take plain tensors and process groups. Collectives are issued through the
`torch.distributed` front end (so `CommDebugMode` and the fake process group see them),
using the `*_single` names where this torch has them (the `*_into_tensor` names are
deprecated from 2.13 on).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool) -> dist.Work | None:
    """Gather every rank's 1D `input` into the 1D `output`, rank-major."""
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_sum(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool) -> dist.Work | None:
    """Sum the 1D `input` over ranks; rank r keeps region r in `output`. (gloo has no AVG or
    PREMUL_SUM, so averaging is a separate multiply.)"""
    return _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool) -> dist.Work | None:
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def copy_out(all_gather_output: torch.Tensor, world: int, region_numels: Sequence[int], outputs: Sequence[torch.Tensor]) -> None:
    """Scatter the rank-major all-gather output into per-parameter padded storages.

    `outputs[i]` is parameter i's padded unsharded storage (world * region_numels[i]
    elements). One fused kernel; autograd's version counters of the outputs are preserved
    because refilling freed storage is not a mutation autograd should see.
    """
    versions = tuple(out._version for out in outputs)
    with torch.no_grad():
        torch.split_with_sizes_copy(
            all_gather_output.view(world, -1), list(region_numels), dim=1, out=[o.view(world, -1) for o in outputs]
        )
    torch._C._autograd._unsafe_set_version_counter(tuple(outputs), versions)


def chunk_cat(tensors: Sequence[torch.Tensor], world: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The reduce-scatter input: each tensor split into `world` dim-0 chunks (zero padded),
    chunk r of every tensor concatenated into region r. Returns a 1D tensor."""
    src_dtype = tensors[0].dtype if tensors else dtype
    # Empty tensors (dim 0 of size 0, or rows of 0 elements) take no room in any region, and
    # _chunk_cat rejects them.
    tensors = [t for t in tensors if t.numel() > 0]
    total = sum(-(-t.shape[0] // world) * (t.numel() // max(t.shape[0], 1)) for t in tensors)
    out = torch.empty((world, total), dtype=src_dtype, device=device)
    if tensors:
        torch._chunk_cat(tensors, dim=0, num_chunks=world, out=out)
    # _chunk_cat cannot cast; one flat cast costs the same as casting each gradient.
    return out.view(-1) if src_dtype == dtype else out.view(-1).to(dtype)
