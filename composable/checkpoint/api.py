"""`checkpoint`: non-reentrant activation checkpointing installed by hooks.

The forward pre-hook runs first of all, whether `fully_shard`/`replicate` were applied before
or after: it captures the module's raw inputs, and the other APIs' pre-hooks (unshard, input
casts) then run inside the checkpointed region, which the recompute re-runs identically. It
enters PyTorch's non-reentrant checkpoint context; the forward hook leaves it. Inside, autograd saves only the inputs; backward re-runs the module call with the
captured inputs — hooks included, so `fully_shard`'s input casts and parameter gathering
happen again exactly as in the original forward — under the same RNG state.

Selective activation checkpointing: `context_fn` (torch's meaning) returns the pair of
contexts the forward and the recompute run under; with
`torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)` the forward keeps the
outputs of the ops the policy saves and the recompute takes them instead of running those ops
again (`selective.save_matmuls` is the usual policy: keep the matmuls).
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn

from .._engine.hooks.autograd import run_eagerly
from .._engine.hooks.compile_boundary import keep_hooks_outside_graphs
from .._engine.hooks.contract import (
    answers_state,
    check_bool,
    check_module,
    check_not_applied,
    install_state,
    register_outermost_pre_hook,
    state_of,
)
from .in_graph import is_compiled_in_place, route_forward_through_checkpoint
from .state import CheckpointState

# torch 2.11-2.15 share this private generator (2.15 keeps it as a shim over `_impl`); its
# parameters after `debug` grew over time.
_GENERATOR_PARAMS = list(inspect.signature(_checkpoint_without_reentrant_generator).parameters)
# The values torch's checkpoint accepts for `determinism_check`.
_DETERMINISM_CHECKS = tuple(getattr(torch.utils.checkpoint, "_allowed_determinism_checks_to_fns", ("default", "none")))


def _state(module: nn.Module) -> CheckpointState | None:
    """The state `checkpoint` installed on exactly `module`, or None (`TypeError` for a non-module)."""
    return state_of("checkpoint", module)


@answers_state(_state)
def checkpoint(
    module: nn.Module,
    *,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
) -> nn.Module:
    """Activation checkpointing on `module`; returns `module` itself.

    Activations inside `module` are not kept; backward recomputes its forward from the saved
    inputs with the same RNG state (when `preserve_rng_state`), the same parameters and
    inputs of the same dtype. Composes with `fully_shard` and `replicate` on the same module
    (either order), on ancestors and on descendants, and with `module.compile()`.

    The keywords of `torch.distributed._composable.checkpoint` (`torch.utils.checkpoint`'s
    meaning): `context_fn` returns the (forward, recompute) pair of context managers, e.g.
    `functools.partial(create_selective_checkpoint_contexts, policy)` for selective activation
    checkpointing (`composable.checkpoint.save_matmuls()` keeps every matmul's output);
    `determinism_check` "default" compares the recomputed tensors' shapes, dtypes and devices
    with the forward's, "none" does not; `debug` records the ops run for the error message of
    a failed check; `early_stop` stops the recompute once it produced every tensor backward
    needs.

    Raises `TypeError` for a non-module, a non-callable `context_fn` or a flag that is not a
    bool, `ValueError` for an unknown `determinism_check` or `debug=True` with a `context_fn`
    (torch refuses the pair), `RuntimeError` when applied twice.
    """
    api = "checkpoint"
    check_module(api, module)
    for name, flag in (("preserve_rng_state", preserve_rng_state), ("debug", debug), ("early_stop", early_stop)):
        check_bool(api, name, flag)
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"{api}: 'context_fn' must be a callable returning two context managers, got {context_fn!r}")
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(f"{api}: 'determinism_check' must be one of {_DETERMINISM_CHECKS}, got {determinism_check!r}")
    if debug and context_fn is not None:  # torch's checkpoint refuses the pair only at the forward
        raise ValueError(f"{api}: debug=True does not combine with a context_fn (torch's checkpoint refuses it)")
    check_not_applied(api, module)
    state = CheckpointState(preserve_rng_state, context_fn, determinism_check, debug, early_stop)
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

    def pre_hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state.in_graph = False
        if not state.enabled or not torch.is_grad_enabled():
            return
        if is_compiled_in_place(mod):  # the compiled forward checkpoints itself (in_graph.py)
            state.in_graph = True
            return
        context_fn = state.context_fn or noop_context_fn
        positional: list[Any] = [recompute, state.preserve_rng_state, context_fn, state.determinism_check, state.debug]
        if "early_stop" in _GENERATOR_PARAMS:
            positional.append(state.early_stop)
            early_stop: Any = nullcontext()
        else:  # where the generator has no such parameter, torch's global switch says it
            early_stop = torch.utils.checkpoint.set_checkpoint_early_stop(state.early_stop)
        generator = _checkpoint_without_reentrant_generator(*positional, *args, **kwargs)
        with early_stop:
            next(generator)
        state._generator = generator

    def post_hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
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
    route_forward_through_checkpoint(module)
    register_outermost_pre_hook(module, run_eagerly(pre_hook))
    module.register_forward_hook(run_eagerly(post_hook), prepend=True, always_call=True)
    install_state(module, api, state)
    return module
