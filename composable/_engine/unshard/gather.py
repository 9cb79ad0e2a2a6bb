"""All-gathering a sharded group's parameters into their unsharded storages.

Two ways, chosen per unshard:
- direct (CUDA, every parameter sharded on dim 0, the whole shard group gathering): one coalesced
  all-gather whose outputs are the parameters' own padded unsharded storages. Each of those
  is exactly its parameter's rank-major gather (dim-0 chunks, padded alike on every rank), so
  nothing is copied out afterwards: no copy-out kernel on the compute stream (about 2 ms per
  step of the 1B benchmark) and no separate gather buffer alive beside the parameters.
- flat (CPU; a parameter sharded on a dim > 0; backward's gather within N ranks after
  `reshard_after_forward=N`, whose input interleaves every parameter's regions): one
  all-gather into a rank-major buffer, then one fused copy-out.

Either way the gather is in place: this rank's regions are copied (+cast, +host-to-device when
offloading) into its own slot of the output, by one fused copy.

Streams (CUDA): the gather runs on the all-gather stream; in the direct way the unsharded
storages are allocated there too (the all-gather stream's memory pool), so the gather need not
wait for the compute stream. Their frees are deferred (`CommStreams.defer_free`): the next
all-gather first waits for the compute stream's last use of them, so the memory is reused in
stream order without `record_stream`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist

from ..comm import collectives as comm
from ..comm.streams import CommStreams, current_stream, stream_context

if TYPE_CHECKING:
    from ..params.param import ManagedParam


class GatherRiders(Protocol):
    """Tensors that travel in a group's all-gather beside its flat parameters (its extension
    parameters' inputs: extension_batch.py; its float8 weights: extension.py). Direct way: the
    collective also gathers `inputs` into `outputs`, filled by `cast()` on the all-gather
    stream. Flat way (`TailRiders` only): `copy_in` packs `nbytes` into the tail of this
    rank's row of the output, `copy_out` splits the gathered tails back."""

    outputs: list[torch.Tensor]
    inputs: list[torch.Tensor]

    def cast(self) -> None: ...


class TailRiders(GatherRiders, Protocol):
    """Riders that also travel in the flat way (see `GatherRiders`)."""

    @property
    def nbytes(self) -> int: ...

    def copy_in(self, slot: torch.Tensor) -> None: ...

    def copy_out(self, rows: torch.Tensor) -> None: ...


@dataclass
class PendingGather:
    """A launched all-gather: what `finish_gather` waits for and what it must keep alive."""

    work: "dist.Work | comm.Done | torch.cuda.Event | None"
    direct: bool
    output: torch.Tensor | None  # flat way: the rank-major gather output
    input: torch.Tensor  # this rank's regions, cast; kept alive until the gather is done
    source: torch.Tensor  # a post-forward shard made on the compute stream lives until then too
    riders: "TailRiders | None" = None  # flat way: riders whose bytes are each row's tail
    tail: int = 0  # the tail's length in elements of the output's dtype


def gathers_directly(params: list["ManagedParam"], coalesced_ok: bool, full_group: bool) -> bool:
    """Whether `start_gather` can gather straight into the parameters' storages: the whole
    shard group gathers, every parameter is sharded on dim 0, and the process group takes
    coalesced all-gathers (`comm.supports_coalesced_gather`; CUDA only: the copy-out it saves
    is a GPU cost, and gloo's coalesced all-gather, issued asynchronously beside our other
    collectives, crashed a 30-step loop in 1 of 14 runs, the flat gather in 0 of 14)."""
    return coalesced_ok and full_group and all(mp.layout.dim == 0 for mp in params)


