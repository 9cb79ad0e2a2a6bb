"""`fully_shard` under forwards other than one forward per backward.

A module run twice in one forward and a whole model called twice before one backward (with
and without resharding after forward), no_grad / eval / inference_mode forwards between
training steps, and parameters unused in some steps (in a group with used ones, in a group
of their own, and never used).

Training cases run on 2 gloo ranks and are compared step by step with a single-process
reference (`_training.train_step`: loss, every gradient, every parameter).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from _training import (
    STEPS,
    TIMEOUT,
    TOL,
    assert_sharded_registered,
    lm_steps,
    mse,
    registered,
    sgd,
    shard_transformer,
    train_step,
    xy,
)
from torch.distributed.tensor import DTensor

from composable import fully_shard

# ----------------------------------------------------------------------------- several forwards, one backward


class _UsesTwice(nn.Module):
    """`inner` runs twice per forward (weight sharing across depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.inner = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.inner(h))
        h = torch.tanh(self.inner(h))
        return self.out(h)


def _module_used_twice(rank: int, world_size: int, reshard: bool) -> None:
    model = _UsesTwice()
    ref = copy.deepcopy(model)
    fully_shard(model.inner, reshard_after_forward=reshard)
    fully_shard(model.out, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt, ref_opt = sgd(model), sgd(ref)
    for step in range(STEPS):
        train_step(
            model, ref, opt, ref_opt, mse, xy(step, world_size, rank), xy(step, world_size, None), f"twice step {step}"
        )


def _two_model_calls_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    # Two forwards of the whole model (different halves of the sequence), one backward.
    return lm_loss(model, tokens[:, :5]) + 0.5 * lm_loss(model, tokens[:, 3:])


def _model_called_twice(rank: int, world_size: int, reshard: bool) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    shard_transformer(model, reshard_after_forward=reshard)
    opt, ref_opt = sgd(model), sgd(ref)
    for step in range(STEPS):
        local, full = batch_for(step, world_size, rank), batch_for(step, world_size, None)
        train_step(model, ref, opt, ref_opt, _two_model_calls_loss, local, full, f"called twice step {step}")
    assert all(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_module_used_twice_in_one_forward(reshard: bool) -> None:
    run_on_ranks(_module_used_twice, 2, reshard, timeout=TIMEOUT)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_model_called_twice_before_backward(reshard: bool) -> None:
    run_on_ranks(_model_called_twice, 2, reshard, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- no_grad / eval forwards


def _no_grad_and_eval(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    shard_transformer(model)
    sharded = registered(model)
    opt, ref_opt = sgd(model), sgd(ref)
    lm_steps(model, ref, rank, world_size, range(0, 1), "before", opt, ref_opt)
    tokens = batch_for(7, world_size, None)[:, :-1]  # every rank evaluates the same batch

    with torch.no_grad():
        out = model(tokens)
    assert not out.requires_grad
    assert_close_tensors(out, ref(tokens).detach(), **TOL, msg="no_grad output")
    assert_sharded_registered(model, sharded, "after no_grad forward")

    model.eval()
    ref.eval()
    with torch.no_grad():
        assert_close_tensors(model(tokens), ref(tokens), **TOL, msg="eval+no_grad output")
    assert_sharded_registered(model, sharded, "after eval+no_grad forward")
    with torch.inference_mode():
        assert_close_tensors(model(tokens), ref(tokens), **TOL, msg="inference_mode output")
    assert_sharded_registered(model, sharded, "after inference_mode forward")
    # eval with autograd on, no backward (e.g. a validation loss computed without no_grad).
    assert_close_tensors(model(tokens).detach(), ref(tokens).detach(), **TOL, msg="eval output with grad")
    assert_sharded_registered(model, sharded, "after eval forward with grad enabled")
    model.train()
    ref.train()

    lm_steps(model, ref, rank, world_size, range(1, STEPS), "after", opt, ref_opt)
    assert_sharded_registered(model, sharded, "after training")


def test_no_grad_and_eval_forward_between_steps() -> None:
    run_on_ranks(_no_grad_and_eval, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- unused parameters


class _Branchy(nn.Module):
    """`b` (in the root group, next to used parameters) and `extra` (its own group) are only
    used on some steps; `never` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(5, 4)
        self.extra = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.never = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: bool, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x) + (self.b(x) if use_b else 0))
        if use_extra:
            h = self.extra(h)
        return self.out(h)


def _branchy_loss(step: int) -> Callable[[nn.Module, Any], torch.Tensor]:
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x, use_b=step % 2 == 1, use_extra=step >= 1 and step != 2), y)

    return loss


def _unused(rank: int, world_size: int) -> None:
    model = _Branchy()
    ref = copy.deepcopy(model)
    fully_shard(model.extra)
    fully_shard(model.never)
    fully_shard(model)
    opt, ref_opt = sgd(model), sgd(ref)
    for step in range(4):  # b: unused, used, unused, used; extra: unused, used, unused, used
        train_step(
            model,
            ref,
            opt,
            ref_opt,
            _branchy_loss(step),
            xy(step, world_size, rank),
            xy(step, world_size, None),
            f"unused step {step}",
        )
        assert model.never.weight.grad is None and model.never.bias.grad is None
        if step % 2 == 0:
            assert model.b.weight.grad is None and model.extra[0].weight.grad is None
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_parameters_unused_in_a_step() -> None:
    run_on_ranks(_unused, 2, timeout=TIMEOUT)
