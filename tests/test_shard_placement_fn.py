"""`fully_shard(..., shard_placement_fn=...)`: parameters sharded on a dim other than 0.

Against a single-process reference (2 and 4 ranks, uneven sizes: width 10 and vocab 13 split
over 4), against PyTorch FSDP2 with the same function (bit for bit), through DCP save and
load across layouts (Shard(1) <-> Shard(0)), `clip_grad_norm_`, an int
`reshard_after_forward`, and the errors for bad return values.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from composable import clip_grad_norm_, fully_shard

RTOL, ATOL = 1e-5, 1e-6


def on_last_dim(param: nn.Parameter) -> Shard | None:
    return Shard(-1) if param.dim() >= 2 else None


def _shard(model: TinyTransformer, fn: object = on_last_dim, **options: object) -> TinyTransformer:
    for block in model.layers:
        fully_shard(block, shard_placement_fn=fn, **options)
    fully_shard(model, shard_placement_fn=fn)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _parity(rank: int, world: int, reshard: bool | int) -> None:
    ref = TinyTransformer()
    model = _shard(copy.deepcopy(ref), reshard_after_forward=reshard)
    for name, p in model.named_parameters():
        expected = Shard(1) if p.dim() >= 2 else Shard(0)
        assert p.placements == (expected,), (name, p.placements)
        chunks = torch.empty(p.shape).chunk(world, dim=expected.dim)  # DTensor's Shard(d): torch.chunk
        local_rows = chunks[rank].shape[expected.dim] if rank < len(chunks) else 0
        assert p.to_local().shape[expected.dim] == local_rows, (name, p.to_local().shape)
    # SGD: Adam would turn rounding in the key bias's exactly-zero gradient into lr-sized steps.
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        loss = lm_loss(model, batch_for(step, world, rank))
        loss.backward()
        ref_loss = lm_loss(ref, batch_for(step, world, None))
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert_close_tensors(mean / world, ref_loss.detach(), rtol=RTOL, atol=ATOL, msg=f"step {step} loss")
        norm, ref_norm = clip_grad_norm_(model.parameters(), 1.0), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        assert_close_tensors(norm, ref_norm, rtol=RTOL, atol=ATOL, msg=f"step {step} grad norm")
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            assert_close_tensors(_full(p.grad), r.grad, rtol=RTOL, atol=ATOL, msg=f"step {step} grad {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close_tensors(_full(p), r, rtol=RTOL, atol=ATOL, msg=f"param {name}")


@pytest.mark.parametrize("world, reshard", [(2, True), (4, True), (4, 2)], ids=["2", "4", "4-reshard2"])
def test_other_shard_dims_train_like_the_reference(world: int, reshard: bool | int) -> None:
    run_on_ranks(_parity, world, reshard)


def _vs_fsdp2(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = TinyTransformer()
    ours = _shard(copy.deepcopy(theirs))
    mesh = init_device_mesh("cpu", (world,))
    for block in theirs.layers:
        torch_fully_shard(block, mesh=mesh, shard_placement_fn=on_last_dim)
    torch_fully_shard(theirs, mesh=mesh, shard_placement_fn=on_last_dim)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        losses = [lm_loss(m, batch_for(step, world, rank)) for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        assert_close_tensors(losses[0].detach(), losses[1].detach(), exact=True, msg=f"step {step} loss")
        for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert a.grad.placements == b.grad.placements, name
            assert_close_tensors(a.grad.to_local(), b.grad.to_local(), exact=True, msg=f"step {step} grad {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_other_shard_dims_match_torch_fsdp2() -> None:
    run_on_ranks(_vs_fsdp2, 2)


def _dcp_across_layouts(rank: int, world: int, path: str) -> None:
    torch.manual_seed(1)
    source = _shard(TinyTransformer())
    lm_loss(source, batch_for(0, world, rank)).backward()
    torch.optim.SGD(source.parameters(), lr=0.1).step()
    dcp.save(source.state_dict(), checkpoint_id=path)
    for fn in (None, on_last_dim):  # into Shard(0) and into Shard(-1) layouts
        torch.manual_seed(2)
        target = _shard(TinyTransformer(), fn=fn)
        state = target.state_dict()
        dcp.load(state, checkpoint_id=path)
        target.load_state_dict(state)
        for (name, a), (_, b) in zip(target.named_parameters(), source.named_parameters()):
            assert_close_tensors(_full(a), _full(b), exact=True, msg=f"{fn} {name}")
        tokens = batch_for(1, world, rank)
        assert_close_tensors(lm_loss(target, tokens).detach(), lm_loss(source, tokens).detach(), exact=True, msg="loss")


def test_dcp_save_and_load_across_shard_dims(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_on_ranks(_dcp_across_layouts, 2, str(tmp_path / "ckpt"))


def _errors(rank: int, world: int) -> None:
    with pytest.raises(
        TypeError, match=r"fully_shard: 'shard_placement_fn' must be a callable\(param\) -> Shard \| None, got 3"
    ):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=3)
    with pytest.raises(
        TypeError, match=r"fully_shard: 'shard_placement_fn' must return a Shard or None, got 1 for 'weight'"
    ):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: 1)
    with pytest.raises(
        ValueError,
        match=r"fully_shard: 'shard_placement_fn' returned Shard\(dim=2\) for 'weight' of shape \(4, 4\): no such dim",
    ):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2))


def test_shard_placement_fn_errors() -> None:
    run_on_ranks(_errors, 2)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tp_other_dims_vs_fsdp2(rank: int, world: int) -> None:
    """Tensor-parallel weights (colwise Shard(0), rowwise Shard(1) over tp) sharded over dp on
    dim 1: placements, losses and parameters equal FSDP2's (dp 2 x tp 2)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ours = _Mlp()
    theirs = copy.deepcopy(ours)
    for model, shard in ((ours, fully_shard), (theirs, torch_fully_shard)):
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        shard(model, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert a.placements == b.placements and a.device_mesh == b.device_mesh, (name, a.placements, b.placements)
        assert_close_tensors(a.to_local(), b.to_local(), exact=True, msg=name)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(3):
        torch.manual_seed(10 + step + 100 * mesh["dp"].get_local_rank())
        x = torch.randn(4, 8)
        losses = []
        for model, opt in zip((ours, theirs), opts):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert_close_tensors(losses[0], losses[1], exact=True, msg=f"step {step}: loss")
        for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert_close_tensors(a.to_local(), b.to_local(), exact=True, msg=f"step {step}: {name}")


def test_tensor_parallel_weights_on_other_dims_match_torch_fsdp2() -> None:
    run_on_ranks(_tp_other_dims_vs_fsdp2, 4)
