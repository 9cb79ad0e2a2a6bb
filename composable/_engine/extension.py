"""PyTorch FSDP2's all-gather extension, honoured for parameters whose local tensor is a
subclass that implements it (torchao's float8 training weights, for example).

Such a subclass decides what travels: `fsdp_pre_all_gather` turns this rank's shard into
the tensors to all-gather (float8 data: half the bytes of bf16) plus metadata, and
`fsdp_post_all_gather` turns the gathered tensors into the unsharded parameter (first
time), or refills it in place (`out=`), naming the inner tensors whose storage may be freed
between uses. These parameters keep their own storage (they are not in the group's flat
buffer) and get one all-gather per input tensor; their gradients are plain and go through
the group's usual reduction.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import collectives as comm
from .param import ManagedParam, _contiguous_stride
from .policies import MixedPrecisionPolicy

HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def has_extension(tensor: object) -> bool:
    """Whether `tensor` implements the all-gather extension (both methods, as FSDP2 requires)."""
    return all(hasattr(tensor, name) for name in HOOKS)


@dataclass
class PendingGather:
    """One extension parameter's all-gathers in flight."""

    works: list[Any]
    outputs: list[torch.Tensor]  # 1D, world x input numel each
    input_shapes: list[torch.Size]
    metadata: Any


def start_gathers(
    params: list[ManagedParam], group: dist.ProcessGroup, mesh: DeviceMesh, world: int, mp_policy: MixedPrecisionPolicy
) -> list[PendingGather]:
    """Ask each parameter's local shard what to all-gather and launch those all-gathers."""
    pending = []
    for mp in params:
        local = mp.sharded_param._local_tensor  # type: ignore[union-attr]
        pre = local.fsdp_pre_all_gather
        if len(inspect.signature(pre).parameters) == 1:  # FSDP2's older signature: mesh only
            inputs, metadata = pre(mesh)
        else:
            module = mp.slots[0][0]
            inputs, metadata = pre(mesh, mp.layout.shape, _contiguous_stride(mp.layout.shape), module, mp_policy)
        outputs, works, shapes = [], [], []
        for tensor in inputs:
            flat = tensor.contiguous().view(-1)
            out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
            works.append(comm.all_gather(out, flat, group, async_op=True))
            outputs.append(out)
            shapes.append(tensor.shape)
        pending.append(PendingGather(works, outputs, shapes, metadata))
    return pending


def finish_gathers(
    params: list[ManagedParam], pending: list[PendingGather], world: int, param_dtype: torch.dtype
) -> None:
    """Wait, then make (first time) or refill each unsharded parameter through
    `fsdp_post_all_gather`, keeping autograd's version counters: refilling freed storage with
    the same values is not a mutation autograd should see."""
    for mp, gather in zip(params, pending):
        for work in gather.works:
            if work is not None:
                work.wait()
        outputs = tuple(o.view(world * s[0], *s[1:]) for o, s in zip(gather.outputs, gather.input_shapes))
        local = mp.sharded_param._local_tensor  # type: ignore[union-attr]
        if mp.unsharded_param is None:
            unsharded, inner = local.fsdp_post_all_gather(outputs, gather.metadata, param_dtype)
            mp.unsharded_param = nn.Parameter(unsharded, requires_grad=mp.wants_grad)
            mp.extension_inner = list(inner)
            continue
        for tensor in mp.extension_inner:
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        with comm.refilling(mp.unsharded_param, *mp.extension_inner):
            local.fsdp_post_all_gather(outputs, gather.metadata, param_dtype, out=mp.unsharded_param)


def free(params: list[ManagedParam]) -> None:
    """Release the inner tensors' storage between uses (the parameter objects stay)."""
    for mp in params:
        for tensor in mp.extension_inner:
            tensor.untyped_storage().resize_(0)
