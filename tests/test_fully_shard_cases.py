"""Real-world cases `fully_shard` must handle (issue 2) and the API principles (API.md).

Each training case runs on 2 gloo ranks, every rank on different data, and is compared step
by step with a single-process reference model trained on the concatenation of all ranks'
data: the rank-averaged loss, every gradient (including which ones are None) and every
parameter after every optimizer step (`full_tensor()` of the DTensors). Every rank builds the
reference itself from the shared seed, so nothing but the losses needs communicating.

Cases: tied parameters, frozen parameters mixed within a module, several forwards before one
backward, no_grad/eval forwards between training steps, parameters unused in a step,
meta-device construction, `copy.deepcopy`, `ignored_params`, nested application and the
`policy` auto-wrap, the state object's fields and `unshard`/`reshard`, explicit prefetching,
`model.half()` after sharding, and the apply-once / unchanged-identity principles.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from _harness import assert_close_tensors, fake_process_group, run_on_ranks
from _models import MLP, Block, TinyTransformer, batch_for, lm_loss
from composable import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)

# fp32 on CPU: the only difference to the reference is the order of the gradient summation.
TOL = dict(rtol=1e-5, atol=1e-6)
TIMEOUT = 60.0
STEPS = 3


# ----------------------------------------------------------------------------- helpers (run on ranks)

def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: linear in the gradients, so tiny summation-order differences stay
    # tiny (Adam can blow them up where a gradient is close to zero).
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _xy(step: int, world_size: int, rank: int | None, din: int = 5, dout: int = 3, per_rank: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Regression batch of step `step`: all ranks' rows (rank None) or only `rank`'s rows."""
    g = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(world_size * per_rank, din, generator=g), torch.randn(world_size * per_rank, dout, generator=g)
    if rank is None:
        return x, y
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], y[rows]


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _rank_mean(loss: torch.Tensor) -> torch.Tensor:
    """The loss over all ranks' data (every rank has the same batch size)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _check_grads(model: nn.Module, ref: nn.Module, tag: str, skip: tuple[str, ...] = ()) -> None:
    """Every gradient equals the reference's, and exactly the same ones are None."""
    for (name, p), (ref_name, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name
        if name in skip:
            continue
        if rp.grad is None:
            assert p.grad is None, f"{tag}: {name} has a gradient, the reference has none"
            continue
        assert p.grad is not None, f"{tag}: {name} has no gradient, the reference has one"
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, f"{tag}: {name} grad {type(p.grad)}"
        assert_close_tensors(p.grad, rp.grad, **TOL, msg=f"{tag} grad {name}")


def _check_params(model: nn.Module, ref: nn.Module, tag: str, skip: tuple[str, ...] = ()) -> None:
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if name not in skip:
            assert_close_tensors(p, rp, **TOL, msg=f"{tag} param {name}")


def _train_step(
    model: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor], local: Any, full: Any, tag: str, skip: tuple[str, ...] = (),
) -> float:
    """One step on both models; checks loss, gradients and parameters. Returns the loss."""
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, local)
    loss.backward()
    ref_loss = loss_fn(ref, full)
    ref_loss.backward()
    assert_close_tensors(_rank_mean(loss), ref_loss.detach(), **TOL, msg=f"{tag} loss")
    _check_grads(model, ref, tag, skip)
    opt.step()
    ref_opt.step()
    _check_params(model, ref, tag, skip)
    return ref_loss.item()


def _shard_transformer(model: TinyTransformer, **options: Any) -> TinyTransformer:
    for layer in model.layers:
        fully_shard(layer, **options)
    return fully_shard(model, **options)


def _lm_steps(model: nn.Module, ref: nn.Module, rank: int, world_size: int, steps: range, tag: str,
              opt: torch.optim.Optimizer | None = None, ref_opt: torch.optim.Optimizer | None = None) -> list[float]:
    opt, ref_opt = opt or _sgd(model), ref_opt or _sgd(ref)
    return [
        _train_step(model, ref, opt, ref_opt, lm_loss, batch_for(s, world_size, rank), batch_for(s, world_size, None), f"{tag} step {s}")
        for s in steps
    ]


