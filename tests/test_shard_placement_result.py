"""`shard_placement_fn` returning FSDP2's `ShardPlacementResult`, and `share_comm_ctx`.

A result on the group's own mesh shards as its placement says, bit for bit as FSDP2 (local
shards, losses, parameters) (results on other meshes: test_per_param_mesh.py); `share_comm_ctx` over two roots trains as FSDP2
with it, and refuses modules fully_shard does not manage.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from composable import ShardPlacementResult, fully_shard, share_comm_ctx

try:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as _TorchResult  # noqa: F401

    HAS_TORCH = True
except ImportError:  # pragma: no cover
    HAS_TORCH = False
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="this torch's FSDP2 has no ShardPlacementResult")


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    one = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    return one, nn.Sequential(nn.Linear(8, 8), nn.Tanh())


def _wrap(api, share, models, fn) -> None:
    for model in models:
        for layer in model:
            if isinstance(layer, nn.Linear):
                api(layer, shard_placement_fn=fn)
        api(model, shard_placement_fn=fn)
    share(list(models))


def _train(models) -> list[torch.Tensor]:
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for step in range(3):
        torch.manual_seed(10 + step + torch.distributed.get_rank())
        loss = models[1](models[0](torch.randn(4, 8))).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _parity(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    info = FSDPMeshInfo(mesh, shard_mesh_dim=0)

    def fn(param: nn.Parameter) -> ShardPlacementResult:
        return ShardPlacementResult(Shard(param.dim() - 1), info)

    ref = _models()
    ours = copy.deepcopy(ref)
    _wrap(torch_fully_shard, torch_share_comm_ctx, ref, fn)
    _wrap(fully_shard, share_comm_ctx, ours, fn)
    for (n, p), q in zip((x for m in ref for x in m.named_parameters()), (x for m in ours for x in m.parameters())):
        assert tuple(q.placements) == tuple(p.placements), n
        assert torch.equal(q._local_tensor, p._local_tensor), n
    assert all(torch.equal(a, b) for a, b in zip(_train(ref), _train(ours)))
    for p, q in zip((x for m in ref for x in m.parameters()), (x for m in ours for x in m.parameters())):
        assert torch.equal(q._local_tensor, p._local_tensor)
    with pytest.raises(
        ValueError, match="share_comm_ctx: 'modules' must hold modules fully_shard manages, got Linear at index 1"
    ):
        share_comm_ctx([ours[0], nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="share_comm_ctx: 'modules' must be a list"):
        share_comm_ctx(ours[0])


@needs_torch
def test_equal_to_fsdp2_and_errors() -> None:
    run_on_ranks(_parity, 4)
