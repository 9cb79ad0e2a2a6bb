"""Flat, batched collectives and the copies around them. Knows nothing about modules.

All functions take plain tensors and process groups. Collectives are issued through the
`torch.distributed` front end (so `CommDebugMode` and the fake process group see them),
using the `*_single` names where this torch has them (the `*_into_tensor` names are
deprecated from 2.13 on).

A group of one rank (a world of one, or HSDP with one rank per shard group) has nothing to
exchange: its all-gather output is its input, and so is its reduce-scatter output (the sum,
and the average, over one rank). PyTorch FSDP2 issues neither there, so a single-GPU run costs
no collective launches; the same here: `all_gather`, `all_gather_coalesced` and
`reduce_scatter` copy (where output and input are not already the same memory) and return a
finished `Done` work. A custom collective (`set_custom_all_gather` / `set_custom_reduce_scatter`)
is skipped there too, as in FSDP2. The all-reduce over one rank leaves its tensor as it is:
`all_reduce` and `all_reduce_async` launch nothing there (HSDP whose replicate dimension has
one rank, as each torchft replica group's mesh, would otherwise pay a kernel and its launch
per group).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions as _AllgatherOptions
from torch._C._distributed_c10d import _resolve_process_group
from torch._subclasses.fake_tensor import is_fake

# torch leaves their results unannotated: a Work with `async_op`, else None.
_all_gather_single: Callable[..., dist.Work | None] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
_reduce_scatter_single: Callable[..., dist.Work | None] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


class Done:
    """The work of a collective that had nothing to exchange (a group of one rank): already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _gather_over_one_rank(output: torch.Tensor, input: torch.Tensor) -> None:
    """The all-gather over one rank: `output` holds `input`'s values (nothing to do where they
    are the same memory)."""
    same = output.data_ptr() == input.data_ptr() and output.numel() == input.numel()
    if not same and output.numel():
        # Refilling the gather output is no mutation autograd should see (as the collective's write).
        with refilling(output):
            output.view(-1).copy_(input.reshape(-1))


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool, custom: Any = None
) -> dist.Work | Done | None:
    """Gather every rank's 1D `input` into the 1D `output`, rank-major; through `custom` (an
    FSDP2 `AllGather`: `custom(output, input, group, async_op)`) when given. Over one rank: a
    copy, and `Done`."""
    if group.size() == 1:
        _gather_over_one_rank(output, input)
        return Done()
    if custom is not None:
        return cast("dist.Work | None", custom(output, input, group, async_op=async_op))  # FSDP2's AllGather
    return _all_gather_single(output, input, group=group, async_op=async_op)


def all_gather_coalesced(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> None:
    """Gather every rank's `inputs[i]` into `outputs[i]` (rank-major), all in one coalesced
    collective (one NCCL group launch) on the current stream. Issued on the process group
    itself: the front end offers it only through `_coalescing_manager`, whose bookkeeping
    costs more than the call. Over one rank: copies."""
    if group.size() == 1:
        for output, input in zip(outputs, inputs):
            _gather_over_one_rank(output, input)
        return
    opts = _AllgatherOptions()
    opts.asyncOp = False
    work = group.allgather_into_tensor_coalesced(list(outputs), list(inputs), opts)
    if work is not None:  # torch 2.11's NCCL returns none when it ran on the current stream
        work.wait()


def supports_coalesced_gather(group: dist.ProcessGroup, sample: torch.Tensor) -> bool:
    """Whether `all_gather_coalesced` works on `group` for tensors like `sample`: the
    coalesced op finds its process group by name, and torch 2.11 does not register every
    group under its name (a group of a sub-mesh can be missing), where it fails with "Could
    not resolve the process group"; and it has no fake-tensor kernel (examples/estimate.py
    runs the engine on fake tensors)."""
    if is_fake(sample):
        return False
    try:
        return _resolve_process_group(group.group_name) is not None
    except (RuntimeError, AttributeError):
        return False


def _op(average: bool) -> dist.ReduceOp.RedOpType:
    return dist.ReduceOp.AVG if average else dist.ReduceOp.SUM


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    average: bool,
    async_op: bool,
    custom: Any = None,
) -> dist.Work | Done | None:
    """Sum (or, where `supports_average`, average) the 1D `input` over ranks; rank r keeps
    region r in `output`. Through `custom` (an FSDP2 `ReduceScatter`: `custom(output, input,
    group, op, async_op)`) when given. Over one rank: a copy, and `Done`."""
    if group.size() == 1:
        output.copy_(input)
        return Done()
    if custom is not None:
        return cast("dist.Work | None", custom(output, input, group, _op(average), async_op=async_op))  # FSDP2's
    return _reduce_scatter_single(output, input, op=_op(average), group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, average: bool, async_op: bool) -> dist.Work | None:
    """Sum (or average) `tensor` over `group` in place: a Work with `async_op`, else None;
    nothing to do, and None, over one rank."""
    if group.size() == 1:
        return None
    work = dist.all_reduce(tensor, op=_op(average), group=group, async_op=async_op)
    return cast("dist.Work | None", work)  # torch leaves the result unannotated


def all_reduce_async(tensor: torch.Tensor, group: dist.ProcessGroup, average: bool) -> dist.Work | Done:
    """`all_reduce(..., async_op=True)` issued on the process group itself: it runs once per
    bucket inside backward, where the front end's argument checks and wrappers (a few
    microseconds each time) are CPU time small batches wait for. The process group still
    dispatches `c10d::allreduce_`, so dispatch modes and the fake process group see it. Over
    one rank: nothing to do, and `Done`."""
    if group.size() == 1:
        return Done()
    opts = dist.AllreduceOptions()
    opts.reduceOp = cast(dist.ReduceOp, _op(average))  # the binding converts the enum member
    return group.allreduce([tensor], opts)


