"""`QueuedSteps`: host steps of offloaded parameter groups that run on past `optimizer.step()`, each
waited for by its group's next forward (`step_in_backward(..., finish_in_forward=True)`).

A queued step cannot read `param.grad` when it runs, nor the param groups' hyperparameters: the
training loop has gone on (`zero_grad`, an LR scheduler's step). So each step is given what it
reads when it is queued: the gradients, and the groups' hyperparameters as they are then. It
steps aliases of the parameters (`param.detach()`: the same storage and version counter, so the
step writes the parameter and fully_shard sees it changed) that hold those gradients, through a
shadow of the optimizer of its own whose `state` maps each alias to its parameter's state dict
(the same dict: the step fills and updates it). The optimizer's own code computes the same
numbers for an alias as for its parameter.

The steps run on the caller's single worker thread, in the order they are queued; the ones not
begun when `optimizer.step()` comes can be taken back and queued again in the model's module
order, the order the next forward gathers the groups in.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn as nn

from ..clip_grad import clip_grads_with_norm_
from ._step_in_parts import StepInParts

# A step to queue: its parameters, their gradients, the event their copy to the host ends at.
Part = tuple[list[torch.Tensor], list[Any], Any]
Future = concurrent.futures.Future[None]


class QueuedSteps:
    """The queued steps of `groups` (fully_shard's offloaded parameter groups, in `model`'s module
    order), run by `worker` through `parts`; see the module doc. `hooks` are the handles of what
    it registered (each module's forward waiting for its groups' steps)."""

    def __init__(
        self,
        parts: StepInParts,
        worker: concurrent.futures.ThreadPoolExecutor,
        states: list[Any],
        groups: list[Any],
    ) -> None:
        self._parts = parts
        self._worker = worker
        self._shadow = parts.new_shadow()  # the worker's: the caller's thread steps through its own
        self._order = {id(group): i for i, group in enumerate(groups)}
        self._group_of = {id(mp.sharded): id(group) for group in groups for mp in group.params}
        self._group_steps: dict[int, list[Future]] = {}  # id(group) -> its queued steps
        self._landing: list[tuple[Future, Part]] = []  # queued during this backward
        mine = {id(group) for group in groups}
        self.hooks: list[Any] = []
        for state in states:
            if any(id(group) in mine for group in state.groups):
                hook = self._before_forward_hook(state)
                self.hooks += [module.register_forward_pre_hook(hook, prepend=True) for module in state.modules]

    def _before_forward_hook(self, state: Any) -> Callable[..., None]:
        """Before the module's fully_shard pre-forward gathers: its groups' steps, and those of
        the modules it prefetches, are done."""

        def before_forward(module: nn.Module, args: Any) -> None:
            for gathered in (state, *state.forward_prefetch):
                for group in gathered.groups:
                    for future in self._group_steps.pop(id(group), ()):
                        future.result()

        return before_forward

    def queue(self, part: Part, threads: int, clip: tuple[float, torch.Tensor] | None = None) -> Future:
        """Queue the step of `part` with the hyperparameters as they are now, on `threads` host
        threads, its gradients clipped first by (max_norm, total_norm) `clip` when given."""
        params, grads, ready = part
        groups = self._parts.part_groups(params)
        future = self._worker.submit(self._step, params, grads, groups, ready, threads, clip)
        for group in {self._group_of[id(p)] for p in params if id(p) in self._group_of}:
            self._group_steps.setdefault(group, []).append(future)
        return future

    def queue_landed(self, part: Part, threads: int) -> Future:
        """`queue` a part whose gradients landed during backward: `take_back_unbegun` may queue it
        again in forward order."""
        future = self.queue(part, threads)
        self._landing.append((future, part))
        return future

    def take_back_unbegun(self) -> list[Part]:
        """The parts queued during this backward whose steps have not begun, taken back."""
        taken = [part for future, part in self._landing if future.cancel()]
        self._landing.clear()
        for futures in self._group_steps.values():
            futures[:] = [f for f in futures if not f.cancelled()]
        return taken

    def in_forward_order(self, parts: list[Part]) -> list[Part]:
        """`parts` in the order the next forward gathers their groups."""

        def place(part: Part) -> int:
            return min(self._order.get(self._group_of.get(id(p), -1), 0) for p in part[0])

        return sorted(parts, key=place)

    def by_group(self, params: Iterable[torch.Tensor]) -> list[Part]:
        """`params` (their gradients on the host) as one part per group."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for param in params:
            by_group.setdefault(self._group_of.get(id(param), -1), []).append(param)
        return [(ps, [p.grad for p in ps], None) for ps in by_group.values()]

    def forget(self) -> None:
        """After waiting for every step: nothing is queued."""
        self._group_steps.clear()
        self._landing.clear()

    def _step(
        self,
        params: list[torch.Tensor],
        grads: list[Any],
        groups: list[dict[str, Any]],
        ready: torch.cuda.Event | None,
        threads: int,
        clip: tuple[float, torch.Tensor] | None,
    ) -> None:
        """On the worker: once the gradients are on the host, clip them if asked, and step the
        parameters' aliases holding them."""
        if torch.get_num_threads() != threads:  # a new thread starts with the process's default
            torch.set_num_threads(threads)
        if ready is not None:
            ready.synchronize()
        if clip is not None:
            clip_grads_with_norm_(grads, clip[0], clip[1], _are_grads=True)
        optimizer_state = self._parts.optimizer.state
        aliases, state = {}, {}
        for param, grad in zip(params, grads):
            alias = param.detach()
            alias.grad = grad
            aliases[id(param)] = alias
            state[alias] = optimizer_state[param]
        self._shadow.state = cast(Any, state)
        self._parts.step_part([dict(g, params=[aliases[id(p)] for p in g["params"]]) for g in groups], self._shadow)
