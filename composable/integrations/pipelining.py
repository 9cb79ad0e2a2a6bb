"""Pipeline parallelism (`torch.distributed.pipelining`) over stage modules that `fully_shard`,
`replicate` or HSDP manage (with TP inside a stage or not).

torch's pipeline stage recognises data parallelism by class (`DistributedDataParallel`,
`FSDPModule`); a composable stage module keeps its own class, so a plain `PipelineStage`
would run each microbatch's backward as a full training backward and reduce gradients once
per microbatch (the engine refuses that at the first forward, `_engine/hooks/pipeline_guard.py`).
`ComposablePipelineStage` (built by `pipeline_stage`) tells composable what the schedule knows,
as torch 2.15 does for FSDP2, on every torch:

- every microbatch's backward runs under manual backward finalization (`_engine/module_state/finalize.py`)
  with gradient sync off and reshard-after-backward off: unsharded gradients accumulate
  locally, the gathered parameters stay for the next microbatch (no all-gather per microbatch);
- after the last microbatch's backward of the step (or at the schedule's REDUCE_GRAD action),
  `finalize_backward` reduces each group once (one reduce-scatter per `fully_shard` group, one
  all-reduce per `replicate` bucket), waits, and reshards; where torch 2.15's schedule finalizes
  an `FSDPModule` stage itself (composable's FSDP2 interface), it does so through the same
  methods;
- then the gradients are divided by the number of microbatches where the schedule scales
  them (`scale_grads=True`, torch's default), exactly as torch's stage does.

Zero-bubble schedules split backward into input and weight parts computed with
`torch.autograd.grad` over `stage.submod.parameters()`; during those parts the unsharded
parameters (the ones forward used) are what the stage module registers.

The schedule's UNSHARD/RESHARD actions are issued only for `FSDPModule` stages. For a plain
composable stage the first forward of the step gathers each group and the end of the step
reshards it (gather once per step, the fewest possible), so the number of all-gathers per step
is that of FSDP2 under the same schedule with `reshard_after_forward=False` (the schedules'
prefetch only moves those gathers earlier). A stage module given FSDP2's interface
(`composable.integrations.fsdp2_module.as_fsdp_modules`) gets the schedule's UNSHARD/RESHARD
calls as FSDP2 does. torch 2.15's own `PipelineStage` drives such a module through
`finalize_backward` as it drives FSDP2; older torch reaches into FSDP2's private state there,
so it fails at the first forward with a line naming `pipeline_stage`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from .._engine.hooks.contract import param_states
from .._engine.module_state.state import ModuleState
from ..clip_grad import clip_grads_with_norm_, get_total_norm

__all__ = ["ComposablePipelineStage", "pipeline_stage", "clip_pipeline_grad_norm_"]


class ComposablePipelineStage(PipelineStage):
    """A `torch.distributed.pipelining.PipelineStage` whose stage module (or modules inside it)
    is managed by `fully_shard` / `replicate`: gradients are reduced once per group per step,
    not once per microbatch. Takes `PipelineStage`'s arguments; the stage module is not
    wrapped, swapped or copied."""

    # The engine lets a stage with this marker run composable modules (`_engine/hooks/pipeline_guard.py`).
    _composable_reduces_once_per_step = True

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"ComposablePipelineStage: submodule must be an nn.Module, got {type(submodule).__name__}")
        super().__init__(submodule, *args, **kwargs)

    # -- composable's states of this stage --------------------------------------------------
    def _states(self) -> list[ModuleState]:
        return param_states(self.submod)

    def _roots(self) -> list[ModuleState]:
        """The roots among this stage's states (those that ran a forward): the stage module
        itself when it is managed, else each managed subtree that ran on its own."""
        return [s for s in self._states() if s.is_root]

    def _accumulate_locally(self) -> None:
        # As torch 2.15's stage drives FSDP2: each microbatch's backward with sync and
        # reshard-after-backward off, under manual finalization (`reduce_grads` finalizes).
        for state in self._states():
            state.requires_gradient_sync = False
            state.reshard_after_backward = False
        for root in self._roots():
            root.set_manual_backward_finalization(True)

    @contextlib.contextmanager
    def _unsharded_registered(self, backward_type: str) -> Iterator[None]:
        """Split backward (`input`/`weight`): torch differentiates w.r.t. the parameters the
        stage module registers; show it the unsharded ones forward used, then the sharded."""
        if backward_type == "full":
            yield
            return
        groups = [group for s in self._states() for group in s.groups]
        for group in groups:
            group.unshard()  # kept from forward: registers them, gathers nothing
        try:
            yield
        finally:
            for group in groups:
                group.keep_unsharded()

    # -- what the schedule calls ------------------------------------------------------------
    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        self._accumulate_locally()
        with self._unsharded_registered(backward_type):
            # Never `last_backward=True` to torch: for an `FSDPModule` stage module (composable's
            # adapter) older torch would then reach into FSDP2's private state; we reduce below.
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False)
        if last_backward and not _torch_finalizes(self.submod):
            self.reduce_grads()
        return result

    def reduce_grads(self) -> None:
        """Reduce the gradients accumulated over this step's microbatches once per group, wait
        for them and reshard (a no-op for groups that hold no gradients)."""
        for state in self._states():
            state.requires_gradient_sync = True
            state.reshard_after_backward = True
        for root in self._roots():
            backward_end = root.root_context.backward_end if root.root_context is not None else None
            if backward_end is not None and backward_end.pending_reduction is not None:
                backward_end.pending_reduction.wait()  # an asynchronous finalization the schedule started
            if backward_end is not None and backward_end.manual_active:  # a backward ran since the last finalization
                root.finalize_backward()
            elif (
                backward_end is not None and not root.manual_finalization
            ):  # backwards outside the schedule (automatic)
                backward_end.finish_outside_autograd()
            root.set_manual_backward_finalization(False)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # The schedule's REDUCE_GRAD action: after the last backward of this stage in the step.
        self.reduce_grads()
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)

    if hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):  # torch 2.11-2.14 (2.15 warms up otherwise)

        def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
            # The schedule's warm-up exchange with the neighbouring stages. Under a V-shaped
            # schedule two neighbouring stages live on one rank, which torch 2.11 warms up by a
            # send to and a receive from that rank itself; gloo has no connection to its own
            # rank ("Pair is not connected"), so the first step fails there (torch's own stages
            # too). Those stages hand activations and gradients to each other locally afterwards
            # (torch 2.12+ warms a PipelineStage up without this exchange), so the pairs with
            # this rank carry nothing that is needed.
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def _post_metadata_inference_cleanup(self) -> None:
        # Shape inference ran a real forward/backward: drop what it left (gathered parameters,
        # gradients, no-sync sums) so the first step starts clean.
        parent = getattr(super(), "_post_metadata_inference_cleanup", None)
        if parent is not None:
            parent()
        self.reduce_grads()
        for param in self.submod.parameters():
            param.grad = None


def _torch_finalizes(module: nn.Module) -> bool:
    """Whether torch's schedule finalizes this stage's backward itself (torch 2.15+ drives an
    `FSDPModule` stage through `finalize_backward` at its REDUCE_GRAD action, as FSDP2's):
    then the reduction happens there, through composable's FSDP2 interface."""
    return isinstance(module, FSDPModule) and hasattr(FSDPModule, "finalize_backward")


def pipeline_stage(
    module: nn.Module,
    stage_index: int,
    num_stages: int,
    device: torch.device | str,
    **kwargs: Any,
) -> ComposablePipelineStage:
    """Build the pipeline stage of `module` (managed by `fully_shard` / `replicate` / HSDP,
    inside or on it) for `torch.distributed.pipelining`'s schedules. `kwargs` are those of
    `PipelineStage` (`group` = the pipeline process group, e.g. `mesh["pp"].get_group()`,
    `input_args`, `output_args`, ...). Gradients are reduced once per group per step."""
    if not isinstance(stage_index, int) or not isinstance(num_stages, int) or not 0 <= stage_index < num_stages:
        raise ValueError(
            f"pipeline_stage: stage_index must be an int in [0, num_stages={num_stages!r}), got {stage_index!r}"
        )
    return ComposablePipelineStage(module, stage_index, num_stages, torch.device(device), **kwargs)


def clip_pipeline_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """`composable.clip_grad_norm_` for a pipelined model: `parameters` are this rank's
    parameters of all its stages; their norm (over the data-parallel and TP meshes, as
    composable computes it) is combined over `pp_group` (the ranks of one pipeline), so every
    rank clips with the norm of the whole model. Returns that norm (a plain tensor, the same on
    every rank)."""
    params = [p for p in parameters if p.grad is not None]
    grads = [g for p in params if (g := p.grad) is not None]  # every one of them (typed by the test)
    norm = get_total_norm(grads, norm_type, error_if_nonfinite)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        norm = norm.clone()
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, group=pp_group)
            norm = norm.pow(1.0 / norm_type)
    clip_grads_with_norm_(params, max_norm, norm)
    return norm
