"""replicate's keywords from torch's FSDP2-based replicate: `ignored_params` and `offload_policy`.

Against torch's replicate (2 gloo ranks): an ignored parameter stays a plain, unsynchronised
tensor and everything trains bit for bit alike; CPU offload trains as without it; bad values
raise at the call, named.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from torch.distributed.tensor import DTensor

from composable import CPUOffloadPolicy, replicate

try:
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
except ImportError:  # pragma: no cover
    torch_replicate = None


def _train(model: nn.Module, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        torch.manual_seed(10 * step + rank)
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [getattr(p, "_local_tensor", p).detach() for p in model.parameters()]


def _ignored_and_offload(rank: int, world: int) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    ref, ours, offloaded = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    torch_replicate(ref, ignored_params={ref[0].weight})
    replicate(ours, ignored_params={ours[0].weight})
    assert not isinstance(ours[0].weight, DTensor) and isinstance(ours[0].bias, DTensor)
    trained = _train(ours, rank)
    for p, q in zip(_train(ref, rank), trained):
        assert torch.equal(p, q)
    replicate(offloaded, ignored_params={offloaded[0].weight}, offload_policy=CPUOffloadPolicy(pin_memory=False))
    for p, q in zip(trained, _train(offloaded, rank)):
        assert torch.equal(p, q)
    with pytest.raises(TypeError, match="replicate: 'ignored_params' must be a set of nn.Parameter or None, got"):
        replicate(nn.Linear(2, 2), ignored_params=[1])
    with pytest.raises(TypeError, match="replicate: 'offload_policy' must be a composable.OffloadPolicy"):
        replicate(nn.Linear(2, 2), offload_policy="cpu")


@pytest.mark.skipif(torch_replicate is None, reason="no FSDP2-based replicate in this torch")
def test_ignored_params_and_offload() -> None:
    run_on_ranks(_ignored_and_offload, 2)
