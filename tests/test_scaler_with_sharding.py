"""ShardedGradScaler driving real sharded training: fully_shard + scaler against replicate +
scaler on the same fp16-compute model and data. Both must skip the same (overflowing) steps,
end with the same scale, and take the same optimizer steps."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks
from _models import Block, TinyTransformer, batch_for, lm_loss

from composable import MixedPrecisionPolicy, ShardedGradScaler, fully_shard, replicate

FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


def _train(model: nn.Module, rank: int, world_size: int, steps: int) -> tuple[list[float], list[bool], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # A scale this large overflows fp16 gradients: the first steps are skipped and backed off
    # (by 1/16 each) until the gradients fit; growth_interval=2 then grows it again.
    scaler = ShardedGradScaler(init_scale=2.0**40, backoff_factor=2.0**-4, growth_interval=2)
    losses, skipped = [], []
    for step in range(steps):
        loss = lm_loss(model, batch_for(step, world_size, rank))
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)  # AdamW.step returns None whether or not it ran: read the backoff instead
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        opt.zero_grad()
        losses.append(loss.item())
    return losses, skipped, scaler.get_scale()


def _sharded_vs_replicated(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    sharded = TinyTransformer()
    replicated = copy.deepcopy(sharded)
    fully_shard(sharded, policy={Block}, mp_policy=FP16)
    replicate(replicated, mp_policy=FP16)
    ours = _train(sharded, rank, world_size, steps=8)
    theirs = _train(replicated, rank, world_size, steps=8)
    assert ours[1] == theirs[1], f"skipped steps differ: {ours[1]} vs {theirs[1]}"
    assert ours[2] == theirs[2], f"scales differ: {ours[2]} vs {theirs[2]}"
    assert any(ours[1]) and not all(ours[1]), f"the test must skip some steps and take others: {ours[1]}"
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(theirs[0]), rtol=2e-3, atol=2e-3)
    for (name, p), q in zip(sharded.named_parameters(), replicated.parameters()):
        assert_close_tensors(p, q, rtol=2e-3, atol=2e-3, msg=f"parameter {name}")
    return {"skipped": ours[1], "scale": ours[2]}


def test_fully_shard_with_scaler_matches_replicate_with_scaler() -> None:
    results = run_on_ranks(_sharded_vs_replicated, 2)
    assert results[0] == results[1], "ranks disagree on skipped steps or the scale"
