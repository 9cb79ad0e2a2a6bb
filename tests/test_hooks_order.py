"""User forward hooks see what the forward sees.

A user's forward pre-hook or forward hook on a module, registered before or after
`fully_shard`/`replicate` was applied to it, sees the unsharded parameters (plain tensors,
not DTensors) in `param_dtype`, and pre-hooks see the cast inputs. `checkpoint`'s pre-hook
stays the very first whatever the order the APIs were applied in (it captures the raw inputs
and everything after it is recomputed identically); results are the same in every order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks
from torch.distributed.tensor import DTensor

from composable import MixedPrecisionPolicy, checkpoint, fully_shard, replicate

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _seen(module: nn.Module, x: torch.Tensor | None) -> tuple:
    w = module.weight
    return (isinstance(w, DTensor), w.dtype, tuple(w.shape), None if x is None else x.dtype)


def _hooks_see_the_forward(rank: int, world_size: int, api_name: str, ckpt: str) -> dict:
    api = {"fully_shard": fully_shard, "replicate": replicate}[api_name]
    model = _model()
    target = model[0]
    seen: dict[str, tuple] = {}

    def hook(tag: str, pre: bool):  # type: ignore[no-untyped-def]
        if pre:
            return lambda mod, args: seen.__setitem__(tag, _seen(mod, args[0]))
        return lambda mod, args, out: seen.__setitem__(tag, _seen(mod, None))

    target.register_forward_pre_hook(hook("pre-before", True))
    target.register_forward_hook(hook("post-before", False))
    if ckpt == "before":
        checkpoint(target)
    api(target, mp_policy=BF16)
    if ckpt == "after":
        checkpoint(target)
    api(model, mp_policy=BF16)
    target.register_forward_pre_hook(hook("pre-after", True))
    target.register_forward_hook(hook("post-after", False))
    if ckpt != "none":  # checkpoint's pre-hook first, then the API's, then the user's
        state = api.state(target)
        hooks = list(target._forward_pre_hooks.values())
        assert hooks[1] == state._pre_forward and hooks[0] != state._pre_forward, hooks
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    model(x).float().sum().backward()
    unsharded = (False, torch.bfloat16, (6, 4))
    for tag in ("pre-before", "pre-after"):
        assert seen[tag] == (*unsharded, torch.bfloat16), (tag, seen[tag])
    for tag in ("post-before", "post-after"):
        assert seen[tag] == (*unsharded, None), (tag, seen[tag])
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("ckpt", ["none", "before", "after"], ids=lambda c: f"checkpoint-{c}")
@pytest.mark.parametrize("api_name", ["fully_shard", "replicate"])
def test_user_hooks_see_unsharded_params_and_cast_inputs(api_name: str, ckpt: str) -> None:
    run_on_ranks(_hooks_see_the_forward, 2, api_name, ckpt)


def test_checkpoint_order_does_not_change_results() -> None:
    grads = [run_on_ranks(_hooks_see_the_forward, 2, "fully_shard", ckpt)[0] for ckpt in ("none", "before", "after")]
    assert_close_tensors(grads[1], grads[0], exact=True)
    assert_close_tensors(grads[2], grads[0], exact=True)
