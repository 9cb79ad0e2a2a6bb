"""Per-parameter meshes in one `fully_shard` call (`shard_placement_fn` returning
`ShardPlacementResult`s on different meshes), as PyTorch FSDP2 does for MoE blocks.

On 4 gloo ranks laid out as (edp 2, ep 2), every block of the example MoE transformer is
sharded by ONE `fully_shard(block, shard_placement_fn=...)`: the routed experts (split over
`ep`, examples/models/moe.py) on the 2-rank `edp` mesh, the other parameters on the 4-rank dense
mesh. Against FSDP2's own `fully_shard` with the same function (torch >= 2.13): losses, local
shards, gradients and parameters over 3 AdamW steps equal bit for bit, and the same
all-gathers / reduce-scatters / all-reduces per process group per step. On every torch the
mean loss follows a single-process model trained on all ranks' batches. A second layout puts
plain expert weights on an HSDP mesh with `Shard(1)`. State methods and the knobs FSDP2's
methods set reach every group (dp_mesh_dims and errors: test_per_param_mesh_dims.py).
"""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from _harness import count_collectives, on_gpus, run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import composable
from composable import ShardPlacementResult, clip_grad_norm_, fully_shard
from models.model import Transformer, get_config, lm_loss
from trainer.parallel import expert_mesh, sharding_units

try:  # torch >= 2.13: FSDP2 takes ShardPlacementResult (composable's is torch's class there)
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as _TorchResult

    HAS_FSDP2 = ShardPlacementResult is _TorchResult
except ImportError:  # pragma: no cover
    HAS_FSDP2 = False
needs_fsdp2 = pytest.mark.skipif(not HAS_FSDP2, reason="this torch's FSDP2 has no ShardPlacementResult")

CFG = get_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=48, n_experts=4)
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _info(mesh, hsdp: bool = False) -> object:
    """torch's mesh info where it exists, else any object with a `mesh` (composable takes both)."""
    if not HAS_FSDP2:
        return SimpleNamespace(mesh=mesh)
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0) if hsdp else FSDPMeshInfo(mesh, shard_mesh_dim=0)


def _tokens(step: int, rank: int) -> torch.Tensor:
    torch.manual_seed(1000 * step + rank)
    return torch.randint(0, CFG.vocab_size, (2, 17))


def _shard(model: Transformer, shard, layout: str, world: int, device: str = "cpu") -> None:
    """One fully_shard per block: experts on their own mesh, the rest on the dense mesh."""
    mesh = expert_mesh(device, CFG.n_experts, ep=2)  # (edp, ep)
    dense = init_device_mesh(device, (world,))
    dense_info = _info(dense)
    if layout == "ep":  # experts split over ep, sharded over edp on dim 0
        expert_info, placement = _info(mesh["edp"]), Shard(0)
        for block in model.layers:
            block.feed_forward.experts.split(mesh["ep"])
    else:  # plain experts, HSDP: replicated over edp, sharded over ep on dim 1
        expert_info, placement = _info(mesh, hsdp=True), Shard(1)
    for unit in sharding_units(model):
        if unit in list(model.layers):
            experts = set(unit.feed_forward.experts.parameters())

            def fn(p: nn.Parameter, experts: set = experts) -> ShardPlacementResult:
                if p in experts:
                    return ShardPlacementResult(placement, expert_info)
                return ShardPlacementResult(Shard(0), dense_info)

            shard(unit, mesh=dense, shard_placement_fn=fn)
        else:
            shard(unit, mesh=dense)


