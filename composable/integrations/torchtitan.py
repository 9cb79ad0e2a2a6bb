"""torchtitan with composable's data parallelism, for torchtitan 0.2.x and 0.3.x.

torchtitan 0.3 (`composable_model_spec`, `use_composable_in_torchtitan`; composable.integrations.torchtitan_v03):
torchtitan's own parallelize code of every decoder model (llama3, qwen3 and its mixture of
experts, deepseek_v3, ...) shards with composable's `fully_shard` in place of FSDP2's.

torchtitan 0.2 (`register_llama3`, `parallelize_llama`, `pipeline_llama` below): a
`parallelize_fn` for its llama3 model and the model registration that selects it.

torchtitan applies its parallelisms in each model's `parallelize_fn`, a field of the model's
`TrainSpec` (the framework's extension point). `parallelize_llama` here runs torchtitan's own
llama3 `parallelize_llama` for everything but data parallelism (tensor / context parallelism,
activation checkpointing, per-block `torch.compile`, float8 converters are untouched), then
shards with composable exactly where torchtitan's `apply_fsdp` uses FSDP2: the token embeddings,
each transformer block, one group over `[norm, output]`, and the root; HSDP on a 2D
`[dp_replicate, fsdp]` mesh; composable's `replicate` where torchtitan would use DDP.

torchtitan scales the loss by the global count of valid tokens itself, and FSDP2's averaging is
switched off for that (`disable_fsdp_gradient_division`, which only finds `FSDPModule`
instances): here every group reduces with `set_gradient_divide_factor(1.0)` too, otherwise the
gradients would silently be off by the data-parallel size. The sharded modules get FSDP2's
module interface (`fsdp2_module.as_fsdp_module`), so torchtitan code that looks for
`FSDPModule`s (fault tolerance, float8 scale precompute) finds them.

Pipeline parallelism (`--parallelism.pipeline_parallel_degree > 1`): torchtitan's `pipeline_llm`
splits the model into stage modules, calls the `parallelize_fn` on each (so each stage is sharded
with composable on the data-parallel mesh of the `(pp, dp...)` mesh) and wraps each in torch's
`PipelineStage`, which would reduce a composable stage's gradients once per microbatch.
`pipeline_llama` runs torchtitan's `pipeline_llm` with `ComposablePipelineStage` in its place
(composable.integrations.pipelining): one reduction per group per step, as FSDP2 gets.

    from composable.integrations.torchtitan import register_llama3
    register_llama3()     # then run torchtitan with `--model.name llama3_composable`

`examples/integrations/torchtitan_train.py` is torchtitan's `train.py` entry point with that
line added.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from composable import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard, replicate

from .fsdp2_module import as_fsdp_modules
from .pipelining import ComposablePipelineStage
from .torchtitan_v03 import (
    composable_model_spec,
    fully_shard_for_torchtitan,
    sharding_with_composable,
    use_composable_in_torchtitan,
)
from .torchtitan_version import SUPPORTED, check_torchtitan_version, installed_torchtitan_version  # noqa: F401

__all__ = [
    "apply_fsdp",
    "check_torchtitan_version",
    "composable_model_spec",
    "fully_shard_for_torchtitan",
    "installed_torchtitan_version",
    "parallelize_llama",
    "pipeline_llama",
    "register_llama3",
    "sharding_with_composable",
    "use_composable_in_torchtitan",
]


def _reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":  # torchtitan's default: no reshard under pipeline parallelism
        return not pp_enabled
    raise ValueError(
        f"apply_fsdp: 'reshard_after_forward_policy' must be 'default', 'always' or 'never', got {policy!r}"
    )


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
) -> nn.Module:
    """torchtitan's llama3 `apply_fsdp` (same arguments, same groups) on composable's `fully_shard`.

    Gradients are summed, not averaged (divide factor 1.0): torchtitan divides the loss by the
    global number of valid tokens.
    """
    options: dict[str, Any] = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    reshard = _reshard_after_forward(reshard_after_forward_policy, pp_enabled)
    if getattr(model, "tok_embeddings", None) is not None:
        fully_shard(cast(nn.Module, model.tok_embeddings), reshard_after_forward=reshard, **options)
    for block in cast(nn.ModuleDict, model.layers).values():
        fully_shard(block, reshard_after_forward=reshard, **options)
    if getattr(model, "norm", None) is not None and getattr(model, "output", None) is not None:
        # The last group runs at the end of forward and first in backward: keep it gathered.
        fully_shard(
            [cast(nn.Module, model.norm), cast(nn.Module, model.output)],
            reshard_after_forward=reshard_after_forward_policy == "always",
            **options,
        )
    fully_shard(model, **options)
    seen: set[int] = set()
    for module in model.modules():
        state = fully_shard.state(module)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            state.set_gradient_divide_factor(1.0)
    return as_fsdp_modules(model)


class _WithoutDataParallel:
    """A view of torchtitan's `ParallelDims` with data parallelism off, so torchtitan's own
    `parallelize_llama` applies everything else and leaves data parallelism to composable."""

    fsdp_enabled = False
    dp_replicate_enabled = False

    def __init__(self, parallel_dims: Any) -> None:
        self._parallel_dims = parallel_dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel_dims, name)


def parallelize_llama(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
    """torchtitan's llama3 `parallelize_fn` with composable's data parallelism (same arguments)."""
    check_torchtitan_version(api="0.2")
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models.llama3 import parallelize_llama as torchtitan_parallelize_llama

    model = torchtitan_parallelize_llama(model, _WithoutDataParallel(parallel_dims), job_config)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
    elif parallel_dims.dp_replicate_enabled:
        mesh = parallel_dims.get_mesh("dp_replicate")
        if parallel_dims.world_size != mesh.size():
            raise NotImplementedError("parallelize_llama: DDP (replicate) with other parallelisms is not supported")
        replicate(model, mesh=mesh, bucket_cap_mb=100)
    return model


@contextlib.contextmanager
def _composable_stages(built: list[ComposablePipelineStage]) -> Iterator[None]:
    """torchtitan 0.2 constructs its stages by the name `PipelineStage` of its pipeline module
    and offers no hook for the stage class: build `ComposablePipelineStage`s (same arguments)
    there for the duration of the call, and record them."""
    from torchtitan.distributed import pipeline_parallel

    def build(*args: Any, **kwargs: Any) -> ComposablePipelineStage:
        stage = ComposablePipelineStage(*args, **kwargs)
        built.append(stage)
        return stage

    original = pipeline_parallel.PipelineStage
    pipeline_parallel.PipelineStage = build
    try:
        yield
    finally:
        pipeline_parallel.PipelineStage = original


def pipeline_llama(
    model: nn.Module,
    parallel_dims: Any,
    job_config: Any,
    device: torch.device,
    model_args: Any,
    parallelize_fn: Callable[..., nn.Module],
    loss_fn: Callable[..., torch.Tensor],
) -> tuple[Any, list[nn.Module], bool, bool]:
    """torchtitan's `pipeline_llm` (its `pipelining_fn`: same arguments, same split, schedule and
    results) with each stage a `ComposablePipelineStage`: the stage modules that
    `parallelize_fn` (composable's, e.g. `parallelize_llama`) shards with composable reduce
    their gradients once per group per step, not once per microbatch."""
    check_torchtitan_version(api="0.2")
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import pipeline_parallel

    built: list[ComposablePipelineStage] = []
    with _composable_stages(built):
        result = pipeline_parallel.pipeline_llm(
            model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn
        )
    if not built:
        raise NotImplementedError(
            "pipeline_llama: torchtitan's pipeline_llm built no stage through "
            "torchtitan.distributed.pipeline_parallel.PipelineStage (a torchtitan version this does not support)"
        )
    for stage in built:
        for module in stage.submod.modules():
            # PyTorch's FSDP2 in a composable stage would never reduce its gradients.
            if isinstance(module, FSDPModule) and fully_shard.state(module) is None:
                raise ValueError(
                    f"pipeline_llama: parallelize_fn must shard with composable (parallelize_llama), "
                    f"got {getattr(parallelize_fn, '__module__', '?')}.{getattr(parallelize_fn, '__name__', '?')}, "
                    "which applied PyTorch's FSDP2"
                )
    return cast("tuple[Any, list[nn.Module], bool, bool]", result)  # torchtitan's, untyped here


def register_llama3(name: str = "llama3_composable") -> str:
    """Register torchtitan's llama3 `TrainSpec` with `parallelize_llama` and `pipeline_llama`
    above under `name` (select it with `--model.name <name>`; the model flavors are llama3's).
    Idempotent. `NotImplementedError` for a torchtitan outside 0.2.x."""
    check_torchtitan_version(api="0.2")
    from torchtitan.protocols import train_spec as specs

    spec = dataclasses.replace(
        specs.get_train_spec("llama3"), parallelize_fn=parallelize_llama, pipelining_fn=pipeline_llama
    )
    try:
        specs.register_train_spec(name, spec)
    except ValueError:  # registered before (torchtitan refuses a second registration)
        if specs.get_train_spec(name).parallelize_fn is not parallelize_llama:
            raise
    return name
