"""Device meshes: validation, the default mesh, and the compute device a mesh implies."""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def infer_device_type(module: nn.Module) -> str:
    """The device type to build a default mesh on: the module's accelerator if it has one,
    else the current accelerator when the default group can use it (NCCL), else the CPU."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device.type
    # "nccl" or a mixed backend such as "cpu:gloo,cuda:nccl" (what CPU offload wants).
    if torch.cuda.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return "cuda"
    return "cpu"


def default_mesh(api: str, module: nn.Module) -> DeviceMesh:
    """A 1D mesh over the whole default process group."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{api}: torch.distributed is not initialised; call dist.init_process_group() or pass 'mesh'"
        )
    return init_device_mesh(infer_device_type(module), (dist.get_world_size(),))


def check_mesh(api: str, mesh: object, allowed_ndims: tuple[int, ...]) -> DeviceMesh:
    """Raise `TypeError`/`ValueError` naming `api` unless `mesh` is a DeviceMesh of an allowed rank."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{api}: 'mesh' must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}: {mesh!r:.80}"
        )
    if mesh.ndim not in allowed_ndims:
        dims = " or ".join(f"{n}D" for n in allowed_ndims)
        raise ValueError(f"{api}: 'mesh' must be {dims}, got a {mesh.ndim}D mesh of shape {tuple(mesh.shape)}")
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(
            f"{api}: 'mesh' does not contain this rank (global rank {dist.get_rank()}); mesh ranks "
            f"{mesh.mesh.flatten().tolist()}: call {api} only on the ranks of its mesh"
        )
    return mesh


def compute_device(mesh: DeviceMesh) -> torch.device:
    """The device unsharded parameters live on: the current accelerator of the mesh's type."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def mesh_from_process_group(api: str, group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1D DeviceMesh over an existing process group."""
    if cast(object, group) is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives ranks outside it
        raise ValueError(
            f"{api}: 'process_group' does not contain this rank (global rank {dist.get_rank()}): call {api} only on the ranks of its group"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{api}: 'process_group' must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return DeviceMesh.from_group(group, device_type)
