"""Muon after `fully_shard` (`composable.optim.Muon`): the update one process gives.

Each step the sharded model's gradients (whole, `full_tensor`) are fed to a single-process copy
stepped by `torch.optim.Muon`; after every step every parameter equals the copy's bit for bit
(Newton-Schulz on the same whole matrices), at 2 and 4 gloo ranks: uneven rows (a rank holding no
row), tall and wide matrices, several per group, a frozen one skipped, AdamW beside it for the
rest; on HSDP (replicate x shard) each replica group orthogonalizes on its own ranks; on dp x tp
(a matrix whole only across both) each matrix is gathered whole; `replicate`'s whole parameters give
the same update; so do PyTorch FSDP2's sharded parameters, and gradients accumulated under
`no_sync`, computed in bf16 over fp32 parameters and clipped before the step. The momentum buffers are DTensors
sharded as their parameters, and a DCP checkpoint resumes bit for bit. Expert weights (3D, one
matrix per expert) get each matrix's single-process update. And
`torch.optim.Muon` over sharded parameters is refused at its first step, with one line.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _harness import on_gpus, run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import composable
from composable.optim import Muon


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 10, bias=False)  # 10 rows: 3, 3, 3, 1 on 4 ranks
        self.gate = nn.Linear(8, 5)  # 5 rows: 2, 2, 1, 0 (a rank without a row)
        self.down = nn.Linear(15, 8, bias=False)  # wide: orthogonalized through its transpose
        self.frozen = nn.Linear(8, 8, bias=False)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([torch.tanh(self.up(x)), self.gate(x)], dim=-1)
        return x + self.down(h) + self.frozen(x)


class MLP(nn.Module):
    """A tensor-parallel block: `up` column-parallel (10 rows, 5 a tp rank), `down` row-parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 10)
        self.down = nn.Linear(10, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _model(layout: str = "fully_shard") -> nn.Sequential:
    torch.manual_seed(0)
    block = MLP if layout in ("tp", "hsdp_tp") else Block
    return nn.Sequential(block(), block(), nn.Linear(8, 3))


def _optimizers(model: nn.Module, muon: type) -> list[torch.optim.Optimizer]:
    """Muon on the hidden matrices, AdamW on the rest (biases, the head), the usual split."""
    hidden = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and not n.startswith("2.")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and (p.ndim != 2 or n.startswith("2."))]
    return [muon(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-2)]


