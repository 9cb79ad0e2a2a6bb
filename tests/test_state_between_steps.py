"""Between steps the module shows its sharded parameters, and no_sync gradients behave as in DDP.

1. After a training forward whose backward never runs (the root keeps its unsharded storage),
   `named_parameters()` still yields the sharded DTensors, so torch.distributed.checkpoint's
   `set_model_state_dict(full_state_dict=True)` and `get_optimizer_state_dict` work (they read
   `named_parameters()` directly, not through `state_dict()`'s pre-hooks).
2. `replicate`: during no_sync the local gradient is the parameter's visible `.grad`, so
   `optimizer.zero_grad()` after a no_sync backward discards it, as with DDP.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from _harness import run_on_ranks

from composable import fully_shard, no_sync, replicate


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _target() -> nn.Sequential:
    ref = _mlp()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    return ref


# -- 1. state-dict APIs after a forward without backward ------------------------------------
def _set_full_sd_after_forward_without_backward(rank: int, world: int) -> float:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ref, model = _target(), _mlp()
    fully_shard(model)
    x = torch.randn(2, 4)
    model(x)  # train-mode forward, graph dropped (e.g. a metric computed without no_grad)
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        return (model(x) - ref(x)).abs().max().item()


def test_set_full_model_state_dict_after_forward_without_backward() -> None:
    assert run_on_ranks(_set_full_sd_after_forward_without_backward, 2) == [0.0, 0.0]


def _get_optim_sd_after_forward_without_backward(rank: int, world: int) -> int:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _mlp()
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    model(x)  # forward whose backward never runs
    return len(get_optimizer_state_dict(model, opt)["state"])


def test_get_optimizer_state_dict_after_forward_without_backward() -> None:
    assert run_on_ranks(_get_optim_sd_after_forward_without_backward, 2) == [4, 4]


# -- 2. replicate: zero_grad after no_sync must discard the accumulated gradient ------------
def _replicate_zero_grad_after_no_sync(rank: int, world: int) -> float:
    model = _mlp()
    ref = copy.deepcopy(model)
    replicate(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    xs = torch.randn(2, world, 2, 4)
    with no_sync(model):
        model(xs[0, rank]).sum().backward()
    opt.zero_grad()  # DDP: the no-sync gradient lives in p.grad and is discarded here
    model(xs[1, rank]).sum().backward()
    (ref(xs[1].reshape(-1, 4)).sum() / world).backward()
    return max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def test_replicate_zero_grad_discards_no_sync_gradients() -> None:
    assert max(run_on_ranks(_replicate_zero_grad_after_no_sync, 2)) < 1e-6
