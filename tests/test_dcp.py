"""`torch.distributed.checkpoint` (DCP) for `fully_shard` models.

- DCP `save`/`load` of model and optimizer through `get_state_dict`/`set_state_dict`, with the
  AdamW state (`step`, `exp_avg`, `exp_avg_sq`) present and sharded like the parameters.
- Resharding: a checkpoint saved at world size 4 loads at world size 2 and into HSDP (2x2).
- Resuming: 2 steps + save + fresh model/optimizer + load + 2 steps is bit-identical to
  4 uninterrupted steps (losses and parameters, `torch.equal`) on CPU.
- Tensor parallel x FSDP (2D (dp, tp) mesh, 4 ranks; even and uneven TP shards): sharded and
  full state dicts, DCP round trip with resumed training, the checkpoint loaded into plain 1D
  FSDP at world size 2, and a 1D checkpoint loaded back into TP x FSDP.

Checkpoints go to pytest's `tmp_path`, passed to the ranks as an argument (all ranks share the
file system). The model and helpers (`TiedNet`, `shard_layers`, `train`, ...) are in
`_training.py`. Every comparison runs on every rank: `full_tensor()` is a collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import test_tensor_parallel as tp  # the TP x FSDP model, plan and data
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks
from _models import NormMLPStack
from _training import (
    FULL,
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
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from composable import fully_shard

ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}


# ----------------------------------------------------------------------------- DCP save/load


def _dcp_model_and_optimizer(rank: int, world: int, path: str) -> None:
    model = shard_layers(tied_net(0), "fsdp")
    opt = adamw(model)
    train(model, opt, range(2), world, rank)
    msd, osd = get_state_dict(model, opt)
    # AdamW's state is present, keyed by FQN, sharded exactly like its parameter.
    assert set(osd["state"]) == {n for n, _ in model.named_parameters()}, sorted(osd["state"])
    for fqn, state in osd["state"].items():
        assert set(state) == ADAM_KEYS, f"{fqn}: {sorted(state)}"
        param = msd[fqn]
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor) and state[key].placements == param.placements, fqn
            assert state[key].to_local().shape == param.to_local().shape, fqn
        assert float(state["step"]) == 2.0
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    expected_model, expected_optim = full_state(msd), full_state(osd)

    fresh = shard_layers(tied_net(1), "fsdp")  # other initial values: loading must overwrite them all
    fresh_opt = adamw(fresh)
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd2, optim_state_dict=osd2)
    assert_same_params(fresh, expected_model, "after DCP load")
    loaded_model, loaded_optim = get_state_dict(fresh, fresh_opt)
    assert_close_tensors(full_state(loaded_optim)["state"], expected_optim["state"], exact=True, msg="optimizer state")
    assert param_groups(loaded_optim) == param_groups(expected_optim)

    # Both continue identically.
    a = train(model, opt, range(2, 3), world, rank)
    b = train(fresh, fresh_opt, range(2, 3), world, rank)
    assert torch.equal(a[0], b[0])
    assert_same_params(fresh, model, "one step after loading")


def test_dcp_save_load_model_and_optimizer(tmp_path: Any) -> None:
    run_on_ranks(_dcp_model_and_optimizer, 2, str(tmp_path / "ckpt"))


# ----------------------------------------------------------------------------- resharding


def _save_world4(rank: int, world: int, path: str) -> dict[str, Any]:
    model = shard_layers(tied_net(0), "fsdp")
    opt = adamw(model)
    train(model, opt, range(2), world, rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return {"model": full_state(msd), "optim": full_state(osd)}


def _load_resharded(rank: int, world: int, path: str, layout: str, expected: dict[str, Any]) -> None:
    model = shard_layers(tied_net(1), layout)
    opt = adamw(model)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for name, p in model.named_parameters():
        assert p.placements == expected_placements(layout), name
    assert_same_params(model, expected["model"], f"loaded into {layout} at world {world}")
    loaded = full_state(get_state_dict(model, opt)[1])
    assert_close_tensors(loaded["state"], expected["optim"]["state"], exact=True, msg="optimizer state")
    train(model, opt, range(2, 3), world, rank)  # and training goes on


def test_checkpoint_from_world_4_loads_at_world_2_and_into_hsdp(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt_w4")
    expected = run_on_ranks(_save_world4, 4, path)[0]
    run_on_ranks(_load_resharded, 2, path, "fsdp", expected)
    run_on_ranks(_load_resharded, 4, path, "hsdp", expected)


# ----------------------------------------------------------------------------- resume


def _resume_is_bit_exact(rank: int, world: int, path: str) -> None:
    steps = 4
    straight = shard_layers(tied_net(0), "fsdp")
    straight_opt = adamw(straight)
    expected = train(straight, straight_opt, range(steps), world, rank)

    first = shard_layers(tied_net(0), "fsdp")
    first_opt = adamw(first)
    losses = train(first, first_opt, range(steps // 2), world, rank)
    msd, osd = get_state_dict(first, first_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    del first, first_opt, msd, osd

    resumed = shard_layers(tied_net(1), "fsdp")
    resumed_opt = adamw(resumed)
    msd, osd = get_state_dict(resumed, resumed_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(resumed, resumed_opt, model_state_dict=msd, optim_state_dict=osd)
    losses += train(resumed, resumed_opt, range(steps // 2, steps), world, rank)
    for step, (a, b) in enumerate(zip(losses, expected)):
        assert torch.equal(a, b), f"step {step}: resumed loss {a.item()!r} != {b.item()!r}"
    assert_same_params(resumed, straight, "after resumed training")


def test_resume_from_checkpoint_is_bit_exact(tmp_path: Any) -> None:
    run_on_ranks(_resume_is_bit_exact, 2, str(tmp_path / "ckpt"))


# ----------------------------------------------------------------------------- TP x FSDP

# The model, plan and data of test_tensor_parallel.py: a stack of MLP blocks with a
# sequence-parallel LayerNorm on a 2x2 (dp, tp) mesh. TP_CASES: (dim, hidden, seq), whether
# the TP styles return local tensors (even TP shards) or DTensors (uneven TP shards).
TP_CASES = [
    pytest.param((8, 12, 6), True, id="even"),
    # hidden 3 -> 2 + 1 over tp, then 1 + 1 and 1 + 0 over dp: an empty local shard.
    pytest.param((9, 3, 5), False, id="uneven-tp-empty-shard", marks=tp.UNEVEN_TP_NEEDS_TORCH_2_13),
]


def _tp_model(seed: int, dims: tuple[int, int, int], mesh: DeviceMesh, local_outputs: bool) -> nn.Module:
    torch.manual_seed(seed)
    return tp._parallelize(NormMLPStack(*dims[:2]), mesh, local_outputs)


def _tp_train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    dims: tuple[int, int, int],
    mesh: DeviceMesh,
    local_outputs: bool,
) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        _, x = tp._batch(step, dims, mesh, local_outputs)
        loss = tp._local_loss(model(x), tp.BATCH_PER_DP * dims[2] * dims[0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _1d_model(seed: int, dims: tuple[int, int, int]) -> nn.Module:
    torch.manual_seed(seed)
    model = NormMLPStack(*dims[:2])
    for block in model.layers:
        fully_shard(block)
    return fully_shard(model)


def _tp_save(
    rank: int, world: int, path: str, dims: tuple[int, int, int], local_outputs: bool
) -> dict[str, torch.Tensor]:
    """TP x FSDP: state dict layout, full state dict == reference, DCP round trip + resume."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = NormMLPStack(*dims[:2])
    model = _tp_model(0, dims, mesh, local_outputs)
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    for key, value in sd.items():
        assert isinstance(value, DTensor) and value.device_mesh == mesh, key
        assert value.placements == tp._expected_placements(key), f"{key}: {value.placements}"
    full = get_model_state_dict(model, options=FULL)
    if rank == 0:
        assert_close_tensors(full, ref.state_dict(), exact=True, msg="TP x FSDP full state dict")

    opt = adamw(model)
    _tp_train(model, opt, range(2), dims, mesh, local_outputs)
    msd, osd = get_state_dict(model, opt)
    for fqn, state in osd["state"].items():
        assert set(state) == ADAM_KEYS, fqn
        assert state["exp_avg"].placements == msd[fqn].placements and state["exp_avg"].device_mesh == mesh, fqn
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    expected = full_state(msd)

    fresh = _tp_model(1, dims, mesh, local_outputs)
    fresh_opt = adamw(fresh)
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd2, optim_state_dict=osd2)
    assert_same_params(fresh, expected, "TP x FSDP after DCP load")
    a = _tp_train(model, opt, range(2, 3), dims, mesh, local_outputs)
    b = _tp_train(fresh, fresh_opt, range(2, 3), dims, mesh, local_outputs)
    assert torch.equal(a[0], b[0]), "resumed TP x FSDP training diverged"
    assert_same_params(fresh, model, "TP x FSDP one step after loading")
    return expected


