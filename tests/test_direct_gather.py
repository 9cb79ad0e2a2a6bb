"""`fully_shard` on CUDA all-gathers straight into the parameters' storages (`_engine/unshard/gather.py`).

- Every parameter sharded on dim 0: one coalesced all-gather per unshard, whose outputs are the
  padded unsharded storages (no gather buffer, no copy-out); a parameter on another dim, or
  backward's gather within N ranks after `reshard_after_forward=N`, takes the flat gather, and
  so does every CPU (gloo) group.
- Re-gathering into storage autograd saved is no mutation autograd sees: a compiled block
  checks its saved inputs' versions in backward.
Training parity on NCCL: the GPU suite (test_fully_shard_parity.py, test_mixed_precision_parity.py,
test_offload.py, test_compile.py); of the flat gather: the CPU suite.
"""

from __future__ import annotations

import torch
from _harness import requires_gpus, run_on_ranks, trace_collectives
from _models import MLP
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

import composable


def _gather_ops(tracer: object) -> list[str]:
    return [r.op for r in tracer.records if r.kind == "all_gather"]  # type: ignore[attr-defined]


def _traced_step(net: nn.Module, device: str) -> list[str]:
    with trace_collectives() as t:
        net(torch.randn(3, 6, device=device)).sum().backward()
    return _gather_ops(t)


def test_cpu_groups_gather_flat(world2: DeviceMesh) -> None:
    net = MLP(6, 8)
    composable.fully_shard(net.fc1, mesh=world2)
    composable.fully_shard(net, mesh=world2)
    ops = _traced_step(net, "cpu")
    assert ops and not any("coalesced" in op for op in ops), ops


def _which_gathers(rank: int, world: int) -> dict[str, list[str]]:
    torch.cuda.set_device(rank)
    out = {}
    net = MLP(6, 8).cuda()
    composable.fully_shard(net.fc1)
    composable.fully_shard(net)
    out["dim0"] = _traced_step(net, "cuda")
    group = composable.fully_shard.state(net.fc1).groups[0]
    # The unsharded parameters are views of the gathered storages themselves.
    out["views"] = [
        str(mp.unsharded_param.untyped_storage().data_ptr() == mp.unsharded_padded.untyped_storage().data_ptr())
        for mp in group.params
    ]
    on_dim1 = MLP(6, 8).cuda()
    composable.fully_shard(on_dim1, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    out["dim1"] = _traced_step(on_dim1, "cuda")
    return out


@requires_gpus(2)
def test_cuda_dim0_groups_gather_coalesced_into_their_storages() -> None:
    result = run_on_ranks(_which_gathers, 2, backend="nccl")[0]
    assert len(result["dim0"]) == 3, result  # net.fc1 in forward and backward, the root (kept for backward) once
    assert all("coalesced" in op for op in result["dim0"]), result
    assert result["views"] == ["True"] * 2, result
    assert result["dim1"] and not any("coalesced" in op for op in result["dim1"]), result


def _regather_keeps_versions(rank: int, world: int, compiled: bool) -> list[float]:
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    net = MLP(6, 8).cuda()
    if compiled:  # compiled graphs check their saved inputs' versions in backward
        net.fc1.compile(backend="aot_eager")
    composable.fully_shard(net.fc1)
    composable.fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    group = composable.fully_shard.state(net.fc1).groups[0]
    losses = []
    for _ in range(3):
        loss = net(torch.randn(4, 6, device="cuda")).sum()
        versions = [mp.unsharded_padded._version for mp in group.params]
        loss.backward()  # re-gathers net.fc1 (resharded after forward) into the saved storage
        assert [mp.unsharded_padded._version for mp in group.params] == versions
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@requires_gpus(2)
def test_cuda_regathering_into_saved_storage_keeps_autograd_versions() -> None:
    eager = run_on_ranks(_regather_keeps_versions, 2, False, backend="nccl")
    compiled = run_on_ranks(_regather_keeps_versions, 2, True, backend="nccl")
    torch.testing.assert_close(compiled, eager)
