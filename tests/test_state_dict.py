"""State dicts of `fully_shard` models; DCP checkpoints are in test_dcp.py.

- Sharded state dicts: `model.state_dict()` holds the managed parameters as DTensors
  (`Shard(0)`; `NO_SHARD` gives `Replicate()`; HSDP `(Replicate(), Shard(0))`), buffers stay
  plain tensors, FQNs are unchanged; `load_state_dict` writes into the very storage forward
  gathers from (the loss after loading equals the reference's bit for bit).
- Mixed precision (bf16 compute): the state dict holds the fp32 sharded parameters.
- `model.half()` after `fully_shard`: fp16 DTensors in the state dict, DCP round trip.
- Full state dicts (`full_state_dict=True, cpu_offload=True`) of model and optimizer equal
  the single-process reference's, and load back with `broadcast_from_rank0=True` where only
  rank 0 holds the values, into a freshly sharded model or one built on meta + `to_empty`.

The model and helpers (`TiedNet`, `shard_layers`, `train`, ...) are in `_training.py`.
Every comparison runs on every rank: `full_tensor()` is a collective.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _harness import assert_close_tensors, requires_gpus, run_on_ranks
from _models import batch_for, lm_loss
from _training import (
    FULL,
    TOL,
    TiedNet,
    adamw,
    assert_same_params,
    expected_placements,
    full_state,
    param_groups,
    shard_layers,
    tied_net,
    train,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from composable import MixedPrecisionPolicy, fully_shard, replicate

# ----------------------------------------------------------------------------- sharded state dicts


def _sharded_state_dict_roundtrip(rank: int, world: int, layout: str) -> None:
    ref = tied_net(0)
    model = shard_layers(copy.deepcopy(ref), layout)
    sd = model.state_dict()
    ref_sd = ref.state_dict()
    assert list(sd) == list(ref_sd), "FQNs must be unchanged (tied head.weight included)"
    for key, value in sd.items():
        if key == "scale":  # buffers are never sharded
            assert type(value) is torch.Tensor and torch.equal(value, ref_sd[key]), key
            continue
        assert isinstance(value, DTensor), f"{key}: {type(value).__name__}"
        assert value.placements == expected_placements(layout), f"{key}: {value.placements}"
        assert value.device_mesh == model.tok.weight.device_mesh
        assert_close_tensors(value, ref_sd[key], exact=True, msg=key)
    assert sd["head.weight"].to_local().data_ptr() == sd["tok.weight"].to_local().data_ptr(), "tied: one storage"

    snapshot = {k: v.detach().clone() for k, v in sd.items()}  # the state dict aliases the params
    params_before = [id(p) for p in model.parameters()]
    train(model, adamw(model), range(2), world, rank)
    assert not torch.equal(model.tok.weight.full_tensor(), ref.tok.weight), "training changed nothing"

    result = model.load_state_dict(snapshot)
    assert not result.missing_keys and not result.unexpected_keys, result
    assert [id(p) for p in model.parameters()] == params_before, "load_state_dict must copy in place"
    assert model.tok.weight.placements == expected_placements(layout)
    assert_same_params(model, ref, "after load_state_dict")
    # Forward must compute with the loaded values: the same parameters on the same (full)
    # batch give the very same loss as the single-process reference.
    tokens = batch_for(7, world, None)
    assert torch.equal(lm_loss(model, tokens), lm_loss(ref, tokens))


@pytest.mark.parametrize("layout", ["fsdp", "no_shard"])
def test_sharded_state_dict_and_load_state_dict(layout: str) -> None:
    run_on_ranks(_sharded_state_dict_roundtrip, 2, layout)


def test_hsdp_sharded_state_dict() -> None:
    run_on_ranks(_sharded_state_dict_roundtrip, 4, "hsdp")


def _mixed_precision_state_dict(rank: int, world: int) -> None:
    """bf16 compute keeps fp32 sharded parameters: the state dict holds those, not bf16."""
    model = tied_net(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    train(model, adamw(model), range(1), world, rank)
    sd = model.state_dict()
    for key, value in sd.items():
        assert value.dtype == torch.float32, f"{key}: {value.dtype}"
        if key != "scale":
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), key
    assert_same_params(model, full_state(sd), "state dict of a bf16-compute model")
    full = get_model_state_dict(model, options=FULL)
    assert rank != 0 or all(v.dtype == torch.float32 for v in full.values())


def test_mixed_precision_state_dict_is_fp32() -> None:
    run_on_ranks(_mixed_precision_state_dict, 2)


# ----------------------------------------------------------------------------- half precision


def _half_state_dict(rank: int, world: int, path: str) -> None:
    ref = tied_net(0).half()
    model = shard_layers(tied_net(0), "fsdp").half()  # .half() after fully_shard
    sd = model.state_dict()
    for key, value in sd.items():
        assert value.dtype == torch.float16, f"{key}: {value.dtype}"
        if key != "scale":
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), key
    assert_close_tensors(sd, ref.state_dict(), exact=True, msg="half state dict")
    dcp.save({"model": sd}, checkpoint_id=path)

    fresh = shard_layers(tied_net(1), "fsdp").half()
    msd = get_model_state_dict(fresh)
    dcp.load({"model": msd}, checkpoint_id=path)
    set_model_state_dict(fresh, msd)
    for name, p in fresh.named_parameters():
        assert p.dtype == torch.float16 and isinstance(p, DTensor), name
    assert_same_params(fresh, ref, "half model after DCP load")
    tokens = batch_for(0, world, None)
    assert torch.equal(lm_loss(fresh, tokens), lm_loss(ref, tokens))


def test_half_model_state_dict_and_dcp(tmp_path: Any) -> None:
    run_on_ranks(_half_state_dict, 2, str(tmp_path / "ckpt_half"))


# ----------------------------------------------------------------------------- full state dicts


def _full_state_dict_matches_reference(rank: int, world: int) -> None:
    ref = tied_net(0)
    model = shard_layers(copy.deepcopy(ref), "fsdp")
    ref_opt, opt = adamw(ref), adamw(model)
    train(ref, ref_opt, range(3), world, None)
    train(model, opt, range(3), world, rank)

    full = get_model_state_dict(model, options=FULL)
    full_osd = get_optimizer_state_dict(model, opt, options=FULL)
    if rank != 0:  # cpu_offload: only rank 0 keeps the gathered values
        assert full == {} and not full_osd.get("state"), (sorted(full), sorted(full_osd))
        return
    ref_sd = ref.state_dict()
    assert list(full) == list(ref_sd)
    for key, value in full.items():
        assert type(value) is torch.Tensor and value.device.type == "cpu", f"{key}: {type(value).__name__}"
    assert_close_tensors(full, ref_sd, **TOL, msg="full model state dict")
    ref_osd = get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(full_state_dict=True))
    assert set(full_osd["state"]) == set(ref_osd["state"])
    for fqn, state in full_osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(state[key]) is torch.Tensor, f"{fqn}.{key}: {type(state[key]).__name__}"
        assert_close_tensors(state, ref_osd["state"][fqn], **TOL, msg=f"optimizer state of {fqn}")
    assert param_groups(full_osd) == param_groups(ref_osd)


def test_full_state_dict_equals_reference() -> None:
    run_on_ranks(_full_state_dict_matches_reference, 2)


def _broadcast_from_rank0(rank: int, world: int, init: str) -> None:
    ref = tied_net(0)
    ref_opt = adamw(ref)
    train(ref, ref_opt, range(2), world, None)
    # Rank 0 alone holds the real values (as after `torch.load` of a consolidated file).
    # Copies: DCP may adopt the given tensors (the 0-d `step`s), and the reference's
    # optimizer must not share them with ours.
    full = copy.deepcopy(ref.state_dict()) if rank == 0 else {}
    full_osd = (
        copy.deepcopy(get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(full_state_dict=True)))
        if rank == 0
        else {}
    )

    if init == "cpu":
        model = shard_layers(tied_net(1), "fsdp")
    else:  # the usual way to build a large model: on meta, shard, materialise, load
        with torch.device("meta"):
            model = shard_layers(TiedNet(), "fsdp")
        model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    params_before = [id(p) for p in model.parameters()]
    set_model_state_dict(model, full, options=options)
    assert [id(p) for p in model.parameters()] == params_before, "loading must copy in place"
    opt = adamw(model)
    set_optimizer_state_dict(model, opt, full_osd, options=options)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device.type == "cpu", name
    assert model.head.weight is model.tok.weight
    assert_same_params(model, ref, "after broadcast_from_rank0")
    assert torch.equal(model.scale, ref.scale)
    # The optimizer state arrived too: both take the same next step.
    train(ref, ref_opt, range(2, 3), world, None)
    train(model, opt, range(2, 3), world, rank)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close_tensors(p, r, **TOL, msg=f"step after loading: {name}")


# (Loading into parameters still on meta makes DCP use `load_state_dict(assign=True)`, which
# unties tied parameters even without any sharding: materialise with `to_empty` first.)
@pytest.mark.parametrize("init", ["cpu", "meta_to_empty"])
def test_full_state_dict_broadcast_from_rank0(init: str) -> None:
    run_on_ranks(_broadcast_from_rank0, 2, init)


def _torch_save_roundtrip(rank: int, world: int, api: str, device: str) -> None:
    """`torch.save(model.state_dict())` and back: the values are DTensors over views of the
    flat sharded buffer at storage offsets, which torch (>= 2.10) could not pickle."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    model = tied_net(0).to(device)
    if api == "replicate":
        replicate(model)
    else:
        shard_layers(model, FULL)
    saved = model.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert list(loaded) == list(saved)
    for key, value in saved.items():
        assert type(loaded[key]) is type(value), key
        assert_close_tensors(loaded[key], value, exact=True, msg=key)
    copy.deepcopy(saved)  # the same wrappers deep-copy too
    model.load_state_dict(loaded)


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_torch_save_of_the_state_dict(api: str) -> None:
    run_on_ranks(_torch_save_roundtrip, 2, api, "cpu")


@requires_gpus(2)
@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_torch_save_of_the_state_dict_on_gpus(api: str) -> None:
    run_on_ranks(_torch_save_roundtrip, 2, api, "cuda", backend="nccl")