def _tp_checkpoint_into_1d(
    rank: int, world: int, path: str, dims: tuple[int, int, int], expected: dict[str, torch.Tensor], out_path: str
) -> dict[str, torch.Tensor]:
    """Load the 2D checkpoint into plain 1D FSDP at world 2; save one of its own."""
    model = _1d_model(1, dims)
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=path)
    set_model_state_dict(model, msd)
    assert_same_params(model, expected, "TP x FSDP checkpoint in 1D FSDP")
    with torch.no_grad():  # new values, so the next load has something to prove
        for p in model.parameters():
            p.mul_(-0.5)
    msd = get_model_state_dict(model)
    dcp.save({"model": msd}, checkpoint_id=out_path)
    return full_state(msd)


def _1d_checkpoint_into_tp(
    rank: int, world: int, path: str, dims: tuple[int, int, int], local_outputs: bool, expected: dict[str, torch.Tensor]
) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_model(2, dims, mesh, local_outputs)
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=path)
    set_model_state_dict(model, msd)
    assert_same_params(model, expected, "1D FSDP checkpoint in TP x FSDP")
    opt = adamw(model)
    _tp_train(model, opt, range(1), dims, mesh, local_outputs)  # and it trains


@pytest.mark.parametrize("dims, local_outputs", TP_CASES)
def test_tensor_parallel_fsdp_state_dict_and_dcp(
    tmp_path: Any, dims: tuple[int, int, int], local_outputs: bool
) -> None:
    tp_path, one_d_path = str(tmp_path / "ckpt_tp"), str(tmp_path / "ckpt_1d")
    expected = run_on_ranks(_tp_save, 4, tp_path, dims, local_outputs)[0]
    expected = run_on_ranks(_tp_checkpoint_into_1d, 2, tp_path, dims, expected, one_d_path)[0]
    run_on_ranks(_1d_checkpoint_into_tp, 4, one_d_path, dims, local_outputs, expected)
