"""Bucketed gradient all-reduce for `replicate` (DDP semantics).

Gradients are all-reduced in buckets of about `bucket_cap_mb`, each launched from the
post-accumulate-grad hooks as soon as its gradients are all in, strictly in bucket order, so
communication overlaps the rest of the backward and every rank issues the same collectives in
the same order whatever its parameter usage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from ..comm.profiling import labelled
from ..comm.streams import CommStreams
from ..params.annotated import untyped
from .reduce import GradReducer, ReduceSpec
from .reduction import Reduction, region_offsets

if TYPE_CHECKING:
    from ..params.param import ManagedParam

FIRST_BUCKET_CAP_BYTES = 1 << 20  # as DDP's first bucket


@dataclass
class _Bucket:
    """One all-reduce bucket: its parameters, where each lands in the flat output (computed
    once) and how many of its gradients this backward still waits for."""

    params: list["ManagedParam"]
    offsets: list[int]
    waiting: int = 0
    launched: bool = False
    present: list[bool] = field(default_factory=list)  # this backward: which gradients it had
    reduction: "Reduction | None" = None  # this backward's all-reduce


class BucketedReducer(GradReducer):
    """A `GradReducer` for replicated groups that all-reduces in buckets during backward."""

    def __init__(
        self, params: list["ManagedParam"], spec: ReduceSpec, streams: CommStreams | None, bucket_cap_bytes: int
    ) -> None:
        super().__init__(params, spec, streams)
        self.bucket_cap_bytes = bucket_cap_bytes
        self._buckets: list[_Bucket] | None = None
        self._next_bucket = 0  # buckets launch strictly in order

    def buckets(self) -> list[_Bucket]:
        """Buckets in reverse registration order (roughly the order backward produces
        gradients), filled as DDP fills them: a bucket closes once it holds at least its cap,
        `min(cap, 1 MiB)` for the first (its all-reduce starts as early as possible) and
        `bucket_cap_bytes` for the rest; every collective launch costs CPU time, so there
        are no more buckets than needed."""
        if self._buckets is None:
            cap = self.bucket_cap_bytes
            size = self.spec.dtypes.reduce.itemsize
            groups: list[list["ManagedParam"]] = [[]]
            used = 0
            for mp in reversed(self._grad_params()):
                groups[-1].append(mp)
                used += math.prod(mp.layout.shape) * size
                if used >= (min(cap, FIRST_BUCKET_CAP_BYTES) if len(groups) == 1 else cap):
                    groups.append([])
                    used = 0
            groups = [g for g in groups if g]
            self._buckets = [_Bucket(g, region_offsets(g), waiting=len(g)) for g in groups]
            for i, bucket in enumerate(self._buckets):
                for mp in bucket.params:
                    mp.bucket_index = i
        return self._buckets

    def on_grad_ready(self, mp: "ManagedParam") -> None:
        """Post-accumulate-grad hook body: once a bucket's gradients are all in, launch it and
        every complete bucket after it, strictly in bucket order (as DDP does), so ranks whose
        parameter usage differs still issue the same collectives in the same order. Runs per
        parameter per step: kept short."""
        buckets = self._buckets if self._buckets is not None else self.buckets()
        bucket = buckets[cast(int, mp.bucket_index)]  # `buckets()` numbered every parameter
        if bucket.launched:
            return  # a late accumulation (parameter used twice): `flush_buckets` reduces it
        bucket.waiting -= 1
        if bucket.waiting == 0:
            while self._next_bucket < len(buckets) and buckets[self._next_bucket].waiting <= 0:
                self._launch_bucket(buckets[self._next_bucket])
                self._next_bucket += 1

    @labelled("composable::reduce_bucket")
    @untyped
    def _launch_bucket(self, bucket: _Bucket) -> None:
        bucket.launched = True
        grads, bucket.present = self._take_grads(bucket.params)
        bucket.reduction = self._launch_all_reduce(bucket.params, grads, bucket.present, offsets=bucket.offsets)

    @labelled("composable::flush_buckets")
    @untyped
    def flush_buckets(self) -> None:
        """End of backward: launch, in order, every bucket not launched yet — on every rank,
        filled with the missing mark where this rank has no gradient, so a gradient exists
        afterwards wherever any rank produced one (DDP's unused-parameter semantics; see
        `reduce.py`) — then reduce what accumulated after a bucket was launched (a parameter
        used twice in one forward)."""
        buckets = self.buckets()
        late = [mp for b in buckets if b.launched for mp in b.params if self.has_grads(mp)]
        for bucket in buckets[self._next_bucket :]:  # buckets launch in order: none of these has
            self._launch_bucket(bucket)
        self._next_bucket = len(buckets)  # a second flush in this backward launches only late ones
        if late:
            grads, present = self._take_grads(late)
            self._launch_all_reduce(late, grads, present)

    def _end_of_backward(self) -> None:
        # Forget what this backward launched (stale bookkeeping would make the next backward
        # defer every bucket to its end: no overlap).
        for bucket in self._buckets or []:
            bucket.waiting, bucket.launched = len(bucket.params), False
            bucket.present, bucket.reduction = [], None
        self._next_bucket = 0
