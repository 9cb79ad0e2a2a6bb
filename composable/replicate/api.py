"""`replicate`: DDP-style data parallelism on the same engine as `fully_shard`."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._claim import check_same_device, claim_parameters, mark_replaced
from .._contract import attach_state_accessor, check_composable, check_module, install_state
from .._mesh import check_mesh, compute_device, default_mesh, infer_device_type, mesh_from_process_group
from ..fsdp._param_group import GroupConfig, ParamGroup
from ..fsdp.api import _move_buffers, _on_device, make_managed_param
from ..mixed_precision import MixedPrecisionPolicy, check_policies
from ._state import ReplicateState


def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
) -> nn.Module:
    """Replicate `module` over a 1D mesh (DDP semantics) and return `module` itself.

    Manages the parameters of the subtree that no API applied earlier to a descendant
    manages; each becomes an `nn.Parameter(DTensor)` with placement `Replicate()`. Gradients
    are averaged with all-reduces over buckets of about `bucket_cap_mb` MiB, each launched as
    soon as its gradients are ready, overlapping the rest of the backward. `mesh` or
    `process_group` (not both) choose the ranks; the default is the whole world.
    """
    api = "replicate"
    check_module(api, module)
    check_policies(api, mp_policy)
    check_composable(api, module)
    if mesh is not None and process_group is not None:
        raise ValueError("replicate: pass 'mesh' or 'process_group', not both")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"replicate: 'bucket_cap_mb' must be a number, got {bucket_cap_mb!r}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"replicate: 'bucket_cap_mb' must be > 0, got {bucket_cap_mb!r}")
    if process_group is not None:
        mesh = mesh_from_process_group(api, process_group, infer_device_type(module))
    elif mesh is None:
        mesh = default_mesh(api, module)
    check_mesh(api, mesh, (1,))

    claimed = claim_parameters(module, set(), api)
    originals = [p for _, _, p in claimed]
    check_same_device(api, originals)
    if any(isinstance(p, DTensor) for p in originals):
        raise NotImplementedError("replicate: parameters that are already DTensors are not supported")
    device = compute_device(mesh)
    _move_buffers(module, device)
    config = GroupConfig(
        mesh=mesh, device=device, sharded=False, hsdp=False,
        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
        offload=False, pin_memory=False, bucket_cap_bytes=int(bucket_cap_mb * 1024 * 1024),
    )
    group = None
    if claimed:
        params = [make_managed_param(fqn, slots, p, mesh, False, 1, 0) for fqn, slots, p in claimed]
        group = ParamGroup(params, [_on_device(p, device) for p in originals], config)
        for mp in params:
            mp.register(mp.sharded_param)
        mark_replaced(originals, "replicate")
    state = ReplicateState(module, group, mp_policy, reshard_after_forward=False, reshard_is_default=False)
    state.mesh = mesh
    state.bucket_cap_mb = float(bucket_cap_mb)
    install_state(module, api, state)
    return module


attach_state_accessor(replicate, "replicate")
