"""Parameters used on some ranks only (a data-dependent branch): every rank must end the step
with the same gradients as a reference that averages the per-rank losses, for fully_shard
and replicate. A rank without a gradient sends -0.0s in its place (composable/_engine/grads/reduce.py):
a parameter no rank used ends with no gradient, as on one process.

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
from torch.distributed.device_mesh import init_device_mesh

from composable import ShardingStrategy, fully_shard, replicate


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
    """Step 0: rank 0 alone takes the branch; step 1: no rank does (the parameter has no gradient
    anywhere); step 2: every rank but rank 0."""
    return (rank == 0) if step == 0 else False if step == 1 else rank != 0


def _train(rank: int, world_size: int, api: str) -> None:
    torch.manual_seed(3)
    model = Branchy()
    ref = copy.deepcopy(model)
    if api == "fully_shard":
        fully_shard(model)
    elif api == "no_shard":
        fully_shard(model, strategy=ShardingStrategy.NO_SHARD)
    elif api == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, world_size // 2)))
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
            if q.grad is None:  # no rank used it: none here either (not a zero gradient)
                assert p.grad is None, f"{api}: rank {rank} has a gradient for unused {name} at step {step}"
                continue
            assert p.grad is not None, f"{api}: rank {rank} has no gradient for {name} at step {step}"
            assert_close_tensors(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{api} grad {name} step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_tensors(p, q, rtol=1e-5, atol=1e-6, msg=f"{api} param {name}")


@pytest.mark.parametrize(
    "api, world", [("fully_shard", 2), ("fully_shard", 4), ("no_shard", 2), ("hsdp", 4), ("replicate", 2)]
)
def test_parameters_used_on_some_ranks_match_the_reference(api: str, world: int) -> None:
    """At 4 ranks `extra`'s 5 rows shard as 2, 2, 1, 0: rank 3's region is all padding, and it
    still learns from it whether any rank had the gradient."""
    run_on_ranks(_train, world, api=api)
