"""Per-parameter meshes (`ShardPlacementResult`) under `dp_mesh_dims`, and their errors.

Parameters as DTensors on whole meshes: a block's experts on the sparse (efsdp, ep) mesh, the
rest on the dense (fsdp,) mesh, sharded by one `fully_shard(..., dp_mesh_dims=...)` whose
`shard_placement_fn` gives torch's `_get_mesh_info(mesh, dims)` per parameter: losses,
gradients and parameters over 3 AdamW steps equal FSDP2's bit for bit (torch 2.15), with the
same collectives per process group per step. A mesh_info that is wrong fails at the call with
one line naming the parameter and the mesh.
"""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from _harness import count_collectives, run_on_ranks
from test_per_param_mesh import HAS_FSDP2, KINDS
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from composable import ShardPlacementResult, fully_shard

try:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
except ImportError:  # pragma: no cover
    pass


class _CudaMesh(DeviceMesh):
    """A mesh that says it is on CUDA (what a CUDA mesh passed to a CPU module looks like)."""

    device_type = property(lambda self: "cuda")  # type: ignore[assignment]


def _errors(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("edp", "ep"))
    others = [r for r in range(world) if r not in mesh["edp"].mesh.tolist()]
    foreign = DeviceMesh("cpu", torch.tensor(others[:2]))
    with pytest.raises(
        ValueError, match=r"fully_shard: 'shard_placement_fn' put 'weight' on mesh .*, which does not contain this rank"
    ):
        fully_shard(
            nn.Linear(4, 4), shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), SimpleNamespace(mesh=foreign))
        )
    meta = SimpleNamespace(mesh=SimpleNamespace(device_type="meta"))
    with pytest.raises(TypeError, match="ShardPlacementResult without a DeviceMesh 'mesh_info.mesh' for 'weight'"):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), meta))
    other_type = copy.copy(mesh["edp"])
    other_type.__class__ = _CudaMesh
    with pytest.raises(ValueError, match="put 'weight' on mesh .* of device type 'cuda', not the module mesh's 'cpu'"):
        fully_shard(
            nn.Linear(4, 4),
            shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), SimpleNamespace(mesh=other_type)),
        )

    cube = init_device_mesh("cpu", (1, 2, world // 2))
    with pytest.raises(ValueError, match="put 'weight' on mesh .*: a per-parameter mesh must be 1D .* got 3D"):
        fully_shard(
            nn.Linear(4, 4), shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), SimpleNamespace(mesh=cube))
        )
    first = SimpleNamespace(mesh=mesh, shard_mesh_dim=0)
    with pytest.raises(NotImplementedError, match="put 'weight' on mesh .* sharded over mesh dim 0: only the last dim"):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), first))
    from composable import DataParallelMeshDims

    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    plain = SimpleNamespace(mesh=mesh["edp"])
    with pytest.raises(
        ValueError, match="with 'dp_mesh_dims', 'shard_placement_fn' must give 'experts' a mesh_info with"
    ):
        fully_shard(
            _SpmdBlock(dense, mesh),
            mesh=dense,
            dp_mesh_dims=DataParallelMeshDims(shard="fsdp"),
            shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), plain) if p.dim() == 3 else None,
        )


def test_errors_at_the_call() -> None:
    run_on_ranks(_errors, 4)


try:  # torch's mesh info of a whole SPMD mesh (`_get_mesh_info(mesh, dp_mesh_dims)`, torch 2.15)
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    HAS_SPMD_INFO = HAS_FSDP2 and "spmd_mesh" in getattr(FSDPMeshInfo, "__dataclass_fields__", {})
except ImportError:  # pragma: no cover
    HAS_SPMD_INFO = False


class _SpmdBlock(nn.Module):
    """Parameters as DTensors on whole meshes: `experts` (4, 6, 8) split over `ep` of the sparse
    (efsdp, ep) mesh, `proj` replicated on the dense (fsdp,) mesh; computes with local tensors."""

    def __init__(self, dense, sparse) -> None:
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        torch.manual_seed(0)
        self.experts = nn.Parameter(distribute_tensor(torch.randn(4, 6, 8), sparse, (Replicate(), Shard(0))))
        lin = nn.Linear(8, 8)
        self.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), dense, (Replicate(),)))
        self.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), dense, (Replicate(),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bd,edh->bh", x, self.experts.to_local())
        return torch.tanh(h) @ self.weight.to_local().T + self.bias.to_local()


def _spmd_train(rank: int, world: int, shard) -> dict:
    from composable import DataParallelMeshDims

    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    sparse = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("efsdp", "ep"))
    dims, sparse_dims = DataParallelMeshDims(shard="fsdp"), DataParallelMeshDims(shard="efsdp")
    if HAS_SPMD_INFO:
        info, sparse_info = _get_mesh_info(dense, dims), _get_mesh_info(sparse, sparse_dims)
    else:
        info = SimpleNamespace(mesh=dense["fsdp"], spmd_mesh=dense, dp_mesh_dims=dims)
        sparse_info = SimpleNamespace(mesh=sparse["efsdp"], spmd_mesh=sparse, dp_mesh_dims=sparse_dims)
    block = _SpmdBlock(dense, sparse)
    shard(
        block,
        mesh=dense,
        dp_mesh_dims=dims,
        shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), sparse_info if p.dim() == 3 else info),
    )
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
    out: dict = {"losses": [], "grads": [], "counts": []}
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        with count_collectives() as comm:
            loss = block(torch.randn(5, 6)).pow(2).sum()
            loss.backward()
        out["counts"].append(Counter((r.kind, r.group) for r in comm.records if r.kind in KINDS))
        out["grads"].append([p.grad._local_tensor.clone() for p in block.parameters()])
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
    out["params"] = [p._local_tensor.clone() for p in block.parameters()]
    out["placements"] = [(p.device_mesh.mesh.tolist(), tuple(p.placements)) for p in block.parameters()]
    return out


def _spmd_vs_fsdp2(rank: int, world: int) -> None:
    ref, ours = _spmd_train(rank, world, torch_fully_shard), _spmd_train(rank, world, fully_shard)
    assert ours["placements"] == ref["placements"]
    assert ours["placements"][0][0] == [[0, 1], [2, 3]] and ours["placements"][1][0] == [0, 1, 2, 3]
    for key in ("losses", "params"):
        assert all(torch.equal(a, b) for a, b in zip(ref[key], ours[key])), key
    for step in range(3):
        assert all(torch.equal(a, b) for a, b in zip(ref["grads"][step], ours["grads"][step])), step
        assert ours["counts"][step] == ref["counts"][step], (ours["counts"][step], ref["counts"][step])


@pytest.mark.skipif(not HAS_SPMD_INFO, reason="this torch's FSDP2 has no per-parameter meshes with dp_mesh_dims")
def test_dp_mesh_dims_equal_to_fsdp2() -> None:
    run_on_ranks(_spmd_vs_fsdp2, 4)
