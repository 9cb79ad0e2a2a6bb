"""Tensor parallel x FSDP (2D) on a 2x2 (dp, tp) mesh of 4 ranks.

Users apply PyTorch's tensor-parallel plan first (`parallelize_module` on `mesh["tp"]`), then
`fully_shard(block, mesh=mesh["dp"])` per block and on the root. The model is a stack of MLP
blocks with a sequence-parallel LayerNorm: `norm` SequenceParallel, `w1`
ColwiseParallel(input_layouts=Shard(1)), `w2` RowwiseParallel(output_layouts=Shard(1)). Every
dp rank gets its own batch rows and every tp rank its part of the sequence.

Checked against a single-process reference trained on the whole batch:
- layout: every parameter is a DTensor on the 2D (dp, tp) parent mesh, with the TP placement
  on tp and a dp shard of the TP-local tensor on dp (`_StridedShard(0, sf=tp)` under a
  Colwise `Shard(0)`, so the global row order stays right); each local shard holds exactly the
  reference's rows/columns, and DTensor's own idea of the local shape (what DCP uses) agrees;
- gradients (same placements and mesh as their parameters) and parameters over 3 AdamW steps,
  and the losses, to fp32 rounding;
- `torch.nn.utils.clip_grad_norm_` on the 2D model (total norm and clipped gradients);
- uneven sizes: dp shards of unequal size, unequal TP shards (hidden and sequence lengths
  odd), and an empty dp shard of a TP-local tensor. PyTorch's TP styles wrap their *local* inputs with `DTensor.from_local` without a
  global shape, which assumes even shards; with uneven TP shards that breaks TP itself, FSDP
  or not (`a and b must have same reduction dim` in `w2`). Uneven TP therefore keeps DTensor
  activations end to end (`use_local_output=False`, a DTensor input), which PyTorch supports.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks
from _models import NormMLPBlock, NormMLPStack
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from composable import ShardingStrategy, fully_shard, replicate

# PyTorch 2.11-2.12's tensor parallelism itself fails on uneven TP shards (F.linear raises "view
# size is not compatible" with no fully_shard involved: checked with torch 2.11.0 and 2.12.1 on CPU).
UNEVEN_TP_NEEDS_TORCH_2_13 = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="PyTorch < 2.13 tensor parallelism fails on uneven TP shards, without fully_shard too",
)

STEPS = 3
LR = 1e-2
BATCH_PER_DP = 2
# fp32 on CPU: sharded runs sum partial products in another order than the reference.
# Measured: about 3e-8 on gradients of size ~0.1; losses and parameters alike.
TOL = dict(rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- model


def _plan(local_outputs: bool) -> dict:
    return {
        "norm": SequenceParallel(use_local_output=local_outputs),
        "w1": ColwiseParallel(input_layouts=Shard(1), use_local_output=local_outputs),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=local_outputs),
    }


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _parallelize(model: NormMLPStack, mesh: DeviceMesh, local_outputs: bool) -> NormMLPStack:
    for block in model.layers:
        parallelize_module(block, mesh["tp"], _plan(local_outputs))
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


# ----------------------------------------------------------------------------- expectations


def _chunk(t: torch.Tensor, n: int, i: int, dim: int) -> torch.Tensor:
    """Piece `i` of `n` of torch.chunk (DTensor's Shard semantics); empty past the last one."""
    pieces = t.chunk(n, dim=dim)
    return pieces[i] if i < len(pieces) else t.narrow(dim, 0, 0)


def _expected_local(name: str, full: torch.Tensor, dp: int, tp: int) -> torch.Tensor:
    """The rows/columns of the reference tensor that rank (dp, tp) must hold: the TP-local
    piece, then this dp rank's dim-0 piece of that."""
    if ".w1." in name:  # Colwise: tp splits dim 0
        tp_local = _chunk(full, 2, tp, 0)
    elif name.endswith("w2.weight"):  # Rowwise: tp splits dim 1
        tp_local = _chunk(full, 2, tp, 1)
    else:  # norm and w2.bias: replicated over tp
        tp_local = full
    return _chunk(tp_local, 2, dp, 0)


def _expected_placements(name: str) -> tuple:
    if ".w1." in name:
        return (_StridedShard(0, split_factor=2), Shard(0))
    if name.endswith("w2.weight"):
        return (Shard(0), Shard(1))
    return (Shard(0), Replicate())


def _check_layout(model: nn.Module, ref: nn.Module, mesh: DeviceMesh) -> None:
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), f"{name}: {type(p).__name__}"
        assert p.device_mesh == mesh and p.device_mesh.mesh_dim_names == ("dp", "tp"), f"{name}: {p.device_mesh}"
        assert p.placements == _expected_placements(name), f"{name}: {p.placements}"
        assert p.shape == r.shape and p.requires_grad, name
        local = p.to_local()
        assert torch.equal(local, _expected_local(name, r.detach(), dp, tp)), (
            f"{name}: local shard holds the wrong values"
        )
        dtensor_shape, _ = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        assert tuple(local.shape) == tuple(dtensor_shape), (
            f"{name}: local {tuple(local.shape)}, DTensor says {dtensor_shape}"
        )
        assert_close_tensors(p, r, exact=True, msg=f"full_tensor of {name}")


