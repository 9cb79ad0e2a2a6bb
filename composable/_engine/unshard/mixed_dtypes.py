"""Groups whose parameters compute in different dtypes (`param_dtype_override_fn`: e.g. norms
kept in fp32 among bf16 weights).

Such a group all-gathers in the parameters' own dtype (one collective, as any group) and
casts each parameter into its compute dtype while copying it out of the gather output: the
unsharded values are the same as a gather of casts (the cast is elementwise), at the price
of gathering the low-precision parameters at full width. (PyTorch FSDP2 gathers such groups
as bytes, each parameter in its own dtype.) Gradients come out in each parameter's compute
dtype and are reduced together in the group's reduce dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, cast

import torch
import torch.nn as nn

from ..comm import collectives as comm
from ..comm.streams import CommStreams, current_stream
from .gather import finish_gather

if TYPE_CHECKING:
    from ..params.param import ManagedParam
    from .gather import PendingGather


def resolve_param_dtypes(
    claimed: Sequence[tuple[str, object, nn.Parameter]],
    param_dtype: torch.dtype | None,
    dtype_for: Callable[[str, nn.Parameter], torch.dtype | None] | None,
) -> tuple[torch.dtype | None, tuple[torch.dtype, ...] | None]:
    """(the group's param_dtype, each parameter's compute dtype where they differ, else None)
    for the `claimed` (fqn, slots, original parameter) of one group. `dtype_for(fqn, param)`
    answers for one parameter (the policy's `param_dtype_for`); without it, `param_dtype`."""
    if dtype_for is None or not claimed:
        return param_dtype, None
    computes = tuple((dtype_for(fqn, p) or p.dtype) if p.is_floating_point() else p.dtype for fqn, _, p in claimed)
    floating = {c for c, (_, _, p) in zip(computes, claimed) if p.is_floating_point()}
    if len(floating) <= 1:  # uniform: the ordinary path, with that dtype (or none to cast to)
        own = {p.dtype for _, _, p in claimed if p.is_floating_point()}
        uniform = floating.pop() if floating else None
        return (None if uniform is None or uniform in own else uniform), None
    return param_dtype, computes


def check_mixed_group(api: str, dtypes: tuple[torch.dtype, ...] | None, sharded: bool, extension: bool) -> None:
    """`NotImplementedError` for a group in several compute dtypes (`dtypes`) that is replicated
    (NO_SHARD, replicate: one replica buffer in one dtype) or has all-gather extension parameters."""
    if dtypes is not None and (extension or not sharded):
        raise NotImplementedError(
            f"{api}: parameters of one group in different dtypes (param_dtype_override_fn) need a "
            "sharded layout and no all-gather extension parameters"
        )


def finish_gather_mixed(
    pending: "PendingGather",
    params: list["ManagedParam"],
    dtypes: tuple[torch.dtype, ...] | None,
    world: int,
    device: torch.device,
    streams: CommStreams | None,
) -> None:
    """Wait for the all-gather `pending` and copy the parameters out. With `dtypes` (one compute
    dtype per parameter; the gather was in their own dtype) each is cast into its unsharded
    storage in its compute dtype; without, as `gather.finish_gather`."""
    if dtypes is None:
        finish_gather(pending, params, world, device, streams)
        return
    work = pending.work
    if isinstance(work, torch.cuda.Event):
        current_stream(device).wait_event(work)
    elif work is not None:
        work.wait()
    assert pending.output is not None  # a gather in the parameters' own dtypes is a flat one
    rows = pending.output.view(world, -1)
    for mp, dtype in zip(params, dtypes):
        if streams is not None:
            streams.reclaim(mp.unsharded_padded)
        mp.alloc_unsharded(world, dtype, device)
        lay = mp.layout
        regions = rows.narrow(1, lay.offset, lay.region_numel)
        if lay.dim == 0:
            padded = cast(torch.Tensor, mp.unsharded_padded)  # made by `alloc_unsharded` above
            with comm.refilling(padded):
                padded.view(world, -1).copy_(regions)
        else:
            mp.fill_from_rank_major(regions.to(dtype).reshape(-1), world)
    if streams is not None:
        streams.after_copy_out((pending.output, pending.input, pending.source))
