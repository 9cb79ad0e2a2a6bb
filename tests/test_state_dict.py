"""State dicts and `torch.distributed.checkpoint` (DCP) for `fully_shard` models (issue 5).

- Sharded state dicts: `model.state_dict()` holds the managed parameters as DTensors
  (`Shard(0)`; `NO_SHARD` gives `Replicate()`; HSDP `(Replicate(), Shard(0))`), buffers stay
  plain tensors, FQNs are unchanged; `load_state_dict` writes into the very storage forward
  gathers from (the loss after loading equals the reference's bit for bit).
- DCP `save`/`load` of model and optimizer through `get_state_dict`/`set_state_dict`, with the
  AdamW state (`step`, `exp_avg`, `exp_avg_sq`) present and sharded like the parameters.
- Mixed precision (bf16 compute): the state dict holds the fp32 sharded parameters.
- Full state dicts (`full_state_dict=True, cpu_offload=True`) of model and optimizer equal
  the single-process reference's, and load back with `broadcast_from_rank0=True` where only
  rank 0 holds the values, into a freshly sharded model or one built on meta + `to_empty`.
- Resharding: a checkpoint saved at world size 4 loads at world size 2 and into HSDP (2x2).
- Resuming: 2 steps + save + fresh model/optimizer + load + 2 steps is bit-identical to
  4 uninterrupted steps (losses and parameters, `torch.equal`) on CPU.
- `model.half()` after `fully_shard`: fp16 DTensors in the state dict, DCP round trip.
- Tensor parallel x FSDP (2D (dp, tp) mesh, 4 ranks; even and uneven TP shards): sharded and
  full state dicts, DCP round trip with resumed training, the checkpoint loaded into plain 1D
  FSDP at world size 2, and a 1D checkpoint loaded back into TP x FSDP.

Checkpoints go to pytest's `tmp_path`, passed to the ranks as an argument (all ranks share the
file system). Every comparison runs on every rank: `full_tensor()` is a collective.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import test_tensor_parallel as tp  # the TP x FSDP model, plan and data
from _harness import assert_close_tensors, run_on_ranks
from _models import batch_for
from composable import MixedPrecisionPolicy, ShardingStrategy, fully_shard

LR = 1e-2
# fp32 on CPU: the sharded run sums per-rank gradients where the reference sums one batch.
TOL = dict(rtol=1e-5, atol=1e-6)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}


# ----------------------------------------------------------------------------- models

class Net(nn.Module):
    """Tied embedding/head around two pre-norm MLP blocks, plus a persistent buffer.

    No attention on purpose: a key bias has an exactly-zero gradient, which Adam turns
    into lr-sized noise steps and would need a loose tolerance. Vocab 13 and width 10 do
    not divide 2 or 4, so shards are uneven (and at world 4 some are empty)."""

    def __init__(self, vocab: int = 13, dim: int = 10, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_MLPBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, two FQNs
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x) * self.scale.to(x.dtype))  # buffers are not cast by mp_policy


class _MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).to(torch.float32), tokens[:, 1:].flatten())


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _shard(model: nn.Module, layout: str) -> nn.Module:
    """fully_shard per block + root. layout: "fsdp" (1D world), "no_shard", "hsdp" (2x2)."""
    if layout == "hsdp":
        kwargs: dict[str, Any] = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    elif layout == "no_shard":
        kwargs = {"strategy": ShardingStrategy.NO_SHARD}
    else:
        kwargs = {}
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _expected_placements(layout: str) -> tuple:
    return {"fsdp": (Shard(0),), "no_shard": (Replicate(),), "hsdp": (Replicate(), Shard(0))}[layout]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, world: int, rank: int | None) -> list[torch.Tensor]:
    """`steps` optimizer steps on this rank's rows (all rows when `rank` is None)."""
    losses = []
    for step in steps:
        loss = _loss(model, batch_for(step, world, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _full(sd: dict[str, Any]) -> dict[str, Any]:
    """Plain tensors (DTensors gathered) of a state dict; nested dicts recursively."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _full(v)
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor()
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
        else:
            out[k] = v
    return out


def _groups(osd: dict[str, Any]) -> list[dict[str, Any]]:
    """Optimizer param groups, with tuples as lists (a loaded `betas` is a list)."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in osd["param_groups"]]


def _same_params(model: nn.Module, other: nn.Module | dict[str, torch.Tensor], msg: str) -> None:
    """Every parameter of `model` equals `other`'s exactly (a model or a dict of full tensors)."""
    theirs = dict(other.named_parameters()) if isinstance(other, nn.Module) else other
    for name, p in model.named_parameters():
        assert_close_tensors(p, theirs[name], exact=True, msg=f"{msg}: {name}")


# ----------------------------------------------------------------------------- sharded state dicts

def _sharded_state_dict_roundtrip(rank: int, world: int, layout: str) -> None:
    ref = _net(0)
    model = _shard(copy.deepcopy(ref), layout)
    sd = model.state_dict()
    ref_sd = ref.state_dict()
    assert list(sd) == list(ref_sd), "FQNs must be unchanged (tied head.weight included)"
    for key, value in sd.items():
        if key == "scale":  # buffers are never sharded
            assert type(value) is torch.Tensor and torch.equal(value, ref_sd[key]), key
            continue
        assert isinstance(value, DTensor), f"{key}: {type(value).__name__}"
        assert value.placements == _expected_placements(layout), f"{key}: {value.placements}"
        assert value.device_mesh == model.tok.weight.device_mesh
        assert_close_tensors(value, ref_sd[key], exact=True, msg=key)
    assert sd["head.weight"].to_local().data_ptr() == sd["tok.weight"].to_local().data_ptr(), "tied: one storage"

    snapshot = {k: v.detach().clone() for k, v in sd.items()}  # the state dict aliases the params
    params_before = [id(p) for p in model.parameters()]
    _train(model, _adamw(model), range(2), world, rank)
    assert not torch.equal(model.tok.weight.full_tensor(), ref.tok.weight), "training changed nothing"

    result = model.load_state_dict(snapshot)
    assert not result.missing_keys and not result.unexpected_keys, result
    assert [id(p) for p in model.parameters()] == params_before, "load_state_dict must copy in place"
    assert model.tok.weight.placements == _expected_placements(layout)
    _same_params(model, ref, "after load_state_dict")
    # Forward must compute with the loaded values: the same parameters on the same (full)
    # batch give the very same loss as the single-process reference.
    tokens = batch_for(7, world, None)
    assert torch.equal(_loss(model, tokens), _loss(ref, tokens))


@pytest.mark.parametrize("layout", ["fsdp", "no_shard"])
def test_sharded_state_dict_and_load_state_dict(layout: str) -> None:
    run_on_ranks(_sharded_state_dict_roundtrip, 2, layout)


def test_hsdp_sharded_state_dict() -> None:
    run_on_ranks(_sharded_state_dict_roundtrip, 4, "hsdp")


def _mixed_precision_state_dict(rank: int, world: int) -> None:
    """bf16 compute keeps fp32 sharded parameters: the state dict holds those, not bf16."""
    model = _net(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    _train(model, _adamw(model), range(1), world, rank)
    sd = model.state_dict()
    for key, value in sd.items():
        assert value.dtype == torch.float32, f"{key}: {value.dtype}"
        if key != "scale":
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), key
    _same_params(model, _full(sd), "state dict of a bf16-compute model")
    full = get_model_state_dict(model, options=FULL)
    assert rank != 0 or all(v.dtype == torch.float32 for v in full.values())


def test_mixed_precision_state_dict_is_fp32() -> None:
    run_on_ranks(_mixed_precision_state_dict, 2)


# ----------------------------------------------------------------------------- DCP save/load

def _dcp_model_and_optimizer(rank: int, world: int, path: str) -> None:
    model = _shard(_net(0), "fsdp")
    opt = _adamw(model)
    _train(model, opt, range(2), world, rank)
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
    expected_model, expected_optim = _full(msd), _full(osd)

    fresh = _shard(_net(1), "fsdp")  # other initial values: loading must overwrite them all
    fresh_opt = _adamw(fresh)
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd2, optim_state_dict=osd2)
    _same_params(fresh, expected_model, "after DCP load")
    loaded_model, loaded_optim = get_state_dict(fresh, fresh_opt)
    assert_close_tensors(_full(loaded_optim)["state"], expected_optim["state"], exact=True, msg="optimizer state")
    assert _groups(loaded_optim) == _groups(expected_optim)

    # Both continue identically.
    a = _train(model, opt, range(2, 3), world, rank)
    b = _train(fresh, fresh_opt, range(2, 3), world, rank)
    assert torch.equal(a[0], b[0])
    _same_params(fresh, model, "one step after loading")


def test_dcp_save_load_model_and_optimizer(tmp_path: Any) -> None:
    run_on_ranks(_dcp_model_and_optimizer, 2, str(tmp_path / "ckpt"))


# ----------------------------------------------------------------------------- full state dicts

def _full_state_dict_matches_reference(rank: int, world: int) -> None:
    ref = _net(0)
    model = _shard(copy.deepcopy(ref), "fsdp")
    ref_opt, opt = _adamw(ref), _adamw(model)
    _train(ref, ref_opt, range(3), world, None)
    _train(model, opt, range(3), world, rank)

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
    assert _groups(full_osd) == _groups(ref_osd)


def test_full_state_dict_equals_reference() -> None:
    run_on_ranks(_full_state_dict_matches_reference, 2)


def _broadcast_from_rank0(rank: int, world: int, init: str) -> None:
    ref = _net(0)
    ref_opt = _adamw(ref)
    _train(ref, ref_opt, range(2), world, None)
    # Rank 0 alone holds the real values (as after `torch.load` of a consolidated file).
    # Copies: DCP may adopt the given tensors (the 0-d `step`s), and the reference's
    # optimizer must not share them with ours.
    full = copy.deepcopy(ref.state_dict()) if rank == 0 else {}
    full_osd = copy.deepcopy(get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(full_state_dict=True))) if rank == 0 else {}

    if init == "cpu":
        model = _shard(_net(1), "fsdp")
    else:  # the usual way to build a large model: on meta, shard, materialise, load
        with torch.device("meta"):
            model = _shard(Net(), "fsdp")
        model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    params_before = [id(p) for p in model.parameters()]
    set_model_state_dict(model, full, options=options)
    assert [id(p) for p in model.parameters()] == params_before, "loading must copy in place"
    opt = _adamw(model)
    set_optimizer_state_dict(model, opt, full_osd, options=options)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device.type == "cpu", name
    assert model.head.weight is model.tok.weight
    _same_params(model, ref, "after broadcast_from_rank0")
    assert torch.equal(model.scale, ref.scale)
    # The optimizer state arrived too: both take the same next step.
    _train(ref, ref_opt, range(2, 3), world, None)
    _train(model, opt, range(2, 3), world, rank)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close_tensors(p, r, **TOL, msg=f"step after loading: {name}")


