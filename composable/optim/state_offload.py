"""`offload_optimizer_state`: an optimizer's state in host memory, streamed through the GPU to step.

Adam's two moments are 8 of the 16 bytes a parameter costs a GPU under mixed precision with fp32
master weights. `CPUOffloadPolicy` moves them to the host with the parameters and their
gradients, and then the host's cores run the step: a few hundred milliseconds for a billion
parameters, which the GPUs wait for. Here only the optimizer state leaves the GPU: the parameters
and gradients stay, and the step runs on the GPU, in buckets of parameters whose state is copied
in from the host, stepped by the optimizer itself, and copied back out. The next bucket's copy in
runs beside this bucket's step and the last bucket's copy out, on two side streams, so the step
costs about the time the state takes to cross the link once each way, not the host's arithmetic.
Given the model (`prefetch_in_backward`), the state's copies in start during backward, each
module's as backward leaves it, where its activations' memory has just been freed; the copies out
run beside the next forward, so the link's time hides behind the GPU's work.

The math is the optimizer's own on the GPU: each bucket is stepped by a shallow copy of the user's
optimizer that shares its state and holds only that bucket's parameters, with the hyperparameters
of their groups. Optimizers that step each parameter on its own (SGD, Adam, AdamW, fused, foreach
or neither) give bit for bit what one `optimizer.step()` over every parameter gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._engine.optimizer.optim_state import STATE_ON_HOST_ATTR
from .._engine.params.wrappers import local_tensor, new_dtensor
from ..fsdp import fully_shard
from ._step_in_parts import StepInParts
from .backward_order import modules_inside, when_backward_leaves
from .muon import Muon

_API = "composable.optim.offload_optimizer_state"
_OFFLOAD_ATTR = "_composable_state_offload"  # on the optimizer: its OptimizerStateOffload
_AMP_ATTRS = ("grad_scale", "found_inf")  # what torch.amp.GradScaler sets on a fused optimizer to step


def offload_optimizer_state(
    optimizer: torch.optim.Optimizer,
    bucket_bytes: int = 256 * 2**20,
    prefetch_in_backward: nn.Module | None = None,
) -> "OptimizerStateOffload":
    """Keep `optimizer`'s state in host memory between steps and step on the parameters' device.

    Every state tensor shaped like its parameter (AdamW's `exp_avg` and `exp_avg_sq`, SGD's
    `momentum_buffer`) lives in host memory, pinned where CUDA is, once `optimizer.step()` has
    made it; scalars (step counters) stay where the optimizer keeps them. The parameters and
    their gradients stay where they are: on the GPU, sharded or not (`fully_shard`,
    `replicate` or none). `optimizer.step()` then steps the parameters in buckets of about
    `bucket_bytes` of state, in the order of `optimizer.param_groups`: each bucket's state is
    copied to the device (the next bucket's copy beside this bucket's step), stepped there by
    `optimizer`'s own kernels, and copied back to the same host memory. The training loop is
    unchanged, and so is every number it computes, for optimizers that step each parameter on
    its own (SGD, Adam, AdamW, fused, foreach or neither).

    `prefetch_in_backward`, the model whose parameters `optimizer` steps: the state of the
    parameters each `fully_shard`-ed module of it manages is copied to the device during
    backward, as backward leaves that module (when the next module's backward starts), on the
    copy stream; the step then waits only for what is left. The copies read no gradient, so
    the step's math (clipping and a GradScaler's checks included) is unchanged; the copied
    state waits on the device until the step (a backward without a step keeps it there). So
    at the end of backward the device holds the parameters, their gradients and all of the
    state: the memory backward's activations held, where they outweigh the state; where they
    do not (activation checkpointing), that is the step's peak, and without the prefetch it
    holds two buckets of state instead.

    `optimizer.state_dict()` holds the host tensors (DTensors sharded as their parameters for
    sharded parameters: DCP saves and loads them as any optimizer state), after the last step's
    copies are done; state that `load_state_dict` puts on the device goes to the host after the
    next step. Parameters on the CPU gain nothing (their state is copied between two host
    tensors, without streams: the same code path). A closure is refused. Call this
    before making an LR scheduler: both replace `optimizer.step`.

    Returns the `OptimizerStateOffload` (`wait()`: the copies to the host done; `close()`:
    the state back on the parameters' devices and the plain step).

    Raises:
        TypeError: `optimizer` is not a `torch.optim.Optimizer`, `bucket_bytes` not an int, or
            `prefetch_in_backward` neither None nor an `nn.Module`.
        ValueError: `bucket_bytes` < 1, `optimizer` is a `composable.optim.Muon` (its step
            communicates), `optimizer`'s state is already offloaded, or no module of
            `prefetch_in_backward` is under `fully_shard`.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_API}: 'optimizer' must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise TypeError(
            f"{_API}: 'bucket_bytes' must be an int, got {type(bucket_bytes).__name__}: {bucket_bytes!r:.60}"
        )
    if bucket_bytes < 1:
        raise ValueError(f"{_API}: 'bucket_bytes' must be >= 1, got {bucket_bytes}")
    if isinstance(optimizer, Muon):
        raise ValueError(
            f"{_API}: composable.optim.Muon's step sends whole matrices between ranks, which per-bucket steps would "
            "split differently on each rank; offload the parameters instead (CPUOffloadPolicy)"
        )
    if _OFFLOAD_ATTR in optimizer.__dict__:
        raise ValueError(f"{_API}: 'optimizer' already has its state offloaded; call close() on the first one")
    if prefetch_in_backward is not None and not isinstance(prefetch_in_backward, nn.Module):
        raise TypeError(
            f"{_API}: 'prefetch_in_backward' must be an nn.Module (the model) or None, "
            f"got {type(prefetch_in_backward).__name__}"
        )
    sharded = [] if prefetch_in_backward is None else _sharded_modules(prefetch_in_backward)
    if prefetch_in_backward is not None and not sharded:
        raise ValueError(
            f"{_API}: 'prefetch_in_backward' ({type(prefetch_in_backward).__name__}) has no module under fully_shard, "
            "whose backward the copies would follow"
        )
    offload = OptimizerStateOffload(optimizer, bucket_bytes)
    if sharded:
        offload.prefetch_in_backward_of(sharded)
    return offload


