"""`StepInParts`: a user's optimizer whose `optimizer.step()` is replaced by one that steps its
parameters part by part, each part by the optimizer's own code.

The parts are stepped by a shallow copy of the optimizer (the shadow) that shares its `state` and
`defaults` and is given, per part, param groups holding only that part's parameters with their
groups' hyperparameters. Optimizers that step each parameter on its own (SGD, Adam, AdamW: fused,
foreach or neither) compute for every parameter what one step over all of them computes. The
shadow has its own, empty, hook dicts: the user's step hooks run once per `optimizer.step()`,
around all of the parts, not once per part.
"""

from __future__ import annotations

import collections
import copy
import types
from collections.abc import Callable
from typing import Any

import torch


class StepInParts:
    """`optimizer.step` replaced by `owner.step(closure)` until `restore()` (the owner is set on
    the optimizer as `owner_attr`); `step_part` steps some of its parameters with its own code."""

    def __init__(self, optimizer: torch.optim.Optimizer, owner_attr: str, owner: object) -> None:
        self.optimizer = optimizer
        self._owner_attr = owner_attr
        self.shadow = copy.copy(optimizer)
        self.shadow.__dict__.pop("step", None)  # an LR scheduler's wrapper of the user's step: the class's
        self.shadow._optimizer_step_pre_hooks = collections.OrderedDict()
        self.shadow._optimizer_step_post_hooks = collections.OrderedDict()
        self._own_step = optimizer.__dict__.get("step")  # an instance's own step (a scheduler's wrapper), if any
        setattr(optimizer, owner_attr, owner)
        # Bound to the optimizer, as `step` is: an LR scheduler re-binds `optimizer.step.__func__`.
        setattr(optimizer, "step", types.MethodType(_replaced_step(owner_attr), optimizer))

    def step_part(self, param_groups: list[dict[str, Any]]) -> None:
        """Step the parameters of `param_groups` (each a group's hyperparameters and some of its
        parameters) with the optimizer's own code and state."""
        self.shadow.param_groups = param_groups
        self.shadow.step()

    def part_groups(self, params: list[torch.Tensor]) -> list[dict[str, Any]]:
        """The optimizer's param groups cut down to `params` (in the groups' order), empty ones dropped."""
        wanted = {id(p) for p in params}
        groups = []
        for group in self.optimizer.param_groups:
            mine = [p for p in group["params"] if id(p) in wanted]
            if mine:
                groups.append(dict(group, params=mine))
        return groups

    def run_pre_hooks(self, api: str) -> None:
        """The user's step pre-hooks on the optimizer, once; one that changes the arguments is refused."""
        opt = self.optimizer
        for pre_hook in opt._optimizer_step_pre_hooks.values():
            if pre_hook(opt, (), {}) is not None:
                raise RuntimeError(
                    f"{api}: an optimizer step pre-hook that changes the step's arguments is not supported"
                )

    def run_post_hooks(self) -> None:
        """The user's step post-hooks on the optimizer, once."""
        opt = self.optimizer
        for post_hook in opt._optimizer_step_post_hooks.values():
            post_hook(opt, (), {})

    def restore(self) -> None:
        """Give the optimizer its step back (the class's, or the instance's own it had)."""
        if self._own_step is None:
            del self.optimizer.__dict__["step"]
        else:
            setattr(self.optimizer, "step", self._own_step)
        del self.optimizer.__dict__[self._owner_attr]


def _replaced_step(owner_attr: str) -> Callable[..., Any]:
    def replaced(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        return optimizer.__dict__[owner_attr].step(closure)

    replaced.__name__ = f"step_via_{owner_attr.strip('_')}"
    return replaced
