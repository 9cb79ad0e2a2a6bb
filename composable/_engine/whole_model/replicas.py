"""Every rank built the same model (`fully_shard` and `replicate`), and replicas start equal
(DDP semantics, `replicate`): at the call, check that every rank built the same parameters and
buffers; `replicate` then broadcasts group rank 0's values to every rank.

A parameter whose shape, dtype or `requires_grad` differs across ranks would make the ranks'
collectives differ in size: gloo aborts the process, NCCL may hang or mix unrelated bytes.
Cheap: one all-gather of a 64-bit digest of the metadata (FQN, shape, dtype, meta or not,
requires_grad) per mesh dim; only when the digests differ is the metadata itself gathered,
to name the first mismatch.
Then one broadcast per dtype of everything flattened. Meta tensors are not broadcast (the
model is materialised and initialised later, identically on every rank: the user's job).
"""

from __future__ import annotations

import hashlib
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import collectives as comm
from ..hooks.contract import get_state

Entry = tuple[str, str, tuple[int, ...], str, bool, bool]  # kind, fqn, shape, dtype, on meta, requires grad
Param = tuple[str, torch.Tensor, bool]  # fqn, local tensor, requires_grad of the parameter


def check_same_model(
    api: str, module: nn.Module, params: list[Param], groups: list[dist.ProcessGroup], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Raise `ValueError` (the same message on every rank) naming the first parameter or
    buffer whose shape, dtype, meta-ness or requires_grad differs across the ranks of any of
    `groups`. Returns `module`'s buffers (those no descendant `api` call checked)."""
    buffers = _buffers(module, api)
    entries: list[Entry] = [("parameter", fqn, tuple(t.shape), str(t.dtype), t.is_meta, rg) for fqn, t, rg in params]
    entries += [("buffer", fqn, tuple(t.shape), str(t.dtype), t.is_meta, False) for fqn, t in buffers]
    digest = int.from_bytes(hashlib.sha256(repr(entries).encode()).digest()[:8], "little", signed=True)
    for group in groups:
        if dist.get_world_size(group) == 1:
            continue
        digests = comm.all_gather_int64(digest, group, device)
        if len(set(digests)) > 1:
            gathered: list[list[Entry] | None] = [None] * len(digests)
            dist.all_gather_object(gathered, entries, group=group)
            filled = cast("list[list[Entry]]", gathered)  # all_gather_object filled every rank's slot
            raise ValueError(_first_mismatch(api, filled, group))
    return buffers


def sync_replicas(
    api: str, module: nn.Module, params: list[Param], group: dist.ProcessGroup, device: torch.device
) -> None:
    """`check_same_model` over `group`, then make `params` and `module`'s buffers equal to
    group rank 0's, in place."""
    if dist.get_world_size(group) == 1:
        return
    buffers = check_same_model(api, module, params, [group], device)
    tensors = [t for _, t, _ in params] + [t for _, t in buffers]
    tensors = [t for t in tensors if not t.is_meta]
    if tensors:
        comm.broadcast_coalesced(tensors, group)


def _buffers(module: nn.Module, api: str) -> list[tuple[str, torch.Tensor]]:
    """Buffers of the subtree, except those under a descendant `api` already synchronised."""
    found: list[tuple[str, torch.Tensor]] = []
    done: set[int] = set()
    for prefix, sub in module.named_modules():
        if sub is not module and get_state(sub, api) is not None:
            done.update(id(m) for m in sub.modules())
        if id(sub) in done:
            continue
        for name, buf in sub._buffers.items():
            if buf is not None:
                found.append((f"{prefix}.{name}" if prefix else name, buf))
    return found


def _first_mismatch(api: str, gathered: list[list[Entry]], group: dist.ProcessGroup) -> str:
    ranks = [dist.get_global_rank(group, r) for r in range(len(gathered))]
    per_rank = [
        {(kind, fqn): (shape, dtype, meta, grad) for kind, fqn, shape, dtype, meta, grad in entries}
        for entries in gathered
    ]
    order = list(dict.fromkeys(key for entries in gathered for key in ((e[0], e[1]) for e in entries)))
    for key in order:
        values = [table.get(key) for table in per_rank]
        if len(set(values)) == 1:
            continue
        present = [v for v in values if v is not None]
        show_dtype = len({v[1] for v in present}) > 1
        show_meta = len({v[2] for v in present}) > 1
        show_grad = len({v[3] for v in present}) > 1

        def describe(v: tuple[tuple[int, ...], str, bool, bool] | None) -> str:
            if v is None:
                return "missing"
            return (
                f"shape {v[0]}"
                + (f" {v[1]}" if show_dtype else "")
                + (" on meta" if show_meta and v[2] else "")
                + (f" requires_grad={v[3]}" if show_grad else "")
            )

        groups: dict[str, list[int]] = {}
        for rank, v in zip(ranks, values):
            groups.setdefault(describe(v), []).append(rank)
        parts = [f"{desc} on ranks {rs}" for desc, rs in groups.items()]
        return (
            f"{api}: {key[0]} '{key[1]}' differs across ranks: "
            + " but ".join(parts)
            + "; every rank must build the same model"
        )
    return f"{api}: parameters or buffers are registered in a different order across ranks {ranks}; every rank must build the same model"
