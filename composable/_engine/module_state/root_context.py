"""The training state of a module's hooks and what the root of a tree keeps for the whole tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Generic, TypeVar

from .finalize import BackwardEnd, TreeMember

# The module states of the tree (state.py's `ModuleState`, which imports this file).
State = TypeVar("State", bound=TreeMember)


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


@dataclass(eq=False)
class RootContext(Generic[State]):
    """What only the root of a tree keeps, shared by every state of the tree: the states
    themselves, the order their forwards finished in this iteration (backward prefetches in
    reverse) and the end of backward of the tree (`BackwardEnd`, finalize.py)."""

    root: State
    states: list[State]
    forward_order: list[State] = field(default_factory=list)
    backward_end: BackwardEnd = field(init=False)

    def __post_init__(self) -> None:
        self.backward_end = BackwardEnd(self.root, self.states)
