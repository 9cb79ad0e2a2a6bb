"""`fully_shard` with tied parameters and with frozen parameters mixed within modules.

Training cases run on 2 gloo ranks and are compared step by step with a single-process
reference (`_training.train_step`: loss, every gradient, every parameter).

Tied weights whose users get different API calls are refused with a clear error.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import fake_process_group, run_on_ranks
from _models import TinyTransformer
from _training import STEPS, TIMEOUT, lm_steps, mse, sgd, shard_transformer, train_step, xy
from torch.distributed.tensor import DTensor

from composable import fully_shard

# ----------------------------------------------------------------------------- tied parameters


def _tied(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    shard_transformer(model)
    # The tied pair is one sharded parameter in the root's group, registered under both names.
    assert model.tok.weight is model.head.weight and isinstance(model.tok.weight, DTensor)
    assert fully_shard.state(model).param_names == ["tok.weight", "pos.weight", "norm.weight", "norm.bias"]
    losses = lm_steps(model, ref, rank, world_size, range(STEPS), "tied")
    assert losses[-1] < losses[0]
    assert model.tok.weight is model.head.weight  # still tied after training


def test_tied_parameters() -> None:
    run_on_ranks(_tied, 2, timeout=TIMEOUT)


def test_tied_parameter_across_groups_is_refused_clearly() -> None:
    """A tied weight whose users get different API calls would silently split into two
    independently trained copies; the second call refuses instead, naming the parameter."""
    with fake_process_group(2):
        model = TinyTransformer()
        fully_shard(model.head)  # manages the tied weight; model.tok still holds the original
        with pytest.raises(RuntimeError, match=r"Cannot apply fully_shard.*'tok\.weight' is shared \(tied\)"):
            fully_shard(model)
        other = TinyTransformer()
        with pytest.raises(RuntimeError, match=r"shared \(tied\)"):
            fully_shard(other, policy={nn.Embedding, nn.Linear})


# ----------------------------------------------------------------------------- frozen parameters


def _frozen_model() -> nn.Sequential:
    """Frozen and trainable parameters mixed inside modules, and one wholly frozen module."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4), nn.Tanh(), nn.Linear(4, 3))
    model[0].weight.requires_grad_(False)  # mixed inside model[0]: bias trains
    model[2].bias.requires_grad_(False)  # mixed inside the root group
    model[4].requires_grad_(False)  # a whole group frozen
    return model


FROZEN = ("0.weight", "2.bias", "4.weight", "4.bias")


def _frozen(rank: int, world_size: int) -> None:
    model = _frozen_model()
    ref = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model[4])
    fully_shard(model)
    initial = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.requires_grad == (name not in FROZEN), name
    opt, ref_opt = sgd(model), sgd(ref)
    for step in range(STEPS):
        train_step(
            model, ref, opt, ref_opt, mse, xy(step, world_size, rank), xy(step, world_size, None), f"frozen step {step}"
        )
        for name, p in model.named_parameters():
            if name in FROZEN:
                assert p.grad is None and not p.requires_grad, name
                assert torch.equal(p.full_tensor(), initial[name]), f"frozen {name} changed"
            else:
                assert not torch.equal(p.full_tensor(), initial[name]), f"trainable {name} did not change"


def test_frozen_parameters_mixed_within_modules() -> None:
    run_on_ranks(_frozen, 2, timeout=TIMEOUT)
