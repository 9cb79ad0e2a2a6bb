"""Errors of replicate, checkpoint, the state methods and the clear errors
(the fully_shard argument errors are in test_errors.py, whose helpers these share)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import fake_process_group
from test_errors import _model, _raises
from torch.distributed.device_mesh import DeviceMesh

from composable import (
    checkpoint,
    fully_shard,
    no_sync,
    replicate,
    set_requires_gradient_sync,
)

# ----------------------------------------------------------------------------- replicate


def test_replicate_mesh_and_process_group(world2: DeviceMesh) -> None:
    m = _model()
    _raises(
        ValueError,
        r"replicate: pass 'mesh' or 'process_group', not both",
        m,
        replicate,
        m,
        mesh=world2,
        process_group=dist.group.WORLD,
    )


def test_replicate_process_group_wrong_type(world2: DeviceMesh) -> None:
    m = _model()
    _raises(
        TypeError,
        r"replicate: 'process_group' must be a torch\.distributed\.ProcessGroup",
        m,
        replicate,
        m,
        process_group=world2,
    )


@pytest.mark.parametrize(
    "bad, exc",
    [
        (0, ValueError),
        (-1.5, ValueError),
        (float("nan"), ValueError),
        ("25", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
    ids=repr,
)
def test_replicate_bad_bucket_cap(world2: DeviceMesh, bad: Any, exc: type[Exception]) -> None:
    m = _model()
    _raises(exc, r"replicate: 'bucket_cap_mb' must be", m, replicate, m, mesh=world2, bucket_cap_mb=bad)


# ----------------------------------------------------------------------------- checkpoint


def test_checkpoint_bad_preserve_rng_state() -> None:
    m = _model()
    _raises(TypeError, r"checkpoint: 'preserve_rng_state' must be a bool", m, checkpoint, m, preserve_rng_state=1)


# ----------------------------------------------------------------------------- state methods


@pytest.mark.parametrize("which", ["set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"])
def test_prefetch_module_without_fully_shard(world2: DeviceMesh, which: str) -> None:
    m = _model()
    fully_shard(m[0], mesh=world2)
    fully_shard(m, mesh=world2)
    setter = getattr(fully_shard.state(m), which)
    with pytest.raises(ValueError, match=rf"{which}: every module must have fully_shard applied, got Linear"):
        setter([m[0], m[2]])  # m[2] has no fully_shard of its own
    with pytest.raises((ValueError, TypeError), match=rf"{which}: .*int"):
        setter([3])
    setter([m[0]])  # valid


def test_no_sync_and_set_requires_gradient_sync_bad_arguments(world2: DeviceMesh) -> None:
    m = fully_shard(_model(), mesh=world2)
    with pytest.raises(TypeError, match=r"no_sync: argument 'module' must be an nn\.Module"):
        with no_sync([m]):
            pass
    with pytest.raises(TypeError, match=r"set_requires_gradient_sync: argument 'module' must be an nn\.Module"):
        set_requires_gradient_sync(fully_shard.state(m), False)
    for bad in (0, None, "False"):
        with pytest.raises(TypeError, match=r"set_requires_gradient_sync: 'requires_gradient_sync' must be a bool"):
            set_requires_gradient_sync(m, bad)
        with pytest.raises(TypeError, match=r"set_requires_gradient_sync: 'requires_gradient_sync' must be a bool"):
            fully_shard.state(m).set_requires_gradient_sync(bad)
    assert fully_shard.state(m).requires_gradient_sync is True  # rejected calls changed nothing


def test_no_sync_raises_at_the_call(world2: DeviceMesh) -> None:
    """A wrong call raises at the call (API.md "Errors"), not later when entering `with`."""
    with pytest.raises(TypeError, match=r"no_sync: argument 'module' must be an nn\.Module"):
        no_sync("model")


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize("api", [fully_shard, replicate, checkpoint], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [123, None, "model", [nn.Linear(2, 2)]], ids=repr)
def test_state_of_a_non_module_is_a_type_error(api: Any, bad: Any) -> None:
    with pytest.raises(TypeError, match=rf"{api.__name__}\.state: argument 'module' must be an nn\.Module"):
        api.state(bad)


@pytest.mark.parametrize("api", [fully_shard, replicate], ids=lambda f: f.__name__)
def test_meta_parameters_at_forward_name_what_to_materialise(world2: DeviceMesh, api: Any) -> None:
    """Left on the meta device (or moved there after the call): a clear RuntimeError at the
    unshard naming the parameters, not "Cannot copy out of meta tensor"."""
    with torch.device("meta"):
        m = _model()
    api(m, mesh=world2)
    with pytest.raises(
        RuntimeError,
        match=rf"{api.__name__}: parameters '0\.weight', '0\.bias', '2\.weight', '2\.bias' are still on the meta device .*to_empty",
    ):
        m(torch.randn(2, 4))
    m = api(_model(), mesh=world2)
    m(torch.randn(2, 4))  # forward kept the root's parameters unsharded for a backward
    m.to("meta")
    with pytest.raises(RuntimeError, match=rf"{api.__name__}: parameters .* are still on the meta device"):
        m(torch.randn(2, 4))


@pytest.mark.parametrize("api", [fully_shard, replicate], ids=lambda f: f.__name__)
def test_rank_not_in_mesh(api: Any) -> None:
    with fake_process_group(2, rank=1):
        mesh = DeviceMesh("cpu", torch.tensor([0]))  # rank 1 is not in it
        m = _model()
        _raises(
            ValueError,
            rf"{api.__name__}: 'mesh' does not contain this rank \(global rank 1\); mesh ranks \[0\]",
            m,
            api,
            m,
            mesh=mesh,
        )
        group = dist.new_group([0])
        _raises(
            ValueError,
            r"replicate: 'process_group' does not contain this rank \(global rank 1\)",
            m,
            replicate,
            m,
            process_group=group,
        )
