"""`fully_shard` all-gathers straight into the parameters' storages (`_engine/gather.py`).

- Every parameter sharded on dim 0: one coalesced all-gather per unshard, whose outputs are the
  padded unsharded storages (no gather buffer, no copy-out); a parameter on another dim, or
  backward's gather within N ranks after `reshard_after_forward=N`, takes the flat gather.
- Re-gathering into storage autograd saved is no mutation autograd sees: gloo writes the
  outputs of a coalesced gather when the work completes (bumping their version counters then),
  and a backward that re-gathers must still find its saved tensors at their saved versions.
Training parity of both ways is in test_fully_shard_parity.py, test_shard_placement_fn.py and
test_fsdp2_extras.py (int reshard); on NCCL in the GPU suite.
"""

from __future__ import annotations

import torch
from _harness import run_on_ranks, trace_collectives
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

import composable


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _ops(tracer: object) -> list[str]:
    return [r.op for r in tracer.records if r.kind == "all_gather"]  # type: ignore[attr-defined]


def test_dim0_groups_gather_coalesced_into_their_storages(world2: DeviceMesh) -> None:
    net = _Net()
    composable.fully_shard(net.a, mesh=world2)
    composable.fully_shard(net, mesh=world2)
    with trace_collectives() as t:
        net(torch.randn(3, 6)).sum().backward()
    ops = _ops(t)
    assert len(ops) == 3, ops  # net.a in forward and backward, the root (kept for backward) once
    assert all("coalesced" in op for op in ops), ops
    group = composable.fully_shard.state(net.a).group
    for mp in group.params:  # the unsharded parameter is a view of the gathered storage itself
        assert mp.unsharded_param.untyped_storage().data_ptr() == mp.unsharded_padded.untyped_storage().data_ptr()


def test_other_dims_and_int_reshard_take_the_flat_gather(world4: tuple[DeviceMesh, DeviceMesh]) -> None:
    mesh, _ = world4
    on_dim1 = _Net()
    composable.fully_shard(on_dim1, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    with trace_collectives() as t:
        on_dim1(torch.randn(3, 6)).sum().backward()
    assert _ops(t) and not any("coalesced" in op for op in _ops(t)), _ops(t)

    pairs = _Net()
    composable.fully_shard(pairs, mesh=mesh, reshard_after_forward=2)
    with trace_collectives() as t:
        pairs(torch.randn(3, 6)).sum().backward()
    forward, backward = _ops(t)
    assert "coalesced" in forward and "coalesced" not in backward, (forward, backward)


def _regather_keeps_versions(rank: int, world: int, compiled: bool) -> list[float]:
    torch.manual_seed(0)
    net = _Net()
    if compiled:  # compiled graphs check their saved inputs' versions in backward
        net.a.compile(backend="aot_eager")
    composable.fully_shard(net.a)
    composable.fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    group = composable.fully_shard.state(net.a).group
    losses = []
    for _ in range(3):
        loss = net(torch.randn(4, 6)).sum()
        versions = [mp.unsharded_padded._version for mp in group.params]
        loss.backward()  # re-gathers net.a (resharded after forward) into the saved storage
        assert [mp.unsharded_padded._version for mp in group.params] == versions
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_regathering_into_saved_storage_keeps_autograd_versions() -> None:
    eager = run_on_ranks(_regather_keeps_versions, 2, False)
    compiled = run_on_ranks(_regather_keeps_versions, 2, True)
    torch.testing.assert_close(compiled, eager)
