"""Which parameters an API call manages: those of the subtree that no API applied earlier to
a descendant manages (bottom-up claiming), minus ignored ones; each with every slot it is
registered under (tied parameters have several)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from ..hooks.contract import iter_param_states

# Set on every sharded parameter a parameter-owning API registers (`mark_managed`): a
# parameter that carries it and is not claimed by a descendant is managed by an ancestor.
MANAGED_BY_ATTR = "_composable_managed_by"
REPLACED_BY_ATTR = "_composable_replaced_by"
# How many times parameters were marked replaced: an optimizer checked before the latest
# replacement must be checked again.
_replacements = [0]


def claim_parameters(
    module: nn.Module, ignored: set[nn.Parameter], api: str = "composable"
) -> list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]]:
    """[(fqn, slots, parameter)] in registration order, one entry per distinct parameter.

    Raises `RuntimeError` ("Cannot apply `api` ...") if one of them is already managed by an
    API applied to an ancestor of `module`: a forbidden composition."""
    claimed: set[int] = {id(p) for p in ignored}
    for _, sub, state in iter_param_states(module):
        if sub is not module:
            claimed.update(id(mp.sharded_param) for group in state.groups for mp in group.params)
    found: dict[int, tuple[str, list[tuple[nn.Module, str]], nn.Parameter]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is None or id(param) in claimed:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            entry = found.setdefault(id(param), (fqn, [], param))
            if (sub, name) not in [(m, n) for m, n in entry[1]]:
                entry[1].append((sub, name))
    for fqn, _, param in found.values():
        tied_with = getattr(param, REPLACED_BY_ATTR, None)
        if tied_with is not None:
            group = "put the modules that share it in one group (fully_shard([module_a, module_b])) or "
            raise RuntimeError(
                f"Cannot apply {api} to {type(module).__name__}: its parameter '{fqn}' is shared (tied) with a module that "
                f"{tied_with} already manages, which replaced it there only; {group if api == 'fully_shard' else ''}"
                f"apply {api} to a common ancestor of them"
            )
        other = getattr(param, MANAGED_BY_ATTR, None)
        if other is not None:
            raise RuntimeError(
                f"Cannot apply {api} to {type(module).__name__}: its parameter '{fqn}' is already managed by {other} "
                f"applied to an ancestor; apply {api} to modules outside that subtree, or before {other} (bottom-up)"
            )
    return list(found.values())


def mark_managed(params: Sequence[torch.Tensor], api: str) -> None:
    """Mark the sharded parameters `api` registered, so an API applied to a descendant later
    refuses them."""
    for param in params:
        setattr(param, MANAGED_BY_ATTR, api)


def mark_replaced(params: Sequence[torch.Tensor], api: str) -> None:
    """Mark original parameters an API replaced by sharded ones in its subtree's slots: a slot
    outside that subtree still holding one (a tied weight) must not be claimed again."""
    for param in params:
        setattr(param, REPLACED_BY_ATTR, api)
    _replacements[0] += 1


def replacement_count() -> int:
    """Bumped by every `mark_replaced` call."""
    return _replacements[0]


def check_same_device(api: str, params: Sequence[torch.Tensor]) -> None:
    """Raise `ValueError` naming `api` unless every parameter is on one device."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{api}: all managed parameters must be on one device, got {sorted(map(str, devices))}")


def check_ignored(api: str, ignored_params: object) -> set[nn.Parameter]:
    """`ignored_params` as a set (`TypeError` naming `api` unless a set of tensors or None)."""
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset)) or not all(isinstance(p, torch.Tensor) for p in ignored_params):
        raise TypeError(f"{api}: 'ignored_params' must be a set of nn.Parameter or None, got {ignored_params!r:.80}")
    return set(ignored_params)
