"""`replicate.state(module).set_all_reduce_hook`: a hook on each gradient bucket once it is
all-reduced over the mesh, in place, before the division that averages it (gloo sums): what
extends the data-parallel dimension over ranks the mesh does not hold (torchft's replica groups,
tests/test_torchft.py). Each bucket reaches the hook once per backward, and what the hook writes
is what the gradients become."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks

from composable import replicate


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _hooked_buckets(rank: int, world_size: int) -> list[int]:
    plain = replicate(_model(), bucket_cap_mb=0.01)  # about 2,600 fp32 elements a bucket: several
    hooked = replicate(_model(), bucket_cap_mb=0.01)
    seen: list[int] = []

    def double(bucket: torch.Tensor) -> None:
        seen.append(bucket.numel())
        bucket.mul_(2)

    replicate.state(hooked).set_all_reduce_hook(double)
    torch.manual_seed(rank)
    x = torch.randn(4, 8)
    for model in (plain, hooked):
        model(x).square().mean().backward()
    for (name, p), q in zip(hooked.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad.full_tensor(), 2 * q.grad.full_tensor()), name
    assert sum(seen) == sum(p.numel() for p in hooked.parameters())
    return seen


def test_the_hook_sees_each_bucket_once_and_writes_the_gradients() -> None:
    seen = run_on_ranks(_hooked_buckets, 2)
    assert seen[0] == seen[1] and len(seen[0]) > 1, seen


def _not_callable(rank: int, world_size: int) -> None:
    model = replicate(copy.deepcopy(_model()))
    with pytest.raises(TypeError, match=r"^set_all_reduce_hook: 'hook' must be callable, got int$"):
        replicate.state(model).set_all_reduce_hook(3)  # type: ignore[arg-type]


def test_a_hook_that_is_not_callable_is_one_line() -> None:
    run_on_ranks(_not_callable, 2)
