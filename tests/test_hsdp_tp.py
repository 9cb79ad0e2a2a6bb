"""HSDP x tensor parallel: a 3D (dp_replicate, dp_shard, tp) mesh of 8 gloo ranks (2 x 2 x 2).

Users apply PyTorch's tensor-parallel plan on `mesh["tp"]`, then `fully_shard(block,
mesh=mesh["dp_replicate", "dp_shard"])` per block and on the root, as with PyTorch FSDP2. Two
plans on a stack of MLP blocks: colwise/rowwise (`w1` Colwise, `w2` Rowwise, the LayerNorm a
plain parameter on the 2D dp mesh) and the sequence-parallel recipe (`norm` SequenceParallel,
`w1` Colwise from `Shard(1)`, `w2` Rowwise to `Shard(1)`).

Checked against PyTorch FSDP2 on the same model and mesh, bit for bit (`torch.equal`): the
sharded parameters' meshes, placements and local shards, losses, gradients and parameters over
AdamW steps, `clip_grad_norm_`'s total norm, the sharded state dict's placements, and a DCP
checkpoint written by one loaded by the other. Against one process trained on the whole batch,
to fp32 rounding. PyTorch's own `TestFullyShardHSDP3DTraining.test_3d_mlp_with_nd_mesh` runs
through the FSDP2 adapter. Also over TP: `replicate` and NO_SHARD (Replicate() on every dp dim),
and TP x CP two ways (parameters on a 2D (cp, tp) mesh; HSDP over a flattened (dp_shard, cp)
dim). Every check of one mesh runs in one multi-rank call: 8 ranks on 2 cores start slowly.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import assert_close_tensors, count_collectives, run_on_ranks
from _models import NormMLPStack
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from composable import ShardingStrategy, clip_grad_norm_, fully_shard, replicate

WORLD = 8
STEPS = 3
LR = 1e-2
BATCH_PER_DP = 2  # rows per data-parallel rank (4 of them: 2 replicas x 2 shards)
DIMS = (8, 12, 4)  # model dim, hidden, sequence
# fp32 on CPU against one process: partial sums in another order (about 1e-7 measured).
TOL = dict(rtol=1e-5, atol=1e-6)


def _plan(sequence_parallel: bool) -> dict:
    if not sequence_parallel:
        return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    return {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def _parallelize(
    shard: Any, model: NormMLPStack, mesh: DeviceMesh, sequence_parallel: bool, dp_mesh: DeviceMesh | None = None
) -> NormMLPStack:
    """The TP plan on mesh["tp"], then `shard` over `dp_mesh` (HSDP's 2D dp mesh by default)
    per block and on the root."""
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_mesh is None else dp_mesh
    for block in model.layers:
        parallelize_module(block, mesh["tp"], _plan(sequence_parallel))
        shard(block, mesh=dp_mesh)
    shard(model, mesh=dp_mesh)
    return model


def _expected_placements(name: str, sequence_parallel: bool) -> tuple:
    """FSDP2's placements on the 3D mesh (plain parameters: on the 2D dp mesh)."""
    if ".w1." in name:  # Colwise: tp splits dim 0, dp's shard nests inside
        return (Replicate(), _StridedShard(0, split_factor=2), Shard(0))
    if name.endswith("w2.weight"):  # Rowwise: tp splits dim 1
        return (Replicate(), Shard(0), Shard(1))
    if ".norm." in name and not sequence_parallel:  # no TP: a plain HSDP parameter
        return (Replicate(), Shard(0))
    return (Replicate(), Shard(0), Replicate())


def _batch(step: int, mesh: DeviceMesh, sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(all rows for the reference, this rank's input): the dp rank picks rows; under sequence
    parallelism the tp rank then picks its piece of the sequence."""
    dim, _, seq = DIMS
    dp = mesh["dp_replicate"].get_local_rank() * 2 + mesh["dp_shard"].get_local_rank()
    full = torch.randn(4 * BATCH_PER_DP, seq, dim, generator=torch.Generator().manual_seed(100 + step))
    rows = full[dp * BATCH_PER_DP : (dp + 1) * BATCH_PER_DP]
    if sequence_parallel:
        rows = rows.chunk(2, dim=1)[mesh["tp"].get_local_rank()]
    return full, rows.contiguous()


def _loss(out: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """This rank's loss: the mean over its dp rank's rows (fully_shard averages over dp). Under
    sequence parallelism each tp rank holds a part of the sequence, and their parts add up to
    that mean; otherwise every tp rank holds the whole output."""
    dim, _, seq = DIMS
    if sequence_parallel:
        return out.pow(2).sum() / (BATCH_PER_DP * seq * dim)
    return out.pow(2).mean()


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Bit for bit and laid out alike: mesh, placements, global shape and local tensor."""
    assert type(ours) is type(theirs), f"{what}: {type(ours).__name__} vs {type(theirs).__name__}"
    if isinstance(ours, DTensor):
        assert ours.device_mesh == theirs.device_mesh, f"{what}: {ours.device_mesh} vs {theirs.device_mesh}"
        assert ours.placements == theirs.placements, f"{what}: {ours.placements} vs {theirs.placements}"
        assert ours.shape == theirs.shape, f"{what}: {ours.shape} vs {theirs.shape}"
        ours, theirs = ours.to_local(), theirs.to_local()
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, f"{what}: {ours.shape} vs {theirs.shape}"
    assert torch.equal(ours, theirs), f"{what}: max diff {(ours - theirs).abs().max().item()}"


def _torch_norm(model: nn.Module) -> torch.Tensor:
    """torch's total gradient norm of FSDP2's model. torch refuses gradients on several meshes
    (plain parameters on the dp mesh beside TP ones on the 3D mesh), so each mesh's norm is
    torch's and the norms are combined here."""
    by_mesh: dict[DeviceMesh, list[torch.Tensor]] = {}
    for p in model.parameters():
        by_mesh.setdefault(p.device_mesh, []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(grads).full_tensor() for grads in by_mesh.values()]
    return torch.stack(norms).pow(2).sum().sqrt()


def _train_against_fsdp2(rank: int, world: int, sequence_parallel: bool, path: str) -> None:
    mesh = _mesh()
    dim, hidden, _ = DIMS
    ref = NormMLPStack(dim, hidden)
    ours = _parallelize(fully_shard, copy.deepcopy(ref), mesh, sequence_parallel)
    theirs = _parallelize(torch_fully_shard, copy.deepcopy(ref), mesh, sequence_parallel)
    named = list(ours.named_parameters())
    assert [n for n, _ in named] == [n for n, _ in theirs.named_parameters()]
    for (name, p), q, r in zip(named, theirs.parameters(), ref.parameters()):
        _assert_same(p, q, f"sharded {name}")
        assert p.placements == _expected_placements(name, sequence_parallel), f"{name}: {p.placements}"
        names = ("dp_replicate", "dp_shard") if len(p.placements) == 2 else ("dp_replicate", "dp_shard", "tp")
        assert p.device_mesh.mesh_dim_names == names, f"{name}: {p.device_mesh}"
        assert_close_tensors(p, r, exact=True, msg=f"full_tensor of {name}")

    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ours, theirs, ref)]
    for step in range(STEPS):
        full, x = _batch(step, mesh, sequence_parallel)
        losses = [_loss(m(x), sequence_parallel) for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        ref_loss = ref(full).pow(2).mean()
        ref_loss.backward()
        _assert_same(losses[0].detach(), losses[1].detach(), f"step {step}: loss")
        total = losses[0].detach().clone()
        dist.all_reduce(total)  # every dp rank's mean, once per tp rank (summed parts under SP)
        assert_close_tensors(total / (4 if sequence_parallel else 8), ref_loss.detach(), **TOL, msg=f"step {step}")
        for (name, p), q, r in zip(named, theirs.parameters(), ref.parameters()):
            _assert_same(p.grad, q.grad, f"step {step}: grad of {name}")
            assert_close_tensors(p.grad, r.grad, **TOL, msg=f"step {step}: grad of {name}")
        if step == STEPS - 1:
            # The norm over the 3D mesh: reduced once over each sharded dim (dp_shard, tp), not
            # over the replicas, which hold the same values. composable's clip_grad_norm_ gives
            # FSDP2's model the same norm and clipped gradients bit for bit; torch's own (per
            # mesh: it refuses several) agrees to rounding, as does one process.
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
            torch_norm = _torch_norm(theirs)
            with count_collectives() as counted:
                norm = clip_grad_norm_(ours.parameters(), ref_norm.item() / 2)
            assert counted.counts["all_reduce"] == 2 and counted.total == 2, counted.counts
            _assert_same(norm, clip_grad_norm_(theirs.parameters(), ref_norm.item() / 2), "total grad norm")
            torch.nn.utils.clip_grad_norm_(ref.parameters(), ref_norm.item() / 2)
            assert_close_tensors(norm, torch_norm, rtol=1e-6, atol=0, msg="torch's total grad norm")
            assert_close_tensors(norm, ref_norm, **TOL, msg="total grad norm against one process")
            for (name, p), q, r in zip(named, theirs.parameters(), ref.parameters()):
                _assert_same(p.grad, q.grad, f"clipped grad of {name}")
                assert_close_tensors(p.grad, r.grad, **TOL, msg=f"clipped grad of {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q, r in zip(named, theirs.parameters(), ref.parameters()):
            _assert_same(p, q, f"step {step}: {name}")
            assert_close_tensors(p, r, **TOL, msg=f"step {step}: {name}")

    # State dicts: the same keys, placements and local shards as FSDP2's.
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert list(ours_sd) == list(theirs_sd)
    for key in ours_sd:
        _assert_same(ours_sd[key], theirs_sd[key], f"state dict {key}")
    # DCP: a checkpoint written from composable's model loads into FSDP2's, and back.
    dcp.save(ours_sd, checkpoint_id=path)
    fresh = _parallelize(torch_fully_shard, NormMLPStack(dim, hidden), mesh, sequence_parallel)
    loaded = fresh.state_dict()
    dcp.load(loaded, checkpoint_id=path)
    for key in ours_sd:
        _assert_same(loaded[key], theirs_sd[key], f"FSDP2 loaded {key}")
    dist.barrier()
    dcp.save(theirs_sd, checkpoint_id=path + "_fsdp2")
    back = _parallelize(fully_shard, NormMLPStack(dim, hidden), mesh, sequence_parallel)
    back_sd = back.state_dict()
    dcp.load(back_sd, checkpoint_id=path + "_fsdp2")
    back.load_state_dict(back_sd)
    for (name, p), q in zip(back.named_parameters(), theirs.parameters()):
        _assert_same(p, q, f"composable loaded {name}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["colwise-rowwise", "sequence-parallel"])
def test_hsdp_tp_matches_fsdp2_bit_for_bit(tmp_path: Any, sequence_parallel: bool) -> None:
    run_on_ranks(_train_against_fsdp2, WORLD, sequence_parallel, str(tmp_path / "ckpt"))


def _replicated_over_tp(rank: int, world: int) -> None:
    mesh = _mesh()
    dim, hidden, _ = DIMS
    flat = mesh["dp_replicate", "dp_shard"]._flatten()
    ref = NormMLPStack(dim, hidden)
    ours = _parallelize(replicate, copy.deepcopy(ref), mesh, False, flat)
    theirs = _parallelize(torch_replicate, copy.deepcopy(ref), mesh, False, flat)
    no_shard = _parallelize(
        functools.partial(fully_shard, strategy=ShardingStrategy.NO_SHARD), copy.deepcopy(ref), mesh, False
    )
    named = list(ours.named_parameters())
    for (name, p), q, n in zip(named, theirs.parameters(), no_shard.parameters()):
        _assert_same(p, q, f"replicated {name}")
        tp = p.placements[1:]
        assert n.placements == (Replicate(), Replicate(), *tp), f"NO_SHARD {name}: {n.placements}"
        assert torch.equal(n.to_local(), p.to_local()), name
    models = (ours, theirs, no_shard, ref)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    for step in range(STEPS):
        full, x = _batch(step, mesh, False)
        losses = [_loss(m(x), False) for m in models[:3]] + [ref(full).pow(2).mean()]
        for loss in losses:
            loss.backward()
        if step == 0:  # later steps start from parameters equal to rounding only
            _assert_same(losses[0].detach(), losses[1].detach(), "first loss")
        for loss in losses[:3]:
            total = loss.detach().clone()
            dist.all_reduce(total)  # every dp rank's mean, once per tp rank
            assert_close_tensors(total / 8, losses[3].detach(), **TOL, msg=f"step {step}: loss")
        for (name, p), q, n, r in zip(named, theirs.parameters(), no_shard.parameters(), ref.parameters()):
            assert p.grad.placements == q.grad.placements == p.placements, f"step {step}: grad of {name}"
            assert n.grad.placements == n.placements, f"step {step}: NO_SHARD grad of {name}"
            for who, got in (("replicate", p.grad), ("NO_SHARD", n.grad), ("FSDP2's replicate", q.grad)):
                assert_close_tensors(got, r.grad, **TOL, msg=f"step {step}: {who}: grad of {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q, n, r in zip(named, theirs.parameters(), no_shard.parameters(), ref.parameters()):
            assert p.placements == q.placements, f"step {step}: {name}"
            for who, got in (("replicate", p), ("NO_SHARD", n), ("FSDP2's replicate", q)):
                assert_close_tensors(got, r, **TOL, msg=f"step {step}: {who}: {name}")


def test_replicate_and_no_shard_over_tp() -> None:
    """`replicate` over the flattened dp dims and `fully_shard(strategy=NO_SHARD)` over the 2D
    dp mesh, each composed with TP: meshes, placements, local values and the first loss equal
    torch's FSDP2-based `replicate`'s; losses, gradients and parameters equal one process's to
    rounding. (Not
    bit for bit with torch's gradients: gloo sums 4 ranks in an order that depends on the
    buffer's size, and replicate's buckets are not FSDP2's buffers.)"""
    run_on_ranks(_replicated_over_tp, WORLD)


def _upstream_3d_mlp(rank: int, world: int, mlp_dims: tuple[int, ...]) -> None:
    """The body of PyTorch's `TestFullyShardHSDP3DTraining.test_3d_mlp_with_nd_mesh` (torch
    2.13's test_fully_shard_training.py), its `fully_shard` resolved to composable's FSDP2
    adapter: `MLPStack.parallelize` calls the `fully_shard` name of torch's common_fsdp module."""
    from torch.distributed._composable import replicate as ddp
    from torch.testing._internal import common_fsdp

    from composable.integrations.fsdp2_module import fsdp2_fully_shard

    saved, common_fsdp.fully_shard = common_fsdp.fully_shard, fsdp2_fully_shard
    try:
        for reshard_after_forward in (False, True):
            for use_activation_checkpointing in (False, True):
                for mlp_dim in mlp_dims:
                    global_mesh = _mesh()
                    dp_mesh, tp_mesh = global_mesh["dp_replicate", "dp_shard"], global_mesh["tp"]
                    dp_pg = dp_mesh._flatten().get_group()
                    torch.manual_seed(42)
                    model = common_fsdp.MLPStack(mlp_dim)
                    ref_model = copy.deepcopy(model)
                    ddp(ref_model, device_ids=None, process_group=dp_pg)
                    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2, foreach=False)
                    model.parallelize(
                        tp_mesh, dp_mesh, use_activation_checkpointing, reshard_after_forward=reshard_after_forward
                    )
                    for ref_p, p in zip(ref_model.parameters(), model.parameters()):
                        assert isinstance(p, DTensor)
                        torch.testing.assert_close(p.full_tensor(), ref_p, rtol=0, atol=0)
                    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
                    torch.manual_seed(42 + dp_pg.rank() + 1)
                    for iter_idx in range(10):
                        inp = torch.randn((8, mlp_dim))
                        losses = []
                        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                            losses.append(_model(inp).sum())
                            losses[-1].backward()
                            _optim.step()
                        torch.testing.assert_close(losses[0], losses[1])
                    for _, p in model.named_parameters():
                        assert isinstance(p, DTensor) and p.device_mesh.ndim == 3 and len(p.placements) == 3
                        assert p.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    finally:
        common_fsdp.fully_shard = saved


def test_upstream_3d_mlp_with_nd_mesh_through_the_fsdp2_adapter() -> None:
    """PyTorch FSDP2's own HSDP x TP test: every (reshard_after_forward, activation
    checkpointing) subtest, with upstream's `mlp_dim`s (3, 5, 16, 17) cut to 5 for time: its
    hidden 15 splits unevenly over tp (8 + 7) and then over dp_shard."""
    run_on_ranks(_upstream_3d_mlp, WORLD, (5,))


# ----------------------------------------------------------------------------- TP x CP


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 12)
        self.w2 = nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def _on_2d_tp_mesh(block: nn.Module, mesh: DeviceMesh) -> None:
    """Colwise/rowwise by hand on a 2D (cp, tp) mesh (PyTorch's TP styles take 1D meshes):
    parameters replicated over cp, computed with DTensors, the output replicated."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, p in list(module.named_parameters(recurse=False)):
            tp = Shard(0) if name == "w1" else Shard(1) if key == "weight" and name == "w2" else Replicate()
            module.register_parameter(key, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate(), tp])))

    def inputs(module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Replicate(), Replicate()]) for x in args)

    def outputs(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return out.redistribute(mesh, [Replicate(), Replicate()]).to_local()

    distribute_module(block, mesh, partition, inputs, outputs)


def _tp_with_cp(rank: int, world: int, layout: str) -> None:
    if layout == "tp-on-cp-x-tp":  # parameters on a 2D (cp, tp) mesh, FSDP over dp
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        dp_mesh, names = mesh["dp"], ("dp", "cp", "tp")

        def parallelize(block: nn.Module) -> None:
            _on_2d_tp_mesh(block, mesh["cp", "tp"])

    else:  # torchtitan's: HSDP over dp_replicate x (dp_shard, cp) flattened, TP on tp
        mesh = init_device_mesh("cpu", (2, 1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        dp_mesh, names = mesh["dp_replicate", "dp_shard_cp"], ("dp_replicate", "dp_shard_cp", "tp")

        def parallelize(block: nn.Module) -> None:
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

    ref = nn.Sequential(_Mlp(), _Mlp())
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = copy.deepcopy(ref)
        for block in model:
            parallelize(block)
            shard(block, mesh=dp_mesh)
        models.append(shard(model, mesh=dp_mesh))
    ours, theirs = models
    named = list(ours.named_parameters())
    for (name, p), q in zip(named, theirs.parameters()):
        _assert_same(p, q, name)
        assert p.device_mesh.mesh_dim_names == names, (name, p.device_mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    data_rank = dp_mesh._flatten().get_local_rank()
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + data_rank))
        losses = [m(x).pow(2).mean() for m in models]
        for loss in losses:
            loss.backward()
        _assert_same(losses[0].detach(), losses[1].detach(), f"step {step}: loss")
        for (name, p), q in zip(named, theirs.parameters()):
            _assert_same(p.grad, q.grad, f"step {step}: grad of {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(named, theirs.parameters()):
            _assert_same(p, q, f"step {step}: {name}")


@pytest.mark.parametrize("layout", ["tp-on-cp-x-tp", "hsdp-over-flattened-shard-cp"])
def test_tp_with_cp_matches_fsdp2(layout: str) -> None:
    """TP x CP two ways, both as FSDP2 (bit for bit: placements, losses, gradients, parameters):
    parameters on a 2D (cp, tp) mesh sharded over a 1D dp mesh (the 3D (dp, cp, tp) parent),
    and HSDP over dp_replicate x the flattened (dp_shard, cp) dim with TP on tp."""
    run_on_ranks(_tp_with_cp, WORLD, layout)