def _shard(model: nn.Module, layout: str, world: int, device: str = "cpu") -> None:
    if layout == "replicate":
        composable.replicate(model)
        return
    if layout in ("tp", "hsdp_tp"):  # the blocks' up column-parallel, down row-parallel on tp, then dp
        if layout == "tp":
            mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("dp", "tp"))
        else:  # HSDP x TP: replicate 2 x shard world/4 x tp 2
            mesh = init_device_mesh(device, (2, world // 4, 2), mesh_dim_names=("replicate", "shard", "tp"))
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        for block in model[:2]:
            parallelize_module(block, mesh["tp"], plan)
        mesh = mesh["dp"] if layout == "tp" else mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh(device, (2, world // 2) if layout == "hsdp" else (world,))
    shard = torch_fully_shard if layout == "fsdp2" else composable.fully_shard
    for block in model[:2]:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _vs_one_process(rank: int, world: int, layout: str, device: str = "cpu") -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    model = _model(layout).to(device)
    ref = copy.deepcopy(model)
    _shard(model, layout, world, device)
    opts, ref_opts = _optimizers(model, Muon), _optimizers(ref, torch.optim.Muon)
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 8, device=device)).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = None if p.grad is None else _whole(p.grad).clone()  # fed the same gradients
        for opt in opts + ref_opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(_whole(p), q), f"{layout}: {name} differs from one process after step {step}"
    for p in opts[0].param_groups[0]["params"]:
        buf = opts[0].state[p]["momentum_buffer"]
        assert isinstance(buf, DTensor) and buf.placements == p.placements, (buf, p.placements)


@pytest.mark.parametrize(
    "layout, world",
    [("fully_shard", 2), ("fully_shard", 4), ("hsdp", 4), ("tp", 4), ("hsdp_tp", 4), ("replicate", 2), ("fsdp2", 2)],
    ids=str,
)
def test_update_equals_one_process(layout: str, world: int) -> None:
    run_on_ranks(_vs_one_process, world, layout)


_GPU_WORLDS = {"fully_shard": 2, "hsdp": 4, "tp": 4, "hsdp_tp": 4}


@pytest.mark.parametrize("layout", [on_gpus(layout, world, id=layout) for layout, world in _GPU_WORLDS.items()])
def test_update_equals_one_process_on_gpus(layout: str) -> None:
    """NCCL: the rounds' all-to-alls in flight on the collectives' stream while the owners compute."""
    world = _GPU_WORLDS[layout]
    run_on_ranks(_vs_one_process, world, layout, "cuda", backend="nccl", timeout=300)


def _accumulated_clipped_bf16(rank: int, world: int) -> None:
    """Two micro-batches (the first under `no_sync`), bf16 compute over fp32 parameters, the
    gradients clipped before the step: Muon steps the fp32 shards as one process steps the whole
    fp32 matrices fed the same (clipped) gradients."""
    model = _model()
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    policy = composable.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model[:2]:
        composable.fully_shard(block, mesh=mesh, mp_policy=policy)
    composable.fully_shard(model, mesh=mesh, mp_policy=policy)
    opts, ref_opts = _optimizers(model, Muon), _optimizers(ref, torch.optim.Muon)
    for step in range(3):
        for micro in range(2):
            torch.manual_seed(100 * step + 10 * micro + rank)
            with composable.no_sync(model) if micro == 0 else contextlib.nullcontext():
                model(torch.randn(4, 8)).float().square().mean().backward()
        norm = composable.clip_grad_norm_(model.parameters(), max_norm=0.05)
        assert norm > 0.05  # it clips
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.dtype == torch.float32
            q.grad = None if p.grad is None else _whole(p.grad).clone()
        for opt in opts + ref_opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(_whole(p), q), f"{name} differs from one process after step {step}"


def test_accumulated_clipped_bf16_compute_steps_as_one_process() -> None:
    run_on_ranks(_accumulated_clipped_bf16, 2)


def _which_path(rank: int, world: int) -> list:
    from torch.distributed.tensor.placement_types import _StridedShard

    from composable.optim._whole_matrices import _nested_rows, _row_layout

    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh("cpu", (2, 2))
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    cases = [
        (named, (Replicate(), Shard(0)), ((1,), False)),  # HSDP: each replica group on its own
        (named, (Shard(0), Replicate()), ((0,), False)),
        (named, (Shard(0), Shard(0)), ((0, 1), False)),
        (named, strided, ((1, 0), False)),  # column-parallel under dp: tp's rows split over dp
        (named, (Shard(0), Shard(1)), ((0, 1), True)),  # row-parallel: laid out by rows first
        (unnamed, (Shard(0), Shard(1)), None),  # no names to flatten two dims: gathered
        (named, (Replicate(), Replicate()), None),  # whole everywhere
    ]
    found = []
    for mesh, placements, want in cases:
        local = torch.zeros(2, 8)  # the layout alone is read
        param = DTensor.from_local(local, mesh, placements, shape=(8, 8), stride=(8, 1), run_check=False)
        found.append((_row_layout(param), want))
    # Shard(0) over one dim then another: torch.chunk's sizes, nested (10 rows: 5 | 5, then 3 2 | 3 2).
    found.append((_nested_rows(10, [2, 2]), [3, 2, 3, 2]))
    found.append((_nested_rows(5, [4]), [2, 2, 1, 0]))
    return found


def test_layouts_take_the_owners_path_where_they_can() -> None:
    """HSDP's layout divides its matrices among its shard ranks; a dp x tp matrix goes to owners
    over the whole (dp, tp) group, laid out by rows first; only an unnamed 2D mesh is gathered."""
    assert all(got == want for got, want in run_on_ranks(_which_path, 4)[0])


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _build_for_checkpoint(seed: int, world: int, layout: str = "fully_shard") -> tuple[nn.Module, Muon]:
    torch.manual_seed(seed)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 3))
    _shard(model, layout, world)
    hidden = [p for p in model[:2].parameters() if p.requires_grad and p.ndim == 2]
    return model, Muon(hidden, lr=0.02, weight_decay=0.01)


