"""The training state of a module's hooks and what the root of a tree keeps for the whole tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from . import finalize

ModuleState = Any  # state.py's (which imports this file)


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


@dataclass(eq=False)
class RootContext:
    """What only the root of a tree keeps, shared by every state of the tree: the states
    themselves, the order their forwards finished in this iteration (backward prefetches in
    reverse) and whether the end-of-backward callback is queued."""

    root: "ModuleState"
    states: list["ModuleState"]
    forward_order: list["ModuleState"] = field(default_factory=list)
    final_callback_queued: bool = False
    manual_active: bool | None = None  # manual finalization, as chosen when this backward started (finalize.py)
    pending_reduction: finalize.GradientReductionHandle | None = None  # finalize_backward's, until finished
    finalizing: bool = False  # inside finalize_backward
