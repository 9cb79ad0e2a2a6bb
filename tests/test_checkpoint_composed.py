"""checkpoint composed with fully_shard and replicate (world size 2, different data per rank).

Every configuration is checked step by step against the plain model, which computes each
rank's loss under the same dropout seed and averages the gradients: losses and parameters agree
bit for bit, with `zero_grad(set_to_none=True)` and `False`. Mixed precision additionally
records the dtypes each linear sees in the original and in the recomputed forward. The models
are test_checkpoint.py's.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks, step_and_match
from test_checkpoint import BIG, DIM, HIDDEN, STEPS, Net, _saved_bytes, clear_logs, data, full_params, logs, loss_fn

from composable import MixedPrecisionPolicy, ShardingStrategy, checkpoint, fully_shard, replicate

# ----------------------------------------------------------------------------- composed


def _cfg_seq_policy(m: Net) -> None:
    checkpoint(m.u1.seq)
    fully_shard(m.u1.seq, policy={nn.Linear})
    fully_shard(m)


def _cfg_inside_sharded(m: Net) -> None:
    fully_shard(m.u1)
    checkpoint(m.u1.seq)
    fully_shard(m)


def _cfg_sharded_root(m: Net) -> None:
    checkpoint(m.u1.seq)
    fully_shard(m)


def _cfg_sharded_root_no_shard(m: Net) -> None:
    checkpoint(m.u1.seq)
    fully_shard(m, strategy=ShardingStrategy.NO_SHARD)


def _cfg_same_ckpt_first(m: Net) -> None:
    checkpoint(m.u1)
    fully_shard(m.u1)
    checkpoint(m.u2)
    fully_shard(m.u2, strategy=ShardingStrategy.SHARD_GRAD_OP)
    fully_shard(m)


def _cfg_same_fsdp_first(m: Net) -> None:
    fully_shard(m.u1)
    checkpoint(m.u1)
    fully_shard(m.u2, strategy=ShardingStrategy.NO_SHARD)
    checkpoint(m.u2)
    fully_shard(m)


def _cfg_checkpointed_root(m: Net) -> None:
    fully_shard(m.u1)
    checkpoint(m)
    fully_shard(m)


def _cfg_replicate_same_ckpt_first(m: Net) -> None:
    checkpoint(m.u1)
    replicate(m.u1)
    fully_shard(m)


def _cfg_replicate_same_replicate_first(m: Net) -> None:
    replicate(m.u1)
    checkpoint(m.u1)
    fully_shard(m)


def _cfg_replicate_root(m: Net) -> None:
    checkpoint(m.u1.seq)
    fully_shard(m.u2)
    checkpoint(m.u2)
    replicate(m)


CONFIGS: dict[str, Callable[[Net], None]] = {
    "checkpoint(u1.seq); fully_shard(u1.seq, policy); fully_shard(root)": _cfg_seq_policy,
    "fully_shard(u1); checkpoint(u1.seq); fully_shard(root)": _cfg_inside_sharded,
    "checkpoint(u1.seq); fully_shard(root)": _cfg_sharded_root,
    "checkpoint(u1.seq); fully_shard(root, NO_SHARD)": _cfg_sharded_root_no_shard,
    "checkpoint(u); fully_shard(u)": _cfg_same_ckpt_first,
    "fully_shard(u); checkpoint(u)": _cfg_same_fsdp_first,
    "fully_shard(u1); checkpoint(root); fully_shard(root)": _cfg_checkpointed_root,
    "checkpoint(u1); replicate(u1); fully_shard(root)": _cfg_replicate_same_ckpt_first,
    "replicate(u1); checkpoint(u1); fully_shard(root)": _cfg_replicate_same_replicate_first,
    "checkpoint(u1.seq); fully_shard(u2); checkpoint(u2); replicate(root)": _cfg_replicate_root,
}


def _reference_step(ref: nn.Module, step: int, world_size: int) -> list[torch.Tensor]:
    """Every rank's loss under that rank's dropout seed; gradients averaged over ranks."""
    losses = []
    for r in range(world_size):
        torch.manual_seed(10 * step + r)
        loss = loss_fn(ref, data(step, r))
        loss.backward()
        losses.append(loss.detach())
    for p in ref.parameters():
        p.grad.div_(world_size)
    return losses


def _composed_parity(rank: int, world_size: int, name: str, set_to_none: bool) -> None:
    apply = CONFIGS[name]
    torch.manual_seed(7)
    model = Net()
    ref = copy.deepcopy(model)
    apply(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for step in range(STEPS):
        clear_logs(model)
        torch.manual_seed(10 * step + rank)
        loss = loss_fn(model, data(step, rank))
        loss.backward()
        ref_losses = _reference_step(ref, step, world_size)
        step_and_match(model, ref, opts, f"step {step}", losses=(loss, ref_losses[rank]), set_to_none=set_to_none)
        if not set_to_none:
            assert all(p.grad is not None for p in model.parameters())
        # Linears inside a checkpointed module ran twice (the second time in backward), the
        # others once.
        ckpt = [n for n, m in model.named_modules() if checkpoint.state(m) is not None]
        for mod, seen in logs(model).items():
            inside = any(p == "" or mod == p or mod.startswith(p + ".") for p in ckpt)
            assert [c[2] for c in seen] == ([False, True] if inside else [False]), (mod, seen)


# Which zero_grad each composition runs with (a covering set of config x set_to_none):
# set_to_none decides how the APIs' post-backward hooks find the gradients (None, or zeros to
# accumulate into), not how checkpoint recomputes, so every API and strategy (fully_shard's
# FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, replicate) runs with both, each config with one.
_SET_TO_NONE = {
    "checkpoint(u1.seq); fully_shard(u1.seq, policy); fully_shard(root)": [True],
    "fully_shard(u1); checkpoint(u1.seq); fully_shard(root)": [False],
    "checkpoint(u1.seq); fully_shard(root)": [True],
    "checkpoint(u1.seq); fully_shard(root, NO_SHARD)": [True],
    "checkpoint(u); fully_shard(u)": [True, False],  # SHARD_GRAD_OP's only config
    "fully_shard(u); checkpoint(u)": [False],
    "fully_shard(u1); checkpoint(root); fully_shard(root)": [True],
    "checkpoint(u1); replicate(u1); fully_shard(root)": [False],
    "replicate(u1); checkpoint(u1); fully_shard(root)": [True],
    "checkpoint(u1.seq); fully_shard(u2); checkpoint(u2); replicate(root)": [False],
}
assert list(_SET_TO_NONE) == list(CONFIGS)


@pytest.mark.parametrize(
    "name,set_to_none",
    [
        pytest.param(name, none, id=f"{name}-{'none' if none else 'zeros'}")
        for name, values in _SET_TO_NONE.items()
        for none in values
    ],
)
def test_composed_with_fully_shard_and_replicate(name: str, set_to_none: bool) -> None:
    run_on_ranks(_composed_parity, 2, name=name, set_to_none=set_to_none)


def _saved_bytes_composed(rank: int, world_size: int) -> tuple[int, int]:
    """Saved bytes of one forward with u1 sharded, without and with checkpoint(u1)."""
    out = []
    for ckpt in (False, True):
        torch.manual_seed(8)
        model = Net(dropout=0.0)
        fully_shard(model.u1)
        if ckpt:
            checkpoint(model.u1)
        fully_shard(model)
        x = torch.randn(BIG, DIM)
        out.append(_saved_bytes(model, x))
    return out[0], out[1]


def test_activations_not_saved_under_fully_shard() -> None:
    plain, ckpt = run_on_ranks(_saved_bytes_composed, 2)[0]
    # u1 saves at least its hidden activations (BIG x HIDDEN floats, several times) without.
    assert plain - ckpt >= 2 * BIG * HIDDEN * 4, (plain, ckpt)


# -- mixed precision ------------------------------------------------------------------------

FP16_CHILD = MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32, cast_forward_inputs=True)
FP32_ROOT = MixedPrecisionPolicy(param_dtype=torch.float32)


def _apply_mp(m: Net, where: str | None) -> None:
    fully_shard(m.u2, mp_policy=FP16_CHILD)
    if where is not None:
        checkpoint(m.get_submodule(where))
    fully_shard(m.u1)
    fully_shard(m, mp_policy=FP32_ROOT)


def _mixed_precision(rank: int, world_size: int, where: str, set_to_none: bool) -> None:
    torch.manual_seed(9)
    model = Net()
    plain = copy.deepcopy(model)  # fp32 throughout: loose parity
    same = copy.deepcopy(model)  # the same fp16 child without checkpoint: exact parity
    _apply_mp(model, where)
    _apply_mp(same, None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, same, plain)]
    for step in range(STEPS):
        clear_logs(model)
        torch.manual_seed(10 * step + rank)
        loss = loss_fn(model, data(step, rank))
        loss.backward()
        torch.manual_seed(10 * step + rank)
        same_loss = loss_fn(same, data(step, rank))
        same_loss.backward()
        plain_losses = _reference_step(plain, step, world_size)
        torch.testing.assert_close(loss.detach(), plain_losses[rank], atol=5e-3, rtol=5e-3)
        # Bit for bit against the same model without checkpoint (every optimizer steps).
        step_and_match(model, same, opts, f"step {step}", losses=(loss, same_loss), set_to_none=set_to_none)
        assert_close_tensors(full_params(model), full_params(plain), atol=5e-3, rtol=5e-3, msg=f"step {step}")
        for n, p in model.named_parameters():  # sharded parameters keep their own dtype
            assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32), n
        # What each linear saw: u2's in fp16 (inputs cast by u2's policy), in the original
        # forward and again in the recomputed one; everything else fp32.
        fp16, fp32 = (torch.float16, torch.float16), (torch.float32, torch.float32)
        for mod, seen in logs(model).items():
            recomputing = mod.startswith(where + ".") or mod == where
            want = fp16 if mod.startswith("u2.") else fp32
            assert seen == [(*want, False)] + ([(*want, True)] if recomputing else []), (mod, seen)


# A covering set: each place of the checkpoint, and each zero_grad mode, once.
@pytest.mark.parametrize("where,set_to_none", [("u2", False), ("u2.l", True)], ids=["u2-zeros", "u2.l-none"])
def test_mixed_precision_recompute_sees_cast_inputs(where: str, set_to_none: bool) -> None:
    run_on_ranks(_mixed_precision, 2, where=where, set_to_none=set_to_none)