def _momenta(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [_whole(opt.state[p]["momentum_buffer"]) for p in opt.param_groups[0]["params"]]


def _checkpoint_round_trip(rank: int, world: int, path: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        return _build_for_checkpoint(seed, world)

    model, opt = build(0)
    _train_steps(model, opt, range(2), rank)
    msd, osd = get_state_dict(model, opt)
    for fqn, state in osd["state"].items():  # the momentum, sharded as its parameter
        assert isinstance(state["momentum_buffer"], DTensor), fqn
        assert state["momentum_buffer"].placements == msd[fqn].placements, fqn
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = _momenta(opt)
    fresh, fresh_opt = build(1)  # other values: the load must overwrite them all
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd2, optim_state_dict=osd2)
    _train_steps(model, opt, range(2, 4), rank)  # the run that never stopped
    _train_steps(fresh, fresh_opt, range(2, 4), rank)  # the resumed one
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(_whole(p), _whole(q)), f"{name}: the resumed run differs"
    return saved, [_whole(p).detach() for p in model.parameters()]


def _load_elsewhere(rank: int, world: int, path: str, layout: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The checkpoint loaded into a run of `layout` at `world` ranks: its momenta, and its
    parameters after the steps the saving run took next (the same data only at 2 ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _build_for_checkpoint(1, world, layout)
    _train_steps(model, opt, range(1), rank)  # a momentum of its own, which the load replaces
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = _momenta(opt)
    _train_steps(model, opt, range(2, 4), rank)
    return loaded, [_whole(p).detach() for p in model.parameters()]


def test_checkpoint_round_trip_resumes_bit_for_bit(tmp_path: Path) -> None:
    """DCP through `get_state_dict`: the momentum saved sharded as its parameter, loaded into a
    fresh run, which then trains on exactly as the run that never stopped; loaded into a run on
    PyTorch FSDP2's parameters, which trains on as it too; and into 4 ranks, resharded."""
    path = str(tmp_path / "ckpt")
    saved, never_stopped = run_on_ranks(_checkpoint_round_trip, 2, path)[0]
    loaded, params = run_on_ranks(_load_elsewhere, 2, path, "fsdp2")[0]
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved))
    assert all(torch.equal(a, b) for a, b in zip(params, never_stopped))
    loaded, _ = run_on_ranks(_load_elsewhere, 4, path, "fully_shard")[0]
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved))


class Experts(nn.Module):
    """A stack of expert matrices, one per expert along dim 0, as a mixture of experts keeps them."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, 6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,eoi->bo", x, self.w)


def _experts_vs_one_process(rank: int, world: int, experts: int, dim: int) -> None:
    torch.manual_seed(0)
    model = Experts(experts)
    ref = [nn.Parameter(m.detach().clone()) for m in model.w.unbind(0)]  # one matrix per expert
    composable.fully_shard(model, shard_placement_fn=lambda p: Shard(dim))
    opt = Muon([model.w], lr=0.02, weight_decay=0.01)
    ref_opt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.01)
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 8)).square().mean().backward()
        for q, g in zip(ref, model.w.grad.full_tensor().unbind(0)):
            q.grad = g.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for e, (got, want) in enumerate(zip(model.w.full_tensor().unbind(0), ref)):
            assert torch.equal(got, want), f"expert {e} differs from one process after step {step}"


@pytest.mark.parametrize("world, experts, dim", [(2, 3, 0), (4, 2, 0), (2, 3, 1)], ids=str)
def test_expert_matrices_each_get_one_process_update(world: int, experts: int, dim: int) -> None:
    """3D expert weights: each expert's matrix stepped as torch.optim.Muon steps it alone. Sharded
    by experts (dim 0: 2 + 1 experts, or 1, 1, 0, 0 at 4 ranks) each rank orthogonalizes its own
    whole matrices; sharded inside the matrices (dim 1) they are gathered whole first."""
    run_on_ranks(_experts_vs_one_process, world, experts, dim)


def test_shapes_other_than_matrices_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"Muon: parameters must be matrices \(2D\) or stacks of them \(3D\), got one of shape \(4,\)"
    ):
        Muon([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="Muon: 'lr' must be >= 0, got -1"):
        Muon([nn.Parameter(torch.zeros(2, 2))], lr=-1)


def _owners_balance(rank: int, world: int) -> list[int]:
    from composable.optim._whole_matrices import _owners

    return _owners([torch.Size((64, 64)), torch.Size((8, 8)), torch.Size((64, 64)), torch.Size((16, 8))], world)


def test_owners_spread_the_work() -> None:
    """The two large matrices go to different ranks; every rank makes the same choice."""
    owners = run_on_ranks(_owners_balance, 2)
    assert owners[0] == owners[1] and owners[0][0] != owners[0][2]


def _torch_muon_on_shards(rank: int, world: int) -> str:
    model = _model()
    _shard(model, "fully_shard", world)
    opt = _optimizers(model, torch.optim.Muon)[0]
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError) as caught:
        opt.step()
    return str(caught.value)


def test_torch_muon_over_sharded_parameters_is_refused() -> None:
    message = run_on_ranks(_torch_muon_on_shards, 2)[0]
    assert message.startswith("torch.optim.Muon.step(): a parameter of shape (10, 8) in param group 0 is sharded")
    assert "use composable.optim.Muon" in message and "\n" not in message
