"""`dp_mesh_dims`: parameters are DTensors on the whole mesh (dp x tp, HSDP, dp x cp flattened).

Each case builds one model whose parameters are DTensors on a 2x2 mesh of 4 gloo ranks
(Replicate() on the data-parallel dims, TP placements on tp), trains it with torch's FSDP2 /
replicate and with composable's, and checks bit for bit: the sharded placements and meshes,
the local shards, the losses and the parameters over several steps. Then clipping, a DCP
round trip (also into a plain 1D fully_shard layout), compile, and every error.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import composable
from composable import DataParallelMeshDims, fully_shard, replicate

try:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    # FSDP2 with full-DTensor meshes (torch >= 2.13).
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    HAS_TORCH_SPMD = hasattr(FSDPParam, "_init_sharding_spec_spmd")
except ImportError:  # pragma: no cover
    HAS_TORCH_SPMD = False
needs_torch_spmd = pytest.mark.skipif(not HAS_TORCH_SPMD, reason="this torch's FSDP2 has no dp_mesh_dims")

DIM, HIDDEN, STEPS = 8, 12, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


# case -> (mesh dim names, DataParallelMeshDims keywords, input placements)
CASES = {
    "dp_tp": (("dp", "tp"), dict(shard="dp"), (Shard(0), Replicate())),
    "hsdp": (("rep", "shard"), dict(shard="shard", replicate="rep"), (Shard(0), Shard(0))),
    "dp_cp": (("dp", "cp"), dict(shard=("dp", "cp")), (Shard(0), Shard(1))),
    "ddp_tp": (("dp", "tp"), dict(replicate="dp"), (Shard(0), Replicate())),
}


def _distribute(model: nn.Module, mesh, tp: bool) -> nn.Module:
    """Every parameter a DTensor on the whole mesh: Replicate() on dim 0 (data parallel) and,
    with `tp`, Colwise w1 / Rowwise w2 on dim 1."""
    for name, sub in model.named_modules():
        for pname, p in list(sub._parameters.items()):
            if p is None:
                continue
            place = Replicate()
            if tp and name.endswith("w1"):
                place = Shard(0)
            elif tp and name.endswith("w2") and pname == "weight":
                place = Shard(1)
            sub._parameters[pname] = nn.Parameter(distribute_tensor(p.detach(), mesh, (Replicate(), place)))
    return model


def _apply(api, model: nn.Module, mesh, dims, replicate_api: bool) -> None:
    if replicate_api:
        api(model, mesh=mesh, dp_mesh_dims=dims)
        return
    for block in model.blocks:
        api(block, mesh=mesh, dp_mesh_dims=dims)
    api(model, mesh=mesh, dp_mesh_dims=dims)


def _train(model: nn.Module, mesh, in_place, steps: int = STEPS, clip: bool = False) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = distribute_tensor(torch.randn(4, 4, DIM), mesh, in_place)
        loss = model(x).pow(2).mean().full_tensor()
        loss.backward()
        if clip:
            composable.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _parity(rank: int, world: int, case: str) -> None:
    names, dims_kw, in_place = CASES[case]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    dims = DataParallelMeshDims(**dims_kw)
    tp = names[1] == "tp"
    replicate_api = case == "ddp_tp"
    torch.manual_seed(0)
    ref = _distribute(Model(), mesh, tp)
    ours = copy.deepcopy(ref)
    if replicate_api:
        from torch.distributed._composable.replicate_with_fsdp import replicate as torch_api
    else:
        torch_api = torch_fully_shard
    _apply(torch_api, ref, mesh, dims, replicate_api)
    _apply(fully_shard if not replicate_api else replicate, ours, mesh, dims, replicate_api)
    for (n, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert isinstance(q, DTensor), n
        assert tuple(q.placements) == tuple(p.placements), (n, q.placements, p.placements)
        assert q.device_mesh.mesh.tolist() == p.device_mesh.mesh.tolist(), n
        assert torch.equal(q._local_tensor, p._local_tensor), n
        assert q.shape == p.shape, n
    ref_losses, our_losses = _train(ref, mesh, in_place), _train(ours, mesh, in_place)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, our_losses)), (ref_losses, our_losses)
    for (n, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert torch.equal(q._local_tensor, p._local_tensor), n


# torch 2.12's FSDP2 (an earlier form of dp_mesh_dims) shows several shard dims as separate mesh
# dims, (Shard(0), Shard(0)); torch 2.13 and later, and composable on every torch, show them as
# one flattened dim, (Shard(0),).
_SEPARATE_SHARD_DIMS = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)
_FSDP2_CASES = [
    pytest.param(
        c, marks=pytest.mark.skipif(_SEPARATE_SHARD_DIMS, reason="torch 2.12's FSDP2 keeps dp x cp unflattened")
    )
    if c == "dp_cp"
    else c
    for c in CASES
]


@needs_torch_spmd
@pytest.mark.parametrize("case", _FSDP2_CASES)
def test_equal_to_fsdp2(case: str) -> None:
    """Placements (`_StridedShard` under Colwise), local shards, losses and parameters of
    dp x tp, HSDP, dp x cp flattened and DDP-over-dp x tp equal torch's, bit for bit."""
    run_on_ranks(_parity, 4, case)


