"""`register_forward_method`: run the data-parallel hooks around a method other than `forward`."""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn

from ._engine.hooks.contract import PARAM_OWNING_APIS, check_module, get_state

_WRAPPED_ATTR = "_composable_forward_method"


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>(...)` run the same pre/post-forward hooks of `fully_shard`
    / `replicate` as `module(...)`: parameters are gathered before the method runs and
    freed after it (as `reshard_after_forward` says), inputs and outputs are cast per the
    mixed-precision policy, and it is `no_grad`-aware (generation under `torch.no_grad()`
    frees everything after). For methods such as HuggingFace's `generate` that compute with
    the module's own parameters without going through `forward`.

    Raises `TypeError` for a non-module or a non-string name, `ValueError` when the module
    has no such method or neither API applied to it, `RuntimeError` when it is registered
    twice."""
    api = "register_forward_method"
    check_module(api, module)
    if not isinstance(method_name, str):
        raise TypeError(f"{api}: 'method_name' must be a str, got {method_name!r}")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{api}: {type(module).__name__} has no method {method_name!r}")
    if getattr(method, _WRAPPED_ATTR, False):
        raise RuntimeError(f"{api}: {type(module).__name__}.{method_name} is already registered")
    states = [state for name in PARAM_OWNING_APIS if (state := get_state(module, name)) is not None]
    if not states:
        raise ValueError(
            f"{api}: {type(module).__name__} has neither fully_shard nor replicate applied to it; apply one first"
        )

    @functools.wraps(method)
    def with_hooks(*args: Any, **kwargs: Any) -> Any:
        for state in states:
            args, kwargs = state._pre_forward(module, args, kwargs)
        output = method(*args, **kwargs)
        for state in states:
            output = state._post_forward(module, args, output)
        return output

    setattr(with_hooks, _WRAPPED_ATTR, True)
    # An instance attribute shadows the class's method for this module only.
    module.__dict__[method_name] = with_hooks


def _managed(module: object) -> bool:
    return isinstance(module, nn.Module) and any(get_state(module, name) is not None for name in PARAM_OWNING_APIS)


def _install_torch_entry_point() -> None:
    """torch's public `torch.distributed.fsdp.register_fsdp_forward_method(module, name)` does
    nothing for a module that is not an `FSDPModule` (composable's core never swaps classes) and
    reaches FSDP2's private state on one that is (the FSDP2 adapter). Code written for FSDP2
    (HuggingFace Trainer calls it for `generate`) then runs the method on sharded parameters.
    For a module that `fully_shard` or `replicate` manages, torch's function registers the
    method here instead (a repeated registration does nothing, as FSDP2's wraps again); any
    other module goes to torch's own. Installed on torch's modules when composable is
    imported; a name imported from torch before that still refers to torch's function."""
    import torch.distributed.fsdp as fsdp
    import torch.distributed.fsdp._fully_shard as fully_shard_pkg
    import torch.distributed.fsdp._fully_shard._fully_shard as impl

    original = getattr(impl, "register_fsdp_forward_method", None)
    if original is None or getattr(original, _WRAPPED_ATTR, False):
        return

    @functools.wraps(original)
    def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
        if not _managed(module):
            original(module, method_name)
            return
        if getattr(getattr(module, method_name, None), _WRAPPED_ATTR, False):
            return None  # already registered: the hooks run once
        return register_forward_method(module, method_name)

    setattr(register_fsdp_forward_method, _WRAPPED_ATTR, True)
    for namespace in (impl, fully_shard_pkg, fsdp):
        if getattr(namespace, "register_fsdp_forward_method", None) is original:
            setattr(namespace, "register_fsdp_forward_method", register_fsdp_forward_method)


_install_torch_entry_point()
