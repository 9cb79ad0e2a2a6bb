"""Checkpointing inside torch.compile's graph of a module compiled with `module.compile()`.

The hooks of `checkpoint` run eagerly, around the compiled forward. For a compiled module that
costs twice: the recompute runs the whole compiled forward again as one opaque call, and a
selective policy only sees the compiled code's kernels (inductor's matmuls write into buffers
it reuses, which a policy must not keep), so selective checkpointing there saved nothing.

So for a module compiled with `module.compile()` the checkpoint goes into the graph instead:
`route_forward_through_checkpoint` gives the module a `forward` that, when the hooks say so,
calls `torch.utils.checkpoint.checkpoint` on the module's own forward. Dynamo traces that as
its checkpoint operator, and AOTAutograd's partitioner applies the policy op by op: the kept
matmuls are saved from the graph, everything else is recomputed inside the compiled backward
(fused into its kernels), as torchtitan gets by wrapping blocks in `checkpoint_wrapper` before
compiling them. Where the frame runs eagerly after all (a graph break or a recompile limit),
the same call is torch's eager checkpoint: activations are never silently kept.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
import torch.nn as nn

from .._engine.hooks.compile_boundary import with_own_code
from .._engine.hooks.contract import get_state
from .state import CheckpointState

# The module's forward before checkpoint took it over: (function, bound). `bound` means the
# function takes the module as its first argument (a forward method set on the instance,
# rebound to a copy by `copy.deepcopy` because it is kept unbound here); None: the class's.
_INNER_FORWARD_KEY = "_composable_checkpoint_inner_forward"


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether `module.compile()` was called on `module` (its calls run compiled code)."""
    return module.__dict__.get("_compiled_call_impl") is not None


def _run_inner_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner, bound = module.__dict__[_INNER_FORWARD_KEY]
    if inner is None:
        return type(module).forward(module, *args, **kwargs)
    return inner(module, *args, **kwargs) if bound else inner(*args, **kwargs)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = cast(CheckpointState, get_state(self, "checkpoint"))  # installed with it: as every API's state is found
    if not state.in_graph:
        return _run_inner_forward(self, *args, **kwargs)

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        return _run_inner_forward(self, *inner_args, **inner_kwargs)

    options: dict[str, Any] = {"preserve_rng_state": state.preserve_rng_state, "use_reentrant": False}
    if state.context_fn is not None:
        options["context_fn"] = state.context_fn
    if state.determinism_check != "default":
        options["determinism_check"] = state.determinism_check
    if state.debug:
        options["debug"] = True
    return torch.utils.checkpoint.checkpoint(run, *args, **options, **kwargs)


# One copy of `_checkpointed_forward` per original forward function, each its own code object:
# dynamo keeps its compiled graphs per code object (a bounded cache), so one code shared by
# every checkpointed module type would fill that cache and fall back to eager.
_FORWARD_COPIES: dict[Any, Any] = {}


def _forward_copy_for(original: Any) -> Any:
    if original not in _FORWARD_COPIES:
        name = (
            getattr(original, "__qualname__", type(original).__name__)
            .replace(".", "_")
            .replace("<", "")
            .replace(">", "")
        )
        qualname = f"checkpointed {getattr(original, '__qualname__', original)!s}"
        _FORWARD_COPIES[original] = with_own_code(_checkpointed_forward, f"checkpointed_{name}", qualname)
    return _FORWARD_COPIES[original]


def route_forward_through_checkpoint(module: nn.Module) -> None:
    """Replace `module.forward` by one that checkpoints the original forward whenever the
    module's checkpoint state has `in_graph` set (the pre-hook sets it for calls of a module
    compiled in place) and calls it plainly otherwise."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        inner: tuple[Any, bool] = (forward.__func__, True)
    else:  # None (the class's forward) or a plain callable set on the instance
        inner = (forward, False)
    module.__dict__[_INNER_FORWARD_KEY] = inner
    # A bound method (not a closure), so `copy.deepcopy` rebinds it to the copy.
    original = inner[0] if inner[0] is not None else type(module).forward
    module.forward = types.MethodType(_forward_copy_for(original), module)
