"""Gradient reduction for one parameter group.

`launch` turns the accumulated unsharded gradients into one flat reduction input and starts
the collectives asynchronously; `finish` waits and accumulates the results into the sharded
gradients (DTensors, in the parameter's own dtype, on the CPU when offloading). `replicate`
groups reduce in buckets instead (`buckets.py`).

Presence (which parameters had a gradient on some rank): `reduction.py`.

Averaging: sum, then divide by the data-parallel world. For low-precision reduce dtypes the
division is split into a pre- and a post-factor (powers of two) to avoid overflow and
underflow; gloo has neither AVG nor PREMUL_SUM, so this works on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm import collectives as comm
from ..comm.streams import CommStreams, current_stream, stream_context
from ..meshes.layout import DataParallelLayout
from ..meshes.shard_dims import full_to_regions
from ..params.spmd import grad_to_local
from .grad_dtype import GroupDtypes
from .no_sync import NoSyncSums
from .reduce_options import ReduceOptions
from .reduction import MISSING, Reduction, had_a_gradient_somewhere, region_offsets

if TYPE_CHECKING:
    from ..params.param import ManagedParam


@dataclass(frozen=True)
class ReduceSpec:
    """What a reducer needs to know of its group."""

    layout: DataParallelLayout
    device: torch.device  # compute device: where unsharded gradients and reductions live
    offload: bool  # sharded gradients live on the CPU
    dtypes: GroupDtypes
    pin_host: bool = False  # offload with pinned host memory from CUDA: copies to the host overlap backward


class GradReducer:
    """Reduces the unsharded gradients of `params` into their sharded gradients, in one
    collective (plus the replica all-reduce of HSDP) per launch."""

    def __init__(self, params: list["ManagedParam"], spec: ReduceSpec, streams: CommStreams | None) -> None:
        self.params = params
        self.spec = spec
        self.streams = streams
        self.pending: list[Reduction] = []
        self._partial: torch.Tensor | None = None  # HSDP partial sums awaiting the replica all-reduce
        self._collectives_average: dict[torch.dtype, bool] = {}
        self.options = ReduceOptions()
        self.no_sync_sums = NoSyncSums(params, spec.layout, spec.dtypes)

    def _grad_params(self) -> list["ManagedParam"]:
        return [mp for mp in self.params if mp.wants_grad]

    def stash(self) -> None:
        """No-sync backward: keep this backward's gradients unreduced (`NoSyncSums.stash`)."""
        self.no_sync_sums.stash()

    def drop_discarded_sums(self) -> None:
        """Forget the no-sync sums `zero_grad` discarded (`NoSyncSums.drop_discarded`)."""
        self.no_sync_sums.drop_discarded()

    @property
    def collectives_average(self) -> bool:
        """Whether every collective of a reduction averages (ReduceOp.AVG) instead of summing:
        then no division is left to do. Decided once per reduce dtype (`module.half()` after
        sharding changes it; the backends do not change)."""
        if self.options.divide_factor is not None or self.options.force_sum:
            return False  # sum, then divide by the user's factor (or by the world, after)
        lay, dtype = self.spec.layout, self.spec.dtypes.reduce
        decided = self._collectives_average.get(dtype)
        if decided is None:
            groups = ([lay.shard_group] if lay.shard_group is not None else []) + list(lay.replicate_groups)
            decided = self._collectives_average[dtype] = bool(groups) and all(
                comm.supports_average(pg, self.spec.device, dtype) for pg in groups
            )
        return decided

    @property
    def dp_world(self) -> float:
        """What the summed gradients are divided by: the data-parallel world (an average), or
        the user's `set_gradient_divide_factor`."""
        return self.options.divide_factor or self.spec.layout.dp_world

    def _take_grads(self, params: list["ManagedParam"]) -> tuple[list[torch.Tensor], list[bool]]:
        """Detach the unsharded gradients from their parameters (freeing them after the
        reduction), filling missing ones with `self._missing_fill` so every rank lays out the
        same buffer."""
        grads, present = [], []
        for mp in params:
            up = mp.unsharded_param
            g = None if up is None else up.grad
            if (
                mp.stashed_grad is None
                and not mp.grad_is_unreduced
                and type(g) is torch.Tensor
                and mp.annotation is None
                and up is not None  # it is (it has a gradient): said for the type checker
            ):
                up.grad = None  # the common case, kept short: it runs per parameter per step
                grads.append(g)
                present.append(True)
                continue
            acc = mp.take_stashed_grad()  # what no-sync micro-steps stashed (see `stash`)
            if acc is not None:
                g = acc if g is None else acc.add_(g)
            if mp.take_grad_is_unreduced():  # replicated no-sync sums, shown as `.grad`
                sp = mp.sharded
                visible, sp.grad = sp.grad, None
                if visible is not None:  # None: the user discarded them (zero_grad)
                    local = cast(DTensor, visible)._local_tensor.to(self.spec.device)
                    g = local if g is None else local.add_(g)
            if (
                mp.annotation is not None and g is not None and not isinstance(g, DTensor)
            ):  # spmd_types: a plain gradient of its backward types
                g = mp.annotation.grad_spec.wrap(g)
            if isinstance(g, DTensor):  # tensor parallel: complete pending TP reductions, go local
                g = grad_to_local(g, mp.tp, mp.dp_dims)
            present.append(g is not None)
            if g is None:
                g = torch.full(
                    mp.layout.shape, self._missing_fill, dtype=self.spec.dtypes.unsharded, device=self.spec.device
                )
            elif up is not None:
                up.grad = None
            grads.append(g)
        dtype = grads[0].dtype if grads else None
        if any(g.dtype != dtype for g in grads):  # stashed (wider) next to fresh gradients
            grads = [g.to(self.spec.dtypes.reduce) for g in grads]
        return grads, present

    def has_grads(self, mp: "ManagedParam") -> bool:
        """Whether `mp` has an unsharded gradient (or a stashed one) waiting to be reduced."""
        up = mp.unsharded_param
        return (
            (up is not None and up.grad is not None)
            or mp.stashed_grad is not None
            or (mp.grad_is_unreduced and mp.sharded.grad is not None)
        )

    @property
    def _missing_fill(self) -> float:
        """-0.0 marks a missing gradient (see the module's note); FSDP2's
        `reduce_scatter_unused_params` gives every parameter a gradient, of +0.0 where unused."""
        return 0.0 if self.options.reduce_unused else MISSING

    # -- launching ------------------------------------------------------------------------
    def launch(self) -> None:
        self.no_sync_sums.drop_discarded()
        self.no_sync_sums.hand_over()  # consumed by this reduction
        params = self._grad_params()
        if not params or not (self.options.reduce_unused or any(self.has_grads(mp) for mp in params)):
            return
        grads, present = self._take_grads(params)
        if self.options.reduce_unused:  # as FSDP2: a zero gradient for every parameter that wants one
            present = [True] * len(present)
        if self.spec.layout.sharded:
            self._launch_reduce_scatter(params, grads, present)
        else:
            self._launch_all_reduce(params, grads, present)

    def _launch_reduce_scatter(
        self, params: list["ManagedParam"], grads: list[torch.Tensor], present: list[bool]
    ) -> None:
        lay, device = self.spec.layout, self.spec.device
        world, dtype = lay.shard_world, self.spec.dtypes.reduce
        average = self.collectives_average
        pre = 1.0 if average else comm.divide_factors(self.dp_world, dtype)[0]
        # Copy-in on the compute stream, so the unsharded gradients are freed in stream order.
        # 0-d parameters are replicated in every rank region: feed each region a copy. dim > 0
        # parameters go in as their rank-major regions (each rank's contiguous shard). A missing
        # gradient fills its whole regions, padding included, with its mark: a rank whose
        # region is all padding still reads from it whether any rank had the gradient.
        pieces = [
            gr.expand(world)
            if gr.dim() == 0
            else gr.new_full((world, mp.layout.region_numel), self._missing_fill)
            if not here
            else full_to_regions(mp.layout, gr, world)
            if mp.layout.dim
            else gr
            for mp, gr, here in zip(params, grads, present)
        ]
        custom = self.options.reduce_scatter_comm
        flat_in = comm.chunk_cat(pieces, world, dtype, device, None if custom is None else custom.allocate)
        if pre != 1.0:
            flat_in.div_(pre)
        # Clear the caller's list too (`launch` holds it): the gradients are freed before the output is made.
        grads.clear()
        del pieces
        streams = self.streams
        if streams is not None:
            streams.before_reduce(self.options.max_input_buffers)
        # CPU: gloo works run asynchronously and need their input until `finish`. CUDA: the
        # streams keep it alive only until the next reduce-scatter (memory stays bounded).
        red = Reduction(
            params,
            present,
            region_offsets(params),
            flat_in,
            keep_alive=[flat_in] if streams is None else [],
            divided=average,
        )
        with stream_context(streams.reduce if streams is not None else None):
            if custom is None:
                out = torch.empty(flat_in.numel() // world, dtype=dtype, device=device)
            else:
                out = custom.allocate((flat_in.numel() // world,), dtype=dtype, device=device)
            red.output = out
            async_op = streams is None
            # A sharded layout has a shard group: None is only the replicated one's.
            group = cast(dist.ProcessGroup, self.options.reduce_scatter_group or lay.shard_group)
            if (work := comm.reduce_scatter(out, flat_in, group, average, async_op, custom)) is not None:
                red.works.append(work)  # None: it ran synchronously
            if lay.replicate_groups:
                if self.options.requires_all_reduce:
                    if async_op:
                        red.works.pop().wait()  # the replica all-reduce consumes the reduce-scatter output
                    if self._partial is not None:
                        out.add_(self._partial)
                        self._partial = None
                    for grp in lay.replicate_groups:
                        if (work := comm.all_reduce(out, grp, average, async_op=async_op)) is not None:
                            red.works.append(work)
                else:
                    red.all_reduced = False
            if red.all_reduced and self.options.all_reduce_hook is not None:
                self._run_all_reduce_hook(red)
            if streams is not None:
                self._average(red)
                if self.spec.pin_host and red.all_reduced:
                    red.host_output = comm.copy_to_pinned_host(out, self.spec.dtypes.orig)
                    if all(present) and custom is None:  # the host copy is all that is read: free the GPU's
                        red.output = red.host_output
                red.event = streams.reduce.record_event()
                streams.after_reduce(red.event, flat_in)
        self._assign_early(red)
        if self.options.host_grads_hook is not None and self.spec.offload:
            self.hand_over_on_host(red)
        self.pending.append(red)

    def _launch_all_reduce(
        self,
        params: list["ManagedParam"],
        grads: list[torch.Tensor],
        present: list[bool],
        offsets: list[int] | None = None,
    ) -> Reduction:
        """All-reduce `grads` (of `params`) as one flat buffer."""
        dtype = self.spec.dtypes.reduce
        average = self.collectives_average
        pre = 1.0 if average else comm.divide_factors(self.dp_world, dtype)[0]
        if len(grads) == 1:
            # One gradient (most buckets of a large model): one copy, cast as it goes, and
            # no cat (which takes a slower per-input path when it casts).
            flat = torch.empty(grads[0].numel(), dtype=dtype, device=self.spec.device)
            flat.view(grads[0].shape).copy_(grads[0])
        else:
            pieces = [gr.reshape(-1) for gr in grads]
            flat = torch.empty(sum(p.numel() for p in pieces), dtype=dtype, device=self.spec.device)
            if all(p.dtype == dtype for p in pieces):
                torch.cat(pieces, out=flat)  # one kernel
            else:  # cat takes a per-input path when it casts; a multi-tensor copy casts in one
                torch._foreach_copy_(list(flat.split([p.numel() for p in pieces])), pieces)
            del pieces
        if pre != 1.0:
            flat.div_(pre)
        grads.clear()  # the caller's list too: the gradients are in `flat` now
        # Issued from the current stream with async_op: the process group orders its own
        # communication stream after the copy-in, and `finish` (work.wait) orders the
        # current stream after the result. No stream switch or event of ours per bucket:
        # this runs once per bucket inside backward, where CPU time is what limits small
        # batches. The bucket stays alive until `finish`, as DDP's do.
        offsets = region_offsets(params) if offsets is None else offsets
        red = Reduction(params, present, offsets, flat, divided=average)
        for i, grp in enumerate(self.spec.layout.replicate_groups):
            if i:  # a replicated 2D mesh (NO_SHARD): one dim after the other, never two at once on `flat`
                red.works.pop().wait()
            red.works.append(comm.all_reduce_async(flat, grp, average))
        if self.options.all_reduce_hook is not None:  # replicate's set_all_reduce_hook: each bucket, once reduced
            self._run_all_reduce_hook(red)
        self._assign_early(red)
        self.pending.append(red)
        return red

    # -- finishing ----------------------------------------------------------------------------
    def _average(self, red: Reduction) -> None:
        """Apply the post-division of the average, once. On CUDA it runs on the reduce stream
        right after the collectives, so the end of backward has less left to do."""
        if red.all_reduced and not red.divided:
            _, post = comm.divide_factors(self.dp_world, red.output.dtype)
            if post != 1.0:
                red.output.div_(post)
            red.divided = True

    def _assign_early(self, red: Reduction) -> None:
        """Point fresh sharded gradients at their slices of the reduction output now, while
        the CPU is ahead of the GPU, instead of at the end of backward. Only where nothing is
        left to do to them (no accumulation, cast or offload copy); the values are ready once
        `finish` has waited for the reduction."""
        if not red.all_reduced or self.spec.offload or red.output.dtype != self.spec.dtypes.orig:
            return
        out = red.output
        assigned = red.assigned = [False] * len(red.params)
        for i, (mp, present, off) in enumerate(zip(red.params, red.present, red.offsets)):
            sp = mp.sharded_param
            assert sp is not None  # registered before any reduction
            if present and sp.grad is None:  # per parameter per step: kept to the bare minimum
                sp.grad = mp.make_sharded_grad(mp.layout.local_at(out, off))
                assigned[i] = True

    def hand_over_on_host(self, red: Reduction) -> None:
        """Offload with a host-grads hook: point the sharded gradients at `red`'s host copy now,
        during backward, and hand them to the hook (their host step can start while backward goes
        on). Only a complete reduction (not HSDP's deferred sum) with every gradient present here;
        a parameter that has a gradient keeps it (summed at the end of backward) and is named to
        the hook as kept. CPU: the reduction is waited for here (its output is on the host)."""
        hook = self.options.host_grads_hook
        if hook is None or not red.all_reduced or not all(red.present):
            return
        orig = self.spec.dtypes.orig
        if red.host_output is None:
            if red.output.device.type != "cpu":
                return  # pageable offload from CUDA: copied at the end of backward, as without a hook
            for work in red.works:
                work.wait()
            red.works.clear()
            self._average(red)
            red.host_output = red.output if red.output.dtype == orig else red.output.to(orig)
        handed: list[torch.Tensor] = []
        kept: list[torch.Tensor] = []
        red.assigned = [False] * len(red.params)
        for i, (mp, off) in enumerate(zip(red.params, red.offsets)):
            sp = mp.sharded
            if sp.grad is None:
                sp.grad = mp.make_sharded_grad(mp.layout.local_at(red.host_output, off))
                red.assigned[i] = True
                handed.append(sp)
            else:
                kept.append(sp)
        hook(handed, kept, red.event)

    def finish(self) -> None:
        """Wait for launched reductions and accumulate them into the sharded gradients."""
        for red in self.pending:  # all first, then the results (one wait on the host)
            for work in red.works:
                work.wait()
            if red.event is not None:
                current_stream(self.spec.device).wait_event(red.event)
        for red in self.pending:
            if not red.all_reduced:
                self._partial = red.output if self._partial is None else self._partial.add_(red.output)
                continue
            self._average(red)
            out = red.output
            if all(red.assigned) and red.assigned:
                if red.host_output is not None and red.event is not None:
                    red.event.synchronize()  # handed over on the host: complete when backward ends
                continue
            present_anywhere = red.present
            if not all(red.present):
                # Only a locally missing gradient needs the marks read (a host sync); the
                # common all-present case skips it.
                missing = [i for i, here in enumerate(red.present) if not here]
                regions = [(red.offsets[i], red.params[i].layout.region_numel) for i in missing]
                present_anywhere = list(red.present)
                for i, somewhere in zip(missing, had_a_gradient_somewhere(out, regions)):
                    present_anywhere[i] = somewhere
            if red.host_output is not None and red.event is not None:
                red.event.synchronize()  # its copy to the host, launched with the reduction, overlapped backward
                out = red.host_output
            else:
                target_device = torch.device("cpu") if self.spec.offload else self.spec.device
                out = out.to(device=target_device, dtype=self.spec.dtypes.orig)
            for i, (mp, present, off) in enumerate(zip(red.params, present_anywhere, red.offsets)):
                if present and not (red.assigned and red.assigned[i]):
                    mp.add_to_sharded_grad(mp.layout.local_at(out, off))
        self.pending.clear()
        self._end_of_backward()

    def _run_all_reduce_hook(self, red: Reduction) -> None:
        """The user's hook, after the reduce-scatter or HSDP's all-reduce, before the division
        that averages. CPU: the reduction is finished first."""
        for work in red.works:
            if work is not None:
                work.wait()
        red.works.clear()
        self.options.run_all_reduce_hook(red.output, self.streams)

    def discard(self) -> None:
        """Forget every launched reduction (after waiting for its collectives), the gradients
        it was to produce, HSDP partial sums and no-sync sums: an iteration aborted by an
        exception (`reset_iter_state`)."""
        for red in self.pending:
            for work in red.works:
                work.wait()
            for mp, assigned in zip(red.params, red.assigned):
                if assigned:  # pointed at the unfinished output early
                    mp.sharded.grad = None
        self.pending.clear()
        self._partial = None
        self.no_sync_sums.discard()
        for mp in self.params:
            if mp.unsharded_param is not None:
                mp.unsharded_param.grad = None
        self._end_of_backward()

    def _end_of_backward(self) -> None:
        """Hook for subclasses: every reduction of this backward is finished."""