# (Loading into parameters still on meta makes DCP use `load_state_dict(assign=True)`, which
# unties tied parameters even without any sharding: materialise with `to_empty` first.)
@pytest.mark.parametrize("init", ["cpu", "meta_to_empty"])
def test_full_state_dict_broadcast_from_rank0(init: str) -> None:
    run_on_ranks(_broadcast_from_rank0, 2, init)


# ----------------------------------------------------------------------------- resharding

def _save_world4(rank: int, world: int, path: str) -> dict[str, Any]:
    model = _shard(_net(0), "fsdp")
    opt = _adamw(model)
    _train(model, opt, range(2), world, rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return {"model": _full(msd), "optim": _full(osd)}


def _load_resharded(rank: int, world: int, path: str, layout: str, expected: dict[str, Any]) -> None:
    model = _shard(_net(1), layout)
    opt = _adamw(model)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for name, p in model.named_parameters():
        assert p.placements == _expected_placements(layout), name
    _same_params(model, expected["model"], f"loaded into {layout} at world {world}")
    loaded = _full(get_state_dict(model, opt)[1])
    assert_close_tensors(loaded["state"], expected["optim"]["state"], exact=True, msg="optimizer state")
    _train(model, opt, range(2, 3), world, rank)  # and training goes on


def test_checkpoint_from_world_4_loads_at_world_2_and_into_hsdp(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt_w4")
    expected = run_on_ranks(_save_world4, 4, path)[0]
    run_on_ranks(_load_resharded, 2, path, "fsdp", expected)
    run_on_ranks(_load_resharded, 4, path, "hsdp", expected)


# ----------------------------------------------------------------------------- resume

def _resume_is_bit_exact(rank: int, world: int, path: str) -> None:
    steps = 4
    straight = _shard(_net(0), "fsdp")
    straight_opt = _adamw(straight)
    expected = _train(straight, straight_opt, range(steps), world, rank)

    first = _shard(_net(0), "fsdp")
    first_opt = _adamw(first)
    losses = _train(first, first_opt, range(steps // 2), world, rank)
    msd, osd = get_state_dict(first, first_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    del first, first_opt, msd, osd

    resumed = _shard(_net(1), "fsdp")
    resumed_opt = _adamw(resumed)
    msd, osd = get_state_dict(resumed, resumed_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(resumed, resumed_opt, model_state_dict=msd, optim_state_dict=osd)
    losses += _train(resumed, resumed_opt, range(steps // 2, steps), world, rank)
    for step, (a, b) in enumerate(zip(losses, expected)):
        assert torch.equal(a, b), f"step {step}: resumed loss {a.item()!r} != {b.item()!r}"
    _same_params(resumed, straight, "after resumed training")


def test_resume_from_checkpoint_is_bit_exact(tmp_path: Any) -> None:
    run_on_ranks(_resume_is_bit_exact, 2, str(tmp_path / "ckpt"))


# ----------------------------------------------------------------------------- half precision

def _half_state_dict(rank: int, world: int, path: str) -> None:
    ref = _net(0).half()
    model = _shard(_net(0), "fsdp").half()  # .half() after fully_shard
    sd = model.state_dict()
    for key, value in sd.items():
        assert value.dtype == torch.float16, f"{key}: {value.dtype}"
        if key != "scale":
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), key
    assert_close_tensors(sd, ref.state_dict(), exact=True, msg="half state dict")
    dcp.save({"model": sd}, checkpoint_id=path)

    fresh = _shard(_net(1), "fsdp").half()
    msd = get_model_state_dict(fresh)
    dcp.load({"model": msd}, checkpoint_id=path)
    set_model_state_dict(fresh, msd)
    for name, p in fresh.named_parameters():
        assert p.dtype == torch.float16 and isinstance(p, DTensor), name
    _same_params(fresh, ref, "half model after DCP load")
    tokens = batch_for(0, world, None)
    assert torch.equal(_loss(fresh, tokens), _loss(ref, tokens))


def test_half_model_state_dict_and_dcp(tmp_path: Any) -> None:
    run_on_ranks(_half_state_dict, 2, str(tmp_path / "ckpt_half"))


# ----------------------------------------------------------------------------- TP x FSDP

# The model, plan and data of test_tensor_parallel.py: a stack of MLP blocks with a
# sequence-parallel LayerNorm on a 2x2 (dp, tp) mesh. TP_CASES: (dim, hidden, seq), whether
# the TP styles return local tensors (even TP shards) or DTensors (uneven TP shards).
TP_CASES = [
    pytest.param((8, 12, 6), True, id="even"),
    # hidden 3 -> 2 + 1 over tp, then 1 + 1 and 1 + 0 over dp: an empty local shard.
    pytest.param((9, 3, 5), False, id="uneven-tp-empty-shard"),
]


def _tp_model(seed: int, dims: tuple[int, int, int], mesh: DeviceMesh, local_outputs: bool) -> nn.Module:
    torch.manual_seed(seed)
    return tp._parallelize(tp._Stack(*dims[:2]), mesh, local_outputs)


def _tp_train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, dims: tuple[int, int, int],
              mesh: DeviceMesh, local_outputs: bool) -> list[torch.Tensor]:
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
    model = tp._Stack(*dims[:2])
    for block in model.layers:
        fully_shard(block)
    return fully_shard(model)


def _tp_save(rank: int, world: int, path: str, dims: tuple[int, int, int], local_outputs: bool) -> dict[str, torch.Tensor]:
    """TP x FSDP: state dict layout, full state dict == reference, DCP round trip + resume."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = tp._Stack(*dims[:2])
    model = _tp_model(0, dims, mesh, local_outputs)
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    for key, value in sd.items():
        assert isinstance(value, DTensor) and value.device_mesh == mesh, key
        assert value.placements == tp._expected_placements(key), f"{key}: {value.placements}"
    full = get_model_state_dict(model, options=FULL)
    if rank == 0:
        assert_close_tensors(full, ref.state_dict(), exact=True, msg="TP x FSDP full state dict")

    opt = _adamw(model)
    _tp_train(model, opt, range(2), dims, mesh, local_outputs)
    msd, osd = get_state_dict(model, opt)
    for fqn, state in osd["state"].items():
        assert set(state) == ADAM_KEYS, fqn
        assert state["exp_avg"].placements == msd[fqn].placements and state["exp_avg"].device_mesh == mesh, fqn
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    expected = _full(msd)

    fresh = _tp_model(1, dims, mesh, local_outputs)
    fresh_opt = _adamw(fresh)
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd2, optim_state_dict=osd2)
    _same_params(fresh, expected, "TP x FSDP after DCP load")
    a = _tp_train(model, opt, range(2, 3), dims, mesh, local_outputs)
    b = _tp_train(fresh, fresh_opt, range(2, 3), dims, mesh, local_outputs)
    assert torch.equal(a[0], b[0]), "resumed TP x FSDP training diverged"
    _same_params(fresh, model, "TP x FSDP one step after loading")
    return expected


def _tp_checkpoint_into_1d(rank: int, world: int, path: str, dims: tuple[int, int, int],
                           expected: dict[str, torch.Tensor], out_path: str) -> dict[str, torch.Tensor]:
    """Load the 2D checkpoint into plain 1D FSDP at world 2; save one of its own."""
    model = _1d_model(1, dims)
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=path)
    set_model_state_dict(model, msd)
    _same_params(model, expected, "TP x FSDP checkpoint in 1D FSDP")
    with torch.no_grad():  # new values, so the next load has something to prove
        for p in model.parameters():
            p.mul_(-0.5)
    msd = get_model_state_dict(model)
    dcp.save({"model": msd}, checkpoint_id=out_path)
    return _full(msd)


def _1d_checkpoint_into_tp(rank: int, world: int, path: str, dims: tuple[int, int, int], local_outputs: bool,
                           expected: dict[str, torch.Tensor]) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_model(2, dims, mesh, local_outputs)
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=path)
    set_model_state_dict(model, msd)
    _same_params(model, expected, "1D FSDP checkpoint in TP x FSDP")
    opt = _adamw(model)
    _tp_train(model, opt, range(1), dims, mesh, local_outputs)  # and it trains


@pytest.mark.parametrize("dims, local_outputs", TP_CASES)
def test_tensor_parallel_fsdp_state_dict_and_dcp(tmp_path: Any, dims: tuple[int, int, int], local_outputs: bool) -> None:
    tp_path, one_d_path = str(tmp_path / "ckpt_tp"), str(tmp_path / "ckpt_1d")
    expected = run_on_ranks(_tp_save, 4, tp_path, dims, local_outputs)[0]
    expected = run_on_ranks(_tp_checkpoint_into_1d, 2, tp_path, dims, expected, one_d_path)[0]
    run_on_ranks(_1d_checkpoint_into_tp, 4, one_d_path, dims, local_outputs, expected)
