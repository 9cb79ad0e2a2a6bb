"""Gradient reduction for one parameter group.

`launch` turns the accumulated unsharded gradients into one flat reduction input and starts
the collectives asynchronously; `finish` waits and accumulates the results into the sharded
gradients (DTensors, in the parameter's own dtype, on the CPU when offloading). `replicate`
groups instead launch one all-reduce per bucket from post-accumulate-grad hooks, as soon as
the bucket's gradients are ready, so communication overlaps the rest of the backward.

Averaging: sum, then divide by the data-parallel world. For low-precision reduce dtypes the
division is split into a pre- and a post-factor (powers of two) to avoid overflow and
underflow; gloo has neither AVG nor PREMUL_SUM, so this works on every backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _collectives as comm
from ._streams import stream_context

if TYPE_CHECKING:
    from ._param import ManagedParam
    from ._param_group import ParamGroup


@dataclass
class _Reduction:
    """One launched reduction: its works, its flat output and what maps back to whom."""

    params: list["ManagedParam"]
    present: list[bool]
    offsets: list[int]
    output: torch.Tensor  # 1D, reduce dtype
    works: list[dist.Work] = field(default_factory=list)
    all_reduced: bool = True  # False: HSDP partial, not yet reduced across replicas
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    event: "torch.cuda.Event | None" = None  # CUDA: recorded on the reduce stream when done
    divided: bool = False  # averaging applied (by ReduceOp.AVG, or the division after a SUM)
    assigned: list[bool] = field(default_factory=list)  # sharded grads already pointed at `output`
    with_presence: bool = False  # `output` ends with one presence flag per parameter


FIRST_BUCKET_CAP_BYTES = 1 << 20  # as DDP's first bucket


def _offsets(params: list["ManagedParam"]) -> list[int]:
    offsets, off = [], 0
    for mp in params:
        offsets.append(off)
        off += mp.layout.region_numel
    return offsets


def _divide_factors(world: int, dtype: torch.dtype) -> tuple[float, float]:
    if world == 1:
        return 1.0, 1.0
    if dtype in (torch.float16, torch.bfloat16):
        pre = 1
        while world % (pre * 2) == 0 and world // pre > pre:
            pre *= 2
        return float(pre), world / pre
    return 1.0, float(world)


class GradReducer:
    def __init__(self, group: "ParamGroup") -> None:
        self.group = group
        self.pending: list[_Reduction] = []
        self.requires_all_reduce = True  # HSDP: False keeps reduce-scatter, defers replica all-reduce
        self._partial: torch.Tensor | None = None  # HSDP partial sums awaiting the replica all-reduce
        self._buckets: list[list["ManagedParam"]] | None = None
        self._ready: dict[int, int] = {}
        self._launched: set[int] = set()
        self._complete: set[int] = set()  # buckets whose gradients are all in
        self._next_bucket = 0  # buckets launch strictly in order
        self._dp_world: int | None = None
        self._all_present: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._collectives_average: dict[torch.dtype, bool] = {}

    @property
    def collectives_average(self) -> bool:
        """Whether every collective of a reduction averages (ReduceOp.AVG) instead of summing:
        then no division is left to do. Decided once per reduce dtype (`module.half()` after
        sharding changes it; the backends do not change)."""
        g = self.group
        dtype = g.reduce_dtype
        decided = self._collectives_average.get(dtype)
        if decided is None:
            groups = ([g.shard_group] if g.config.sharded else []) + list(g.replicate_groups)
            decided = self._collectives_average[dtype] = bool(groups) and all(comm.supports_average(pg, g.config.device, dtype) for pg in groups)
        return decided

    # -- sizes ----------------------------------------------------------------------------
    @property
    def dp_world(self) -> int:
        if self._dp_world is None:
            self._dp_world = self.group.shard_world * math.prod(dist.get_world_size(pg) for pg in self.group.replicate_groups)
        return self._dp_world

    def _grad_params(self) -> list["ManagedParam"]:
        return [mp for mp in self.group.params if mp.wants_grad]

    def _take_grads(self, params: list["ManagedParam"]) -> tuple[list[torch.Tensor], list[bool]]:
        """Detach the unsharded gradients from their parameters (freeing them after the
        reduction), zero-filling missing ones so every rank lays out the same buffer."""
        grads, present = [], []
        for mp in params:
            up = mp.unsharded_param
            g = None if up is None else up.grad
            acc = mp.extra.pop("acc_grad", None)  # what no-sync micro-steps stashed (see `stash`)
            if acc is not None:
                g = acc if g is None else acc.add_(g)
            if mp.extra.pop("unreduced_grad", False):  # replicated no-sync sums, shown as `.grad`
                visible, mp.sharded_param.grad = mp.sharded_param.grad, None
                if visible is not None:  # None: the user discarded them (zero_grad)
                    local = visible._local_tensor.to(self.group.config.device)
                    g = local if g is None else local.add_(g)
            if isinstance(g, DTensor):  # tensor parallel: complete pending TP reductions, go local
                g = g.redistribute(mp.tp.mesh, mp.tp.placements).to_local()
            present.append(g is not None)
            if g is None:
                g = torch.zeros(mp.layout.shape, dtype=self.group.unsharded_dtype, device=self.group.config.device)
            elif up is not None:
                up.grad = None
            grads.append(g)
        if len({g.dtype for g in grads}) > 1:  # stashed (wider) next to fresh gradients
            grads = [g.to(self.group.reduce_dtype) for g in grads]
        return grads, present

    def stash(self) -> None:
        """No-sync backward: accumulate the unsharded gradients in the reduce dtype where it is
        wider than the compute dtype (bf16 compute, fp32 reduce), as PyTorch FSDP2 does, so the
        sum over micro-steps is not rounded to bf16 each time (at the price of holding a wider
        gradient). Otherwise they simply stay in `.grad`, where autograd accumulates them."""
        if not self.group.config.sharded:
            self._stash_as_visible_grads()
            return
        dtype = self.group.reduce_dtype
        if dtype.itemsize <= self.group.unsharded_dtype.itemsize:
            return
        for mp in self._grad_params():
            up = mp.unsharded_param
            if up is None or up.grad is None:
                continue
            acc = mp.extra.get("acc_grad")
            mp.extra["acc_grad"] = up.grad.to(dtype) if acc is None else acc.add_(up.grad)
            up.grad = None

    def _stash_as_visible_grads(self) -> None:
        """Replicated groups (replicate, NO_SHARD), as in DDP: during no_sync the locally
        accumulated gradient is the parameter's visible `.grad` (in the parameter's dtype), so
        `zero_grad` discards it and the next synced backward reduces whatever is left there.
        Gradients already reduced are equal on every rank, so reducing them again with the
        new local ones leaves them unchanged: accumulation across steps stays right."""
        for mp in self._grad_params():
            up = mp.unsharded_param
            if up is None or up.grad is None:
                continue
            grad, up.grad = up.grad, None
            sp = mp.sharded_param
            local = grad.to(device=sp._local_tensor.device, dtype=sp.dtype)
            with torch.no_grad():
                if sp.grad is None:
                    sp.grad = mp.make_sharded_grad(local)
                else:
                    sp.grad._local_tensor.add_(local)
            mp.extra["unreduced_grad"] = True

    def has_grads(self, mp: "ManagedParam") -> bool:
        """Whether `mp` has an unsharded gradient (or a stashed one) waiting to be reduced."""
        up = mp.unsharded_param
        return (
            (up is not None and up.grad is not None)
            or "acc_grad" in mp.extra
            or (mp.extra.get("unreduced_grad", False) and mp.sharded_param.grad is not None)
        )

    def _presence_flags(self, present: list[bool], dtype: torch.dtype) -> torch.Tensor:
        """One flag per parameter on the compute device; the all-present case is cached."""
        if all(present):
            key = (len(present), dtype)
            cached = self._all_present.get(key)
            if cached is None:
                cached = self._all_present[key] = torch.ones(len(present), dtype=dtype, device=self.group.config.device)
            return cached
        return torch.tensor([float(p) for p in present], dtype=dtype).to(self.group.config.device, non_blocking=True)

    # -- launching ------------------------------------------------------------------------
    def launch(self) -> None:
        params = self._grad_params()
        if not params or not any(self.has_grads(mp) for mp in params):
            return
        grads, present = self._take_grads(params)
        if self.group.config.sharded:
            self._launch_reduce_scatter(params, grads, present)
        else:
            self._launch_all_reduce(params, grads, present)

    def _launch_reduce_scatter(self, params: list["ManagedParam"], grads: list[torch.Tensor], present: list[bool]) -> None:
        g, cfg = self.group, self.group.config
        world, dtype = g.shard_world, g.reduce_dtype
        average = self.collectives_average
        pre = 1.0 if average else _divide_factors(self.dp_world, dtype)[0]
        # Copy-in on the compute stream, so the unsharded gradients are freed in stream order.
        # 0-d parameters are replicated in every rank region: feed each region a copy. So are
        # the presence flags (one per parameter, at the end of every region): after the sum,
        # a rank knows which gradients any rank produced, even for its own missing ones.
        flags = self._presence_flags(present, grads[0].dtype)
        pieces = [gr.expand(world) if gr.dim() == 0 else gr for gr in grads] + [flags.expand(world, len(present)).contiguous()]
        flat_in = comm.chunk_cat(pieces, world, dtype, cfg.device)
        if pre != 1.0:
            flat_in.div_(pre)
        del grads, pieces
        streams = g.streams
        if streams is not None:
            streams.before_reduce()
        # CPU: gloo works run asynchronously and need their input until `finish`. CUDA: the
        # streams keep it alive only until the next reduce-scatter (memory stays bounded).
        red = _Reduction(params, present, _offsets(params), flat_in, keep_alive=[flat_in] if streams is None else [], with_presence=True, divided=average)
        with stream_context(streams.reduce if streams is not None else None):
            out = torch.empty(flat_in.numel() // world, dtype=dtype, device=cfg.device)
            red.output = out
            async_op = streams is None
            red.works.append(comm.reduce_scatter(out, flat_in, g.shard_group, average, async_op=async_op))
            if g.replicate_groups:
                if self.requires_all_reduce:
                    if async_op:
                        red.works.pop().wait()  # the replica all-reduce consumes the reduce-scatter output
                    if self._partial is not None:
                        out.add_(self._partial)
                        self._partial = None
                    for grp in g.replicate_groups:
                        red.works.append(comm.all_reduce(out, grp, average, async_op=async_op))
                else:
                    red.all_reduced = False
            if streams is not None:
                self._average(red)
                red.event = streams.reduce.record_event()
                streams.after_reduce(red.event, flat_in)
        red.works = [w for w in red.works if w is not None]
        self._assign_early(red)
        self.pending.append(red)

    def _launch_all_reduce(self, params: list["ManagedParam"], grads: list[torch.Tensor], present: list[bool], with_presence: bool = False) -> None:
        g = self.group
        dtype = g.reduce_dtype
        average = self.collectives_average
        pre = 1.0 if average else _divide_factors(self.dp_world, dtype)[0]
        pieces = [gr.reshape(-1) for gr in grads]
        if with_presence:  # one flag per parameter: after the sum, > 0 where any rank had a gradient
            pieces.append(self._presence_flags(present, dtype))
        flat = torch.empty(sum(p.numel() for p in pieces), dtype=dtype, device=g.config.device)
        torch.cat(pieces, out=flat)  # one kernel, casting as it copies
        if pre != 1.0:
            flat.div_(pre)
        del grads, pieces
        # Issued from the current stream with async_op: the process group orders its own
        # communication stream after the copy-in, and `finish` (work.wait) orders the
        # current stream after the result. No stream switch or event of ours per bucket:
        # this runs once per bucket inside backward, where CPU time is what limits small
        # batches. The bucket stays alive until `finish`, as DDP's do.
        red = _Reduction(params, present, _offsets(params), flat, with_presence=with_presence, divided=average)
        for grp in g.replicate_groups:
            work = comm.all_reduce(flat, grp, average, async_op=True)
            if work is not None:
                red.works.append(work)
        self._assign_early(red)
        self.pending.append(red)

    # -- bucketed (replicate) ---------------------------------------------------------------
    def buckets(self) -> list[list["ManagedParam"]]:
        """Buckets in reverse registration order (roughly the order backward produces
        gradients), filled as DDP fills them: a bucket closes once it holds at least its cap,
        `min(cap, 1 MiB)` for the first (its all-reduce starts as early as possible) and
        `bucket_cap_bytes` for the rest; every collective launch costs CPU time, so there
        are no more buckets than needed."""
        if self._buckets is None:
            cap = self.group.config.bucket_cap_bytes or 0
            size = self.group.reduce_dtype.itemsize
            buckets: list[list[ManagedParam]] = [[]]
            used = 0
            for mp in reversed(self._grad_params()):
                buckets[-1].append(mp)
                used += math.prod(mp.layout.shape) * size
                if used >= (min(cap, FIRST_BUCKET_CAP_BYTES) if len(buckets) == 1 else cap):
                    buckets.append([])
                    used = 0
            self._buckets = [b for b in buckets if b]
            for i, bucket in enumerate(self._buckets):
                for mp in bucket:
                    mp.extra["bucket"] = i
        return self._buckets

    def on_grad_ready(self, mp: "ManagedParam") -> None:
        """Post-accumulate-grad hook body: once a bucket's gradients are all in, launch it and
        every complete bucket after it, strictly in bucket order (as DDP does), so ranks whose
        parameter usage differs still issue the same collectives in the same order."""
        buckets = self.buckets()
        index = mp.extra["bucket"]
        if index in self._launched:
            return  # a late accumulation (parameter used twice): `flush_buckets` reduces it
        self._ready[index] = self._ready.get(index, 0) + 1
        if self._ready[index] == len(buckets[index]):
            self._complete.add(index)
            while self._next_bucket in self._complete:
                self._launch_bucket(self._next_bucket)
                self._next_bucket += 1

    def _launch_bucket(self, index: int) -> None:
        bucket = self.buckets()[index]
        self._launched.add(index)
        grads, present = self._take_grads(bucket)
        # Every bucket carries presence flags, so its size is the same on every rank however
        # each rank's parameter usage differs.
        self._launch_all_reduce(bucket, grads, present, with_presence=True)

    def flush_buckets(self) -> None:
        """End of backward: launch, in order, every bucket not launched yet — on every rank,
        zero-filled where this rank has no gradient, with a presence flag per parameter so a
        gradient exists afterwards wherever any rank produced one (DDP's unused-parameter
        semantics) — then reduce what accumulated after a bucket was launched (a parameter
        used twice in one forward)."""
        buckets = self.buckets()
        late = [mp for i in sorted(self._launched) for mp in buckets[i] if self.has_grads(mp)]
        for index in range(self._next_bucket, len(buckets)):
            self._launch_bucket(index)
        self._next_bucket = len(buckets)  # a second flush in this backward launches only late ones
        if late:
            grads, present = self._take_grads(late)
            self._launch_all_reduce(late, grads, present)

    def _reset_buckets(self) -> None:
        self._ready.clear()
        self._launched.clear()
        self._complete.clear()
        self._next_bucket = 0

    # -- finishing ----------------------------------------------------------------------------
    def _average(self, red: _Reduction) -> None:
        """Apply the post-division of the average, once. On CUDA it runs on the reduce stream
        right after the collectives, so the end of backward has less left to do."""
        if red.all_reduced and not red.divided:
            _, post = _divide_factors(self.dp_world, red.output.dtype)
            if post != 1.0:
                red.output.div_(post)
            red.divided = True

    def _assign_early(self, red: _Reduction) -> None:
        """Point fresh sharded gradients at their slices of the reduction output now, while
        the CPU is ahead of the GPU, instead of at the end of backward. Only where nothing is
        left to do to them (no accumulation, cast or offload copy); the values are ready once
        `finish` has waited for the reduction."""
        g = self.group
        if not red.all_reduced or g.config.offload or red.output.dtype != g.orig_dtype:
            return
        red.assigned = [False] * len(red.params)
        for i, (mp, present, off) in enumerate(zip(red.params, red.present, red.offsets)):
            if present and mp.sharded_param.grad is None:
                _accumulate_sharded_grad(g, mp, red.output, off)
                red.assigned[i] = True

    def finish(self) -> None:
        """Wait for launched reductions and accumulate them into the sharded gradients."""
        g, cfg = self.group, self.group.config
        for red in self.pending:
            for work in red.works:
                work.wait()
            if red.event is not None:
                torch.cuda.current_stream().wait_event(red.event)
            if not red.all_reduced:
                self._partial = red.output if self._partial is None else self._partial.add_(red.output)
                continue
            self._average(red)
            out = red.output
            if all(red.assigned) and red.assigned:
                continue
            present_anywhere = red.present
            if red.with_presence and not all(red.present):
                # Only a locally missing gradient needs the flags (> 0: some rank had one); the
                # read waits for the reduction, so skip it in the common all-present case.
                present_anywhere = (out[-len(red.params):] > 0).tolist()
            target_device = torch.device("cpu") if cfg.offload else cfg.device
            out = out.to(device=target_device, dtype=g.orig_dtype)
            for i, (mp, present, off) in enumerate(zip(red.params, present_anywhere, red.offsets)):
                if present and not (red.assigned and red.assigned[i]):
                    _accumulate_sharded_grad(g, mp, out, off)
        self.pending.clear()
        # End of a backward: forget which buckets this one launched (stale bookkeeping would
        # make the next backward defer every bucket to its end: no overlap).
        self._reset_buckets()


def _accumulate_sharded_grad(group: "ParamGroup", mp: "ManagedParam", flat: torch.Tensor, offset: int) -> None:
    lay = mp.layout
    local = flat[offset : offset + lay.local_rows * lay.row_numel].view(lay.local_shape())
    sp = mp.sharded_param
    with torch.no_grad():
        if sp.grad is None:
            sp.grad = mp.make_sharded_grad(local)
        else:
            sp.grad._local_tensor.add_(local)