def start_gather(
    params: list["ManagedParam"],
    source: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    world: int,
    region_numel: int,
    dtype: torch.dtype,
    device: torch.device,
    streams: CommStreams | None,
    direct: bool,
    custom: Any = None,
    riders: "GatherRiders | None" = None,
) -> PendingGather:
    """Launch the all-gather of `params` over `group` (this process is its `rank`), in `dtype`
    on `device`, on the all-gather stream when there is one. `source` is the 1D input (this
    rank's region of `region_numel` elements, or after `reshard_after_forward=N` the N-rank
    group's share of regions); the output holds the `world` regions of the shard group.
    `direct` is `gathers_directly`'s answer, never with a `custom` all-gather (an FSDP2
    `AllGather`, flat way only), which allocates the output and gathers into it.
    `riders` travel in the same collective: in the direct way their inputs are filled on the
    all-gather stream (`riders.cast()`) before it is issued; in the flat way (only the whole
    shard group, no `custom`) their bytes are packed after this rank's region, so a group is one
    collective, one stream switch and one event however its parameters are gathered."""
    n = source.numel()  # a post-forward shard holds several ranks' regions: `world` counts those
    assert not (direct and custom is not None), "a custom all-gather takes the flat way"
    assert riders is None or direct or (custom is None and n == region_numel), "flat riders: whole group only"
    travels = n > 0 or riders is not None  # the flat buffer may be empty (only extension parameters)
    async_op = streams is None
    with stream_context(streams.all_gather if streams is not None else None):
        if direct:
            for mp in params:
                if streams is not None:
                    streams.reclaim(mp.unsharded_padded)  # a deferred free of this storage is off
                mp.alloc_unsharded(world, dtype, device, on_gather_stream=streams is not None)
            outputs = cast("list[torch.Tensor]", [mp.unsharded_padded for mp in params])  # just allocated
            # In place, as the flat way: each input is this rank's slot of its output, filled by
            # one fused copy (+cast, +host-to-device); no input buffer beside the parameters.
            inputs = [
                out.narrow(0, rank * mp.layout.region_numel, mp.layout.region_numel) for mp, out in zip(params, outputs)
            ]
            shards = [source.narrow(0, mp.layout.offset, mp.layout.region_numel) for mp in params]
            # Refilling freed storage with the values it held is no mutation autograd should see.
            # `all_gather_coalesced` waits before returning: whatever version bumps the
            # collective makes (at issue or, like gloo's, at completion) happen in here.
            with comm.refilling(*outputs):
                if outputs:
                    torch._foreach_copy_(inputs, shards, non_blocking=True)
                if riders is not None:
                    riders.cast()
                    outputs, inputs = outputs + riders.outputs, inputs + riders.inputs
                if travels:
                    comm.all_gather_coalesced(outputs, inputs, group)
                work = None  # it waits before returning
            gather_in, gather_out = source, None
        else:
            # The riders' bytes, padded to whole elements, follow the region in each rank's row.
            flat_riders: Any = riders
            tail = -(-flat_riders.nbytes // dtype.itemsize) if riders is not None else 0
            row = n + tail
            # In place: the input is this rank's slot of the output. `world` regions of the shard
            # group, whatever share of them the group's ranks hold (a post-forward shard holds
            # several); riders travel with the whole shard group only (n == region_numel).
            if custom is None:
                gather_out = torch.empty(world * (region_numel + tail), dtype=dtype, device=device)
            else:
                gather_out = custom.allocate((world * region_numel,), dtype=dtype, device=device)
            gather_in = gather_out.narrow(0, rank * row, row)
            gather_in.narrow(0, 0, n).copy_(source, non_blocking=True)
            if riders is not None:
                flat_riders.copy_in(_tail_bytes(gather_in.view(1, row), n, flat_riders).view(-1))
            # row == 0: only extension parameters, gathered on their own: nothing travels here
            work = comm.all_gather(gather_out, gather_in, group, async_op, custom) if row else None
        if streams is not None and travels:
            work = streams.all_gather.record_event()
    if direct:
        return PendingGather(work, direct, gather_out, gather_in, source)
    return PendingGather(work, direct, gather_out, gather_in, source, flat_riders, tail)


def _tail_bytes(rows: torch.Tensor, n: int, riders: "TailRiders") -> torch.Tensor:
    """The riders' bytes of each row of `rows` (rank-major rows of `n` elements plus a tail)."""
    return rows.narrow(1, n, rows.shape[1] - n).view(torch.uint8).narrow(1, 0, riders.nbytes)


def free_storages(params: list["ManagedParam"], streams: CommStreams | None) -> None:
    """Free the unsharded storages of `params`: at once where the compute stream's pool holds
    them, deferred (`CommStreams.defer_free`) where a direct gather took them from the
    all-gather stream's pool."""
    deferred: list[torch.Tensor] = []
    for mp in params:
        padded = mp.unsharded_padded
        if mp.unsharded_on_gather_stream and padded is not None and mp.is_unsharded_allocated():
            deferred.append(padded)
        else:
            mp.free_unsharded()
    if deferred:
        assert streams is not None  # only direct gathers (CUDA, with their streams) set the flag
        streams.defer_free(deferred)


def finish_gather(
    pending: PendingGather, params: list["ManagedParam"], world: int, device: torch.device, streams: CommStreams | None
) -> None:
    """Wait for `pending` (the current stream waits on CUDA) and, in the flat way, copy the
    parameters out of the gather output."""
    work = pending.work
    if isinstance(work, torch.cuda.Event):
        current_stream(device).wait_event(work)
    elif work is not None:
        work.wait()
    if pending.direct:
        return  # the all-gather stream's buffers are freed in its own order; nothing to keep
    if streams is not None:
        for mp in params:
            streams.reclaim(mp.unsharded_padded)  # allocated for a direct gather, free deferred
    output = pending.output
    assert output is not None  # only a direct gather (returned above) has none
    if pending.riders is not None:  # the rows end in the riders' bytes
        rows = output.view(world, -1)
        region = rows.shape[1] - pending.tail
        pending.riders.copy_out(_tail_bytes(rows, region, pending.riders))
        output = rows.narrow(1, 0, region)
    if params:
        copy_out_params(output, world, params, device)
    if streams is not None:
        streams.after_copy_out((pending.output, pending.input, pending.source))


def copy_out_params(gathered: torch.Tensor, world: int, params: list[ManagedParam], device: torch.device) -> None:
    """Fill the unsharded parameters from the rank-major all-gather output `gathered`: one
    fused copy into the padded storages; parameters sharded on a dim > 0 go through a
    rank-major staging buffer into their natural (contiguous) layout."""
    for mp in params:
        mp.alloc_unsharded(world, gathered.dtype, device)
    staged = {
        id(mp): torch.empty(world * mp.layout.region_numel, dtype=gathered.dtype, device=gathered.device)
        for mp in params
        if mp.layout.dim != 0
    }
    # `alloc_unsharded` above made every padded storage.
    targets = [staged.get(id(mp), cast(torch.Tensor, mp.unsharded_padded)) for mp in params]
    comm.copy_out(gathered, world, [mp.layout.region_numel for mp in params], targets)
    for mp in params:
        if mp.layout.dim != 0:
            mp.fill_from_rank_major(staged[id(mp)], world)
