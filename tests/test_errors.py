"""Clear errors for bad input (API.md "Errors").

Every wrong call raises at the call, with the promised exception type, and its message names
the API and the argument (``pytest.raises(..., match=...)``). A rejected call must also leave
the module untouched: no state installed, the original plain parameters still registered.

Everything here runs in this process under the fake process group (no numerics are needed to
validate arguments), so the whole file takes well under a second.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import fake_process_group
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from composable import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    checkpoint,
    fully_shard,
    replicate,
)

# ----------------------------------------------------------------------------- helpers


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


@contextlib.contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """The block must not change `module`: the same plain parameters stay registered and no
    API state appears anywhere in the tree (a failed call has no side effects)."""
    before = dict(module.named_parameters(remove_duplicate=False))
    yield
    after = dict(module.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys()
    for name, p in after.items():
        assert p is before[name], f"parameter {name} was replaced by a failed call"
        assert not isinstance(p, DTensor), name
    for sub in module.modules():
        for api in (fully_shard, replicate, checkpoint):
            assert api.state(sub) is None, f"a failed call left a {api.__name__} state on {type(sub).__name__}"


def _raises(
    exc: type[BaseException] | tuple, match: str, module: nn.Module, fn: Any, *args: Any, **kwargs: Any
) -> None:
    """`fn(*args, **kwargs)` raises `exc` matching `match` and leaves `module` untouched."""
    with _untouched(module), pytest.raises(exc, match=match):
        fn(*args, **kwargs)


# ----------------------------------------------------------------------------- fully_shard


@pytest.mark.parametrize("api", [fully_shard, replicate, checkpoint], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [None, 3, "model", [nn.Linear(2, 2)], torch.zeros(2), nn.Linear], ids=repr)
def test_not_a_module(world2: DeviceMesh, api: Any, bad: Any) -> None:
    if api is fully_shard and isinstance(bad, list):
        bad = [*bad, 3]  # a list of modules is one fully_shard group: a list holding a non-module is refused
    with pytest.raises(TypeError, match=rf"{api.__name__}: argument 'module' must be an nn\.Module"):
        api(bad)


@pytest.mark.parametrize("container", [nn.ModuleList, nn.ModuleDict], ids=lambda c: c.__name__)
def test_container_without_forward(world2: DeviceMesh, container: type) -> None:
    """Nothing calls a container's forward, so its hooks would never gather its parameters (the
    parent's forward failed inside F.linear on DTensors): refused at the call, as FSDP2 does."""
    members = [nn.Linear(2, 2), nn.Linear(2, 2)]
    module = container(members) if container is nn.ModuleList else container(dict(zip("ab", members)))
    match = rf"fully_shard does not support containers that do not implement forward: argument 'module' is a {container.__name__}"
    _raises(ValueError, match, module, fully_shard, module, mesh=world2)


def test_mesh_not_1d_or_2d() -> None:
    with fake_process_group(8):
        mesh3d = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        m = _model()
        _raises(
            ValueError,
            r"fully_shard: 'mesh' must be 1D or 2D, got a 3D mesh of shape \(2, 2, 2\)",
            m,
            fully_shard,
            m,
            mesh=mesh3d,
        )
        # replicate takes only 1D meshes.
        mesh2d = init_device_mesh("cpu", (2, 4), mesh_dim_names=("x", "y"))
        _raises(ValueError, r"replicate: 'mesh' must be 1D, got a 2D mesh", m, replicate, m, mesh=mesh2d)
        _raises(ValueError, r"replicate: 'mesh' must be 1D, got a 3D mesh", m, replicate, m, mesh=mesh3d)


@pytest.mark.parametrize("bad", ["cpu", 2, (2,), "group"], ids=repr)
def test_mesh_wrong_type(world2: DeviceMesh, bad: Any) -> None:
    bad = dist.group.WORLD if bad == "group" else bad  # a ProcessGroup is a common mix-up
    m = _model()
    _raises(
        TypeError,
        r"fully_shard: 'mesh' must be a torch\.distributed\.device_mesh\.DeviceMesh",
        m,
        fully_shard,
        m,
        mesh=bad,
    )
    _raises(
        TypeError, r"replicate: 'mesh' must be a torch\.distributed\.device_mesh\.DeviceMesh", m, replicate, m, mesh=bad
    )


