"""A composable module run by a pipeline stage that would reduce its gradients once per
microbatch instead of once per step.

torch's `torch.distributed.pipelining` stages recognise data parallelism by class
(`DistributedDataParallel`, FSDP2's `FSDPModule`); a composable module keeps its own class, so
torch's plain `PipelineStage` runs each microbatch's backward as a whole training backward:
it trains correctly, but reduces every group once per microbatch (n_microbatches times FSDP2's
traffic), silently. The stage that reduces once per step is
`composable.integrations.pipelining.pipeline_stage`; torch 2.15's stage also drives a module
with composable's FSDP2 interface correctly (through `finalize_backward`). Anything else fails
at the root's first forward, naming the fix.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

_STAGE_MODULE = "torch.distributed.pipelining.stage"
_MAX_DEPTH = 40  # frames from the root's pre-forward hook up to the stage's call of its module


def _torch_stage_calling() -> Any | None:
    """The `torch.distributed.pipelining` stage whose forward is running this one, if any."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_globals.get("__name__") == _STAGE_MODULE:  # a stage's forward or its shape inference
            stage = frame.f_locals.get("self")
            if stage is not None and hasattr(stage, "submod"):
                return stage
        frame = frame.f_back
    return None


def check_pipeline_stage(api: str, module: nn.Module) -> None:
    """Root's lazy init: raise `RuntimeError` naming `pipeline_stage` when a torch pipeline
    stage that would reduce this tree's gradients once per microbatch runs it."""
    stage = _torch_stage_calling()
    if stage is None or getattr(stage, "_composable_reduces_once_per_step", False):
        return
    submod = getattr(stage, "submod", None)
    if isinstance(submod, FSDPModule) and hasattr(FSDPModule, "finalize_backward"):
        return  # torch 2.15+: finalizes through composable's FSDP2 interface, once per step
    raise RuntimeError(
        f"{api}: torch.distributed.pipelining's {type(stage).__name__} runs {type(module).__name__}, which "
        f"{api} manages, as a plain module: it would reduce gradients once per microbatch instead of once per "
        "step; build the stage with composable.integrations.pipelining.pipeline_stage(module, stage_index, "
        "num_stages, device, group=...)"
    )
