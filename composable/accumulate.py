"""Gradient accumulation across every API in a module tree."""

from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Iterator

import torch.nn as nn

from ._engine.hooks.contract import check_bool, check_module, param_states


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient communication on or off for every `fully_shard`/`replicate` in the tree.

    While off, backward communicates nothing and gradients accumulate locally, unsharded
    (a full-size gradient per parameter is held: the memory cost of skipping communication).
    The first backward with it on reduces everything accumulated.
    """
    check_module("set_requires_gradient_sync", module)
    check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
    for state in param_states(module):
        state.requires_gradient_sync = requires_gradient_sync


def no_sync(module: nn.Module) -> ContextManager[None]:
    """Context manager: no gradient communication inside (see `set_requires_gradient_sync`);
    each state's previous setting is restored on exit."""
    check_module("no_sync", module)  # here, not in the generator: a wrong call raises at the call
    return _no_sync(module)


@contextmanager
def _no_sync(module: nn.Module) -> Iterator[None]:
    states = param_states(module)
    previous = [s.requires_gradient_sync for s in states]
    for state in states:
        state.requires_gradient_sync = False
    try:
        yield
    finally:
        for state, flag in zip(states, previous):
            state.requires_gradient_sync = flag