def _check_grads(model: nn.Module, ref: nn.Module, step: int) -> None:
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        g = p.grad
        assert isinstance(g, DTensor), f"step {step}: grad of {name} is {type(g).__name__}"
        assert g.device_mesh == p.device_mesh and g.placements == p.placements, (
            f"step {step}: grad of {name}: {g.placements}"
        )
        assert g.to_local().shape == p.to_local().shape, f"step {step}: local grad shape of {name}"
        assert_close_tensors(g, r.grad, **TOL, msg=f"step {step}: grad of {name}")


# ----------------------------------------------------------------------------- training


def _batch(
    step: int, dims: tuple[int, int, int], mesh: DeviceMesh, local_outputs: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(all rows for the reference, this rank's input): dp picks rows, tp a sequence piece."""
    dim, _, seq = dims
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    full = torch.randn(2 * BATCH_PER_DP, seq, dim, generator=torch.Generator().manual_seed(100 + step))
    rows = full[dp * BATCH_PER_DP : (dp + 1) * BATCH_PER_DP]
    piece = _chunk(rows, 2, tp, 1).contiguous()
    if local_outputs:
        return full, piece
    # DTensor input with the true global shape: correct for uneven sequence pieces too.
    return full, DTensor.from_local(
        piece, mesh["tp"], [Shard(1)], run_check=False, shape=rows.shape, stride=rows.stride()
    )


def _local_loss(out: torch.Tensor, rows_numel: int) -> torch.Tensor:
    """This rank's part of the mean over its dp rank's rows: the tp ranks' parts add up to
    that mean (their backward passes meet in TP's collectives), and fully_shard averages
    over dp, so the effective loss is the mean over all rows, like the reference's."""
    local = out.to_local() if isinstance(out, DTensor) else out
    return local.pow(2).sum() / rows_numel


def _tp_fsdp_parity(rank: int, world: int, dims: tuple[int, int, int], local_outputs: bool) -> None:
    dim, hidden, seq = dims
    mesh = _mesh()
    ref = NormMLPStack(dim, hidden)
    model = _parallelize(copy.deepcopy(ref), mesh, local_outputs)
    _check_layout(model, ref, mesh)

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    rows_numel = BATCH_PER_DP * seq * dim
    for step in range(STEPS):
        full, x = _batch(step, dims, mesh, local_outputs)
        out = model(x)
        if not local_outputs:
            assert isinstance(out, DTensor) and out.placements == (Shard(1),) and out.shape == (BATCH_PER_DP, seq, dim)
        loss = _local_loss(out, rows_numel)
        loss.backward()
        ref_loss = ref(full).pow(2).mean()
        ref_loss.backward()

        total = loss.detach().clone()
        dist.all_reduce(total)  # sum over tp = this dp rank's mean; sum over dp, / dp = all rows
        assert_close_tensors(total / 2, ref_loss.detach(), **TOL, msg=f"step {step}: loss")
        _check_grads(model, ref, step)

        if step == STEPS - 1:
            # torch's own clip_grad_norm_ on a model whose parameters all live on one 2D mesh.
            # Clip to half the norm so that clipping really scales (max_norm=inf only measures).
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).detach()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ref_norm.item() / 2)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), ref_norm.item() / 2)
            assert isinstance(norm, DTensor), type(norm)
            assert_close_tensors(norm.full_tensor(), ref_norm, **TOL, msg="total grad norm")
            _check_grads(model, ref, step)  # clipped alike

        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert p.placements == _expected_placements(name), f"step {step}: {name} after step: {p.placements}"
            assert_close_tensors(p, r, **TOL, msg=f"step {step}: {name}")


