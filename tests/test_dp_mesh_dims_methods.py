"""FSDP2's module methods on modules sharded with `dp_mesh_dims` (parameters on the whole mesh).

Each run drives torch's FSDP2 (`fully_shard(..., dp_mesh_dims=...)`, torch >= 2.13) and
composable's `fully_shard` through the same calls on the same model and data, 4 gloo ranks on a
2x2 mesh (dp x tp, HSDP, replicate dims alone), and checks losses and parameters bit for bit:
gradient accumulation without sync (`set_requires_gradient_sync`), HSDP accumulation without
the all-reduce (`set_requires_all_reduce`), `set_gradient_divide_factor` (sum, then divide),
an explicit `unshard` / `reshard` around a forward, `set_reshard_after_forward(False)` and
`set_reshard_after_backward(False)` between micro-batches. An int `set_reshard_after_forward`
is refused, as the `fully_shard` call refuses an int `reshard_after_forward` with `dp_mesh_dims`.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from test_dp_mesh_dims import CASES, DIM, Model, _apply, _distribute, needs_torch_spmd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from composable import DataParallelMeshDims, fully_shard


def _methods_of(model: nn.Module, ours: bool) -> Callable[[nn.Module], Any]:
    """The object that has the FSDPModule methods of `m`: FSDP2's module, composable's state."""
    return (lambda m: fully_shard.state(m)) if ours else (lambda m: m)


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, mesh, in_place, seeds: list[int], on: Any, plan: str
) -> torch.Tensor:
    """One optimizer step over `len(seeds)` micro-batches, driven by `plan`."""
    root = on(model)
    total = torch.zeros(())
    for i, seed in enumerate(seeds):
        last = i == len(seeds) - 1
        if plan == "no_sync":
            root.set_requires_gradient_sync(last)
        elif plan == "no_all_reduce":
            root.set_requires_all_reduce(last)
        elif plan == "keep_after_backward":
            root.set_reshard_after_backward(last)
        torch.manual_seed(seed)
        x = distribute_tensor(torch.randn(4, 4, DIM), mesh, in_place)
        if plan == "unshard":
            for block in model.blocks:
                on(block).unshard()
        loss = model(x).pow(2).mean().full_tensor()
        if plan == "unshard":
            for block in model.blocks:
                on(block).reshard()
        loss.backward()
        total = total + loss.detach()
    opt.step()
    opt.zero_grad()
    return total


PLANS = ["no_sync", "no_all_reduce", "divide_factor", "unshard", "keep_after_forward", "keep_after_backward"]
# Replicate dims alone (no shard dim), where FSDP2 2.15 does something else:
SKIP_DDP = {
    "keep_after_forward": "FSDP2 has no reshard_after_forward to set without shard dims (AssertionError)",
    "divide_factor": "FSDP2 divides by the factor twice where the shard world is 1 (before and after the sum)",
    "no_all_reduce": "FSDP2 defers the all-reduce of a replicate-only group; composable all-reduces each "
    "micro-batch (the same sum, rounded differently)",
}


def _parity(rank: int, world: int, case: str, plan: str) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    names, dims_kw, in_place = CASES[case]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    dims = DataParallelMeshDims(**dims_kw)
    torch.manual_seed(0)
    ref = _distribute(Model(), mesh, tp=names[1] == "tp")
    ours = copy.deepcopy(ref)
    _apply(torch_fully_shard, ref, mesh, dims, False)
    _apply(fully_shard, ours, mesh, dims, False)
    results = []
    for model, is_ours in ((ref, False), (ours, True)):
        on = _methods_of(model, is_ours)
        if plan == "divide_factor":
            for m in (*model.blocks, model):  # FSDP2 would pre-multiply (PREMUL_SUM, which gloo lacks)
                on(m).set_force_sum_reduction_for_comms(True)
                on(m).set_gradient_divide_factor(3.0)
        elif plan == "keep_after_forward":
            on(model).set_reshard_after_forward(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = [_step(model, opt, mesh, in_place, [10 * s, 10 * s + 1], on, plan) for s in range(3)]
        results.append(losses)
    assert all(torch.equal(a, b) for a, b in zip(*results)), results
    for (n, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert torch.equal(q._local_tensor, p._local_tensor), (n, (q._local_tensor - p._local_tensor).abs().max())


@needs_torch_spmd
@pytest.mark.parametrize("case", ["dp_tp", "hsdp", "ddp_tp"])
@pytest.mark.parametrize("plan", PLANS)
def test_methods_equal_fsdp2(case: str, plan: str) -> None:
    """Losses and parameters over 3 steps of 2 micro-batches equal FSDP2's, bit for bit
    ("ddp_tp": fully_shard with replicate dims alone)."""
    if plan == "no_all_reduce" and case == "dp_tp":
        pytest.skip("set_requires_all_reduce concerns replicate dims")
    if case == "ddp_tp" and plan in SKIP_DDP:
        pytest.skip(SKIP_DDP[plan])
    run_on_ranks(_parity, 4, case, plan)


def _int_reshard_refused(rank: int, world: int) -> None:
    names, dims_kw, _ = CASES["hsdp"]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    model = _distribute(Model(), mesh, tp=False)
    _apply(fully_shard, model, mesh, DataParallelMeshDims(**dims_kw), False)
    state = fully_shard.state(model)
    before = [fully_shard.state(m).reshard_after_forward for m in (*model.blocks, model)]
    for value in (2, 1, 4):
        with pytest.raises(
            NotImplementedError,
            match=rf"set_reshard_after_forward: an int 'reshard_after_forward' \({value}\) is not supported on a module "
            r"sharded with 'dp_mesh_dims' \(Model\), as at fully_shard",
        ):
            state.set_reshard_after_forward(value)
    # Refused as a whole: no state below changed either.
    assert [fully_shard.state(m).reshard_after_forward for m in (*model.blocks, model)] == before
    with pytest.raises(NotImplementedError, match=r"\(Block\), as at fully_shard"):
        fully_shard.state(model.blocks[0]).set_reshard_after_forward(2, recurse=False)
    state.set_reshard_after_forward(False)  # a bool is fine
    assert all(fully_shard.state(m).reshard_after_forward is False for m in (*model.blocks, model))


def test_int_set_reshard_after_forward_refused() -> None:
    """An int is refused with one line naming the method, the value and the module (FSDP2
    2.15 refuses any int in `set_reshard_after_forward`; composable takes ints elsewhere)."""
    run_on_ranks(_int_reshard_refused, 4)