def _clip_checkpoint_compile(rank: int, world: int, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp

    names, dims_kw, in_place = CASES["dp_tp"]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    dims = DataParallelMeshDims(**dims_kw)
    torch.manual_seed(0)
    base = _distribute(Model(), mesh, tp=True)
    full = {k: v.full_tensor() for k, v in base.state_dict().items()}
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    _apply(fully_shard, eager, mesh, dims, False)
    _apply(fully_shard, compiled, mesh, dims, False)
    for block in compiled.blocks:
        block.compile(backend="aot_eager")
    # Clipping: one norm over every DTensor on the mesh, equal to a plain model's.
    losses = _train(eager, mesh, in_place, steps=2, clip=True)
    assert all(torch.equal(a, b) for a, b in zip(losses, _train(compiled, mesh, in_place, steps=2, clip=True)))
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(p._local_tensor, q._local_tensor)
    plain = Model()
    plain.load_state_dict(full)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(100 + step)
        loss = plain(torch.randn(4, 4, DIM)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, losses[step])
    for (n, p), q in zip(eager.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, msg=n)
    # DCP: save the whole-mesh layout, load into a plain 1D fully_shard over the world.
    dcp.save(eager.state_dict(), checkpoint_id=tmp)
    other = Model()
    world_mesh = init_device_mesh("cpu", (world,))
    for block in other.blocks:
        fully_shard(block, mesh=world_mesh)
    fully_shard(other, mesh=world_mesh)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=tmp)
    other.load_state_dict(state)
    for (n, p), q in zip(eager.named_parameters(), other.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), n
    # ... and back into a fresh whole-mesh model.
    again = _distribute(Model(), mesh, tp=True)
    _apply(fully_shard, again, mesh, dims, False)
    state = again.state_dict()
    dcp.load(state, checkpoint_id=tmp)
    again.load_state_dict(state)
    for (n, p), q in zip(eager.named_parameters(), again.parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor), n


def test_clip_checkpoint_compile() -> None:
    """clip_grad_norm_ equals a single-process model's; a DCP checkpoint loads into a 1D
    layout and back; compiled blocks train as eager (torch 2.11-2.15, no FSDP2 needed)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_on_ranks(_clip_checkpoint_compile, 4, tmp)


def _errors(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh("cpu", (2, 2))

    def fresh() -> nn.Module:
        return _distribute(nn.Sequential(nn.Linear(4, 4)), mesh, tp=False)

    cases = [
        (TypeError, "'dp_mesh_dims' must be a DataParallelMeshDims", dict(dp_mesh_dims="dp")),
        (ValueError, "names the dim 'cp', which 'mesh' does not have", dict(dp_mesh_dims=DataParallelMeshDims(shard="cp"))),
        (ValueError, r"names \['dp'\] as both shard and replicate", dict(dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="dp"))),
        (ValueError, "names a dim twice", dict(dp_mesh_dims=DataParallelMeshDims(shard=("dp", "dp")))),
        (ValueError, "in the mesh's order", dict(dp_mesh_dims=DataParallelMeshDims(shard=("tp", "dp")))),
        (ValueError, "'strategy' must be left out", dict(dp_mesh_dims=DataParallelMeshDims(shard="dp"), strategy=composable.ShardingStrategy.FULL_SHARD)),
        (NotImplementedError, "an int 'reshard_after_forward'", dict(dp_mesh_dims=DataParallelMeshDims(shard="dp"), reshard_after_forward=2)),
    ]  # fmt: skip
    for exc, match, kwargs in cases:
        with pytest.raises(exc, match=match):
            fully_shard(fresh(), mesh=mesh, **kwargs)
    with pytest.raises(ValueError, match="needs a mesh with named dims"):
        fully_shard(fresh(), mesh=unnamed, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    with pytest.raises(ValueError, match="got a plain tensor for '0.weight'"):
        fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    sharded_tp = nn.Linear(4, 4)
    sharded_tp.weight = nn.Parameter(distribute_tensor(sharded_tp.weight.detach(), mesh, (Shard(0), Replicate())))
    sharded_tp.bias = nn.Parameter(distribute_tensor(sharded_tp.bias.detach(), mesh, (Replicate(), Replicate())))
    with pytest.raises(ValueError, match="'weight' must be Replicate\\(\\) on the data-parallel dim 'dp'"):
        fully_shard(sharded_tp, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    on_sub = nn.Linear(4, 4)
    on_sub.weight = nn.Parameter(distribute_tensor(on_sub.weight.detach(), mesh["tp"], (Replicate(),)))
    on_sub.bias = nn.Parameter(distribute_tensor(on_sub.bias.detach(), mesh["tp"], (Replicate(),)))
    with pytest.raises(ValueError, match="is a DTensor on the mesh .* not on 'mesh'"):
        fully_shard(on_sub, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    with pytest.raises(ValueError, match="replicate: 'dp_mesh_dims' may only name replicate dims"):
        replicate(fresh(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    with pytest.raises(ValueError, match="replicate: pass 'mesh' with 'dp_mesh_dims'"):
        replicate(fresh(), process_group=dist.group.WORLD, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))


def _adapter(rank: int, world: int) -> None:
    from composable.integrations.fsdp2_module import fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _distribute(Model(), mesh, tp=True)
    fsdp2_fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert model.out.weight.placements == (Shard(0), Replicate())


def test_fsdp2_signature_adapter_passes_dp_mesh_dims() -> None:
    run_on_ranks(_adapter, 4)


def test_errors() -> None:
    """Every bad dp_mesh_dims raises at the call, naming the API, the argument and the value."""
    run_on_ranks(_errors, 4)
