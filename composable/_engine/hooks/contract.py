"""How a composable API installs its state on a module and finds it again.

Every API (`fully_shard`, `replicate`, `checkpoint`) is a plain function that leaves the
module's class, identity and parameter names alone. Its only footprint is one state object
stored in the module's ``__dict__`` under a private key (so it is invisible to
``named_modules``/``state_dict``) plus the hooks that state registers.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, OrderedDict, ParamSpec, Protocol, Sequence, TypeVar, cast

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

_STATES_KEY = "_composable_states"
_OUTERMOST_KEY = "_composable_outermost_pre_hooks"  # ids of pre-hooks that must run first

# The APIs whose states own parameters (claim them bottom-up). `checkpoint` owns none.
PARAM_OWNING_APIS = ("fully_shard", "replicate")


def check_module(api: str, module: Any) -> nn.Module:
    """Raise `TypeError` unless `module` is an `nn.Module`; return it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api}: argument 'module' must be an nn.Module, got {type(module).__name__}: {module!r:.80}")
    return module


def check_bool(api: str, name: str, value: object) -> bool:
    """Raise `TypeError` naming `api`, the argument and the value unless `value` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{api}: '{name}' must be a bool, got {value!r}")
    return value


def get_state(module: nn.Module, api: str) -> Any | None:
    """The state `api` installed on exactly `module`, or None."""
    return module.__dict__.get(_STATES_KEY, {}).get(api)


def install_state(module: nn.Module, api: str, state: Any) -> None:
    """Record `state` as `api`'s state on `module`; applying an API twice is a `RuntimeError`."""
    check_not_applied(api, module)
    module.__dict__.setdefault(_STATES_KEY, {})[api] = state


def owning_api(module: nn.Module) -> str | None:
    """Name of the parameter-owning API applied to `module`, if any."""
    states = module.__dict__.get(_STATES_KEY, {})
    for api in PARAM_OWNING_APIS:
        if api in states:
            return api
    return None


def iter_param_states(module: nn.Module) -> Iterator[tuple[str, nn.Module, Any]]:
    """(api, submodule, state) for every parameter-owning state in `module`'s subtree, pre-order."""
    for sub in module.modules():
        states = sub.__dict__.get(_STATES_KEY)
        if not states:
            continue
        for api in PARAM_OWNING_APIS:
            if api in states:
                yield api, sub, states[api]


def param_states(module: nn.Module | Sequence[nn.Module]) -> list[Any]:
    """Every parameter-owning state in the subtree of `module` (or of each module of a
    sequence), pre-order, each once: the state of `fully_shard([m1, m2])` sits on both."""
    found: dict[int, Any] = {}
    for root in (module,) if isinstance(module, nn.Module) else module:
        for _, _, state in iter_param_states(root):
            found.setdefault(id(state), state)
    return list(found.values())


def check_composable(api: str, module: nn.Module) -> None:
    """Forbid two parameter-owning APIs (or one API twice) on the same module."""
    other = owning_api(module)
    if other is not None and other != api:
        raise RuntimeError(
            f"Cannot apply {api} to {type(module).__name__}: it is already managed by {other}; "
            f"apply {api} to a different module of the tree (they nest freely)"
        )
    check_not_applied(api, module)


def check_not_applied(api: str, module: nn.Module) -> None:
    """Applying one API twice to a module is a `RuntimeError`."""
    if get_state(module, api) is not None:
        raise RuntimeError(
            f"{api} has already been applied to this {type(module).__name__}; apply each API at most once per module"
        )


def state_of(api: str, module: object) -> Any | None:
    """What `api.state(module)` returns: the state `api` installed on exactly `module`, or
    None; `TypeError` naming `api` when `module` is not an `nn.Module`."""
    return get_state(check_module(f"{api}.state", module), api)


P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
R_co = TypeVar("R_co", covariant=True)
S_co = TypeVar("S_co", covariant=True)


class StatefulApi(Protocol[P, R_co, S_co]):
    """An API function that also answers `api.state(module)` (`fully_shard.state(m)`)."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def state(self, module: nn.Module) -> S_co | None: ...


def answers_state(state: Callable[[nn.Module], S | None]) -> Callable[[Callable[P, R]], StatefulApi[P, R, S]]:
    """Decorator: sets `fn.state = state` and returns `fn` itself, typed as having it."""

    def attach(fn: Callable[P, R]) -> StatefulApi[P, R, S]:
        setattr(fn, "state", state)
        return cast("StatefulApi[P, R, S]", fn)

    return attach


# Order of forward pre-hooks on one module, whatever order the APIs and the user's hooks were
# added in: [checkpoint's (captures the raw inputs; everything after it is recomputed),
# fully_shard's or replicate's (unshard, cast inputs), the user's]. So user pre-hooks, even
# those registered before the API, see what the forward sees: unsharded parameters in
# `param_dtype` and cast inputs. (User post-hooks: the state keeps its own post-hook last.)


def register_outermost_pre_hook(module: nn.Module, hook: Callable[..., Any]) -> RemovableHandle:
    """A pre-hook (with kwargs) that runs before every other, present or future API hook."""
    handle = module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
    module.__dict__.setdefault(_OUTERMOST_KEY, []).append(handle.id)
    return handle


def register_api_pre_hook(module: nn.Module, hook: Callable[..., Any]) -> RemovableHandle:
    """A pre-hook (with kwargs) that runs before the user's pre-hooks registered so far (and
    after) but after the outermost ones."""
    handle = module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
    hooks = cast("OrderedDict[int, Callable[..., Any]]", module._forward_pre_hooks)  # typed as a dict, is ordered
    for hook_id in reversed(module.__dict__.get(_OUTERMOST_KEY, [])):
        if hook_id in hooks:
            hooks.move_to_end(hook_id, last=False)
    return handle


def keep_post_hook_last(module: nn.Module, hook_id: int) -> None:
    """Move the forward hook `hook_id` behind any registered after it (cheap when it is last)."""
    hooks = cast("OrderedDict[int, Callable[..., Any]]", module._forward_hooks)
    if hook_id in hooks and next(reversed(hooks)) != hook_id:
        hooks.move_to_end(hook_id)
