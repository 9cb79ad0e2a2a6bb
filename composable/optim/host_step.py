"""`step_in_backward`: the host optimizer step of CPU-offloaded parameters, run during backward.

With `CPUOffloadPolicy` the optimizer steps on the host after backward, and the GPUs wait for it:
a few hundred milliseconds for a billion parameters on a host's cores. But a group's step needs
only its own gradients, and those are in host memory as soon as its reduction lands, while
backward goes on with the earlier layers. Here each offloaded group's parameters are stepped
then, on a worker thread, by the user's optimizer's own code (`StepInParts`), so the host's
arithmetic hides behind the GPU's backward; `optimizer.step()` waits for what is left (the groups
backward reaches last: the first blocks and the root's own parameters) and steps the parameters
no reduction handed over (not offloaded, HSDP's deferred replica sum, accumulated gradients).

Clipping (`max_norm`) needs the norm of every gradient before any parameter moves, and that is
known only when backward ends. Each group's gradients' norms are taken on the worker as they
land (on all the host's cores: host_norms.py), so `optimizer.step()` has the total norm from
them, exactly as `clip_grad_norm_` computes it, and steps every group then. `speculate=True`
bets on that norm from the last step's: after a step that clipped nothing, each group steps as
it lands, after its parameters and state are copied aside (`StepBackup`); where the norm clips
nothing the steps stand, else they are taken back and taken again with the clipped gradients.
After a step that clipped (and on the first) it waits, as without the bet: early in training,
when most steps clip, a bet made every step would lose every step. The copy aside moves about
as many bytes as the step itself, so the bet pays only where backward is long enough to hide
both (on a 16-core host with the `1b` preset at batch 4 it does not: BENCHMARKS.md).

What cannot be exact once a parameter has moved is refused, not approximated: clipping after
backward (`composable.clip_grad_norm_` names it), a GradScaler's unscale and inf check (fp16 is
refused here), gradients accumulated over several backwards without `no_sync` (the second
reduction of a parameter before `optimizer.step()` raises during backward).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn

from .._engine.grads.host_norms import host_norms
from .._engine.optimizer.optim_state import STATE_ON_HOST_ATTR, mark_stepped_in_backward
from .._engine.params.wrappers import local_tensor
from ..clip_grad import clip_coefficient, clip_grads_with_norm_, grad_norm_with_known_norms
from ..fsdp import fully_shard
from ._step_backup import StepBackup
from ._step_in_parts import StepInParts
from .muon import Muon

_API = "composable.optim.step_in_backward"
_OWNER_ATTR = "_composable_step_in_backward"  # on the optimizer: its HostStepInBackward


def step_in_backward(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    speculate: bool = False,
) -> "HostStepInBackward":
    """Step `optimizer`'s CPU-offloaded parameters during backward, each group's as soon as its
    reduced gradients are in host memory.

    `model` holds modules under `fully_shard(..., offload_policy=CPUOffloadPolicy())`; each of
    their parameter groups hands its sharded gradients over as its reduce-scatter lands (on CUDA,
    once their copy to pinned host memory is done), and a worker thread steps those parameters
    with `optimizer`'s own code and state, while backward goes on. `optimizer.step()`, called
    after backward as usual, waits for those steps, then steps the parameters that were not
    handed over, and runs the user's step hooks once. For optimizers that step each parameter on
    its own (SGD, Adam, AdamW: fused, foreach or neither) every number equals the plain step's.
    The hyperparameters (`lr`, ...) are read as each group steps: set them before backward. Call
    this before making an LR scheduler: both replace `optimizer.step`.

    Gradient accumulation: under `no_sync` (or `set_requires_gradient_sync(False)`) for all but
    the last micro-batch, whose backward reduces and steps.

    `max_norm`: clip as `composable.clip_grad_norm_(model.parameters(), max_norm, norm_type)`
    would between backward and `optimizer.step()`, bit for bit, with the same total norm (the
    handle's `total_norm` after each step). The gradients' norms are taken on the host as they
    land, beside backward, and the groups step in `optimizer.step()` once the norm is known, as
    plain offload does, without the norm's pass after backward. `speculate=True` (with
    `max_norm`): after a step that clipped nothing, the next backward steps each group as it
    lands, after copying its parameters and state aside, and `optimizer.step()` takes those
    steps back and again with the clipped gradients if the norm clips (or is not finite) after
    all. The copy aside costs about what the step does (host memory bandwidth) and one more
    host copy of the offloaded parameters and their state: it pays only where backward is long
    enough to hide both. Without `max_norm`, `composable.clip_grad_norm_` over a parameter
    handed over in this backward raises: a step that ran cannot be clipped.

    Returns the `HostStepInBackward` (`close()`: the hooks removed, the plain step back;
    `total_norm`: the last step's gradient norm with `max_norm`, else None; `stepped_ahead`:
    whether the last step's groups stepped during backward; `steps_taken_back`: how many
    steps so far were taken back and taken again).

    Raises:
        TypeError: `optimizer` is not a `torch.optim.Optimizer` or `model` not an `nn.Module`.
        ValueError: `max_norm` not a number >= 0 or None, `norm_type` not a number > 0 (or inf),
            `speculate` not a bool or True without `max_norm`;
            `optimizer` is a `composable.optim.Muon` (its step communicates), already
            steps in backward or has its state offloaded (`offload_optimizer_state`), none of
            its parameters is in a `fully_shard` group of `model` with `CPUOffloadPolicy`, or
            such a group computes in float16 (a GradScaler needs every gradient before any step).
        RuntimeError (during backward): a parameter's gradient reduced a second time before
            `optimizer.step()` (accumulation without `no_sync`).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_API}: 'optimizer' must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: 'model' must be an nn.Module, got {type(model).__name__}")
    if max_norm is not None and not (_is_number(max_norm) and max_norm >= 0):
        raise ValueError(f"{_API}: 'max_norm' must be a number >= 0 or None, got {max_norm!r}")
    if not (_is_number(norm_type) and norm_type > 0):
        raise ValueError(f"{_API}: 'norm_type' must be a number > 0 (or inf), got {norm_type!r}")
    if not isinstance(speculate, bool):
        raise ValueError(f"{_API}: 'speculate' must be a bool, got {speculate!r}")
    if speculate and max_norm is None:
        raise ValueError(f"{_API}: 'speculate' needs 'max_norm': without clipping every group steps as it lands")
    if isinstance(optimizer, Muon):
        raise ValueError(
            f"{_API}: composable.optim.Muon's step sends whole matrices between ranks, which cannot run beside backward"
        )
    if _OWNER_ATTR in optimizer.__dict__:
        raise ValueError(f"{_API}: 'optimizer' already steps in backward; call close() on the first one")
    if getattr(optimizer, STATE_ON_HOST_ATTR, False):
        raise ValueError(
            f"{_API}: 'optimizer' has its state offloaded (offload_optimizer_state), which steps on the GPU; "
            "step_in_backward steps CPUOffloadPolicy's host parameters"
        )
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    groups = [
        group
        for module in model.modules()
        if (state := fully_shard.state(module)) is not None
        for group in state.groups
        if group.config.offload and any(id(mp.sharded) in stepped for mp in group.params)
    ]
    if not groups:
        raise ValueError(
            f"{_API}: no parameter of 'optimizer' is in a fully_shard group of 'model' ({type(model).__name__}) "
            "with CPUOffloadPolicy; only host parameters step in backward"
        )
    for group in groups:
        if torch.float16 in (group.dtypes.unsharded, group.dtypes.orig):
            raise ValueError(
                f"{_API}: a fully_shard group of 'model' computes in float16, whose GradScaler needs every "
                "gradient unscaled and checked before any step; use bfloat16, or step after backward"
            )
    names = {id(p): name for name, p in model.named_parameters()}
    handle = HostStepInBackward(optimizer, [group.reducer.options for group in groups], names)
    if max_norm is not None:
        handle.clip_as(list(model.parameters()), float(max_norm), float(norm_type), speculate)
    return handle


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class HostStepInBackward:
    """An optimizer whose offloaded parameters step during backward (`step_in_backward` makes it).

    Attributes: `optimizer` (the user's, whose `step` this replaces); `total_norm` (with
    `max_norm`: the last step's gradient norm, as `clip_grad_norm_` returns it; else None);
    `stepped_ahead` (whether the last step's groups stepped during backward); `steps_taken_back`
    (how many steps a lost `speculate` bet took back and took again). `wait()` waits for the
    steps begun in backward; `close()` also removes the hooks and gives the optimizer its plain
    step back."""

    def __init__(self, optimizer: torch.optim.Optimizer, options: list[Any], names: dict[int, str]) -> None:
        self.optimizer = optimizer
        self._names = names
        self._owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._parts = StepInParts(optimizer, _OWNER_ATTR, self)
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="composable-host-step")
        self._pending: list[concurrent.futures.Future[None]] = []
        self._handed: list[torch.Tensor] = []  # since the last optimizer.step(): handed over by a reduction
        self._handed_ids: set[int] = set()
        # The host's threads as the caller set them: a new thread starts with the process's default.
        self._threads = torch.get_num_threads()
        self._options = options
        for opts in options:
            opts.host_grads_hook = self._landed
        self._hooks = [optimizer.register_state_dict_pre_hook(lambda *_: self.wait())]
        # Clipping (`clip_as`): the parameters clipped, max_norm, norm_type; the steps' backup and
        # the local gradients' norms taken on the worker, by (id(local gradient), dtype).
        self._clip: tuple[list[torch.Tensor], float, float] | None = None
        self._backup = StepBackup()
        self._norms: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._normed: list[torch.Tensor] = []
        self.total_norm: torch.Tensor | None = None
        # Whether this backward's groups step as they land: always without clipping; with it,
        # the bet that this step clips nothing, made when the last one clipped nothing.
        self._step_ahead = True
        self._speculate = False
        self.stepped_ahead = False
        self.steps_taken_back = 0

    def clip_as(self, params: list[torch.Tensor], max_norm: float, norm_type: float, speculate: bool) -> None:
        """Clip as `clip_grad_norm_(params, max_norm, norm_type)` before each step, speculating
        or not (see `step_in_backward`)."""
        self._clip = (params, max_norm, norm_type)
        self._speculate = speculate
        self._step_ahead = False  # no norm seen yet: the first step waits for its own

    def _landed(self, handed: list[torch.Tensor], kept: list[torch.Tensor], ready: torch.cuda.Event | None) -> None:
        """A reduction's gradients are (or will be, at `ready`) in host memory: step them on the worker."""
        again = next((p for p in handed + kept if id(p) in self._handed_ids), None)
        if again is not None:
            raise RuntimeError(
                f"{_API}: the gradient of {self._names.get(id(again), 'a parameter')!r} was reduced a second time "
                "before optimizer.step(), after its step in backward; accumulate gradients under no_sync"
            )
        mine = [p for p in handed if id(p) in self._owned]
        if not mine:
            return
        # Marked whether or not they step now: what clip_grad_norm_ refuses does not hang on the bet.
        mark_stepped_in_backward(mine, True)
        self._handed_ids.update(id(p) for p in mine)
        self._handed += mine
        self._pending.append(self._worker.submit(self._take_part, mine, ready, self._step_ahead))

    def _take_part(self, params: list[torch.Tensor], ready: torch.cuda.Event | None, step_ahead: bool) -> None:
        """On the worker: wait for the gradients' copy to the host; take their norms when
        clipping; step `params` if `step_ahead` (first copying aside what the step overwrites,
        when clipping)."""
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        if ready is not None:
            ready.synchronize()
        if self._clip is not None:
            grads = [local_tensor(cast(torch.Tensor, param.grad)) for param in params]
            for grad, norm in zip(grads, host_norms(grads, self._clip[2], torch.float32)):
                self._norms[(id(grad), torch.float32)] = norm
            self._normed += grads  # alive while their ids key norms: no other tensor takes the ids
            if step_ahead:
                self._backup.save(params, self.optimizer.state)
        if step_ahead:
            self._parts.step_part(self._parts.part_groups(params))

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """`optimizer.step`: the user's pre-hooks, the steps begun in backward finished, the
        parameters not stepped there stepped, the user's post-hooks."""
        if closure is not None:
            raise ValueError(f"{_API}: optimizer.step(closure) is not supported: the parameters step during backward")
        self._parts.run_pre_hooks(_API)
        self._threads = torch.get_num_threads()
        self.wait()
        rest = [p for group in self.optimizer.param_groups for p in group["params"] if id(p) not in self._handed_ids]
        stepped_ahead = self._step_ahead and bool(self._handed)
        clipped = self._clip is not None and self._clips()
        if stepped_ahead and clipped:  # the bet lost: the speculative steps are taken back
            self._backup.restore(self._handed, self.optimizer.state)
            self.steps_taken_back += 1
        if not stepped_ahead or clipped:
            rest += self._handed
        if rest:
            self._parts.step_part(self._parts.part_groups(rest))
        self.stepped_ahead = stepped_ahead
        if self._clip is not None:
            self._step_ahead = self._speculate and not clipped
        self._forget_handed()
        self._parts.run_post_hooks()

    def _clips(self) -> bool:
        """The total norm (as clip_grad_norm_ takes it); the gradients clipped; whether that
        changed them (a coefficient below 1, or not a number)."""
        assert self._clip is not None
        params, max_norm, p = self._clip
        total = grad_norm_with_known_norms(params, p, self._norms)
        self.total_norm = total
        if bool(clip_coefficient(max_norm, total) >= 1.0):
            return False  # clip_grads_with_norm_ would multiply by 1.0: the same values
        clip_grads_with_norm_(params, max_norm, total)
        return True

    def _forget_handed(self) -> None:
        self._norms.clear()
        self._normed.clear()
        mark_stepped_in_backward(self._handed, False)
        self._handed.clear()
        self._handed_ids.clear()

    def wait(self) -> None:
        """Wait for the steps begun in backward (re-raising the first error of one)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Finish what runs, remove the hooks and give `optimizer` its plain step back."""
        self.wait()
        self._forget_handed()
        for opts in self._options:
            opts.host_grads_hook = None
        for hook in self._hooks:
            hook.remove()
        self._worker.shutdown()
        self._parts.restore()
