"""`when_backward_leaves`: a callback as backward leaves each module of a model, in backward's order.

Autograd gives no event at the end of a module's backward, but it gives one at the start of the
next: the first gradient of that module's outputs. So a module is known to be left (its
gradients computed, its activations freed) when the backward of the module after it begins. The
last module of a backward is left only at the backward's end, which the caller sees anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils.hooks import RemovableHandle


def when_backward_leaves(modules: list[nn.Module], callback: Callable[[nn.Module], None]) -> list[RemovableHandle]:
    """Call `callback(module)` during each backward when it has left `module`, one of `modules`:
    when the backward of another of `modules`, not inside it, starts after that module's
    started, in the same backward (a module holding others is never called). Forward hooks on
    `modules` mark their outputs; a forward inside backward (activation checkpointing's
    recomputation) marks nothing. Returns the hooks' handles."""
    started: list[int] = []  # [this backward's graph task, then the modules whose backward started]
    by_id = {id(m): m for m in modules}
    # A module holding another (a root around its blocks) starts its backward first and is left
    # last: the start of an inner module's backward says nothing of it.
    inner = {id(m): {id(c) for c in held} for m, held in zip(modules, modules_inside(modules))}

    def on_backward_start(module: nn.Module) -> None:
        task = torch._C._current_graph_task_id()
        if not started or started[0] != task:
            started[:] = [task]
        elif started[-1] != id(module) and id(module) not in inner[started[-1]]:
            callback(by_id[started[-1]])
        started.append(id(module))

    def on_forward(module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grads: on_backward_start(module), mode="any")

    return [module.register_forward_hook(on_forward) for module in modules]


def modules_inside(modules: list[nn.Module]) -> list[list[nn.Module]]:
    """For each of `modules`, the others of `modules` nested inside it."""
    ids = {id(m) for m in modules}
    return [[c for c in m.modules() if c is not m and id(c) in ids] for m in modules]
