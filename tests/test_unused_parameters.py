"""Parameters used on some ranks only (a data-dependent branch): every rank must end the step
with the same gradients as a reference that averages the per-rank losses, for fully_shard
(the presence flags ride in the reduce-scatter) and replicate (in each bucket).

A module with its own `fully_shard` must still be *called* on every rank, as with PyTorch
FSDP2: gathering its parameters is a collective. Here the branch lives inside the root's group.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors, run_on_ranks

from composable import fully_shard, replicate


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.extra = nn.Linear(5, 5)  # uneven rows: some ranks own no shard of some rows
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(self.extra(h) if use_extra else h)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _uses_extra(step: int, rank: int) -> bool:
    return (step + rank) % 2 == 1  # each step exactly one of the two ranks takes the branch


def _train(rank: int, world_size: int, api: str) -> None:
    torch.manual_seed(3)
    model = Branchy()
    ref = copy.deepcopy(model)
    if api == "fully_shard":
        fully_shard(model)
    else:
        replicate(model, bucket_cap_mb=1e-9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _batch(step, rank)
        F.mse_loss(model(x, _uses_extra(step, rank)), y).backward()
        losses = [
            F.mse_loss(ref(*_batch(step, r)[:1], _uses_extra(step, r)), _batch(step, r)[1]) for r in range(world_size)
        ]
        (sum(losses) / world_size).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None, f"{api}: rank {rank} has no gradient for {name} at step {step}"
            assert_close_tensors(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{api} grad {name} step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_tensors(p, q, rtol=1e-5, atol=1e-6, msg=f"{api} param {name}")


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_parameters_used_on_some_ranks_match_the_reference(api: str) -> None:
    run_on_ranks(_train, 2, api=api)
