"""torchao float8 training under composable: the weight scales of the next step, in place.

torchao's recipe for float8 all-gather computes every float8 weight's scale for the next
forward after each optimizer step, in one all-reduce:
`torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model)`. It works under `fully_shard`
as under FSDP2, but it hands each weight a new scale tensor at every call, which a CUDA graph
cannot follow (a graph replays the addresses it captured: the next forward would read the
scales of the step before the capture forever). `precompute_float8_dynamic_scale_for_fsdp`
here computes the same scales, bit for bit, with the same single all-reduce, and writes them
into the tensors the weights already hold, so `composable.graphed_step` can capture it. It
also costs less host time: it reads the plain data of the local shards instead of sending a
hundred weights through DTensor's and torchao's dispatch (torchao's took 3.5-4.4 ms of host
time per step on the 1B benchmark model on one H100, where an eager float8 step is host-bound).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

_API = "precompute_float8_dynamic_scale_for_fsdp"


@torch.no_grad()  # the scales are data, not part of the graph (a scale that requires grad recompiles the blocks)
def precompute_float8_dynamic_scale_for_fsdp(module: nn.Module) -> None:
    """Compute the float8 scale of every torchao float8 weight under `module` for its next
    all-gather, as `torchao.float8.precompute_float8_dynamic_scale_for_fsdp` does (the same
    arithmetic: `finfo(float8).max / max(|w|)` over the whole weight, one all-reduce for all
    over the sharded mesh dimension, none where that dimension has one rank), writing into
    each weight's existing scale tensor where it has one (the first call makes them). Call it
    after each optimizer step, eagerly or inside a `graphed_step` step.

    Needs torchao; raises `ImportError` naming it otherwise. Weights that are not sharded
    DTensors of torchao's `WeightWithDynamicFloat8CastTensor` are left alone, as torchao does.
    """
    try:
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_utils import EPS
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError as e:
        raise ImportError(
            f"{_API}: needs torchao (float8 training), which is not installed: pip install torchao"
        ) from e
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_API}: 'module' must be an nn.Module, got {type(module).__name__}")
    linears = [
        m
        for m in module.modules()
        if isinstance(m, Float8Linear)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]
    if not linears:
        return
    target_dtypes = {m.config.cast_config_weight.target_dtype for m in linears}
    if len(target_dtypes) != 1:
        raise ValueError(
            f"{_API}: the float8 weights under 'module' mix target dtypes {sorted(map(str, target_dtypes))}"
        )
    (target,) = target_dtypes
    weights = [m.weight for m in linears]
    amax = _amax_from_local_shards(weights)
    if amax is None:  # through DTensor: the max of each weight's local shards is a Partial, reduced once
        amax = torch.stack(torch._foreach_norm(weights, ord=math.inf))
    amax = torch.clamp(amax, EPS)
    origin = amax.dtype
    scales = torch.finfo(target).max / amax.to(torch.float64)  # float64, as torchao: eager equals compiled
    if origin is torch.float16:
        scales = torch.clamp(scales, max=torch.finfo(torch.float16).max)
    local = (scales.to_local() if isinstance(scales, DTensor) else scales).to(torch.float32)
    locals_ = [m.weight._local_tensor for m in linears]
    held = [t._precomputed_scale for t in locals_]
    if all(
        isinstance(h, torch.Tensor) and h.shape == () and h.dtype == local.dtype and h.device == local.device
        for h in held
    ):
        torch._foreach_copy_(held, list(local.unbind()))
        return
    for i, t in enumerate(locals_):
        t._precomputed_scale = local[i]


def _amax_from_local_shards(weights: list[DTensor]) -> torch.Tensor | None:
    """`max(|w|)` of every weight as a plain tensor, from the plain data of the local shards
    and one all-reduce (MAX) over each mesh dimension the weights are sharded on: the values
    DTensor computes, without its dispatch and torchao's over every weight (milliseconds of
    host time per step at a hundred weights). None where that does not apply (weights on
    different meshes or placements, a placement other than Shard and Replicate, an empty local
    shard): then DTensor computes it."""
    mesh, placements = weights[0].device_mesh, weights[0].placements
    if not all(p.is_shard() or p.is_replicate() for p in placements):
        return None
    plain = []
    for weight in weights:
        data = weight._local_tensor._tensor  # type: ignore[attr-defined]  # torchao's float8 weight (untyped)
        if weight.device_mesh is not mesh or weight.placements != placements or data.numel() == 0:
            return None
        plain.append(data)
    amax = torch.stack(torch._foreach_norm(plain, ord=math.inf))
    for dim, placement in enumerate(placements):
        if placement.is_shard() and mesh.size(dim) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return amax
