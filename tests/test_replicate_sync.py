"""replicate makes the replicas equal at the call, as DDP does: shapes (dtypes, requires_grad)
are checked across ranks first, naming the first parameter or buffer that differs and the
ranks, then rank 0's parameters and buffers are broadcast (meta tensors skipped). fully_shard
runs the same check (no broadcast: each rank keeps its own shard)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import assert_close_tensors, count_collectives, run_on_ranks
from test_replicate import Chain, data, full, loss_fn, params_of
from torch.distributed.tensor import DTensor

from composable import fully_shard, replicate


class WithBuffers(nn.Module):
    """Parameters in fp32, a BatchNorm's fp32 running stats and int64 step count."""

    def __init__(self, widths: tuple[int, ...] = (6, 9, 7, 5, 3)) -> None:
        super().__init__()
        self.chain = Chain(widths)
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.chain(x))


def _gather(value: object, world_size: int) -> list:
    out: list = [None] * world_size
    dist.all_gather_object(out, value)
    return out


def _broadcast_at_call(rank: int, world_size: int) -> None:
    torch.manual_seed(10 + rank)  # every rank initialises differently
    model = WithBuffers()
    with torch.no_grad():
        model.norm.running_mean.fill_(rank + 1.0)
        model.norm.num_batches_tracked.fill_(rank + 7)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    with count_collectives() as comm:
        replicate(model)
    # One all-gather of a digest of the metadata; one broadcast per dtype (fp32, int64).
    assert comm.counts == {"all_gather": 1, "broadcast": 2}, comm.render()
    after = {n: full(t).detach().clone() for n, t in model.state_dict().items()}
    everyone = _gather(after, world_size)
    assert_close_tensors(everyone[rank], _gather(before, world_size)[0], exact=True)  # rank 0's values everywhere
    # Training keeps them equal.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        loss_fn(model, data(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    gathered = _gather(params_of(model), world_size)
    assert_close_tensors(gathered[0], gathered[1], exact=True)


def test_replicate_broadcasts_rank0_parameters_and_buffers_at_the_call() -> None:
    run_on_ranks(_broadcast_at_call, 2)


def _shape_mismatch(rank: int, world_size: int, which: str, api: str = "replicate") -> str:
    model: nn.Module
    if which == "requires_grad":
        model = Chain()
        model.layers[0].bias.requires_grad_(rank == 0)
    elif which == "shape":
        model = Chain((6, 9, 7, 5, 3) if rank == 0 else (6, 9, 8, 5, 3))
    elif which == "missing":
        model = Chain() if rank == 0 else Chain((6, 9, 7, 5))
    else:  # dtype of a buffer
        model = WithBuffers()
        if rank == 1:
            model.norm.running_var = model.norm.running_var.double()
    names = [n for n, _ in model.named_parameters()]
    apply = replicate if api == "replicate" else fully_shard
    with pytest.raises(ValueError) as info:
        apply(model)
    # Untouched: plain parameters still registered, no state installed.
    assert [n for n, p in model.named_parameters() if not isinstance(p, DTensor)] == names
    assert apply.state(model) is None
    return str(info.value)


@pytest.mark.parametrize("api", ["replicate", "fully_shard"])
@pytest.mark.parametrize(
    "which, expected",
    [
        (
            "requires_grad",
            r"{api}: parameter 'layers\.0\.bias' differs across ranks: shape \(9,\) requires_grad=True on ranks \[0\] but shape \(9,\) requires_grad=False on ranks \[1\]",
        ),
        (
            "shape",
            r"replicate: parameter 'layers\.1\.weight' differs across ranks: shape \(7, 9\) on ranks \[0\] but shape \(8, 9\) on ranks \[1\]",
        ),
        (
            "missing",
            r"replicate: parameter 'layers\.3\.weight' differs across ranks: shape \(3, 5\) on ranks \[0\] but missing on ranks \[1\]",
        ),
        (
            "dtype",
            r"replicate: buffer 'norm\.running_var' differs across ranks: shape \(3,\) torch\.float32 on ranks \[0\] but shape \(3,\) torch\.float64 on ranks \[1\]",
        ),
    ],
)
def test_model_mismatch_across_ranks_names_the_parameter(which: str, expected: str, api: str) -> None:
    """replicate, and fully_shard too: ranks that built different models (shapes, dtypes,
    requires_grad) would run collectives of different sizes (gloo aborts, NCCL may hang)."""
    messages = run_on_ranks(_shape_mismatch, 2, which, api)
    assert messages[0] == messages[1]  # the same message on every rank
    assert re.match(expected.replace("{api}", api).replace("replicate:", f"{api}:"), messages[0]), messages[0]


def _meta_skipped(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        model = WithBuffers()
    with count_collectives() as comm:
        replicate(model)
    assert comm.counts == {"all_gather": 1}, comm.render()  # shapes checked, nothing to broadcast
    model.to_empty(device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_replicate_skips_meta_tensors() -> None:
    run_on_ranks(_meta_skipped, 2)
