"""Parameters that appear on a managed module after the API call.

An API manages the parameters its subtree has at the call. A parameter registered later
(`module.extra = nn.Parameter(...)`, `register_parameter`, or a new submodule attached with
its own parameters) would be neither sharded nor reduced: every rank would train its own
copy and the replicas would drift apart without a word. So every module of a managed subtree
is marked at the call, two global `torch.nn` registration hooks note what is added to a
marked module, and the root's next forward raises `RuntimeError` naming each such parameter
that no API claimed meanwhile (an API applied afterwards to an ancestor, or to the new
submodule, claims it, and then nothing is raised).

The cost on the hot path is one emptiness check per root forward: the hooks record only
additions to marked modules, which a training loop never makes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..params.claim import MANAGED_BY_ATTR

# In a module's __dict__ (invisible to named_modules/state_dict; copied by deepcopy): the API
# that manages the subtree the module belongs to.
WATCHED_KEY = "_composable_watched_by"

# (module, attribute name) pairs added to watched modules since the last check.
_additions: list[tuple[weakref.ref[nn.Module], str]] = []
_hooks: list[Any] = []


def watch_subtree(module: nn.Module, api: str) -> None:
    """Mark every module of `module`'s subtree as managed by `api`: parameters or submodules
    added to any of them later are noted, and the next root forward checks them."""
    if not _hooks:
        _hooks.append(register_module_parameter_registration_hook(_on_parameter))
        _hooks.append(register_module_module_registration_hook(_on_submodule))
    for sub in module.modules():
        sub.__dict__.setdefault(WATCHED_KEY, api)


def _on_parameter(module: nn.Module, name: str, param: Any) -> None:
    # A replaced slot (name already registered) is the group's business: it adopts or refuses
    # swapped sharded parameters at the next forward. Only new names are noted here.
    if WATCHED_KEY in module.__dict__ and param is not None and module._parameters.get(name) is None:
        _additions.append((weakref.ref(module), name))


def _on_submodule(module: nn.Module, name: str, submodule: Any) -> None:
    if WATCHED_KEY in module.__dict__ and submodule is not None:
        _additions.append((weakref.ref(module), name))


def check_no_late_params(root: nn.Module) -> None:
    """Raise `RuntimeError` naming every parameter added to a watched module of `root`'s tree
    since its API call that no API manages (called at the root's pre-forward)."""
    if not _additions:
        return
    fqns = {id(m): prefix for prefix, m in root.named_modules(remove_duplicate=False)}
    unmanaged: list[str] = []
    api = "composable"
    kept: list[tuple[weakref.ref[nn.Module], str]] = []
    for ref, name in _additions:
        module = ref()
        if module is None:
            continue
        if id(module) not in fqns:
            kept.append((ref, name))  # another root's module: its own forward checks it
            continue
        found = _unmanaged_under(module, name, fqns[id(module)])
        if found:
            kept.append((ref, name))  # raised again at every forward until it is dealt with
            api = api if unmanaged else module.__dict__[WATCHED_KEY]
        unmanaged.extend(found)
    _additions[:] = kept
    if unmanaged:
        shown = ", ".join(repr(n) for n in unmanaged[:8]) + (
            f" and {len(unmanaged) - 8} more" if len(unmanaged) > 8 else ""
        )
        rank = f" (rank {dist.get_rank()})" if dist.is_initialized() else ""
        raise RuntimeError(
            f"{api}: parameter(s) {shown} were registered on a managed module after {api} was applied{rank}, so "
            f"{api} neither shards nor reduces them and each rank would train its own copy; register them before "
            f"applying {api}, or apply an API to the new module (or an ancestor) before the forward"
        )


def _unmanaged_under(module: nn.Module, name: str, prefix: str) -> list[str]:
    """FQNs (relative to the root) of unmanaged parameters at `module.<name>`: a parameter, or
    the parameters of a submodule attached there."""
    base = f"{prefix}.{name}" if prefix else name
    param = module._parameters.get(name)
    if param is not None:
        return [] if _is_managed(param) else [base]
    sub = module._modules.get(name)
    if sub is None:
        return []  # removed again since
    return [f"{base}.{n}" for n, p in sub.named_parameters() if not _is_managed(p)]


def _is_managed(param: nn.Parameter) -> bool:
    # Sharded DTensors carry the mark; between forward and backward a slot may hold an
    # unsharded parameter, but the check runs at the root's pre-forward, when none is left.
    return getattr(param, MANAGED_BY_ATTR, None) is not None