def _train(rank: int, world: int, library: str, layout: str, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    with torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu"):
        model = Transformer(CFG)
    if library != "single":
        shard = composable.fully_shard if library == "composable" else torch_fully_shard
        _shard(model, shard, layout, world, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict = {"losses": [], "grads": [], "counts": []}
    for step in range(3):
        ranks = range(world) if library == "single" else [rank]
        tokens = torch.cat([_tokens(step, r) for r in ranks]).to(device)
        with count_collectives() as comm:
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        out["counts"].append(Counter((r.kind, r.group) for r in comm.records if r.kind in KINDS))
        out["grads"].append({n: getattr(p.grad, "_local_tensor", p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
    out["params"] = {n: getattr(p, "_local_tensor", p).clone() for n, p in model.named_parameters()}
    out["placements"] = {
        n: (p.device_mesh.mesh.tolist(), tuple(p.placements))
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    return out


def _check_single(rank: int, world: int, ours: dict, layout: str) -> None:
    single = _train(rank, world, "single", layout)
    for step, loss in enumerate(ours["losses"]):
        mean = loss.clone()
        torch.distributed.all_reduce(mean)
        torch.testing.assert_close(mean / world, single["losses"][step], rtol=1e-5, atol=1e-5, msg=f"step {step}")


def _vs_fsdp2(rank: int, world: int, layout: str, device: str = "cpu") -> None:
    ref = _train(rank, world, "fsdp2", layout, device)
    ours = _train(rank, world, "composable", layout, device)
    assert ours["placements"] == ref["placements"]
    w1 = ours["placements"]["layers.0.feed_forward.experts.w1"]
    assert w1[0] != ours["placements"]["layers.0.attention.wq.weight"][0]  # its own mesh
    assert all(torch.equal(a, b) for a, b in zip(ref["losses"], ours["losses"])), (ref["losses"], ours["losses"])
    for step in range(3):
        for name, g in ours["grads"][step].items():
            # The reduce-scatter inputs are FSDP2's element for element: the same sums in the
            # same order on any backend and CPU.
            assert torch.equal(g, ref["grads"][step][name]), (step, name)
        assert ours["counts"][step] == ref["counts"][step], (step, ours["counts"][step], ref["counts"][step])
    for name, p in ours["params"].items():
        assert torch.equal(p, ref["params"][name]), name
    gathers = sum(n for (kind, _), n in ours["counts"][0].items() if kind == "all_gather")
    assert gathers >= 2 * CFG.n_layers  # each block gathers on both meshes
    if device == "cpu":
        _check_single(rank, world, ours, layout)


@needs_fsdp2
@pytest.mark.parametrize("layout", ["ep", "hsdp"])
def test_moe_block_equal_to_fsdp2(layout: str) -> None:
    run_on_ranks(_vs_fsdp2, 4, layout)


@needs_fsdp2
@pytest.mark.parametrize("device", [on_gpus("cuda", 4, id="nccl")])
def test_moe_block_equal_to_fsdp2_on_gpus(device: str) -> None:
    run_on_ranks(_vs_fsdp2, 4, "ep", device, backend="nccl", timeout=300)


def _vs_single(rank: int, world: int) -> None:
    _check_single(rank, world, _train(rank, world, "composable", "ep"), "ep")


def test_moe_block_follows_single_process() -> None:
    run_on_ranks(_vs_single, 4)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(4, 6, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.einsum("bd,edh->bh", x, self.experts))


def _block(world: int):
    """A block whose `experts` go on the edp mesh of a (edp 2, ep 2) layout, `proj` on the world."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("edp", "ep"))
    info = _info(mesh["edp"])
    block = nn.Sequential(_Block())
    fully_shard(
        block[0],
        shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), info) if p.dim() == 3 else None,
    )
    fully_shard(block)
    return block, mesh


def _methods(rank: int, world: int) -> None:
    block, mesh = _block(world)
    state = fully_shard.state(block[0])
    experts, weight = block[0].experts, block[0].proj.weight
    assert experts.device_mesh.mesh.tolist() == mesh["edp"].mesh.tolist()
    assert tuple(experts.placements) == (Shard(0),) and tuple(weight.placements) == (Shard(0),)
    assert weight.device_mesh.size() == world and state.param_names == ["experts", "proj.weight", "proj.bias"]
    state.unshard()  # every group
    assert not isinstance(block[0].experts, DTensor) and not isinstance(block[0].proj.weight, DTensor)
    state.reshard()
    assert isinstance(block[0].experts, DTensor) and isinstance(block[0].proj.weight, DTensor)
    handle = state.unshard(async_op=True)
    handle.wait()
    assert not isinstance(block[0].experts, DTensor)
    state.reshard()
    # Gradients summed, not averaged, on every group; no sync on every group.
    x = torch.randn(3, 6)
    block(x).sum().backward()
    averaged = {n: p.grad._local_tensor.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    for s in (fully_shard.state(block), state):
        s.set_gradient_divide_factor(1.0)
    block(x).sum().backward()
    for n, p in block.named_parameters():
        dp = 2 if p.dim() == 3 else world
        torch.testing.assert_close(p.grad._local_tensor, averaged[n] * dp, msg=n)
    block.zero_grad()
    fully_shard.state(block).set_requires_gradient_sync(False)
    with count_collectives() as comm:
        block(x).sum().backward()
    assert comm.counts["reduce_scatter"] == 0 and comm.counts["all_reduce"] == 0
    fully_shard.state(block).set_requires_gradient_sync(True)
    block(x).sum().backward()
    state.set_reshard_after_backward(False)
    block(x).sum().backward()
    assert isinstance(block[0].experts, DTensor)  # shown sharded, kept unsharded
    state.set_reshard_after_backward(True)
    # clip_grad_norm_ over parameters on two meshes: the norm of the full gradients.
    full = [p.grad.full_tensor() for p in block.parameters()]
    with count_collectives() as comm:
        norm = clip_grad_norm_(list(block.parameters()), max_norm=1e9)
    assert comm.counts["all_reduce"] == 2, comm.events  # one per mesh
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.stack([g.norm() for g in full])))
    clone = copy.deepcopy(block)  # its own groups, on the same meshes
    for model in (block, clone):
        model.zero_grad()
        model(x).sum().backward()
    for p, q in zip(block.parameters(), clone.parameters()):
        assert q.device_mesh == p.device_mesh and torch.equal(q.grad._local_tensor, p.grad._local_tensor)
    sd = block.state_dict()
    assert sd["0.experts"].device_mesh.mesh.tolist() == mesh["edp"].mesh.tolist()
    block.load_state_dict(sd)


def test_state_methods_reach_every_group() -> None:
    run_on_ranks(_methods, 4)


class _UnusedComm:
    """An FSDP2 `AllGather` / `ReduceScatter` that is set, never run."""

    def allocate(self, size, *, dtype, device) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError("not run in this test")


def _knobs(rank: int, world: int) -> None:
    """FSDP2's methods on a module of two meshes set their knob on each of its groups (one per
    mesh, as FSDP2's `FSDPParamGroup`s), binding collectives to each group's own process group."""
    from composable import share_comm_ctx
    from composable.integrations.fsdp2_module import as_fsdp_module, restore_class

    block, _ = _block(world)
    state = fully_shard.state(block[0])
    groups = state.groups
    assert len(groups) == 2 and groups[0].layout.shard_group is not groups[1].layout.shard_group
    # Each group its own process group's allocator.
    state.set_allocate_memory_from_process_group_for_comm(True)
    assert all(g.all_gather_comm._group is g.layout.shard_group for g in groups)
    assert all(g.reducer.options.reduce_scatter_comm._group is g.layout.shard_group for g in groups)
    state.set_allocate_memory_from_process_group_for_comm(False)
    gather, reduce, hook = _UnusedComm(), _UnusedComm(), lambda grads: None
    state.set_custom_all_gather(gather)
    state.set_custom_reduce_scatter(reduce)
    state.set_keep_unsharded_storage(True, recurse=False)
    state.set_force_sum_reduction_for_comms(True)
    state.set_reduce_scatter_unused_params(True, recurse=False)
    state.set_reduce_scatter_max_input_buffers(2, recurse=False)
    state.set_requires_all_reduce(False, recurse=False)
    state.set_gradient_divide_factor(3)
    state.set_all_reduce_hook(hook)
    state.set_separate_reduce_scatter_group(False, recurse=False)
    share_comm_ctx([block])
    as_fsdp_module(block[0])
    for g in groups:
        r = g.reducer
        assert g.all_gather_comm is gather and r.options.reduce_scatter_comm is reduce and g.keep_unsharded_storage
        assert (
            r.options.force_sum
            and r.options.reduce_unused
            and r.options.max_input_buffers == 2
            and not r.options.requires_all_reduce
        )
        assert (
            r.options.divide_factor == 3.0
            and r.options.all_reduce_hook is hook
            and r.options.all_reduce_hook_stream is None
        )
        assert r.options.reduce_scatter_group is None and g.streams is None and r.streams is None  # CPU: no streams
        assert g.shows_unsharded_between_passes
    assert all(g.layout.sharded and g.layout.replicate_groups == () for g in groups)
    restore_class(block[0])
    assert not any(g.shows_unsharded_between_passes for g in groups)


def test_knobs_reach_every_group() -> None:
    run_on_ranks(_knobs, 4)


def _two_blocks(world: int, reshard: bool | int, prefetch: bool) -> nn.Sequential:
    torch.manual_seed(0)
    edp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("edp", "ep"))["edp"]
    dense = init_device_mesh("cpu", (world,))
    model = nn.Sequential(_Block(), _Block())
    model[0].proj = nn.Linear(8, 6)
    for block in model:
        fn = lambda p, b=block: ShardPlacementResult(Shard(0), _info(edp) if p is b.experts else _info(dense))  # noqa: E731
        fully_shard(block, mesh=dense, reshard_after_forward=reshard, shard_placement_fn=fn)
    fully_shard(model, mesh=dense)
    if prefetch:
        fully_shard.state(model[0]).set_modules_to_forward_prefetch([model[1]])
        fully_shard.state(model[1]).set_modules_to_backward_prefetch([model[0]])
    return model


def _prefetch_and_int_reshard(rank: int, world: int) -> None:
    """Explicit prefetching and reshard_after_forward=2 (the dense group keeps half, the
    2-rank expert group reshards fully) train as the plain setup, with the same number of
    collectives per step, and the unsharded parameters are freed after forward."""
    runs = []
    for reshard, prefetch in ((True, False), (2, True)):
        model = _two_blocks(world, reshard, prefetch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, counts = [], []
        for step in range(2):
            torch.manual_seed(step * 10 + rank)
            with count_collectives() as comm:
                out = model(torch.randn(3, 6))
                assert all(isinstance(b.experts, DTensor) and isinstance(b.proj.weight, DTensor) for b in model)
                loss = out.pow(2).sum()
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            counts.append(Counter(r.kind for r in comm.records))
        runs.append((losses, [p.detach()._local_tensor.clone() for p in model.parameters()], counts))
    (ref_losses, ref_params, ref_counts), (losses, params, counts) = runs
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    assert counts == ref_counts, (counts, ref_counts)
    with pytest.raises(NotImplementedError, match="live on 2 meshes .* not supported with per-parameter meshes"):
        fully_shard.state(model[0]).set_separate_reduce_scatter_group(True, recurse=False)
    # One process group's allocator per group, each on its own mesh.
    state = fully_shard.state(model[0])
    state.set_allocate_memory_from_process_group_for_comm(True)
    for group in state.groups:
        assert group.all_gather_comm._group is group.layout.shard_group
        assert group.reducer.options.reduce_scatter_comm._group is group.layout.shard_group
    model(torch.randn(3, 6)).sum().backward()


def test_prefetch_and_int_reshard() -> None:
    run_on_ranks(_prefetch_and_int_reshard, 4)
