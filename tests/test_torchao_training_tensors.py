"""torchao's training tensor subclasses under `fully_shard`, as under FSDP2: int8 quantized
training (int8 weights updated with stochastic rounding), int8 mixed precision (fp32 weights,
int8 matmuls) and BitNet b1.58 (ternary weights gathered packed in 2 bits). Each implements
FSDP2's all-gather extension; `fully_shard` shards them with FSDP2's ops, keeps them of their
kind and gathers them through their hooks.

Checked on gloo against PyTorch's FSDP2 bit for bit (losses, gradients, trained weights), with
and without a bf16 mixed-precision policy, and against one process (the first step's loss and
gradients). Also, without torchao: the dtype handed to `fsdp_post_all_gather` is the
parameter's own, as FSDP2's (not its group's), and a subclass that cannot be cut as FSDP2 cuts
it fails at the call in one line naming the parameter, its type and the op.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks
from test_all_gather_extension import BF16GatherWeight

from composable import MixedPrecisionPolicy, fully_shard

DIM = 64


def _has_torchao() -> bool:
    try:
        import torchao.prototype.quantized_training  # noqa: F401
    except ImportError:
        return False
    return True


needs_torchao = pytest.mark.skipif(not _has_torchao(), reason="needs torchao's quantized training: pip install torchao")


def _quantized(kind: str, seed: int = 0) -> nn.Sequential:
    """Three linears (with fp32 biases) whose weights are torchao training tensors of `kind`."""
    from torchao import quantize_
    from torchao.prototype import quantized_training as qt

    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(3)))
    config = {
        "int8": qt.int8_weight_only_quantized_training,
        "int8_mixed_precision": qt.int8_mixed_precision_training,
        "bitnet": qt.bitnet_training,
    }[kind]()
    quantize_(model, config)
    return model


def _shard(model: nn.Sequential, api: str, bf16: bool) -> nn.Sequential:
    if api == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy as Policy
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard, Policy = fully_shard, MixedPrecisionPolicy
    policy = Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else Policy()
    for layer in [*model, model]:
        shard(layer, mp_policy=policy)
    return model


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(step * world + rank))


def _vs_fsdp2(rank: int, world: int, kind: str, bf16: bool) -> None:
    single = _quantized(kind)
    kind_type = type(single[0].weight)
    ours, theirs = (_shard(copy.deepcopy(single), api, bf16) for api in ("composable", "fsdp2"))
    assert type(ours[0].weight.to_local()) is kind_type, "the local shard keeps its kind"
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]  # int8 weights have no mul_ (decay)
    for step in range(3):
        x = _batch(step, rank, world)
        losses = [m(x).square().mean() for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        assert_close_tensors(losses[0].detach(), losses[1].detach(), exact=True, msg=f"step {step} loss")
        for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert_close_tensors(a.grad.to_local(), b.grad.to_local(), exact=True, msg=f"step {step} grad {name}")
        if step == 0 and not bf16:  # one process on every rank's batch: the same mean loss and gradients
            mean = losses[0].detach().clone()
            dist.all_reduce(mean)
            one = single(torch.cat([_batch(0, r, world) for r in range(world)])).square().mean()
            one.backward()
            assert_close_tensors(mean / world, one.detach(), rtol=1e-5, atol=1e-6, msg="loss vs one process")
            for (name, a), (_, c) in zip(ours.named_parameters(), single.named_parameters()):
                assert_close_tensors(a.grad.full_tensor(), c.grad, rtol=1e-3, atol=1e-5, msg=f"grad {name}")
        for opt in opts:
            torch.manual_seed(100 + step)  # int8 training rounds stochastically in the update
            opt.step()
            opt.zero_grad()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert type(a.to_local()) is type(b.to_local()), name
        local_a, local_b = a.to_local(), b.to_local()
        names = local_a.__tensor_flatten__()[0] if hasattr(local_a, "__tensor_flatten__") else []
        for inner in names:  # the trained weights, held as their kind: the same bytes as FSDP2's
            assert torch.equal(getattr(local_a, inner), getattr(local_b, inner)), f"{name}.{inner}"
        if not names:
            assert torch.equal(local_a, local_b), name


@needs_torchao
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16_policy"])
@pytest.mark.parametrize("kind", ["int8", "int8_mixed_precision", "bitnet"])
def test_training_tensor_matches_fsdp2(kind: str, bf16: bool) -> None:
    run_on_ranks(_vs_fsdp2, 2, kind, bf16)


class _Net(nn.Module):
    """A linear computing in its frozen weight's dtype (the trainable bias is fp32: FSDP2 wants
    one dtype among trainable parameters, as in QLoRA's bf16 NF4 base with fp32 adapters)."""

    def __init__(self, weight_dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(DIM, DIM)
        weight = BF16GatherWeight(self.lin.weight.detach().to(weight_dtype))
        self.lin.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        self.seen = w.dtype
        return nn.functional.linear(x.to(w.dtype), w, self.lin.bias.to(w.dtype)).float()


def _own_dtype(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    models = [_Net(torch.bfloat16) for _ in range(2)]
    fully_shard(models[0])
    torch_fully_shard(models[1])
    x = _batch(0, rank, world)
    losses = [m(x).square().mean() for m in models]
    assert models[0].seen == models[1].seen == torch.bfloat16, [m.seen for m in models]
    assert_close_tensors(losses[0], losses[1], exact=True)


def test_post_all_gather_gets_the_parameters_own_dtype() -> None:
    """A frozen bf16 extension weight in a group of fp32 parameters, no policy: made in bf16, as
    under FSDP2 (it was made in the group's fp32)."""
    run_on_ranks(_own_dtype, 2)


class _NoSplitWeight(BF16GatherWeight):
    """An extension weight that cannot be split (FSDP2 cannot shard it either)."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.split.Tensor:
            raise NotImplementedError("no split\nfor this weight")
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_unshardable_subclass_fails_at_the_call_in_one_line(world2: Any) -> None:
    model = nn.Sequential(nn.Linear(DIM, DIM))
    model[0].weight = nn.Parameter(_NoSplitWeight(model[0].weight.detach()))
    with pytest.raises(NotImplementedError) as info:
        fully_shard(model, mesh=world2)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(
        "fully_shard: parameter '0.weight' of type _NoSplitWeight cannot be sharded: it lacks torch.chunk on dim 0"
    ), message
