"""NO_SHARD and HSDP (HYBRID_SHARD) placements, collectives and parity.

- NO_SHARD: parameters and gradients are `Replicate()` DTensors holding the full tensor;
  gradients are all-reduced (averaged); nothing is all-gathered.
- HSDP: a 2D mesh (default strategy) or `HYBRID_SHARD` gives `(Replicate(), Shard(0))`;
  parameters are gathered and gradients reduce-scattered within a shard group, then
  all-reduced across the replica group. Parity on a 2x2 mesh of 4 ranks against a
  single-process reference and against PyTorch FSDP2's HSDP.
- Bad meshes raise at the call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, fake_process_group, run_on_ranks, step_and_match, trace_collectives
from _models import TinyTransformer, batch_for, lm_loss
from _training import step_and_compare
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from composable import MixedPrecisionPolicy, ShardingStrategy, fully_shard

STEPS = 3


def _wrap(model: TinyTransformer, **kwargs: object) -> TinyTransformer:
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _train_against_reference(model: nn.Module, rank: int, world_size: int, check_step: object = None) -> None:
    """SGD steps on this rank's rows vs one process on every rank's rows: same losses (the
    mean of the ranks'), gradients and parameters. `check_step(step, tracer)` inspects the
    collectives of each forward+backward."""
    torch.manual_seed(0)
    ref = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        with trace_collectives() as t:
            loss = lm_loss(model, batch_for(step, world_size, rank))
            loss.backward()
        if check_step is not None:
            check_step(step, t)
        ref_loss = lm_loss(ref, batch_for(step, world_size, None))
        ref_loss.backward()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss)
        assert_close_tensors(mean_loss / world_size, ref_loss.detach(), msg=f"step {step} loss")
        step_and_compare(model, ref, opt, ref_opt, f"step {step}")


# ----------------------------------------------------------------------------- NO_SHARD


def _no_shard(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _wrap(TinyTransformer(), strategy=ShardingStrategy.NO_SHARD)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(),), (name, p.placements)
        assert p.to_local().shape == p.shape, name  # every rank holds the full tensor
    assert fully_shard.state(model).strategy is ShardingStrategy.NO_SHARD

    def check(step: int, t: object) -> None:
        # One all-reduce per group (2 blocks + root) and nothing else: no all-gather.
        assert t.counts == {"all_reduce": 3}, t.render()
        assert {str(r.dtype) for r in t.records} == {"torch.float32"}, t.render()

    _train_against_reference(model, rank, world_size, check)
    for name, p in model.named_parameters():
        assert p.grad is None, name
    # Gradients are Replicate() DTensors too, identical on every rank.
    lm_loss(model, batch_for(9, world_size, rank)).backward()
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Replicate(),), name
        gathered = [torch.empty_like(p.grad.to_local()) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, p.grad.to_local())
        assert all(torch.equal(g, gathered[0]) for g in gathered), name


def test_no_shard_replicates_and_all_reduces() -> None:
    """NO_SHARD: Replicate() params and grads, one all-reduce per group, no all-gather,
    training equal to the single-process reference."""
    run_on_ranks(_no_shard, 2)


def _no_shard_2d(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    model = _wrap(TinyTransformer(), mesh=mesh, strategy=ShardingStrategy.NO_SHARD)
    for name, p in model.named_parameters():
        assert p.placements == (Replicate(), Replicate()), (name, p.placements)

    def check(step: int, t: object) -> None:
        # Per group, one all-reduce over each mesh dim, the second after the first.
        assert t.counts == {"all_reduce": 6}, t.render()

    _train_against_reference(model, rank, world_size, check)


def test_no_shard_over_a_2d_mesh() -> None:
    """NO_SHARD over a 2D mesh all-reduces over both dims, one after the other (two at once
    on one buffer summed each other's partial results): training equal to one process's."""
    run_on_ranks(_no_shard_2d, 4)


def _no_shard_mixed_precision(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _wrap(TinyTransformer(), strategy=ShardingStrategy.NO_SHARD, mp_policy=mp)
    with trace_collectives() as t:
        lm_loss(model, batch_for(0, world_size, rank)).backward()
    assert [str(r) for r in t.records] == [f"all_reduce(g[0,1], float32, {n})" for n in (1120, 1120, 220)], t.render()
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32 and p.grad.placements == (Replicate(),), name


def test_no_shard_mixed_precision() -> None:
    """NO_SHARD with bf16 compute reduces in reduce_dtype; params and grads stay fp32."""
    run_on_ranks(_no_shard_mixed_precision, 2)


# ----------------------------------------------------------------------------- HSDP


def _hsdp(rank: int, world_size: int, how: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    kwargs = {"strategy": ShardingStrategy.HYBRID_SHARD} if how == "HYBRID_SHARD" else {}
    model = _wrap(TinyTransformer(), mesh=mesh, **kwargs)
    assert fully_shard.state(model).strategy is ShardingStrategy.HYBRID_SHARD
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh == mesh, name
        assert p.placements == (Replicate(), Shard(0)), (name, p.placements)
    shard_group = f"g[{rank - rank % 2},{rank - rank % 2 + 1}]"  # same row of the 2x2 mesh
    replica_group = f"g[{rank % 2},{rank % 2 + 2}]"  # same column

    def check(step: int, t: object) -> None:
        groups = {(r.kind, r.group) for r in t.records}
        assert groups == {
            ("all_gather", shard_group),
            ("reduce_scatter", shard_group),
            ("all_reduce", replica_group),
        }, t.render()
        assert t.counts["reduce_scatter"] == t.counts["all_reduce"] == 3, t.render()
        # Each all-reduce takes exactly the preceding reduce-scatter's output (half of it).
        rs = [r.numel for r in t.records if r.kind == "reduce_scatter"]
        ar = [r.numel for r in t.records if r.kind == "all_reduce"]
        assert ar == [n // 2 for n in rs], t.render()

    _train_against_reference(model, rank, world_size, check)
    # Gradients are (Replicate(), Shard(0)) DTensors too.
    lm_loss(model, batch_for(9, world_size, rank)).backward()
    for name, p in model.named_parameters():
        assert p.grad.placements == (Replicate(), Shard(0)) and p.grad.to_local().shape == p.to_local().shape, name


@pytest.mark.parametrize("how", ["2d-mesh", "HYBRID_SHARD"])
def test_hsdp_placements_collectives_and_parity(how: str) -> None:
    """HSDP on a 2x2 mesh of 4 ranks: (Replicate(), Shard(0)), reduce-scatter in the shard
    group + all-reduce across replicas, equal to the single-process reference."""
    run_on_ranks(_hsdp, 4, how)


def _hsdp_vs_torch(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _wrap(TinyTransformer(), mesh=mesh, mp_policy=mp)
    torch.manual_seed(0)
    theirs = TinyTransformer()
    for m in [*theirs.layers, theirs]:
        torch_fully_shard(m, mesh=mesh, mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(STEPS):
        for m in (ours, theirs):
            lm_loss(m, batch_for(step, world_size, rank)).backward()
        step_and_match(ours, theirs, opts, f"step {step}", same_placements=True)


def test_hsdp_matches_torch_fsdp2() -> None:
    """HSDP with bf16 compute / fp32 reduce is bit-identical to PyTorch FSDP2's HSDP."""
    run_on_ranks(_hsdp_vs_torch, 4)


# ----------------------------------------------------------------------------- bad meshes


def test_bad_meshes_raise() -> None:
    """HYBRID_SHARD needs a 2D mesh; FULL_SHARD/SHARD_GRAD_OP need a 1D one; 3D is refused."""
    with fake_process_group(8):
        mesh1 = init_device_mesh("cpu", (8,))
        mesh2 = init_device_mesh("cpu", (2, 4))
        mesh3 = init_device_mesh("cpu", (2, 2, 2))
        with pytest.raises(ValueError, match=r"fully_shard: strategy=HYBRID_SHARD needs a 2D mesh.*1D"):
            fully_shard(nn.Linear(4, 4), mesh=mesh1, strategy=ShardingStrategy.HYBRID_SHARD)
        with pytest.raises(ValueError, match=r"fully_shard: strategy=HYBRID_SHARD needs a 2D mesh"):
            fully_shard(nn.Linear(4, 4), strategy=ShardingStrategy.HYBRID_SHARD)  # default mesh is 1D
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            with pytest.raises(ValueError, match=rf"fully_shard: strategy={strategy.name} .*2D mesh"):
                fully_shard(nn.Linear(4, 4), mesh=mesh2, strategy=strategy)
        with pytest.raises(ValueError, match=r"fully_shard: 'mesh' must be 1D or 2D, got a 3D mesh"):
            fully_shard(nn.Linear(4, 4), mesh=mesh3)
        with pytest.raises(TypeError, match=r"fully_shard: 'strategy' must be a ShardingStrategy"):
            fully_shard(nn.Linear(4, 4), mesh=mesh2, strategy="HYBRID_SHARD")  # type: ignore[arg-type]
        # A failed call leaves the module untouched: it can be sharded afterwards.
        lin = nn.Linear(4, 4)
        with pytest.raises(ValueError):
            fully_shard(lin, mesh=mesh1, strategy=ShardingStrategy.HYBRID_SHARD)
        assert fully_shard.state(lin) is None and not isinstance(lin.weight, DTensor)
        fully_shard(lin, mesh=mesh2)
        assert lin.weight.placements == (Replicate(), Shard(0))
