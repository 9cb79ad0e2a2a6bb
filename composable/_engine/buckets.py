"""Bucketed gradient all-reduce for `replicate` (DDP semantics).

Gradients are all-reduced in buckets of about `bucket_cap_mb`, each launched from the
post-accumulate-grad hooks as soon as its gradients are all in, strictly in bucket order, so
communication overlaps the rest of the backward and every rank issues the same collectives in
the same order whatever its parameter usage.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .profiling import labelled
from .reduce import GradReducer, ReduceSpec
from .streams import CommStreams

if TYPE_CHECKING:
    from .param import ManagedParam

FIRST_BUCKET_CAP_BYTES = 1 << 20  # as DDP's first bucket


class BucketedReducer(GradReducer):
    """A `GradReducer` for replicated groups that all-reduces in buckets during backward."""

    def __init__(
        self, params: list["ManagedParam"], spec: ReduceSpec, streams: CommStreams | None, bucket_cap_bytes: int
    ) -> None:
        super().__init__(params, spec, streams)
        self.bucket_cap_bytes = bucket_cap_bytes
        self._buckets: list[list["ManagedParam"]] | None = None
        self._ready: dict[int, int] = {}  # bucket -> gradients in
        self._launched: set[int] = set()
        self._complete: set[int] = set()  # buckets whose gradients are all in
        self._next_bucket = 0  # buckets launch strictly in order

    def buckets(self) -> list[list["ManagedParam"]]:
        """Buckets in reverse registration order (roughly the order backward produces
        gradients), filled as DDP fills them: a bucket closes once it holds at least its cap,
        `min(cap, 1 MiB)` for the first (its all-reduce starts as early as possible) and
        `bucket_cap_bytes` for the rest; every collective launch costs CPU time, so there
        are no more buckets than needed."""
        if self._buckets is None:
            cap = self.bucket_cap_bytes
            size = self.spec.dtypes.reduce.itemsize
            buckets: list[list["ManagedParam"]] = [[]]
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
                    mp.bucket_index = i
        return self._buckets

    def on_grad_ready(self, mp: "ManagedParam") -> None:
        """Post-accumulate-grad hook body: once a bucket's gradients are all in, launch it and
        every complete bucket after it, strictly in bucket order (as DDP does), so ranks whose
        parameter usage differs still issue the same collectives in the same order."""
        buckets = self.buckets()
        index = mp.bucket_index
        if index in self._launched:
            return  # a late accumulation (parameter used twice): `flush_buckets` reduces it
        self._ready[index] = self._ready.get(index, 0) + 1
        if self._ready[index] == len(buckets[index]):
            self._complete.add(index)
            while self._next_bucket in self._complete:
                self._launch_bucket(self._next_bucket)
                self._next_bucket += 1

    @labelled("composable::reduce_bucket")
    def _launch_bucket(self, index: int) -> None:
        bucket = self.buckets()[index]
        self._launched.add(index)
        grads, present = self._take_grads(bucket)
        # Every bucket carries presence flags, so its size is the same on every rank however
        # each rank's parameter usage differs.
        self._launch_all_reduce(bucket, grads, present, with_presence=True)

    @labelled("composable::flush_buckets")
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

    def _end_of_backward(self) -> None:
        # Forget which buckets this backward launched (stale bookkeeping would make the next
        # backward defer every bucket to its end: no overlap).
        self._ready.clear()
        self._launched.clear()
        self._complete.clear()
        self._next_bucket = 0
