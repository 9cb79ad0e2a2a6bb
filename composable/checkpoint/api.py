"""`checkpoint`: non-reentrant activation checkpointing installed by hooks.

The forward pre-hook runs first of all, whether `fully_shard`/`replicate` were applied before
or after: it captures the module's raw inputs, and the other APIs' pre-hooks (unshard, input
casts) then run inside the checkpointed region, which the recompute re-runs identically. It
enters PyTorch's non-reentrant checkpoint context; the forward hook leaves it. Inside, autograd saves only the inputs; backward re-runs the module call with the
captured inputs — hooks included, so `fully_shard`'s input casts and parameter gathering
happen again exactly as in the original forward — under the same RNG state.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn

from .._engine.autograd import run_eagerly
from .._engine.compile_boundary import keep_hooks_outside_graphs
from .._engine.contract import (
    check_bool,
    check_module,
    check_not_applied,
    install_state,
    register_outermost_pre_hook,
    state_of,
)

# torch 2.11-2.13 share this private generator; its keyword-only tail grew over time.
_GENERATOR_PARAMS = list(inspect.signature(_checkpoint_without_reentrant_generator).parameters)


class CheckpointState:
    """What `checkpoint.state(module)` returns: `preserve_rng_state`, `enabled`."""

    def __init__(self, preserve_rng_state: bool) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.enabled = True
        self._generator: Iterator[None] | None = None

    @contextmanager
    def _disabled(self) -> Iterator[None]:
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous


def checkpoint(module: nn.Module, *, preserve_rng_state: bool = True) -> nn.Module:
    """Activation checkpointing on `module`; returns `module` itself.

    Activations inside `module` are not kept; backward recomputes its forward from the saved
    inputs with the same RNG state (when `preserve_rng_state`), the same parameters and
    inputs of the same dtype. Composes with `fully_shard` and `replicate` on the same module
    (either order), on ancestors and on descendants.
    """
    api = "checkpoint"
    check_module(api, module)
    check_bool(api, "preserve_rng_state", preserve_rng_state)
    check_not_applied(api, module)
    state = CheckpointState(preserve_rng_state)
    # The recompute function is kept by the autograd graph (in C++, invisible to the garbage
    # collector) until backward; a strong reference to the module from there would keep a
    # dropped model alive whenever a forward was not followed by a backward.
    module_ref = weakref.ref(module)

    def recompute(*args: Any, **kwargs: Any) -> Any:
        live = module_ref()
        if live is None:
            raise RuntimeError("checkpoint: the module was freed before its backward recomputed it")
        with state._disabled():
            return live(*args, **kwargs)

    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if not state.enabled or not torch.is_grad_enabled():
            return
        positional = [recompute, state.preserve_rng_state, noop_context_fn, "default", False]
        if "early_stop" in _GENERATOR_PARAMS:
            positional.append(True)
        generator = _checkpoint_without_reentrant_generator(*positional, *args, **kwargs)
        next(generator)
        state._generator = generator

    def post_hook(mod: nn.Module, args: tuple, output: Any) -> None:
        generator, state._generator = state._generator, None
        if generator is None:
            return
        try:
            next(generator)
        except StopIteration:
            return
        raise RuntimeError("checkpoint: the checkpoint context was entered twice")

    # Eager even when the module is compiled: the checkpoint context wraps the compiled forward.
    keep_hooks_outside_graphs(module, api)
    register_outermost_pre_hook(module, run_eagerly(pre_hook))
    module.register_forward_hook(run_eagerly(post_hook), prepend=True, always_call=True)
    install_state(module, api, state)
    return module


def _state(module: nn.Module) -> CheckpointState | None:
    """The state `checkpoint` installed on exactly `module`, or None (`TypeError` for a non-module)."""
    return state_of("checkpoint", module)


checkpoint.state = _state  # type: ignore[attr-defined]
