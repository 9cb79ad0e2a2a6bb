"""torchtitan 0.3 with composable's data parallelism: torchtitan's own parallelize code, sharding
with composable's `fully_shard`.

Every decoder model of torchtitan 0.3 (llama3, qwen3, deepseek_v3, ...) applies data
parallelism in one place, `torchtitan.distributed.fsdp.apply_fsdp_to_decoder`, which calls the
name `fully_shard` of that module (PyTorch FSDP2's) with FSDP2's arguments: the mesh, torch's
`MixedPrecisionPolicy` / `CPUOffloadPolicy`, `reshard_after_forward`, `dp_mesh_dims` under the
"full_dtensor" backend and a `shard_placement_fn` for routed experts (`Shard(1)`, or a
`ShardPlacementResult` on the expert-data-parallel mesh when ep > 1); it then finds the sharded
modules with `isinstance(m, FSDPModule)` to call FSDP2's methods on them
(`set_gradient_divide_factor(1.0)`: torchtitan scales the loss by the global token count
itself; forward/backward prefetching under expert parallelism; the chunked loss's
`set_requires_gradient_sync`, `unshard`, ...).

The hook is that one name and nothing else: while it is installed, `fully_shard` there is
`composable.integrations.fsdp2_module.fsdp2_fully_shard` (FSDP2's signature and policy objects,
composable's sharding, FSDP2's module interface on the result), so torchtitan's parallelize
code runs unchanged, with the same groups, meshes, placements and settings as under FSDP2.

    from composable.integrations.torchtitan import composable_model_spec
    config.model_spec = composable_model_spec(config.model_spec)   # one model
    # or, for every model of the process (torchtitan's train.py entry point):
    from composable.integrations.torchtitan import use_composable_in_torchtitan
    use_composable_in_torchtitan()

Backends (`--parallelism.spmd_backend`), all three served: "spmd_types" (torchtitan's default:
plain local tensors carrying spmd_types annotations, sharded with `dp_mesh_dims` over the whole
mesh and computed with as plain tensors, as FSDP2 does), "partial_dtensor" (DTensors on the
model-parallel meshes, FSDP on the `[dp_replicate, fsdp]` mesh) and "full_dtensor" (every
parameter a DTensor on the whole dense mesh; `dp_mesh_dims` names its data-parallel dims). A
backend name this does not know is refused at the call, naming the three.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator

import torch.nn as nn

from .fsdp2_module import fsdp2_fully_shard
from .torchtitan_version import check_torchtitan_version

__all__ = [
    "SUPPORTED_BACKENDS",
    "composable_model_spec",
    "fully_shard_for_torchtitan",
    "sharding_with_composable",
    "use_composable_in_torchtitan",
]

SUPPORTED_BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")


def _spmd_backend() -> str | None:
    from torchtitan.distributed import utils as dist_utils

    get = getattr(dist_utils, "get_spmd_backend", None)
    return None if get is None else get()


def fully_shard_for_torchtitan(module: nn.Module | list[nn.Module], **kwargs: Any) -> Any:
    """What torchtitan's `apply_fsdp_to_decoder` calls in place of FSDP2's `fully_shard` (same
    keywords): composable's `fully_shard`, and FSDP2's module interface on the result.

    `NotImplementedError` under a torchtitan SPMD backend other than `SUPPORTED_BACKENDS`,
    naming them.
    """
    backend = _spmd_backend()
    if backend is not None and backend not in SUPPORTED_BACKENDS:
        raise NotImplementedError(
            f"composable.integrations.torchtitan: parallelism.spmd_backend {backend!r} is not supported; "
            f"use one of {SUPPORTED_BACKENDS}"
        )
    return fsdp2_fully_shard(module, **kwargs)


def _fsdp_module() -> Any:
    check_torchtitan_version(api="0.3")
    from torchtitan.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        raise NotImplementedError(
            "composable.integrations.torchtitan: torchtitan.distributed.fsdp has no fully_shard to replace "
            "(a torchtitan version this does not support)"
        )
    return fsdp


@contextlib.contextmanager
def sharding_with_composable() -> Iterator[None]:
    """Within the block, torchtitan's data parallelism (`torchtitan.distributed.fsdp`'s
    `fully_shard`) shards with composable (`fully_shard_for_torchtitan`); restored after."""
    fsdp = _fsdp_module()
    original = fsdp.fully_shard
    fsdp.fully_shard = fully_shard_for_torchtitan
    try:
        yield
    finally:
        fsdp.fully_shard = original


def _parallelize_with_composable(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    if getattr(parallelize_fn, "_composable_parallelize", False):
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def parallelize(*args: Any, **kwargs: Any) -> nn.Module:
        with sharding_with_composable():
            return parallelize_fn(*args, **kwargs)

    setattr(parallelize, "_composable_parallelize", True)
    return parallelize


def composable_model_spec(spec: Any) -> Any:
    """A copy of torchtitan's `ModelSpec` whose `parallelize_fn` runs torchtitan's own one with
    `sharding_with_composable()` around it (everything else unchanged). Idempotent.
    `NotImplementedError` for a torchtitan other than 0.3.x."""
    _fsdp_module()
    return dataclasses.replace(spec, parallelize_fn=_parallelize_with_composable(spec.parallelize_fn))


def use_composable_in_torchtitan() -> None:
    """From now on, in this process, every torchtitan model's data parallelism shards with
    composable (`torchtitan.distributed.fsdp.fully_shard` is `fully_shard_for_torchtitan`).
    Idempotent; for an entry point such as torchtitan's `train.py`, where the model spec comes
    from the command line."""
    _fsdp_module().fully_shard = fully_shard_for_torchtitan
