"""Collectives over a group of one rank, skipped.

A shard group of one rank (a world of one, or HSDP with one rank per shard group) has nothing to
exchange: its all-gather output is its input and its reduce-scatter output is its input (summed
over one rank). PyTorch FSDP2 issues neither there, so a single-GPU run costs no collective
launches; the same here. These wrap `collectives`' all-gathers and reduce-scatter: over one rank
they copy (when output and input are not already the same memory) and return a finished work,
otherwise they issue the collective. A custom collective (`set_custom_all_gather` /
`set_custom_reduce_scatter`) is skipped there too, as in FSDP2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import collectives as comm


class Done:
    """The work of a collective that had nothing to exchange: already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _copy(output: torch.Tensor, input: torch.Tensor) -> None:
    same = output.data_ptr() == input.data_ptr() and output.numel() == input.numel()
    if not same and output.numel():
        # Refilling the gather output is no mutation autograd should see (as the collective's write).
        with comm.refilling(output):
            output.view(-1).copy_(input.reshape(-1))


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool, custom: Any = None
) -> Any:
    """`collectives.all_gather`, a copy over a group of one rank."""
    if group.size() == 1:
        _copy(output, input)
        return Done()
    return comm.all_gather(output, input, group, async_op, custom)


def all_gather_coalesced(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> None:
    """`collectives.all_gather_coalesced`, copies over a group of one rank."""
    if group.size() == 1:
        for output, input in zip(outputs, inputs):
            _copy(output, input)
        return
    comm.all_gather_coalesced(outputs, inputs, group)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    average: bool,
    async_op: bool,
    custom: Any = None,
) -> Any:
    """`collectives.reduce_scatter`, a copy over a group of one rank (the sum, and the
    average, over one rank is the input itself)."""
    if group.size() == 1:
        output.copy_(input)
        return Done()
    return comm.reduce_scatter(output, input, group, average, async_op, custom)
