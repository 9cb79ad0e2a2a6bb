"""How `fully_shard` groups parameters, and its state object.

The `policy` auto-wrap against nested application (bottom up, same options everywhere),
`ignored_params`, the state object's fields and `unshard`/`reshard`, explicit forward and
backward prefetching, and the API principles: the module, its class and its FQNs are
unchanged, and applying twice raises.

Training cases run on 2 gloo ranks and are compared step by step with a single-process
reference (`_training.train_step`: loss, every gradient, every parameter).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, fake_process_group, run_on_ranks
from _models import MLP, Block, TinyTransformer, batch_for, lm_loss
from _training import (
    BLOCK_PARAMS,
    ROOT_PARAMS,
    STEPS,
    TIMEOUT,
    TOL,
    assert_sharded_registered,
    check_params,
    lm_steps,
    mse,
    reference_of,
    registered,
    sgd,
    shard_transformer,
    states,
    train_step,
    xy,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from composable import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy, fully_shard

# ----------------------------------------------------------------------------- nested application and policy


@pytest.mark.parametrize("kind", ["set", "callable"])
def test_policy_auto_wrap_matches_nested_application(kind: str) -> None:
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        policy = {Block} if kind == "set" else (lambda m: isinstance(m, Block))
        auto = TinyTransformer()
        assert (
            fully_shard(auto, mesh=mesh, policy=policy, strategy=ShardingStrategy.SHARD_GRAD_OP, mp_policy=mp) is auto
        )
        manual = shard_transformer(TinyTransformer(), mesh=mesh, strategy=ShardingStrategy.SHARD_GRAD_OP, mp_policy=mp)
        expected = {"": ROOT_PARAMS, "layers.0": BLOCK_PARAMS, "layers.1": BLOCK_PARAMS}
        assert states(auto) == states(manual) == expected
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
        assert states(model) == {
            "": ROOT_PARAMS,
            **{f"layers.{i}": block for i in range(2)},
            **{f"layers.{i}.{n}": ["weight", "bias"] for i in range(2) for n in ("norm1", "norm2")},
            **{f"layers.{i}.mlp": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"] for i in range(2)},
        }
        # A policy that matches everything (the root included) still applies once per module.
        everything = nn.Sequential(MLP(4), nn.LayerNorm(4))
        fully_shard(everything, policy=lambda m: True)
        assert states(everything) == {
            "": [],
            "0": [],
            "0.fc1": ["weight", "bias"],
            "0.fc2": ["weight", "bias"],
            "1": ["weight", "bias"],
        }


def _policy_training(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    fully_shard(model, policy=lambda m: isinstance(m, (Block, MLP)))
    assert set(states(model)) == {"", "layers.0", "layers.1", "layers.0.mlp", "layers.1.mlp"}
    lm_steps(model, ref, rank, world_size, range(STEPS), "policy")


def test_policy_auto_wrap_trains() -> None:
    run_on_ranks(_policy_training, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- the state object


def _state_fields(rank: int, world_size: int) -> None:
    # Defaults.
    model = shard_transformer(TinyTransformer())
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
    other = fully_shard(
        nn.Linear(3, 3), mesh=mesh, mp_policy=mp, offload_policy=offload, strategy=ShardingStrategy.SHARD_GRAD_OP
    )
    st = fully_shard.state(other)
    assert st.mesh is mesh and st.mp_policy is mp and st.offload_policy is offload
    assert st.strategy is ShardingStrategy.SHARD_GRAD_OP and st.param_names == ["weight", "bias"]

    # unshard() registers plain full parameters (tied slots share one); reshard() puts the
    # very same sharded DTensors back.
    sharded = registered(model)
    full = {n: p.full_tensor() for n, p in sharded.items()}
    for sub in [model, *model.layers]:
        fully_shard.state(sub).unshard()
    now = registered(model)
    for name, p in now.items():
        assert not isinstance(p, DTensor) and p.shape == full[name].shape, name
        assert torch.equal(p, full[name]), name
    assert model.tok.weight is model.head.weight
    tokens = batch_for(0, world_size, None)[:, :-1]
    with torch.no_grad():
        assert_close_tensors(model(tokens), reference_of(model, full)(tokens), **TOL, msg="forward while unsharded")
    for sub in [model, *model.layers]:
        fully_shard.state(sub).reshard()
    assert_sharded_registered(model, sharded, "after reshard()")
    fully_shard.state(model.layers[1]).unshard()
    assert not isinstance(model.layers[1].qkv.weight, DTensor) and isinstance(model.layers[0].qkv.weight, DTensor)
    fully_shard.state(model.layers[1]).reshard()
    assert_sharded_registered(model, sharded, "after one layer's unshard/reshard")

    # Training still matches after the manual unshard/reshard round trips.
    lm_steps(model, reference_of(model, full), rank, world_size, range(2), "after unshard/reshard")


def test_state_fields_and_unshard_reshard() -> None:
    run_on_ranks(_state_fields, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- explicit prefetching


def _prefetch(rank: int, world_size: int, reshard: bool) -> None:
    plain = TinyTransformer(layers=3)
    prefetched = copy.deepcopy(plain)
    shard_transformer(plain, reshard_after_forward=reshard)
    shard_transformer(prefetched, reshard_after_forward=reshard)
    layers = list(prefetched.layers)
    fully_shard.state(prefetched).set_modules_to_forward_prefetch([layers[0]])
    for i, layer in enumerate(layers):
        state = fully_shard.state(layer)
        state.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])  # two ahead
        state.set_modules_to_backward_prefetch(layers[max(0, i - 1) : i][::-1])
    opt_plain, opt_pre = sgd(plain), sgd(prefetched)
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
    check_params(plain, prefetched, "prefetch vs plain")
    # And both still train like the single-process reference (fresh optimizers on both sides).
    lm_steps(
        prefetched,
        reference_of(prefetched, {n: p.full_tensor() for n, p in prefetched.named_parameters()}),
        rank,
        world_size,
        range(STEPS, STEPS + 1),
        "prefetch vs reference",
    )


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_prefetch_gives_identical_results(reshard: bool) -> None:
    run_on_ranks(_prefetch, 2, reshard, timeout=TIMEOUT)


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
        local, full = xy(step, world_size, rank), xy(step, world_size, None)
        train_step(model, ref, opt, ref_opt, mse, local, full, f"ignored step {step}", skip=names)
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
    local = xy(0, world_size, rank)
    mse(model, local).backward()
    mse(ref, local).backward()
    assert type(model[2].bias.grad) is torch.Tensor
    assert_close_tensors(model[2].bias.grad, ref[2].bias.grad, **TOL, msg="ignored grad is local")
    # The others are reduced: they differ from this rank's local gradient (different data).
    assert not torch.allclose(model[2].weight.grad.full_tensor(), ref[2].weight.grad)


def test_ignored_params_stay_plain_tensors() -> None:
    run_on_ranks(_ignored, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- principles


def test_identity_class_and_names_unchanged() -> None:
    with fake_process_group(2):
        model = TinyTransformer()
        names = list(registered(model))
        unique = [n for n, _ in model.named_parameters()]
        modules = [(n, type(m)) for n, m in model.named_modules()]
        keys = list(model.state_dict())
        layer0 = model.layers[0]
        assert fully_shard(layer0) is layer0
        assert fully_shard(model, policy={Block}) is model  # layers[1] via the policy
        assert type(model) is TinyTransformer and isinstance(model, TinyTransformer) and type(layer0) is Block
        assert list(registered(model)) == names and [n for n, _ in model.named_parameters()] == unique
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
