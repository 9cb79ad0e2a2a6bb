"""The copy of an offloaded group's flat shard that stays on the compute device between steps.

With `CPUOffloadPolicy(compute_shard_on_device=True)` the host keeps the fp32 shard (the
optimizer steps it there) and the device keeps it too, in the dtype the group gathers in: the
all-gathers of forward and backward read the device copy, and the host's shard crosses the link
only after it changed. "Changed" is read from version counters (every in-place write bumps
them; the optimizer-step hook bumps them for fused optimizers, whose kernels do not), so a
stale copy is never gathered. A replicated group's replica buffer is its device copy: it only
records which versions that buffer holds.
"""

from __future__ import annotations

import torch

from ..comm.streams import stream_context


class DeviceShardCopy:
    """A flat shard's copy on the compute device and the host versions its values are of."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None  # sharded groups: the copy they gather from
        self.versions: tuple[int, ...] | None = None  # the host shard's versions copied; None: nothing yet
        self.copies = 0  # copies made from the host, over the group's life

    def holds(self, versions: tuple[int, ...]) -> bool:
        """Whether the copy holds the values of the host shard at `versions`."""
        return self.versions is not None and self.versions == versions

    def refresh(
        self,
        host: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        versions: tuple[int, ...],
    ) -> torch.Tensor:
        """The copy of `host` (a 1D shard, at `versions`) in `dtype` on `device`; copied again,
        on `stream` (the all-gather stream, which reads it next), only when it holds other
        versions or another dtype."""
        copy = self.tensor
        if copy is not None and copy.dtype == dtype and self.holds(versions):
            return copy
        with stream_context(stream):
            if copy is None or copy.dtype != dtype:
                copy = self.tensor = torch.empty(host.numel(), dtype=dtype, device=device)
            copy.copy_(host, non_blocking=True)
        self.mark(versions)
        return copy

    def mark(self, versions: tuple[int, ...]) -> None:
        """The copy (or the replica buffer) was just filled from the host shard at `versions`."""
        self.versions = versions
        self.copies += 1

    def forget(self) -> None:
        """The host shard was rebuilt (a new buffer): the copy holds nothing of it."""
        self.tensor = self.versions = None