def _registered(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every registered parameter slot (tied ones under each name)."""
    return dict(model.named_parameters(remove_duplicate=False))


# ----------------------------------------------------------------------------- tied parameters

def _tied(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    _shard_transformer(model)
    # The tied pair is one sharded parameter in the root's group, registered under both names.
    assert model.tok.weight is model.head.weight and isinstance(model.tok.weight, DTensor)
    assert fully_shard.state(model).param_names == ["tok.weight", "pos.weight", "norm.weight", "norm.bias"]
    losses = _lm_steps(model, ref, rank, world_size, range(STEPS), "tied")
    assert losses[-1] < losses[0]
    assert model.tok.weight is model.head.weight  # still tied after training


def test_tied_parameters() -> None:
    run_on_ranks(_tied, 2, timeout=TIMEOUT)


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
    opt, ref_opt = _sgd(model), _sgd(ref)
    for step in range(STEPS):
        _train_step(model, ref, opt, ref_opt, _mse, _xy(step, world_size, rank), _xy(step, world_size, None), f"frozen step {step}")
        for name, p in model.named_parameters():
            if name in FROZEN:
                assert p.grad is None and not p.requires_grad, name
                assert torch.equal(p.full_tensor(), initial[name]), f"frozen {name} changed"
            else:
                assert not torch.equal(p.full_tensor(), initial[name]), f"trainable {name} did not change"


def test_frozen_parameters_mixed_within_modules() -> None:
    run_on_ranks(_frozen, 2, timeout=TIMEOUT)


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
    opt, ref_opt = _sgd(model), _sgd(ref)
    for step in range(STEPS):
        _train_step(model, ref, opt, ref_opt, _mse, _xy(step, world_size, rank), _xy(step, world_size, None), f"twice step {step}")


def _two_model_calls_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    # Two forwards of the whole model (different halves of the sequence), one backward.
    return lm_loss(model, tokens[:, :5]) + 0.5 * lm_loss(model, tokens[:, 3:])


def _model_called_twice(rank: int, world_size: int, reshard: bool) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    _shard_transformer(model, reshard_after_forward=reshard)
    opt, ref_opt = _sgd(model), _sgd(ref)
    for step in range(STEPS):
        local, full = batch_for(step, world_size, rank), batch_for(step, world_size, None)
        _train_step(model, ref, opt, ref_opt, _two_model_calls_loss, local, full, f"called twice step {step}")
    assert all(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_module_used_twice_in_one_forward(reshard: bool) -> None:
    run_on_ranks(_module_used_twice, 2, reshard, timeout=TIMEOUT)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_model_called_twice_before_backward(reshard: bool) -> None:
    run_on_ranks(_model_called_twice, 2, reshard, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- no_grad / eval forwards

def _assert_sharded_registered(model: nn.Module, expected: dict[str, nn.Parameter], tag: str) -> None:
    """The registered parameters are exactly the sharded DTensors (same objects as before)."""
    now = _registered(model)
    assert now.keys() == expected.keys()
    for name, p in now.items():
        assert p is expected[name], f"{tag}: {name} is a {type(p).__name__}, not the sharded parameter"


def _no_grad_and_eval(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    _shard_transformer(model)
    sharded = _registered(model)
    opt, ref_opt = _sgd(model), _sgd(ref)
    _lm_steps(model, ref, rank, world_size, range(0, 1), "before", opt, ref_opt)
    tokens = batch_for(7, world_size, None)[:, :-1]  # every rank evaluates the same batch

    with torch.no_grad():
        out = model(tokens)
    assert not out.requires_grad
    assert_close_tensors(out, ref(tokens).detach(), **TOL, msg="no_grad output")
    _assert_sharded_registered(model, sharded, "after no_grad forward")

    model.eval()
    ref.eval()
    with torch.no_grad():
        assert_close_tensors(model(tokens), ref(tokens), **TOL, msg="eval+no_grad output")
    _assert_sharded_registered(model, sharded, "after eval+no_grad forward")
    with torch.inference_mode():
        assert_close_tensors(model(tokens), ref(tokens), **TOL, msg="inference_mode output")
    _assert_sharded_registered(model, sharded, "after inference_mode forward")
    # eval with autograd on, no backward (e.g. a validation loss computed without no_grad).
    assert_close_tensors(model(tokens).detach(), ref(tokens).detach(), **TOL, msg="eval output with grad")
    _assert_sharded_registered(model, sharded, "after eval forward with grad enabled")
    model.train()
    ref.train()

    _lm_steps(model, ref, rank, world_size, range(1, STEPS), "after", opt, ref_opt)
    _assert_sharded_registered(model, sharded, "after training")


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
    opt, ref_opt = _sgd(model), _sgd(ref)
    for step in range(4):  # b: unused, used, unused, used; extra: unused, used, unused, used
        _train_step(model, ref, opt, ref_opt, _branchy_loss(step), _xy(step, world_size, rank), _xy(step, world_size, None), f"unused step {step}")
        assert model.never.weight.grad is None and model.never.bias.grad is None
        if step % 2 == 0:
            assert model.b.weight.grad is None and model.extra[0].weight.grad is None
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_parameters_unused_in_a_step() -> None:
    run_on_ranks(_unused, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- meta-device construction

def _meta_init(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        model = TinyTransformer()
    _shard_transformer(model)
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
            assert torch.isfinite(full).all() and full.abs().sum() > 0 or name.endswith("bias"), f"{name} not initialised"
            rp.copy_(full)
    assert torch.equal(ref.norm.weight, torch.ones(10)) and torch.equal(ref.layers[0].norm1.bias, torch.zeros(10))
    assert ref.tok.weight is ref.head.weight and model.tok.weight is model.head.weight
    _lm_steps(model, ref, rank, world_size, range(STEPS), "meta")


def test_meta_device_construction() -> None:
    run_on_ranks(_meta_init, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- deepcopy

def _deepcopy(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    _shard_transformer(model)
    opt, ref_opt = _sgd(model), _sgd(ref)
    _lm_steps(model, ref, rank, world_size, range(0, 1), "original", opt, ref_opt)

    clone = copy.deepcopy(model)
    ref_clone = copy.deepcopy(ref)
    assert type(clone) is TinyTransformer
    for sub, sub_clone in zip(model.modules(), clone.modules(), strict=True):
        state, state_clone = fully_shard.state(sub), fully_shard.state(sub_clone)
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
    _lm_steps(clone, ref_clone, rank, world_size, range(1, STEPS + 1), "clone")
    # ... without touching the original, which then trains on and still matches its reference.
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), snapshot[name]), f"training the copy changed the original's {name}"
    _lm_steps(model, ref, rank, world_size, range(1, STEPS), "original again", opt, ref_opt)


def test_deepcopy_of_a_sharded_model() -> None:
    run_on_ranks(_deepcopy, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- ignored_params

def _ignored(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    ignored = {model[0].bias, model[4].weight}
    # Through the policy too: the auto-wrapped Linears get the same ignored set.
    fully_shard(model, policy={nn.Linear}, ignored_params=ignored)
    names = ("0.bias", "4.weight")
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) == (name not in names), name
    assert model[0].bias in ignored and model[4].weight in ignored  # the very same objects
    assert fully_shard.state(model[0]).param_names == ["weight"]
    assert fully_shard.state(model[4]).param_names == ["bias"]
    assert fully_shard.state(model).param_names == []

    # Ignored parameters are left alone: not sharded, and their gradients are not reduced.
    # The optimizer leaves them out so that the rest stays comparable with the reference.
    trainable = lambda m: [p for n, p in m.named_parameters() if n not in names]  # noqa: E731
    opt = torch.optim.SGD(trainable(model), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(trainable(ref), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        local, full = _xy(step, world_size, rank), _xy(step, world_size, None)
        _train_step(model, ref, opt, ref_opt, _mse, local, full, f"ignored step {step}", skip=names)
        for name in names:
            p = model.get_parameter(name)
            assert type(p) is nn.Parameter and type(p.grad) is torch.Tensor, name
    _ignored_grad_is_local(rank, world_size)


def _ignored_grad_is_local(rank: int, world_size: int) -> None:
    """An ignored parameter's gradient is this rank's own, unreduced: it equals the
    gradient of the reference on this rank's rows only."""
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    fully_shard(model, ignored_params={model[2].bias})
    local = _xy(0, world_size, rank)
    _mse(model, local).backward()
    _mse(ref, local).backward()
    assert type(model[2].bias.grad) is torch.Tensor
    assert_close_tensors(model[2].bias.grad, ref[2].bias.grad, **TOL, msg="ignored grad is local")
    # The others are reduced: they differ from this rank's local gradient (different data).
    assert not torch.allclose(model[2].weight.grad.full_tensor(), ref[2].weight.grad)


def test_ignored_params_stay_plain_tensors() -> None:
    run_on_ranks(_ignored, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- nested application and policy

BLOCK_PARAMS = [n for n, _ in Block(10, 2).named_parameters()]


def _states(model: nn.Module) -> dict[str, list[str]]:
    """{module FQN: its fully_shard param_names} for every module with a state."""
    return {name: fully_shard.state(m).param_names for name, m in model.named_modules() if fully_shard.state(m) is not None}


ROOT_PARAMS = ["tok.weight", "pos.weight", "norm.weight", "norm.bias"]


@pytest.mark.parametrize("kind", ["set", "callable"])
def test_policy_auto_wrap_matches_nested_application(kind: str) -> None:
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        policy = {Block} if kind == "set" else (lambda m: isinstance(m, Block))
        auto = TinyTransformer()
        assert fully_shard(auto, mesh=mesh, policy=policy, strategy=ShardingStrategy.SHARD_GRAD_OP, mp_policy=mp) is auto
        manual = _shard_transformer(TinyTransformer(), mesh=mesh, strategy=ShardingStrategy.SHARD_GRAD_OP, mp_policy=mp)
        expected = {"": ROOT_PARAMS, "layers.0": BLOCK_PARAMS, "layers.1": BLOCK_PARAMS}
        assert _states(auto) == _states(manual) == expected
        # Every auto-applied state got the same options.
        for name in expected:
            state = fully_shard.state(auto.get_submodule(name))
            assert state.mesh is mesh and state.mp_policy is mp and state.strategy is ShardingStrategy.SHARD_GRAD_OP


def test_policy_is_applied_bottom_up() -> None:
    """A policy matching nested modules (Block and the MLP inside it) shards the innermost
    first: the Block's state must not hold the MLP's parameters."""
    with fake_process_group(2):
        model = TinyTransformer()
        seen: list[str] = []
        names = {m: n for n, m in model.named_modules()}

        def policy(m: nn.Module) -> bool:
            seen.append(names[m])
            return isinstance(m, (Block, MLP, nn.LayerNorm)) and m is not model.norm

        fully_shard(model, policy=policy)
        assert "" not in seen or seen.count("") <= 1
        block = [n for n in BLOCK_PARAMS if not n.startswith(("mlp.", "norm1.", "norm2."))]
        assert _states(model) == {
            "": ROOT_PARAMS,
            **{f"layers.{i}": block for i in range(2)},
            **{f"layers.{i}.{n}": ["weight", "bias"] for i in range(2) for n in ("norm1", "norm2")},
            **{f"layers.{i}.mlp": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"] for i in range(2)},
        }
        # A policy that matches everything (the root included) still applies once per module.
        everything = nn.Sequential(MLP(4), nn.LayerNorm(4))
        fully_shard(everything, policy=lambda m: True)
        assert _states(everything) == {
            "": [], "0": [], "0.fc1": ["weight", "bias"], "0.fc2": ["weight", "bias"], "1": ["weight", "bias"],
        }


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


def _policy_training(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    fully_shard(model, policy=lambda m: isinstance(m, (Block, MLP)))
    assert set(_states(model)) == {"", "layers.0", "layers.1", "layers.0.mlp", "layers.1.mlp"}
    _lm_steps(model, ref, rank, world_size, range(STEPS), "policy")


def test_policy_auto_wrap_trains() -> None:
    run_on_ranks(_policy_training, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- the state object

def _state_fields(rank: int, world_size: int) -> None:
    # Defaults.
    model = _shard_transformer(TinyTransformer())
    state = fully_shard.state(model)
    assert state.mesh.ndim == 1 and state.mesh.size() == world_size and state.mesh.device_type == "cpu"
    assert state.mp_policy == MixedPrecisionPolicy()
    assert isinstance(state.offload_policy, OffloadPolicy) and not isinstance(state.offload_policy, CPUOffloadPolicy)
    assert state.strategy is ShardingStrategy.FULL_SHARD
    assert state.param_names == ROOT_PARAMS  # the tied pair named once, by its first name
    assert fully_shard.state(model.layers[0]).param_names == BLOCK_PARAMS
    assert fully_shard.state(model.tok) is None and fully_shard.state(model.layers[0].mlp) is None

    # Explicit options are kept as given.
    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=False)
    other = fully_shard(nn.Linear(3, 3), mesh=mesh, mp_policy=mp, offload_policy=offload, strategy=ShardingStrategy.SHARD_GRAD_OP)
    st = fully_shard.state(other)
    assert st.mesh is mesh and st.mp_policy is mp and st.offload_policy is offload
    assert st.strategy is ShardingStrategy.SHARD_GRAD_OP and st.param_names == ["weight", "bias"]

    # unshard() registers plain full parameters (tied slots share one); reshard() puts the
    # very same sharded DTensors back.
    sharded = _registered(model)
    full = {n: p.full_tensor() for n, p in sharded.items()}
    for sub in [model, *model.layers]:
        fully_shard.state(sub).unshard()
    now = _registered(model)
    for name, p in now.items():
        assert not isinstance(p, DTensor) and p.shape == full[name].shape, name
        assert torch.equal(p, full[name]), name
    assert model.tok.weight is model.head.weight
    tokens = batch_for(0, world_size, None)[:, :-1]
    with torch.no_grad():
        assert_close_tensors(model(tokens), _reference_of(model, full)(tokens), **TOL, msg="forward while unsharded")
    for sub in [model, *model.layers]:
        fully_shard.state(sub).reshard()
    _assert_sharded_registered(model, sharded, "after reshard()")
    fully_shard.state(model.layers[1]).unshard()
    assert not isinstance(model.layers[1].qkv.weight, DTensor) and isinstance(model.layers[0].qkv.weight, DTensor)
    fully_shard.state(model.layers[1]).reshard()
    _assert_sharded_registered(model, sharded, "after one layer's unshard/reshard")

    # Training still matches after the manual unshard/reshard round trips.
    _lm_steps(model, _reference_of(model, full), rank, world_size, range(2), "after unshard/reshard")


def _reference_of(model: TinyTransformer, full: dict[str, torch.Tensor]) -> TinyTransformer:
    """A plain TinyTransformer like `model` holding the parameter values `full`."""
    ref = TinyTransformer(layers=len(model.layers)).to(model.tok.weight.dtype)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(full[name])
    return ref


def test_state_fields_and_unshard_reshard() -> None:
    run_on_ranks(_state_fields, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- explicit prefetching

def _prefetch(rank: int, world_size: int, reshard: bool) -> None:
    plain = TinyTransformer(layers=3)
    prefetched = copy.deepcopy(plain)
    ref = copy.deepcopy(plain)
    _shard_transformer(plain, reshard_after_forward=reshard)
    _shard_transformer(prefetched, reshard_after_forward=reshard)
    layers = list(prefetched.layers)
    fully_shard.state(prefetched).set_modules_to_forward_prefetch([layers[0]])
    for i, layer in enumerate(layers):
        state = fully_shard.state(layer)
        state.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])  # two ahead
        state.set_modules_to_backward_prefetch(layers[max(0, i - 1) : i][::-1])
    opt_plain, opt_pre, ref_opt = _sgd(plain), _sgd(prefetched), _sgd(ref)
    for step in range(STEPS):
        local = batch_for(step, world_size, rank)
        for m, o in ((plain, opt_plain), (prefetched, opt_pre)):
            o.zero_grad(set_to_none=True)
            lm_loss(m, local).backward()
        # Prefetching changes when parameters are gathered, never what is computed: bitwise equal.
        for (name, p), (_, q) in zip(plain.named_parameters(), prefetched.named_parameters(), strict=True):
            assert_close_tensors(q.grad, p.grad, exact=True, msg=f"prefetch grad {name} step {step}")
        opt_plain.step()
        opt_pre.step()
        assert all(isinstance(p, DTensor) for p in prefetched.parameters())
    _check_params(plain, prefetched, "prefetch vs plain")
    # And both still train like the single-process reference (fresh optimizers on both sides).
    _lm_steps(prefetched, _reference_of(prefetched, {n: p.full_tensor() for n, p in prefetched.named_parameters()}),
              rank, world_size, range(STEPS, STEPS + 1), "prefetch vs reference")


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_prefetch_gives_identical_results(reshard: bool) -> None:
    run_on_ranks(_prefetch, 2, reshard, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- model.half() after fully_shard

def _half_after(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    _shard_transformer(model)
    sharded = _registered(model)
    assert model.half() is model
    _assert_sharded_registered(model, sharded, "after half()")  # converted in place, same objects
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.dtype == torch.float16 and p._local_tensor.dtype == torch.float16, name
    ref = _reference_of(model, {n: p.full_tensor() for n, p in model.named_parameters()})
    assert ref.tok.weight.dtype == torch.float16
    opt, ref_opt = _sgd(model), _sgd(ref)
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
        assert_close_tensors(_rank_mean(loss), ref_loss.detach(), rtol=2e-3, atol=2e-3, msg=f"half loss {step}")
        for name, p in model.named_parameters():
            assert isinstance(p.grad, DTensor) and p.grad.dtype == torch.float16, name
            assert_close_tensors(p.grad.float(), dict(ref.named_parameters())[name].grad.float(), rtol=2e-2, atol=2e-3, msg=f"half grad {name} {step}")
        opt.step()
        ref_opt.step()
        for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            assert_close_tensors(p.float(), rp.float(), rtol=1e-2, atol=2e-3, msg=f"half param {name} {step}")
    assert losses[-1] < losses[0]


def test_half_after_fully_shard_trains() -> None:
    run_on_ranks(_half_after, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- principles

def test_identity_class_and_names_unchanged() -> None:
    with fake_process_group(2):
        model = TinyTransformer()
        names = list(_registered(model))
        unique = [n for n, _ in model.named_parameters()]
        modules = [(n, type(m)) for n, m in model.named_modules()]
        keys = list(model.state_dict())
        layer0 = model.layers[0]
        assert fully_shard(layer0) is layer0
        assert fully_shard(model, policy={Block}) is model  # layers[1] via the policy
        assert type(model) is TinyTransformer and isinstance(model, TinyTransformer) and type(layer0) is Block
        assert list(_registered(model)) == names and [n for n, _ in model.named_parameters()] == unique
        assert [(n, type(m)) for n, m in model.named_modules()] == modules
        assert list(model.state_dict()) == keys
        for name, p in model.named_parameters():
            assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
        assert all(not isinstance(b, DTensor) for b in model.buffers())


def test_applying_fully_shard_twice_raises() -> None:
    with fake_process_group(2):
        model = TinyTransformer()
        fully_shard(model, policy={Block})
        for target in (model, model.layers[1]):
            state = fully_shard.state(target)
            with pytest.raises(RuntimeError, match=r"fully_shard has already been applied"):
                fully_shard(target)
            assert fully_shard.state(target) is state
