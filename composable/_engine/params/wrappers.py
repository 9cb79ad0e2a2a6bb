"""DTensor wrappers around local tensors that the engine makes: cheaply (per parameter per
step) and picklable (a wrapper must not carry its local tensor's storage offset)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec


def new_dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """`local` wrapped as a DTensor with `spec`, no autograd. `DTensor.__new__` alone: the
    constructor also runs `__init__` behind `torch._disable_dynamo`, which costs about 3 us
    more per call and does nothing a wrapper needs (this runs per parameter per step)."""
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of `t`: a DTensor's local shard (without a dispatch), else `t`."""
    return t._local_tensor if isinstance(t, DTensor) else t


def offset_free_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """`state_dict()` post-hook: its DTensor values are `param.detach()` of sharded parameters,
    new wrappers that take their local shard's storage offset again, and such a wrapper cannot
    be pickled (`torch.save(model.state_dict())` failed with "invalid python storage"; see
    `offset_free`). Re-wrapped offset-free around the same local shards: no copy."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, DTensor) and value.storage_offset() != 0:
            local = value._local_tensor
            fixed = new_dtensor(offset_free(local), value._spec)
            fixed._local_tensor = local
            state_dict[key] = fixed


def offset_free(local: torch.Tensor) -> torch.Tensor:
    """A stand-in for `local` with storage offset 0, to build the DTensor around (the caller
    then points it at `local`). Since torch 2.10 (pytorch#167597) a DTensor takes its local
    tensor's storage offset, and `Tensor.__deepcopy__` then mistakes such a wrapper for a
    tensor with real storage and fails ("invalid python storage"): local shards are views of
    the flat buffer at offsets, so `copy.deepcopy(model)` would break."""
    return local if local.storage_offset() == 0 else local.new_empty(()).expand(local.shape)