def supports_average(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the collectives can average themselves (ReduceOp.AVG: NCCL), which saves a
    division kernel per reduction. Only for fp32/fp64: in half precision dividing before
    summing can underflow, so those keep the pre/post-factor division. gloo has no AVG."""
    return device.type == "cuda" and dtype in (torch.float32, torch.float64) and "nccl" in str(dist.get_backend(group))


@contextmanager
def refilling(*tensors: torch.Tensor) -> Iterator[None]:
    """Write into `tensors` without autograd seeing a mutation (no grad, version counters
    kept): refilling freed or reused storage with the values it is meant to hold must not
    invalidate the graphs that saved these tensors."""
    versions = tuple(t._version for t in tensors)
    with torch.no_grad():
        yield
    torch._C._autograd._unsafe_set_version_counter(tensors, versions)


def copy_out(
    all_gather_output: torch.Tensor, world: int, region_numels: Sequence[int], outputs: Sequence[torch.Tensor]
) -> None:
    """Scatter the rank-major all-gather output into per-parameter padded storages.

    `outputs[i]` is parameter i's padded unsharded storage (world * region_numels[i]
    elements). One fused kernel, `refilling` the outputs.
    """
    with refilling(*outputs):
        torch.split_with_sizes_copy(
            all_gather_output.view(world, -1), list(region_numels), dim=1, out=[o.view(world, -1) for o in outputs]
        )


def chunk_cat(
    tensors: Sequence[torch.Tensor],
    world: int,
    dtype: torch.dtype,
    device: torch.device,
    allocate: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The reduce-scatter input: each tensor split into `world` dim-0 chunks (zero padded),
    chunk r of every tensor concatenated into region r. Returns a 1D tensor, allocated by
    `allocate(size, dtype=, device=)` (a custom collective's `allocate`) when given."""
    # Empty tensors (dim 0 of size 0, or rows of 0 elements) take no room in any region, and
    # _chunk_cat rejects them.
    tensors = [t for t in tensors if t.numel() > 0]
    total = sum(-(-t.shape[0] // world) * (t.numel() // max(t.shape[0], 1)) for t in tensors)
    if allocate is None:
        out = torch.empty((world, total), dtype=dtype, device=device)
    else:
        out = allocate((world * total,), dtype=dtype, device=device).view(world, total)
    if not tensors:
        return out.view(-1)
    rows = _even_rows(tensors, world)
    if rows is None:
        torch._chunk_cat(tensors, dim=0, num_chunks=world, out=out)  # pads; casts as it copies
    else:
        # No padding: tensor i's chunk r is row r of its (world, n_i) view, and fills columns
        # [offset_i, offset_i + n_i) of row r of `out`. One multi-tensor copy (+cast) does all:
        # in a host-bound float8 step on an H100 host, _chunk_cat (which also builds and copies
        # per-call metadata to the device) took 450 us of host time per call, this 220 us.
        columns, offset = [], 0
        for row in rows:
            columns.append(out[:, offset : offset + row.shape[1]])
            offset += row.shape[1]
        torch._foreach_copy_(columns, rows)
    return out.view(-1)


def _even_rows(tensors: Sequence[torch.Tensor], world: int) -> list[torch.Tensor] | None:
    """Each tensor as a (world, numel / world) view, or None where one needs padding (dim 0 not
    a multiple of `world`) or has no such view (a permuted layout): `_chunk_cat` then."""
    rows = []
    for t in tensors:
        if t.dim() == 0 or t.shape[0] % world:
            return None
        try:
            rows.append(t.view(world, -1))
        except RuntimeError:
            return None
    return rows


def all_gather_int64(value: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank's `value` (a signed 64-bit integer), in group-rank order: one collective."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite `tensors` in place with group rank 0's values: one broadcast per
    (dtype, device), each of the tensors flattened into one buffer."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for bucket in buckets.values():
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, group=group, group_src=0)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def pack_regions(storages: Sequence[torch.Tensor], world: int, first: int, last: int) -> torch.Tensor:
    """Regions `first..last-1` of the rank-major all-gather output, rebuilt from the
    per-parameter padded storages that `copy_out` filled (the inverse of `copy_out` for a
    slice of the ranks). Returns a 1D tensor; one kernel."""
    rows = [s.view(world, -1)[first:last] for s in storages]
    out = torch.empty((last - first, sum(r.shape[1] for r in rows)), dtype=storages[0].dtype, device=storages[0].device)
    torch.cat(rows, dim=1, out=out)
    return out.view(-1)


def divide_factors(world: float, dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post): divide by `pre` before summing and by `post` after, `pre * post == world`.
    In half precision the division is split in powers of two so that neither the summands
    underflow nor the sum overflows."""
    if world == 1:
        return 1.0, 1.0
    if dtype in (torch.float16, torch.bfloat16):
        pre = 1
        while world % (pre * 2) == 0 and world // pre > pre:
            pre *= 2
        return float(pre), world / pre
    return 1.0, float(world)


def copy_to_pinned_host(output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`output` (on the GPU) copied, in `dtype`, into pinned host memory without waiting, on the
    current stream (the caller records an event after it). The cast runs on the GPU; its temporary
    is freed in that stream's order. Pinned blocks come from torch's caching host allocator, which
    hands a block out again only once the copies that used it are done."""
    host = torch.empty(output.shape, dtype=dtype, pin_memory=True)
    host.copy_(output if output.dtype == dtype else output.to(dtype), non_blocking=True)
    return host