@pytest.mark.parametrize(
    "dims, local_outputs",
    [
        pytest.param((8, 12, 6), True, id="even"),
        # TP even (hidden 10 -> 5 + 5, sequence 3 + 3), dp shards uneven: norm and w2 rows
        # 5 + 4, w1's TP-local 5 rows -> 3 + 2.
        pytest.param((9, 10, 6), True, id="uneven-dp"),
        # TP uneven too: hidden 7 -> 4 + 3 (then 2 + 2 and 2 + 1 over dp), sequence 5 -> 3 + 2.
        pytest.param((9, 7, 5), False, id="uneven-tp-and-dp", marks=UNEVEN_TP_NEEDS_TORCH_2_13),
        # hidden 3 -> 2 + 1 over tp, then 1 + 1 and 1 + 0: rank (dp 1, tp 1) holds no w1 rows.
        pytest.param((9, 3, 5), False, id="uneven-tp-empty-shard", marks=UNEVEN_TP_NEEDS_TORCH_2_13),
    ],
)
def test_tp_fsdp_parity_with_single_process(dims: tuple[int, int, int], local_outputs: bool) -> None:
    run_on_ranks(_tp_fsdp_parity, 4, dims, local_outputs)


# ----------------------------------------------------------------------------- unsupported


def _unsupported(rank: int, world: int) -> None:
    mesh = _mesh()
    block = NormMLPBlock(8, 12)
    parallelize_module(block, mesh["tp"], _plan(True))
    # A dp mesh over the TP mesh's own ranks: no 2D mesh holds the two (one cut separately
    # from the same ranks, as other["a"] is, is concatenated with tp, as FSDP2 does).
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match=r"fully_shard: 'mesh' and the tensor-parallel mesh of 'norm.weight' must be"):
        fully_shard(block, mesh=other["b"])
    with pytest.raises(ValueError, match=r"replicate: 'mesh' and the tensor-parallel mesh of 'norm.weight' must be"):
        replicate(block, mesh=other["b"])
    assert fully_shard.state(block) is None and replicate.state(block) is None  # the failed calls installed nothing
    fully_shard(block, mesh=other["a"])  # the same ranks as mesh["dp"], cut from another mesh
    for name, param in block.named_parameters():
        assert torch.equal(param.device_mesh.mesh, mesh.mesh), name  # on the (dp, tp) concatenation


def test_unsupported_tp_compositions_raise() -> None:
    run_on_ranks(_unsupported, 4)


def _no_shard(rank: int, world: int) -> None:
    mesh = _mesh()
    block = NormMLPBlock(8, 12)
    parallelize_module(block, mesh["tp"], _plan(True))
    fully_shard(block, mesh=mesh["dp"], strategy=ShardingStrategy.NO_SHARD)
    for name, param in block.named_parameters():
        tp = Shard(0) if ".w1." in f".{name}" else Shard(1) if name == "w2.weight" else Replicate()
        assert param.device_mesh == mesh and param.placements == (Replicate(), tp), (name, param.placements)


def test_no_shard_over_dp_keeps_tp_placements() -> None:
    """NO_SHARD over dp: the TP-local tensors whole on every dp rank, on the (dp, tp) mesh,
    as torch's FSDP2-based replicate keeps them (trained in test_hsdp_tp.py)."""
    run_on_ranks(_no_shard, 4)


def _tp_of_one(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    block = NormMLPBlock(8, 12)
    blocks = [block, copy.deepcopy(block)]
    for block, shard in zip(blocks, (fully_shard, torch_fully_shard)):
        parallelize_module(block, mesh["tp"], _plan(True))
        shard(block, mesh=mesh["dp"])
    for (name, ours), theirs in zip(blocks[0].named_parameters(), blocks[1].parameters()):
        assert ours.placements == theirs.placements, (name, ours.placements, theirs.placements)
        assert torch.equal(ours.to_local(), theirs.to_local()), name
    assert blocks[0].w1.weight.placements == (Shard(0), Shard(0))


def test_tp_of_one_rank_shards_plainly_as_fsdp2() -> None:
    """A TP dim of one rank splits nothing, so dp's shard is a plain `Shard(0)`, not a strided
    shard of split factor 1: FSDP2's placements."""
    run_on_ranks(_tp_of_one, 2)