@pytest.mark.parametrize(
    "strategy, reshard",
    [(ShardingStrategy.FULL_SHARD, False), (ShardingStrategy.SHARD_GRAD_OP, True), (ShardingStrategy.NO_SHARD, True)],
    ids=lambda v: getattr(v, "name", repr(v)),
)
def test_contradicting_strategy_and_reshard(world2: DeviceMesh, strategy: ShardingStrategy, reshard: bool) -> None:
    m = _model()
    _raises(
        ValueError,
        rf"fully_shard: reshard_after_forward={reshard} contradicts strategy={strategy.name}",
        m,
        fully_shard,
        m,
        mesh=world2,
        strategy=strategy,
        reshard_after_forward=reshard,
    )


def test_consistent_strategy_and_reshard_are_accepted(world2: DeviceMesh) -> None:
    """The counterpart of the contradiction test: agreeing values are fine."""
    for strategy, reshard in [
        (ShardingStrategy.FULL_SHARD, True),
        (ShardingStrategy.SHARD_GRAD_OP, False),
        (ShardingStrategy.NO_SHARD, False),
    ]:
        m = fully_shard(_model(), mesh=world2, strategy=strategy, reshard_after_forward=reshard)
        assert fully_shard.state(m).strategy is strategy


def test_strategy_and_reshard_wrong_types(world2: DeviceMesh) -> None:
    m = _model()
    _raises(
        TypeError,
        r"fully_shard: 'strategy' must be a ShardingStrategy or None, got 'FULL_SHARD'",
        m,
        fully_shard,
        m,
        mesh=world2,
        strategy="FULL_SHARD",
    )
    # An int is a group size since API.md took FSDP2's int reshard_after_forward (see test_fsdp2_extras).
    _raises(
        TypeError,
        r"fully_shard: 'reshard_after_forward' must be a bool or an int, got 'yes'",
        m,
        fully_shard,
        m,
        mesh=world2,
        reshard_after_forward="yes",
    )


def test_hybrid_shard_needs_2d_mesh(world4: tuple[DeviceMesh, DeviceMesh]) -> None:
    mesh1d, _ = world4
    m = _model()
    _raises(
        ValueError,
        r"fully_shard: strategy=HYBRID_SHARD needs a 2D mesh.*got a 1D mesh",
        m,
        fully_shard,
        m,
        mesh=mesh1d,
        strategy=ShardingStrategy.HYBRID_SHARD,
    )


@pytest.mark.parametrize(
    "strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP], ids=lambda s: s.name
)
def test_1d_strategies_reject_2d_mesh(world4: tuple[DeviceMesh, DeviceMesh], strategy: ShardingStrategy) -> None:
    _, mesh2d = world4
    m = _model()
    _raises(
        ValueError,
        rf"fully_shard: strategy={strategy.name} shards over a 1D mesh, got a 2D mesh",
        m,
        fully_shard,
        m,
        mesh=mesh2d,
        strategy=strategy,
    )


@pytest.mark.parametrize("api", [fully_shard, replicate, checkpoint], ids=lambda f: f.__name__)
def test_applying_twice(world2: DeviceMesh, api: Any) -> None:
    m = _model()
    api(m)
    state = api.state(m)
    assert state is not None
    with pytest.raises(RuntimeError, match=rf"{api.__name__} has already been applied to this Sequential"):
        api(m)
    assert api.state(m) is state  # the first state survives the rejected call


@pytest.mark.parametrize("bad", [nn.Linear, [nn.Linear], {"Linear"}, {nn.Linear, 3}, "Linear", 1], ids=repr)
def test_policy_wrong_type(world2: DeviceMesh, bad: Any) -> None:
    # A bare class is callable but is a common slip for {cls}: rejected, not called.
    m = _model()
    _raises(TypeError, r"fully_shard: 'policy'", m, fully_shard, m, mesh=world2, policy=bad)


@pytest.mark.parametrize("bad", ["list", "tensors", "ints", "param"])
def test_ignored_params_wrong_type(world2: DeviceMesh, bad: str) -> None:
    m = _model()
    value = {"list": [m[0].weight], "tensors": {1, 2}, "ints": {3}, "param": m[0].weight}[bad]
    _raises(
        TypeError,
        r"fully_shard: 'ignored_params' must be a set of nn\.Parameter or None",
        m,
        fully_shard,
        m,
        mesh=world2,
        ignored_params=value,
    )