class OptimizerStateOffload:
    """An optimizer whose state lives on the host between steps (`offload_optimizer_state`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, bucket_bytes: int) -> None:
        self.optimizer = optimizer
        self.bucket_bytes = bucket_bytes
        self._parts = StepInParts(optimizer, _OFFLOAD_ATTR, self)  # the buckets are its parts
        for holder in (optimizer, self._parts.shadow):
            setattr(holder, STATE_ON_HOST_ATTR, True)
        # id(param) -> {state key: host tensor}: the host memory each state tensor lives in.
        self._host: dict[int, dict[str, torch.Tensor]] = {}
        self._out_done: torch.cuda.Event | None = None  # the last step's copies to the host
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None  # (in, out)
        # Copied to the device during backward, not yet stepped: id(param) -> {state key: device
        # state}; the optimizer's state keeps pointing at the host tensors until the step.
        self._prefetched: dict[int, dict[str, torch.Tensor]] = {}
        self._prefetch_done: torch.cuda.Event | None = None  # the last of those copies
        self._module_hooks: list[Any] = []
        self._hooks = [
            optimizer.register_state_dict_pre_hook(lambda *_: self.wait()),
            optimizer.register_load_state_dict_pre_hook(lambda *_: self._forget_host()),
        ]

    # -- the step ------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """`optimizer.step`: the user's pre-hooks, the buckets, the user's post-hooks."""
        if closure is not None:
            raise ValueError(f"{_API}: optimizer.step(closure) is not supported: the state streams through in buckets")
        opt = self.optimizer
        self._parts.run_pre_hooks(_API)
        # A GradScaler hands a fused optimizer its scale and inf flag as attributes for one step.
        for name in _AMP_ATTRS:
            if hasattr(opt, name):
                setattr(self._parts.shadow, name, getattr(opt, name))
            else:
                self._parts.shadow.__dict__.pop(name, None)
        self._take_prefetched()
        buckets = self._buckets()
        streams = self._streams_for(buckets)
        incoming = self._copy_in(buckets[0], streams) if buckets else None
        for i, bucket in enumerate(buckets):
            if incoming is not None:
                torch.cuda.current_stream().wait_event(incoming)
            # The next bucket's state crosses the link while this one steps.
            following = self._copy_in(buckets[i + 1], streams) if i + 1 < len(buckets) else None
            self._parts.step_part(bucket)
            self._copy_out(bucket, streams)
            incoming = following
        if streams is not None:
            # One event for the whole step's copies out: the next step's (and backward's) copies
            # in read that host memory. Within this step a bucket's copy in reads other host
            # memory than the earlier buckets' copies out write, and does not wait for them.
            self._out_done = torch.cuda.Event()
            self._out_done.record(streams[1])
        self._parts.run_post_hooks()

    def _buckets(self) -> list[list[dict[str, Any]]]:
        """The parameters with gradients, in param-group order, as lists of param groups (each
        with its group's hyperparameters) of about `bucket_bytes` of state each."""
        buckets: list[list[dict[str, Any]]] = []
        current: dict[int, list[torch.Tensor]] = {}
        size = 0
        groups = self.optimizer.param_groups
        for index, group in enumerate(groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                current.setdefault(index, []).append(p)
                size += _state_bytes(self.optimizer.state.get(p), p)
                if size >= self.bucket_bytes:
                    buckets.append([dict(groups[g], params=ps) for g, ps in current.items()])
                    current, size = {}, 0
        if current:
            buckets.append([dict(groups[g], params=ps) for g, ps in current.items()])
        return buckets

    def _streams_for(self, buckets: list[list[dict[str, Any]]]) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
        """The side streams (copies in, copies out) when the parameters are on CUDA."""
        first = next((p for bucket in buckets for group in bucket for p in group["params"]), None)
        if first is None or local_tensor(first).device.type != "cuda":
            return None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def _copy_in(
        self, bucket: list[dict[str, Any]], streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None
    ) -> torch.cuda.Event | None:
        """Put the bucket's host state on the device (copied on the in-stream, after the last
        copies out of that host memory); the event the step waits for (None off CUDA)."""
        params = [p for group in bucket for p in group["params"]]
        copies = self._device_copies(params, streams)
        for p in params:
            if id(p) in copies:
                self.optimizer.state[p].update(copies[id(p)])
        if streams is None or not copies:
            return None  # nothing to wait for (all of it copied in during backward)
        event = torch.cuda.Event()
        event.record(streams[0])
        return event

    def _device_copies(
        self, params: list[torch.Tensor], streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Device copies of `params`' host state, by id(param) and key, made on the in-stream
        after the work queued so far (the buffers are allocated on the current stream) and after
        the last step's copies out of that host memory; state no longer on the host is left out."""
        if streams is not None:
            streams[0].wait_stream(torch.cuda.current_stream())
            if self._out_done is not None:
                streams[0].wait_event(self._out_done)  # the host memory holds the last step's values
        copies: dict[int, dict[str, torch.Tensor]] = {}
        for p in params:
            hosts = self._host.get(id(p))
            state = self.optimizer.state.get(p)
            if not hosts or not state:
                continue
            for key, host in hosts.items():
                if state.get(key) is not host:
                    continue  # replaced (a load_state_dict): stepped where it is
                device_local = torch.empty_like(local_tensor(host), device=local_tensor(p).device)
                if streams is not None:
                    with torch.cuda.stream(streams[0]):
                        device_local.copy_(local_tensor(host), non_blocking=True)
                else:
                    device_local.copy_(local_tensor(host))
                copies.setdefault(id(p), {})[key] = _like(host, device_local)
        return copies

    def _copy_out(
        self, bucket: list[dict[str, Any]], streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None
    ) -> None:
        """Copy the bucket's stepped state to its host memory (made on first use) on the
        out-stream, and point the optimizer's state at the host tensors."""
        if streams is not None:
            streams[1].wait_stream(torch.cuda.current_stream())
        for group in bucket:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if not state:
                    continue
                hosts = self._host.setdefault(id(p), {})
                for key, value in list(state.items()):
                    if not _offloadable(value, p):
                        continue
                    device_local = local_tensor(value)
                    host = hosts.get(key)
                    if (
                        host is None
                        or local_tensor(host).shape != device_local.shape
                        or local_tensor(host).dtype != device_local.dtype
                    ):
                        fresh = torch.empty(
                            device_local.shape, dtype=device_local.dtype, pin_memory=streams is not None
                        )
                        host = hosts[key] = _like(value, fresh)
                    if streams is not None:
                        with torch.cuda.stream(streams[1]):
                            local_tensor(host).copy_(device_local, non_blocking=True)
                        device_local.record_stream(streams[1])  # freed once copied out, not before
                    else:
                        local_tensor(host).copy_(device_local)
                    state[key] = host

    # -- copies in during backward --------------------------------------------------------------
    def prefetch_in_backward_of(self, modules: list[nn.Module]) -> None:
        """Copy the state of each module's parameters in as backward leaves the module.
        `modules`: those `fully_shard` manages; each owns its parameters outside the nested ones."""
        stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        owned: dict[int, list[torch.Tensor]] = {}
        for module, held in zip(modules, modules_inside(modules)):
            nested = {id(p) for c in held for p in c.parameters()}
            owned[id(module)] = [p for p in module.parameters() if id(p) in stepped and id(p) not in nested]
        self._module_hooks += when_backward_leaves(modules, lambda module: self._prefetch(owned[id(module)]))

    def _prefetch(self, params: list[torch.Tensor]) -> None:
        """Copy `params`' host state to the device on the in-stream, kept aside for the step."""
        params = [p for p in params if id(p) not in self._prefetched]
        streams = self._streams_for([[{"params": params}]])
        copies = self._device_copies(params, streams)
        self._prefetched.update(copies)
        if streams is not None and copies:
            self._prefetch_done = torch.cuda.Event()
            self._prefetch_done.record(streams[0])

    def _take_prefetched(self) -> None:
        """Point the optimizer's state at the state copied in during backward (after those copies)."""
        if not self._prefetched:
            return
        if self._prefetch_done is not None:
            torch.cuda.current_stream().wait_event(self._prefetch_done)
            self._prefetch_done = None
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                copies = self._prefetched.get(id(p))
                state = self.optimizer.state.get(p)
                if not copies or not state:
                    continue
                for key, device_value in copies.items():
                    if state.get(key) is self._host[id(p)][key]:
                        state[key] = device_value
        self._prefetched.clear()

    # -- outside the step ----------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for the last step's copies to the host (before reading the state on the host)."""
        if self._out_done is not None:
            self._out_done.synchronize()

    def _forget_host(self) -> None:
        """`load_state_dict` replaces the state: the host memory is made anew at the next step."""
        self.wait()
        self._host.clear()
        self._prefetched.clear()

    def close(self) -> None:
        """Put the state back on the parameters' devices and give `optimizer` its plain step."""
        self.wait()
        for p, state in self.optimizer.state.items():
            hosts = self._host.get(id(p), {})
            for key, host in hosts.items():
                if state.get(key) is host:
                    state[key] = _like(host, local_tensor(host).to(local_tensor(p).device))
        self._host.clear()
        self._prefetched.clear()
        for hook in self._hooks + self._module_hooks:
            hook.remove()
        self._parts.restore()
        del self.optimizer.__dict__[STATE_ON_HOST_ATTR]


def _sharded_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` (itself included) that `fully_shard` manages, in `modules()` order."""
    return [m for m in model.modules() if fully_shard.state(m) is not None]


def _like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as `template` is: wrapped in the same DTensor spec, or plain."""
    return new_dtensor(local, template._spec) if isinstance(template, DTensor) else local


def _offloadable(value: object, param: torch.Tensor) -> bool:
    """State shaped like its parameter (moments, momentum buffers); not scalars (step counters)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _state_bytes(state: dict[str, Any] | None, param: torch.Tensor) -> int:
    """The bytes of `param`'s offloadable state; before the first step, two of it (Adam's)."""
    if not state:
        return 2 * local_tensor(param).numel() * local_tensor(param).element_size()
    return sum(
        local_tensor(v).numel() * local_tensor(v).element_size() for v in state.values() if _offloadable(v, param)
    )
