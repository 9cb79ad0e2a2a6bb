"""FSDP2's options for a group's gradient reduction: what `composable/fsdp/` sets (as the
`options` of the group's `GradReducer`), with the defaults as class attributes,
so a reducer that never had one set pays one attribute read per reduction and nothing more;
and running the user's hook on the reduced gradients.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm.streams import CommStreams, stream_context

# (handed, kept, ready): the sharded parameters whose `.grad` now holds their reduced gradient in
# host memory (valid once `ready`, a CUDA event, has completed; None: already), and those of the
# same reduction whose gradient is summed into an earlier one at the end of backward instead.
HostGradsHook = Callable[[list[torch.Tensor], list[torch.Tensor], "torch.cuda.Event | None"], None]


class ReduceOptions:
    """One group's reduction options; unset ones are the class defaults."""

    divide_factor: float | None = None  # set_gradient_divide_factor
    requires_all_reduce = True  # set_requires_all_reduce: HSDP's False defers the replica all-reduce
    force_sum = False  # set_force_sum_reduction_for_comms: never ReduceOp.AVG, divide after
    reduce_unused = False  # set_reduce_scatter_unused_params: zeros for parameters without a gradient
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # set_all_reduce_hook
    all_reduce_hook_stream: Any = None
    reduce_scatter_comm: Any = None  # set_custom_reduce_scatter (an FSDP2 `ReduceScatter`) and kin
    reduce_scatter_group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group
    max_input_buffers = 1  # set_reduce_scatter_max_input_buffers (CUDA)
    # Offloaded groups: given each reduction's sharded gradients as they reach host memory,
    # during backward (`GradReducer.hand_over_on_host`); composable.optim.step_in_backward sets it.
    host_grads_hook: "HostGradsHook | None" = None

    # User objects and process groups are shared by a deep copy of the model, not copied.
    _SHARED_ON_COPY = (
        "all_reduce_hook",
        "all_reduce_hook_stream",
        "reduce_scatter_comm",
        "reduce_scatter_group",
        "host_grads_hook",
    )

    def __deepcopy__(self, memo: dict[int, Any]) -> "ReduceOptions":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in vars(self).items():
            setattr(new, name, value if name in self._SHARED_ON_COPY else copy.deepcopy(value, memo))
        return new

    def run_all_reduce_hook(self, grads: torch.Tensor, streams: CommStreams | None) -> None:
        """The user's hook on this rank's reduced gradients (their collectives finished), as
        FSDP2 runs it. CUDA: on the reduce stream, or on the hook's own stream ordered between
        it and what follows."""
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        assert hook is not None
        if stream is None or streams is None:
            hook(grads)
            return
        stream.wait_stream(streams.reduce)
        with stream_context(stream):
            hook(grads)
        streams.reduce.wait_stream(stream)