@pytest.mark.parametrize("api", [fully_shard, replicate], ids=lambda f: f.__name__)
def test_parameters_on_different_devices(world2: DeviceMesh, api: Any) -> None:
    m = _model()
    with torch.device("meta"):
        m[2] = nn.Linear(6, 3)
    _raises(
        ValueError,
        rf"{api.__name__}: all managed parameters must be on one device, got \['cpu', 'meta'\]",
        m,
        api,
        m,
        mesh=world2,
    )


def test_mixed_dtypes_in_one_group_not_supported(world2: DeviceMesh) -> None:
    """One flat buffer per group: mixed dtypes are an unsupported combination (not a crash
    deep inside), and they are fine in separate groups."""
    m = _model()
    m[2].to(torch.float64)
    with pytest.raises(NotImplementedError, match=r"fully_shard: parameters of one group must share a dtype"):
        fully_shard(m, mesh=world2)
    m = _model()
    m[2].to(torch.float64)
    fully_shard(m[2], mesh=world2)
    fully_shard(m, mesh=world2)
    assert m[2].weight.dtype == torch.float64 and m[0].weight.dtype == torch.float32


@pytest.mark.parametrize("api", [fully_shard, replicate], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [None, torch.float16, MixedPrecisionPolicy, {"param_dtype": torch.bfloat16}], ids=repr)
def test_mp_policy_wrong_type(world2: DeviceMesh, api: Any, bad: Any) -> None:
    m = _model()
    _raises(
        TypeError,
        rf"{api.__name__}: 'mp_policy' must be a composable.MixedPrecisionPolicy",
        m,
        api,
        m,
        mesh=world2,
        mp_policy=bad,
    )


@pytest.mark.parametrize("bad", [CPUOffloadPolicy, True, "cpu", MixedPrecisionPolicy()], ids=repr)
def test_offload_policy_wrong_type(world2: DeviceMesh, bad: Any) -> None:
    # The class instead of an instance is the typical slip.
    m = _model()
    _raises(
        TypeError,
        r"fully_shard: 'offload_policy' must be a composable.OffloadPolicy",
        m,
        fully_shard,
        m,
        mesh=world2,
        offload_policy=bad,
    )


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64], ids=str)
def test_mixed_precision_non_floating_dtype(field: str, dtype: torch.dtype) -> None:
    with pytest.raises(
        ValueError, match=rf"MixedPrecisionPolicy: '{field}' must be a floating-point dtype, got {dtype}"
    ):
        MixedPrecisionPolicy(**{field: dtype})


def test_mixed_precision_wrong_types() -> None:
    with pytest.raises(
        TypeError, match=r"MixedPrecisionPolicy: 'param_dtype' must be a torch\.dtype or None, got 'bfloat16'"
    ):
        MixedPrecisionPolicy(param_dtype="bfloat16")
    with pytest.raises(TypeError, match=r"MixedPrecisionPolicy: 'cast_forward_inputs' must be a bool"):
        MixedPrecisionPolicy(cast_forward_inputs=None)


def test_policies_are_accepted(world2: DeviceMesh) -> None:
    """The valid counterparts: a subclass of OffloadPolicy and a full MixedPrecisionPolicy."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    m = fully_shard(_model(), mesh=world2, mp_policy=mp, offload_policy=OffloadPolicy())
    assert fully_shard.state(m).mp_policy == mp


# ----------------------------------------------------------------------------- compositions


def test_replicate_on_fully_shard_module_and_converse(world2: DeviceMesh) -> None:
    m = fully_shard(_model(), mesh=world2)
    with pytest.raises(RuntimeError, match=r"Cannot apply .*replicate"):
        replicate(m, mesh=world2)
    assert replicate.state(m) is None
    m = replicate(_model(), mesh=world2)
    with pytest.raises(RuntimeError, match=r"Cannot apply .*fully_shard"):
        fully_shard(m, mesh=world2)
    assert fully_shard.state(m) is None
    # Different modules of one tree nest freely, either way round.
    m = _model()
    replicate(m[0], mesh=world2)
    fully_shard(m, mesh=world2)
    m = _model()
    fully_shard(m[0], mesh=world2)
    replicate(m, mesh=world2)


def test_checkpoint_composes_on_the_same_module(world2: DeviceMesh) -> None:
    """Not an error: checkpoint + fully_shard/replicate on one module, either order."""
    for first, second in [
        (checkpoint, fully_shard),
        (fully_shard, checkpoint),
        (checkpoint, replicate),
        (replicate, checkpoint),
    ]:
        m = _model()
        first(m)
        second(m)
        assert first.state(m) is not None and second.state(m) is not None
