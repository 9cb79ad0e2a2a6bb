"""FSDP2's all-gather extension: a parameter whose local tensor implements
`fsdp_pre_all_gather` / `fsdp_post_all_gather` is all-gathered through them.

`BF16GatherWeight` is a small wrapper subclass of our own (as torchao's float8 weights are):
an fp32 weight that all-gathers in bf16, half the bytes. Checked against PyTorch's FSDP2 with
the same subclass (bit for bit: the same rounding happens in both), and by counting what the
all-gathers carry: one per group, the weight's bytes riding in the flat buffer's collective.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from _harness import run_on_ranks, step_and_match, trace_collectives
from torch.distributed.device_mesh import init_device_mesh

from composable import fully_shard

aten = torch.ops.aten
# Ops whose results stay weights of this kind (views, copies, allocations), as torchao's do.
_PRESERVE = {
    aten.detach.default, aten.clone.default, aten.slice.Tensor, aten.view.default, aten.alias.default,
    aten._to_copy.default, aten.empty_like.default, aten.new_empty.default, aten.new_zeros.default,
    aten.split.Tensor, aten.as_strided.default, aten.copy_.default, aten.narrow.default,
}  # fmt: skip


class BF16GatherWeight(torch.Tensor):
    """An fp32 weight that all-gathers in bf16; every other op runs on the fp32 data."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> "BF16GatherWeight":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data.shape,
            strides=data.stride(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"BF16GatherWeight({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: None, size: Any, stride: Any) -> "BF16GatherWeight":
        return BF16GatherWeight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t._data if isinstance(t, cls) else t

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        if func in _PRESERVE:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        return out

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any) -> tuple:
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs: tuple, metadata: Any, param_dtype: torch.dtype, *, out: Any = None) -> Any:
        (data,) = outputs
        if out is not None:  # refill in place; the same values, so not a mutation autograd should see
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(data)
            return None
        unsharded = data.to(param_dtype)
        return unsharded, (unsharded,)


class AliasingGatherWeight(BF16GatherWeight):
    """Gathers its fp32 data as is and computes with the all-gather output itself, so the
    `out=` refill does nothing: as torchao's float8 weights (which only swap the scale), it
    relies on later gathers writing into the same outputs."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any) -> tuple:
        return (self._data,), None

    def fsdp_post_all_gather(self, outputs: tuple, metadata: Any, param_dtype: torch.dtype, *, out: Any = None) -> Any:
        (data,) = outputs
        if out is not None:
            return None
        return data, (data,)


class Float8GatherWeight(BF16GatherWeight):
    """Gathers its data as float8 (e4m3, unscaled: the test's weights are small); composable
    moves float8 as bytes, which gloo can carry (FSDP2 does so only in groups that mix dtypes,
    as every group here does)."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any) -> tuple:
        return (self._data.to(torch.float8_e4m3fn),), None


KINDS = {"bf16": BF16GatherWeight, "aliasing": AliasingGatherWeight, "float8": Float8GatherWeight}
# The bytes per element each block's extension weight all-gathers (the flat buffers gather fp32).
GATHER_BYTES = {"bf16": 2, "aliasing": 4, "float8": 1}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _with_extension_weights(model: Net, kind: str = "bf16") -> Net:
    for block in model.blocks:
        block[0].weight = nn.Parameter(KINDS[kind](block[0].weight.detach().clone()))
    return model


def _vs_fsdp2(rank: int, world: int, kind: str = "bf16") -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    theirs = _with_extension_weights(Net(), kind)
    ours = copy.deepcopy(theirs)
    mesh = init_device_mesh("cpu", (world,))
    for block in theirs.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    for block in ours.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    assert isinstance(ours.blocks[0][0].weight.to_local(), KINDS[kind]), "the local shard keeps its kind"
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
        with trace_collectives() as t:
            our_loss = ours(x).square().mean()
        # One fp32 all-gather per group; a block's carries its bias and its extension weight's
        # bytes as the weight says, padded to whole fp32 elements.
        gathers = [r for r in t.records if r.kind == "all_gather"]
        block = world * (8 // world + -(-(64 // world) * GATHER_BYTES[kind] // 4))
        assert len(gathers) == 3 and {r.dtype for r in gathers} == {torch.float32}, t.render()
        assert sum(r.numel == block for r in gathers) == 2, t.render()
        their_loss = theirs(x).square().mean()
        for loss in (our_loss, their_loss):
            loss.backward()
        step_and_match(ours, theirs, opts, f"step {step}", same_placements=True, losses=(our_loss, their_loss))


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_extension_matches_torch_fsdp2(world: int) -> None:
    run_on_ranks(_vs_fsdp2, world)


@pytest.mark.parametrize("kind", ["aliasing", "float8"])
def test_extension_protocol_matches_torch_fsdp2(kind: str) -> None:
    """aliasing: later gathers refill the all-gather outputs the unsharded parameter was made
    from (fresh outputs each time left it reading freed storage from the first backward on). float8:
    gathered as bytes (gloo has no float8: "Invalid scalar type")."""
    run_on_ranks(_vs_fsdp2, 2, kind)
