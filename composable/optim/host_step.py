"""`overlap_host_step`: the optimizer step of a CPU-offloaded model runs behind the next forward.

With `CPUOffloadPolicy` the sharded parameters, their gradients and the optimizer state live in
host memory and the optimizer steps there. Run as usual, `optimizer.step()` is a wall between two
steps: the GPUs wait for the whole host step before the next forward's first all-gather. Yet that
all-gather needs only its own group's parameters. So here `optimizer.step()` takes a snapshot of
the hyperparameters and returns at once; a host thread steps the groups one after the other, in
the order the forward uses them, and each group's next all-gather (its pre-forward) waits for that
group's step alone. The GPUs compute the first layers while the host still steps the last ones.

The math is the optimizer's own: each group is stepped by a shallow copy of the user's optimizer
that shares its state and holds only that group's parameters, with the hyperparameters the step
was called with. Optimizers that work elementwise per parameter (SGD, Adam, AdamW, fused or not)
give bit for bit what one `optimizer.step()` over every parameter gives.
"""

from __future__ import annotations

import copy
import threading
import types
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.nn as nn

from .._engine.groups.group import ParamGroup
from .._engine.groups.group_set import members
from .._engine.hooks.contract import param_states

_API = "composable.optim.overlap_host_step"
_OVERLAP_ATTR = "_composable_host_step"  # on the optimizer: its HostStepOverlap


