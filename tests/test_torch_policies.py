"""PyTorch FSDP2's policy objects (`torch.distributed.fsdp.MixedPrecisionPolicy`,
`OffloadPolicy`, `CPUOffloadPolicy`) are accepted wherever composable takes a policy, and
converted to composable's (same fields, same meaning); anything else is a `TypeError` that
names the API, the argument and the value's type, fully qualified."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import OffloadPolicy as TorchOffload

from composable import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard, replicate
from composable.integrations.fsdp2_module import fsdp2_fully_shard

bf16, fp32 = torch.bfloat16, torch.float32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model: nn.Module, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        torch.manual_seed(10 * step + rank)
        model(torch.randn(5, 4)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def _accepted(rank: int, world_size: int) -> None:
    torch_mp = TorchMP(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32, cast_forward_inputs=True)
    ours_mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32, cast_forward_inputs=True)
    for offload, expected in [
        (TorchOffload(), OffloadPolicy()),
        (TorchCPUOffload(pin_memory=False), CPUOffloadPolicy(pin_memory=False)),
    ]:
        a = fully_shard(_model(), mp_policy=torch_mp, offload_policy=offload)
        b = fully_shard(_model(), mp_policy=ours_mp, offload_policy=expected)
        state = fully_shard.state(a)
        assert type(state.mp_policy) is MixedPrecisionPolicy and state.mp_policy == ours_mp, state.mp_policy
        assert state.offload_policy == expected, state.offload_policy
        assert_close_tensors(_train(a, rank), _train(b, rank), exact=True, msg=f"fully_shard {offload}")
    a, b = replicate(_model(), mp_policy=torch_mp), replicate(_model(), mp_policy=ours_mp)
    assert replicate.state(a).mp_policy == ours_mp
    assert_close_tensors(_train(a, rank), _train(b, rank), exact=True, msg="replicate")
    if "param_dtype_override_fn" in TorchMP.__dataclass_fields__:  # torch >= 2.15: carried over too
        keep = lambda p: p.dtype  # noqa: E731
        state = fully_shard.state(
            fully_shard(_model(), mp_policy=TorchMP(param_dtype=bf16, param_dtype_override_fn=keep))
        )
        assert state.mp_policy == MixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn=keep)
    # The FSDP2-signature adapter (what accelerate calls) takes them too.
    a = fsdp2_fully_shard(_model(), mp_policy=torch_mp, offload_policy=TorchCPUOffload(pin_memory=False))
    assert fully_shard.state(a).mp_policy == ours_mp
    assert fully_shard.state(a).offload_policy == CPUOffloadPolicy(pin_memory=False)


def test_torch_policies_are_accepted_and_converted() -> None:
    """Same policy fields, same training as with composable's policies, bit for bit."""
    run_on_ranks(_accepted, 2)


def _refused(rank: int, world_size: int) -> None:
    mp = r"'mp_policy' must be a composable.MixedPrecisionPolicy or a torch.distributed.fsdp.MixedPrecisionPolicy"
    offload = r"'offload_policy' must be a composable.OffloadPolicy .* or a torch.distributed.fsdp.OffloadPolicy"
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (fully_shard, {"mp_policy": CPUOffloadPolicy()}, rf"fully_shard: {mp}, got composable.CPUOffloadPolicy"),
        (fully_shard, {"mp_policy": TorchOffload()}, rf"fully_shard: {mp}, got torch.distributed.fsdp.OffloadPolicy"),
        (replicate, {"mp_policy": {"param_dtype": bf16}}, rf"replicate: {mp}, got dict:"),
        (
            fully_shard,
            {"offload_policy": TorchMP()},
            rf"fully_shard: {offload}, got torch.distributed.fsdp.MixedPrecisionPolicy",
        ),
        (fully_shard, {"offload_policy": "cpu"}, rf"fully_shard: {offload}, got str:"),
        (fsdp2_fully_shard, {"mp_policy": bf16}, rf"fully_shard: {mp}, got torch.dtype"),
    ]
    for api, kwargs, match in cases:
        with pytest.raises(TypeError, match=match):
            api(_model(), **kwargs)


def test_wrong_policy_types_name_both_classes_fully() -> None:
    run_on_ranks(_refused, 2)
