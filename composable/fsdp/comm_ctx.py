"""`share_comm_ctx`: several fully_shard roots (e.g. the model chunks of one pipeline stage)
communicate on one set of streams, as PyTorch FSDP2's `share_comm_ctx`."""

from __future__ import annotations

import torch.nn as nn

from .._engine.hooks.contract import get_state


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """Make every parameter group of the fully_shard trees of `modules` use the streams of
    the first one (all-gather, reduce-scatter, all-reduce), so memory does not fragment
    between streams of several roots. Groups on one CUDA device already share them by
    construction, so this keeps them shared; on the CPU there are no streams. Raises
    `TypeError` for a non-list and `ValueError` for a module that `fully_shard` does not
    manage (as FSDP2)."""
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"share_comm_ctx: 'modules' must be a list of modules fully_shard manages, got {modules!r:.80}")
    for i, module in enumerate(modules):
        state = get_state(module, "fully_shard") if isinstance(module, nn.Module) else None
        if state is None:
            raise ValueError(
                f"share_comm_ctx: 'modules' must hold modules fully_shard manages, got {type(module).__name__} at index {i}"
            )
    groups = [
        group
        for module in modules
        for sub in module.modules()
        if (s := get_state(sub, "fully_shard")) is not None
        for group in s.groups
    ]
    shared = next((g.streams for g in groups if g.streams is not None), None)
    for group in groups:
        group.streams = shared
        group.reducer.streams = shared
