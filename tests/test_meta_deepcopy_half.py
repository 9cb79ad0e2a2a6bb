"""A `fully_shard` model built on the meta device, deep-copied, or converted with `.half()`.

Meta-device construction + `to_empty` + `reset_parameters`, `copy.deepcopy` of a sharded
model (an independent copy that trains on its own), and `model.half()` after sharding
(fp16 DTensors, converted in place).

Training cases run on 2 gloo ranks and are compared step by step with a single-process
reference (`_training.train_step`: loss, every gradient, every parameter).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _harness import assert_close_tensors, requires_gpus, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from _training import (
    STEPS,
    TIMEOUT,
    assert_sharded_registered,
    lm_steps,
    rank_mean,
    reference_of,
    registered,
    sgd,
    shard_transformer,
)
from torch.distributed.tensor import DTensor, Shard

from composable import ShardingStrategy, fully_shard, replicate

# ----------------------------------------------------------------------------- meta-device construction


def _meta_init(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        model = TinyTransformer()
    shard_transformer(model)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "meta", name
    model.to_empty(device="cpu")
    torch.manual_seed(rank + 1)  # whatever each rank draws: the reference takes the result
    for sub in model.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu" and p.placements == (Shard(0),), name

    # The reference starts from the same full state, read through the sharded parameters.
    ref = TinyTransformer()
    with torch.no_grad():
        for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            full = p.full_tensor()
            assert torch.isfinite(full).all() and full.abs().sum() > 0 or name.endswith("bias"), (
                f"{name} not initialised"
            )
            rp.copy_(full)
    assert torch.equal(ref.norm.weight, torch.ones(10)) and torch.equal(ref.layers[0].norm1.bias, torch.zeros(10))
    assert ref.tok.weight is ref.head.weight and model.tok.weight is model.head.weight
    lm_steps(model, ref, rank, world_size, range(STEPS), "meta")


def test_meta_device_construction() -> None:
    run_on_ranks(_meta_init, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- deepcopy


def _deepcopy(rank: int, world_size: int, api: str) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    if api == "replicate":
        replicate(model)
    else:
        shard_transformer(model, **({"strategy": ShardingStrategy.NO_SHARD} if api == "no_shard" else {}))
    state_of = replicate.state if api == "replicate" else fully_shard.state
    opt, ref_opt = sgd(model), sgd(ref)
    lm_steps(model, ref, rank, world_size, range(0, 1), "original", opt, ref_opt)

    clone = copy.deepcopy(model)
    ref_clone = copy.deepcopy(ref)
    assert type(clone) is TinyTransformer
    for sub, sub_clone in zip(model.modules(), clone.modules(), strict=True):
        state, state_clone = state_of(sub), state_of(sub_clone)
        assert (state is None) == (state_clone is None)
        if state is not None:
            assert state_clone is not state and state_clone.module is sub_clone
            assert state_clone.param_names == state.param_names
    for (name, p), (_, q) in zip(model.named_parameters(), clone.named_parameters(), strict=True):
        assert isinstance(q, DTensor) and q is not p and q.placements == p.placements, name
        assert q._local_tensor.untyped_storage().data_ptr() != p._local_tensor.untyped_storage().data_ptr(), name
    assert clone.tok.weight is clone.head.weight
    snapshot = {n: p.full_tensor().clone() for n, p in model.named_parameters()}

    # The copy trains on its own and matches a reference copied at the same point ...
    lm_steps(clone, ref_clone, rank, world_size, range(1, STEPS + 1), "clone")
    # ... without touching the original, which then trains on and still matches its reference.
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), snapshot[name]), f"training the copy changed the original's {name}"
    lm_steps(model, ref, rank, world_size, range(1, STEPS), "original again", opt, ref_opt)
    if api == "replicate":  # the copy's gradients launch its own buckets (hooks are not copied)
        for mp in replicate.state(clone).groups[0].params:
            assert mp.hooked_param is mp.unsharded_param and mp.unsharded_param._post_accumulate_grad_hooks, mp.fqn


@pytest.mark.parametrize("api", ["fully_shard", "no_shard", "replicate"])
def test_deepcopy_of_a_sharded_model(api: str) -> None:
    """Replicated groups used to fail here: the copy's unsharded parameters were clones of the
    original's views of the shard, so the copy computed with its weights of the copy time."""
    run_on_ranks(_deepcopy, 2, api, timeout=TIMEOUT)


def _deepcopy_on_cuda(rank: int, world_size: int, api: str) -> None:
    torch.cuda.set_device(rank)
    model = TinyTransformer().cuda()
    if api == "replicate":
        replicate(model)
    else:
        shard_transformer(model)
    state_of = replicate.state if api == "replicate" else fully_shard.state
    lm_loss(model, batch_for(0, world_size, rank).cuda()).backward()  # streams in use
    clone = copy.deepcopy(model)  # used to fail: "cannot pickle 'Stream' object"
    assert state_of(clone).groups[0].streams is state_of(model).groups[0].streams  # one set per device
    for (name, p), q in zip(model.named_parameters(), clone.parameters(), strict=True):
        assert torch.equal(p._local_tensor, q._local_tensor), name
        assert q._local_tensor.untyped_storage().data_ptr() != p._local_tensor.untyped_storage().data_ptr(), name


@requires_gpus(2)
@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_deepcopy_of_a_model_sharded_on_gpus(api: str) -> None:
    """CUDA groups hold the device's communication streams, which cannot be copied: the copy
    shares them."""
    run_on_ranks(_deepcopy_on_cuda, 2, api, backend="nccl", timeout=TIMEOUT)


# ----------------------------------------------------------------------------- model.half() after fully_shard


def _half_after(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    shard_transformer(model)
    sharded = registered(model)
    assert model.half() is model
    assert_sharded_registered(model, sharded, "after half()")  # converted in place, same objects
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.dtype == torch.float16 and p._local_tensor.dtype == torch.float16, name
    ref = reference_of(model, {n: p.full_tensor() for n, p in model.named_parameters()})
    assert ref.tok.weight.dtype == torch.float16
    opt, ref_opt = sgd(model), sgd(ref)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, batch_for(step, world_size, rank))
        loss.backward()
        ref_loss = lm_loss(ref, batch_for(step, world_size, None))
        ref_loss.backward()
        losses.append(ref_loss.item())
        # fp16 compute: compare at fp16 precision.
        assert_close_tensors(rank_mean(loss), ref_loss.detach(), rtol=2e-3, atol=2e-3, msg=f"half loss {step}")
        for name, p in model.named_parameters():
            assert isinstance(p.grad, DTensor) and p.grad.dtype == torch.float16, name
            assert_close_tensors(
                p.grad.float(),
                dict(ref.named_parameters())[name].grad.float(),
                rtol=2e-2,
                atol=2e-3,
                msg=f"half grad {name} {step}",
            )
        opt.step()
        ref_opt.step()
        for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            assert_close_tensors(p.float(), rp.float(), rtol=1e-2, atol=2e-3, msg=f"half param {name} {step}")
    assert losses[-1] < losses[0]


def test_half_after_fully_shard_trains() -> None:
    run_on_ranks(_half_after, 2, timeout=TIMEOUT)
