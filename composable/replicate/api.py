"""`replicate`: DDP-style data parallelism on the same engine as `fully_shard`."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._engine.dtypes.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    check_policies,
    param_dtype_resolver,
)
from .._engine.groups.build import GroupOptions, build_groups
from .._engine.hooks.contract import answers_state, check_composable, check_module, install_state, state_of
from .._engine.meshes.mesh import check_mesh, default_mesh, infer_device_type, mesh_from_process_group
from .._engine.params.claim import check_ignored
from .._engine.params.spmd import DataParallelMeshDims, resolve_dp_mesh_dims
from ._state import ReplicateState


def _state(module: nn.Module) -> ReplicateState | None:
    """The state `replicate` installed on exactly `module`, or None (`TypeError` for a non-module)."""
    return state_of("replicate", module)


@answers_state(_state)
def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module:
    """Replicate `module` over a 1D mesh (DDP semantics) and return `module` itself.

    Manages the parameters of the subtree that no API applied earlier to a descendant
    manages; each becomes an `nn.Parameter(DTensor)` with placement `Replicate()`. Gradients
    are averaged with all-reduces over buckets of about `bucket_cap_mb` MiB, each launched as
    soon as its gradients are ready, overlapping the rest of the backward. `mesh` or
    `process_group` (not both) choose the ranks; the default is the whole world.

    As DDP, the call checks that every rank has the same parameters and buffers (FQNs,
    shapes, dtypes; `ValueError` naming the first that differs and the ranks) and broadcasts
    the mesh's first rank's values to the others, so the replicas start equal. Collective:
    every rank of the mesh must call it. Meta-device tensors are skipped: materialise and
    initialise them identically on every rank (same seed) afterwards.

    Tensor-parallel parameters (DTensors on a TP mesh, e.g. `mesh2d["tp"]` beside
    `mesh=mesh2d["dp"]`) stay whole over dp: DTensors on the `(dp, tp)` mesh, `Replicate()` on
    dp and their TP placements on tp, their TP-local gradients averaged over dp.

    As torch's FSDP2-based `replicate`: `offload_policy=CPUOffloadPolicy()` keeps the
    parameters, gradients and the optimizer step on the CPU; `ignored_params` are left alone
    (plain tensors, not synchronised).

    `dp_mesh_dims=DataParallelMeshDims(replicate=...)` (as torch's FSDP2-based replicate):
    `mesh` is the whole SPMD mesh (e.g. dp x tp), every parameter already is a DTensor on it
    with `Replicate()` on the named dim(s), and gradients are averaged over those dims only
    (several are flattened into one); the values are broadcast over them.
    """
    api = "replicate"
    check_module(api, module)
    mp_policy, offload_policy = check_policies(api, mp_policy, offload_policy)
    ignored = check_ignored(api, ignored_params)
    check_composable(api, module)
    if mesh is not None and process_group is not None:
        raise ValueError("replicate: pass 'mesh' or 'process_group', not both")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"replicate: 'bucket_cap_mb' must be a number, got {bucket_cap_mb!r}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"replicate: 'bucket_cap_mb' must be > 0, got {bucket_cap_mb!r}")
    spmd = None
    if dp_mesh_dims is not None:
        if mesh is None:
            raise ValueError("replicate: pass 'mesh' with 'dp_mesh_dims' (the whole mesh), got mesh=None")
        check_mesh(api, mesh, tuple(range(1, 1 + getattr(mesh, "ndim", 1))))
        spmd = resolve_dp_mesh_dims(api, mesh, dp_mesh_dims, allow_shard=False)
    elif process_group is not None:
        mesh = mesh_from_process_group(api, process_group, infer_device_type(module))
    elif mesh is None:
        mesh = default_mesh(api, module)
    if spmd is None:
        check_mesh(api, mesh, (1,))

    options = GroupOptions(
        sharded=False,
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
        bucket_cap_bytes=int(bucket_cap_mb * 1024 * 1024),
        sync_replicas=True,
        spmd=spmd,
        offload=isinstance(offload_policy, CPUOffloadPolicy),
        pin_memory=getattr(offload_policy, "pin_memory", False),
        compute_shard_on_device=getattr(offload_policy, "compute_shard_on_device", False),
        param_dtype_for=param_dtype_resolver(api, mp_policy),
    )
    groups = build_groups(api, module, mesh, ignored, options)
    state = ReplicateState(module, groups, mp_policy, reshard_after_forward=False, reshard_is_default=False)
    state.mesh = mesh
    state.bucket_cap_mb = float(bucket_cap_mb)
    install_state(module, api, state)
    return module