def overlap_host_step(optimizer: torch.optim.Optimizer, module: nn.Module) -> "HostStepOverlap":
    """Make `optimizer.step()` over a CPU-offloaded `module` run behind the next forward.

    `module` is (or contains) modules under `fully_shard(..., offload_policy=CPUOffloadPolicy())`;
    every parameter `optimizer` steps must belong to one of them. Afterwards the training loop is
    unchanged (`loss.backward()`, `clip_grad_norm_`, `optimizer.step()`, a scheduler's `step()`,
    `optimizer.zero_grad()`), and so is every number it computes:

    - `optimizer.step()` reads the hyperparameters (`lr`, ...) then and returns at once; a host
      thread steps the parameter groups of `module` in forward order. A group's next all-gather
      waits for its step (its error, if it failed, is raised there);
    - `optimizer.zero_grad()` clears each group's gradients once its step is done;
    - the state dicts of `optimizer` and `module` (and so DCP's `get_state_dict`) and their
      `load_state_dict` wait for every step first. Anything else that reads the parameters or
      the optimizer state between `step()` and the next forward calls `wait()` first.

    The optimizer must step each parameter on its own (SGD, Adam, AdamW, fused or foreach: the
    result is then bit for bit the plain step's); a closure is refused. Call this before making
    an LR scheduler: both replace `optimizer.step`.

    Returns the `HostStepOverlap` (`wait()`, `close()`: back to the plain step).

    Raises:
        TypeError: `optimizer` is not a `torch.optim.Optimizer` or `module` not an `nn.Module`.
        ValueError: a parameter of `optimizer` is not in a `fully_shard` group of `module` with
            `CPUOffloadPolicy`, or `optimizer` already overlaps its step.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_API}: 'optimizer' must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_API}: 'module' must be an nn.Module, got {type(module).__name__}")
    if _OVERLAP_ATTR in optimizer.__dict__:
        raise ValueError(f"{_API}: 'optimizer' already overlaps its step; call close() on the first one")
    groups = [g for state in param_states(module) for g in members(state.group) if g.config.offload]
    owned = {id(mp.sharded_param) for g in groups for mp in g.params}
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"{_API}: parameter {names.get(id(p), tuple(p.shape))!r} of 'optimizer' is not in a "
                    "fully_shard group of 'module' with CPUOffloadPolicy; only offloaded parameters step on the host"
                )
    return HostStepOverlap(optimizer, module, groups)


class HostStepOverlap:
    """An optimizer whose step runs on a host thread behind the next forward (`overlap_host_step`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, groups: list[ParamGroup]) -> None:
        self.optimizer = optimizer
        self.groups = groups  # forward order
        self._shadow = copy.copy(optimizer)  # shares `state`; its param_groups are set per group
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="composable-host-step")
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self._stepped: list[list[torch.Tensor]] = []  # groups stepped before zero_grad was called
        self._zero_request: bool | None = None  # zero_grad's set_to_none, once called during the steps
        self._failure: BaseException | None = None
        self._plain_step = optimizer.step
        self._plain_zero_grad = optimizer.zero_grad
        # Bound to the optimizer, as `step` is: an LR scheduler re-binds `optimizer.step.__func__` to it.
        setattr(optimizer, _OVERLAP_ATTR, self)
        optimizer.step = types.MethodType(_overlapped_step, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(_overlapped_zero_grad, optimizer)  # type: ignore[method-assign]
        self._hooks = [
            optimizer.register_state_dict_pre_hook(lambda *_: self.wait()),
            optimizer.register_load_state_dict_pre_hook(lambda *_: self.wait()),
            module.register_state_dict_pre_hook(lambda *_: self.wait()),
            module.register_load_state_dict_pre_hook(lambda *_: self.wait()),
        ]

    # -- the step ------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """`optimizer.step`: snapshot the hyperparameters, queue each group's step, return."""
        if closure is not None:
            raise ValueError(f"{_API}: optimizer.step(closure) is not supported: the step runs behind the forward")
        self.wait()
        hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        chosen = [list(pg["params"]) for pg in self.optimizer.param_groups]
        with self._lock:
            self._zero_request = None
            self._stepped = []
        for group in self.groups:
            ids = {id(mp.sharded_param) for mp in group.params}
            param_groups = [dict(hp, params=[p for p in ps if id(p) in ids]) for hp, ps in zip(hyper, chosen)]
            param_groups = [pg for pg in param_groups if pg["params"]]
            if not param_groups:
                continue
            future = self._executor.submit(self._step_group, param_groups)
            self._pending.append(future)
            group.host_write = future

    def _step_group(self, param_groups: list[dict[str, Any]]) -> None:
        if self._failure is not None:
            raise RuntimeError(f"{_API}: an earlier group's host step failed") from self._failure
        try:
            self._shadow.param_groups = param_groups
            self._shadow.step()
        except BaseException as err:
            self._failure = err
            raise
        params = [p for pg in param_groups for p in pg["params"]]
        with self._lock:
            zero = self._zero_request
            if zero is None:
                self._stepped.append(params)
        if zero is not None:
            _zero_grads(params, zero)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`optimizer.zero_grad`: each group's gradients are cleared once its step is done."""
        with self._lock:
            running = any(not f.done() for f in self._pending)
            if running:
                self._zero_request = set_to_none
                stepped, self._stepped = self._stepped, []
        if not running:
            self._plain_zero_grad(set_to_none)
            return
        for params in stepped:
            _zero_grads(params, set_to_none)

    def wait(self) -> None:
        """Wait for every group's host step (raising the first failure)."""
        pending, self._pending = self._pending, []
        for group in self.groups:
            group.host_write = None
        for future in pending:
            future.result()
        if self._zero_request is not None:  # steps that finished before zero_grad was called
            with self._lock:
                stepped, self._stepped = self._stepped, []
            for params in stepped:
                _zero_grads(params, self._zero_request)

    def close(self) -> None:
        """Wait for the steps and give `optimizer` its plain `step` and `zero_grad` back."""
        self.wait()
        for hook in self._hooks:
            hook.remove()
        self.optimizer.step = self._plain_step  # type: ignore[method-assign]
        self.optimizer.zero_grad = self._plain_zero_grad  # type: ignore[method-assign]
        del self.optimizer.__dict__[_OVERLAP_ATTR]
        self._executor.shutdown()


def _overlapped_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> None:
    optimizer.__dict__[_OVERLAP_ATTR].step(closure)


def _overlapped_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    optimizer.__dict__[_OVERLAP_ATTR].zero_grad(set_to_none)


def _zero_grads(params: list[torch.Tensor], set_to_none: bool) -> None:
    """What `Optimizer.zero_grad` does to these parameters' gradients."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()
