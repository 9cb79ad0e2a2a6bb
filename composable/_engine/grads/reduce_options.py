"""FSDP2's options for a group's gradient reduction (mixed into `GradReducer`): what
`composable/fsdp/_methods.py` sets, with the defaults as class attributes, so a reducer that
never had one set pays one attribute read per reduction and nothing more; the user's hook run
on the reduced gradients; and discarding an aborted iteration's reductions.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ..comm.streams import stream_context

if TYPE_CHECKING:
    from ..params.param import ManagedParam


class ReduceOptions:
    force_sum = False  # set_force_sum_reduction_for_comms: never ReduceOp.AVG, divide after
    reduce_unused = False  # set_reduce_scatter_unused_params: zeros for parameters without a gradient
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # set_all_reduce_hook
    all_reduce_hook_stream: Any = None
    reduce_scatter_comm: Any = None  # set_custom_reduce_scatter (an FSDP2 `ReduceScatter`) and kin
    reduce_scatter_group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group
    max_input_buffers = 1  # set_reduce_scatter_max_input_buffers (CUDA)

    # The GradReducer's own fields this mixin reads.
    params: list["ManagedParam"]
    pending: list[Any]
    streams: Any
    _partial: torch.Tensor | None
    _holds_no_sync_sums: bool

    # User objects and process groups are shared by a deep copy of the model, not copied.
    _SHARED_ON_COPY = ("all_reduce_hook", "all_reduce_hook_stream", "reduce_scatter_comm", "reduce_scatter_group")

    def __deepcopy__(self, memo: dict) -> Any:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in vars(self).items():
            setattr(new, name, value if name in self._SHARED_ON_COPY else copy.deepcopy(value, memo))
        return new

    def _run_all_reduce_hook(self, red: Any) -> None:
        """The user's hook on this rank's reduced gradients, before the division that averages
        them, as FSDP2 runs it: after the reduce-scatter, or after HSDP's all-reduce. CPU: the reduction is finished first.
        CUDA: on the reduce stream, or on the hook's own stream ordered between it and what
        follows."""
        for work in red.works:
            if work is not None:
                work.wait()
        red.works.clear()
        grads = red.output
        stream, streams = self.all_reduce_hook_stream, self.streams
        if stream is None or streams is None:
            self.all_reduce_hook(grads)  # type: ignore[misc]
            return
        stream.wait_stream(streams.reduce)
        with stream_context(stream):
            self.all_reduce_hook(grads)  # type: ignore[misc]
        streams.reduce.wait_stream(stream)

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
        self._holds_no_sync_sums = False
        for mp in self.params:
            mp.stashed_grad, mp.grad_marker = None, None
            if mp.take_grad_is_unreduced():  # replicated no-sync: the visible `.grad` holds local sums
                mp.sharded.grad = None
            if mp.unsharded_param is not None:
                mp.unsharded_param.grad = None
        self._end_of_backward()

    def _end_of_backward(self) -> None:  # GradReducer's
        raise NotImplementedError
