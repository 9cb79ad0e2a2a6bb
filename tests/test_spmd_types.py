"""Parameters annotated with spmd_types (torchtitan's default SPMD backend): plain local tensors
with local types and partition specs, sharded with `dp_mesh_dims` over a named storage mesh.

Each case builds one model twice from the same seed on 4 gloo ranks (dp x tp with a
sequence-parallel norm, HSDP, dp x cp flattened, DDP-style replicate over dp x tp), shards one
with torch's FSDP2 and one with composable, and checks bit for bit: placements, meshes and local
shards, losses and parameters over several steps, with spmd_types typechecking on and off.
Then compiled blocks, state dicts and DCP, the FSDPModule methods, and every error. Needs
spmd_types; the comparisons need a torch whose FSDP2 takes spmd_types (2.15).
"""

from __future__ import annotations

import contextlib
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import composable
from composable import DataParallelMeshDims

spmd = pytest.importorskip("spmd_types", reason="spmd_types is not installed (pip install spmd_types)")
try:  # FSDP2 translates spmd_types annotations from torch 2.15 on
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    TORCH_TAKES_SPMD_TYPES = hasattr(FSDPParam, "_resolve_spmd_types_for_storage")
except ImportError:  # pragma: no cover
    TORCH_TAKES_SPMD_TYPES = False
needs_fsdp2 = pytest.mark.skipif(not TORCH_TAKES_SPMD_TYPES, reason="this torch's FSDP2 does not take spmd_types")

DIM, HIDDEN, BATCH, SEQ, STEPS = 8, 16, 4, 4, 3

# case -> (mesh dim names, DataParallelMeshDims keywords, tensor-parallel dim or None)
CASES = {
    "dp_tp": (("dp", "tp"), dict(shard="dp"), "tp"),
    "hsdp": (("rep", "shard"), dict(shard="shard", replicate="rep"), None),
    "dp_cp": (("dp", "cp"), dict(shard=("dp", "cp")), None),
    "ddp_tp": (("dp", "tp"), dict(replicate="dp"), "tp"),
}


class Block(nn.Module):
    """A residual MLP on plain local tensors. With tp: a sequence-parallel norm (R on tp: each
    rank sees its own tokens, so its gradient is Partial over tp), the tokens all-gathered
    over tp, a colwise `w1` (S(0)), a rowwise `w2` (S(1)), reduce-scattered back."""

    def __init__(self, tp: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.tp = tp
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        self.w1 = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM**0.5)
        self.b1 = nn.Parameter(0.1 * torch.randn(HIDDEN))
        self.w2 = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.norm
        same_dtype = {"op_dtype": x.dtype}  # spmd_types asks for the backward's reduction dtype
        if self.tp is not None:
            h = spmd.all_gather(h, self.tp, src=spmd.S(1), dst=spmd.R, backward_options=same_dtype)
        out = F.linear(torch.relu(F.linear(h, self.w1, self.b1)), self.w2)
        if self.tp is not None:
            out = spmd.reduce_scatter(out, self.tp, src=spmd.P, dst=spmd.S(1), backward_options=same_dtype)
        return x + out


class Model(nn.Module):
    def __init__(self, tp: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(tp) for _ in range(2))
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * self.scale


def _axes(mesh) -> dict[str, object]:
    return {name: spmd.MeshAxis.of(mesh.get_group(name)) for name in mesh.mesh_dim_names}


def build(mesh, case: str, seed: int = 0, annotate_dp: bool = True) -> Model:
    """The model with full-size values from `seed`, cut to this rank's tp shard and annotated
    (R on the data-parallel axes unless `annotate_dp` is False: FSDP2 fills them in)."""
    names, _, tp_name = CASES[case]
    axes = _axes(mesh)
    torch.manual_seed(seed)
    model = Model(mesh.get_group(tp_name) if tp_name else None)
    dp_axes = {axes[n]: spmd.R for n in names if n != tp_name} if annotate_dp else {}
    for block in model.blocks:
        if tp_name is not None:
            rank, size = mesh[tp_name].get_local_rank(), mesh.size(names.index(tp_name))
            for attr, dim in (("w1", 0), ("b1", 0), ("w2", 1)):
                full = getattr(block, attr).detach()
                setattr(block, attr, nn.Parameter(full.chunk(size, dim)[rank].clone()))
            tp_types = {"norm": spmd.R, "w1": spmd.S(0), "b1": spmd.S(0), "w2": spmd.S(1)}
            for attr, kind in tp_types.items():
                spmd.assert_type(getattr(block, attr), {**dp_axes, axes[tp_name]: kind})
        else:
            for p in block.parameters():
                spmd.assert_type(p, {axis: spmd.R for axis in axes.values()})
    spmd.assert_type(model.scale, {axis: spmd.R for axis in axes.values()})
    return model


def shard(api, model: Model, mesh, case: str, **kwargs: object) -> None:
    dims = DataParallelMeshDims(**CASES[case][1])
    if case == "ddp_tp":
        api(model, mesh=mesh, dp_mesh_dims=dims, **kwargs)
        return
    for block in model.blocks:
        api(block, mesh=mesh, dp_mesh_dims=dims, **kwargs)
    api(model, mesh=mesh, dp_mesh_dims=dims, **kwargs)


def torch_api(case: str):
    if case == "ddp_tp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def ours_api(case: str):
    return composable.replicate if case == "ddp_tp" else composable.fully_shard


def batch(mesh, case: str, step: int) -> torch.Tensor:
    """This rank's tokens of the step's global batch: batch rows over the data-parallel ranks,
    sequence over tp (sequence parallel), annotated V on the data-parallel axes."""
    names, _, tp_name = CASES[case]
    torch.manual_seed(100 + step)
    x = torch.randn(BATCH, SEQ, DIM)
    dp_names = [n for n in names if n != tp_name]
    dp_rank = 0
    for n in dp_names:
        dp_rank = dp_rank * mesh.size(names.index(n)) + mesh[n].get_local_rank()
    dp_size = BATCH // (mesh.size() // (mesh.size(names.index(tp_name)) if tp_name else 1))
    x = x[dp_rank * dp_size : (dp_rank + 1) * dp_size]
    axes = _axes(mesh)
    types = {axes[n]: spmd.V for n in dp_names}
    if tp_name is not None:
        x = x.chunk(mesh.size(names.index(tp_name)), 1)[mesh[tp_name].get_local_rank()].contiguous()
        types[axes[tp_name]] = spmd.S(1)
    return spmd.assert_type(x, types)


def loss_of(out: torch.Tensor, mesh, case: str) -> torch.Tensor:
    """The local loss, declared a pending sum over every axis (each rank holds other tokens)."""
    loss = out.pow(2).mean()
    for name in mesh.mesh_dim_names:
        loss = spmd.reinterpret(loss, mesh.get_group(name), src=spmd.V, dst=spmd.P)
    return loss


def typechecking(on: bool):
    if not on:
        return contextlib.nullcontext()
    from spmd_types.checker import typecheck

    return typecheck(strict_mode="permissive")


def methods(model: nn.Module) -> object:
    """What has the FSDPModule methods: FSDP2's module itself, composable's state."""
    if hasattr(model, "set_requires_gradient_sync"):
        return model
    return composable.fully_shard.state(model) or composable.replicate.state(model)


def train(model: Model, mesh, case: str, checked: bool, steps: int = STEPS, sync_every: int = 1) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        sync = (step + 1) % sync_every == 0
        methods(model).set_requires_gradient_sync(sync)
        with typechecking(checked):
            loss = loss_of(model(batch(mesh, case, step)), mesh, case)
            loss.backward()
        if sync:
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def assert_same_storage(ref: nn.Module, ours: nn.Module, exact: bool = True) -> None:
    for (n, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert isinstance(q, DTensor), n
        assert tuple(q.placements) == tuple(p.placements), (n, q.placements, p.placements)
        assert q.device_mesh.mesh.tolist() == p.device_mesh.mesh.tolist(), n
        assert q.shape == p.shape, (n, q.shape, p.shape)
        if exact:
            assert torch.equal(q._local_tensor, p._local_tensor), n
        else:
            torch.testing.assert_close(q._local_tensor, p._local_tensor, msg=n)


def _parity(rank: int, world: int, case: str, checked: bool, annotate_dp: bool) -> None:
    names = CASES[case][0]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    ref, ours = build(mesh, case, annotate_dp=annotate_dp), build(mesh, case, annotate_dp=annotate_dp)
    # Annotations on tp alone: the typechecking mesh (spmd_types' current mesh) fills in dp.
    with contextlib.nullcontext() if annotate_dp else spmd.set_current_mesh(mesh):
        shard(torch_api(case), ref, mesh, case)
        shard(ours_api(case), ours, mesh, case)
    assert_same_storage(ref, ours)
    ref_types, our_types = _seen_types(ref), _seen_types(ours)
    ref_losses, our_losses = train(ref, mesh, case, checked), train(ours, mesh, case, checked)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, our_losses)), (ref_losses, our_losses)
    # The reduce-scatter inputs are FSDP2's element for element: the same sums in the same order,
    # over 4 flattened dp x cp ranks too.
    assert_same_storage(ref, ours, exact=True)
    # The module computes with plain local tensors; under typechecking their annotation is back.
    assert our_types == ref_types and len(our_types) == STEPS, (our_types, ref_types)
    assert all(t for t in our_types) == checked, our_types


def _seen_types(model: Model) -> list:
    """What block 0's `w1` is annotated with whenever the block's forward runs (a user
    pre-hook: it runs after the library's, which unshards)."""
    seen: list = []
    model.blocks[0].register_forward_pre_hook(lambda m, _: seen.append(dict(spmd.get_local_type(m.w1))))
    return seen


@needs_fsdp2
@pytest.mark.parametrize("checked", [False, True], ids=["eager", "typechecked"])
@pytest.mark.parametrize("case", list(CASES))
def test_equal_to_fsdp2(case: str, checked: bool) -> None:
    """Storage (placements, meshes, local shards), losses and parameters equal FSDP2's bit for
    bit: dp x tp with a sequence-parallel norm, HSDP, dp x cp flattened, replicate over dp x tp;
    spmd_types typechecking off and on."""
    run_on_ranks(_parity, 4, case, checked, case != "ddp_tp")


def _single_process(rank: int, world: int) -> None:
    """dp x tp against the plain model on the whole batch: the sequence-parallel norm's
    gradient is summed over tp (R -> Partial), the rest as FSDP averages over dp."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours = build(mesh, "dp_tp")
    shard(composable.fully_shard, ours, mesh, "dp_tp")
    torch.manual_seed(0)
    plain = Model(None)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    our_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        # Four ranks' local means summed, averaged over the two dp ranks: twice the global mean.
        (2 * plain(torch.randn(BATCH, SEQ, DIM)).pow(2).mean()).backward()
        loss_of(ours(batch(mesh, "dp_tp", step)), mesh, "dp_tp").backward()
        for (n, p), q in zip(ours.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=f"step {step}: {n}")
        opt.step(), our_opt.step(), opt.zero_grad(), our_opt.zero_grad()


def test_equal_to_single_process() -> None:
    """Sequence-parallel norm weights keep their tensor-parallel gradient reduction (any torch
    spmd_types runs on: no FSDP2 needed)."""
    run_on_ranks(_single_process, 4)


def _mixed_precision(rank: int, world: int) -> None:
    """bf16 compute, fp32 reduction: the sequence-parallel norm's gradient (Partial over tp) is
    reduced over tp in fp32, the others sum in bf16, as FSDP2 decides per parameter."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref, ours = build(mesh, "dp_tp"), build(mesh, "dp_tp")
    shard(torch_api("dp_tp"), ref, mesh, "dp_tp", mp_policy=policy)
    shard(ours_api("dp_tp"), ours, mesh, "dp_tp", mp_policy=policy)
    ref_losses, our_losses = train(ref, mesh, "dp_tp", False), train(ours, mesh, "dp_tp", False)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, our_losses)), (ref_losses, our_losses)
    assert_same_storage(ref, ours)


@needs_fsdp2
def test_mixed_precision_equal_to_fsdp2() -> None:
    run_on_ranks(_mixed_precision, 4)


def _compiled_state_dict_dcp(rank: int, world: int, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, ours = build(mesh, "dp_tp"), build(mesh, "dp_tp")
    shard(torch_api("dp_tp"), ref, mesh, "dp_tp")
    shard(ours_api("dp_tp"), ours, mesh, "dp_tp")
    for block in ours.blocks:
        block.compile(backend="aot_eager")
    ref_losses, our_losses = train(ref, mesh, "dp_tp", False), train(ours, mesh, "dp_tp", False)
    torch.testing.assert_close(torch.stack(our_losses), torch.stack(ref_losses))
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q._local_tensor, p._local_tensor, msg=n)
    # State dicts: the same keys, placements and shards as FSDP2's; DCP across the libraries.
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert list(ref_sd) == list(our_sd)
    for key in ref_sd:
        assert our_sd[key].placements == ref_sd[key].placements, key
        assert torch.equal(our_sd[key]._local_tensor, ref_sd[key]._local_tensor), key
    dcp.save(our_sd, checkpoint_id=tmp)
    fresh = build(mesh, "dp_tp", seed=1)
    shard(torch_api("dp_tp"), fresh, mesh, "dp_tp")
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp)
    fresh.load_state_dict(state)
    for (n, p), q in zip(ours.named_parameters(), fresh.parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor), n


@needs_fsdp2
def test_compiled_blocks_state_dict_and_dcp() -> None:
    """Compiled blocks train as FSDP2's eager ones; state dicts equal FSDP2's and a DCP
    checkpoint of composable's loads into FSDP2's model."""
    with tempfile.TemporaryDirectory() as tmp:
        run_on_ranks(_compiled_state_dict_dcp, 4, tmp)


def _methods(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, ours = build(mesh, "dp_tp"), build(mesh, "dp_tp")
    shard(torch_api("dp_tp"), ref, mesh, "dp_tp")
    shard(ours_api("dp_tp"), ours, mesh, "dp_tp")
    # No-sync micro-steps (two backwards per optimizer step), under typechecking.
    ref_losses = train(ref, mesh, "dp_tp", True, steps=4, sync_every=2)
    our_losses = train(ours, mesh, "dp_tp", True, steps=4, sync_every=2)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, our_losses))
    assert_same_storage(ref, ours)
    # unshard / reshard: the module shows plain local tensors in between.
    for model in (ref, ours):
        methods(model.blocks[0]).unshard()
        w1 = model.blocks[0].w1
        assert not isinstance(w1, DTensor) and w1.shape == (HIDDEN // 2, DIM), (type(w1), w1.shape)
        methods(model.blocks[0]).reshard()
        assert isinstance(model.blocks[0].w1, DTensor)
    # Manual finalization: the reduction runs when finalize_backward is called.
    for model in (ref, ours):
        methods(model).set_manual_backward_finalization(True)
        loss_of(model(batch(mesh, "dp_tp", 7)), mesh, "dp_tp").backward()
        methods(model).finalize_backward()
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p.grad._local_tensor, q.grad._local_tensor), n


@needs_fsdp2
def test_fsdp_module_methods() -> None:
    """No-sync micro-steps, unshard / reshard and manual finalization equal FSDP2's."""
    run_on_ranks(_methods, 4)


def _errors(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    axes = _axes(mesh)
    dims = DataParallelMeshDims(shard="dp")

    def linear(types: dict) -> nn.Linear:
        lin = nn.Linear(4, 4, bias=False)
        spmd.assert_type(lin.weight, types)
        return lin

    full = {axes["dp"]: spmd.R, axes["tp"]: spmd.R}
    for api in (composable.fully_shard, composable.replicate):
        name = api.__name__
        with pytest.raises(ValueError, match=f"{name}: parameter 'weight' carries spmd_types annotations, which need"):
            api(linear(full), mesh=init_device_mesh("cpu", (4,)))
    with pytest.raises(ValueError, match="'weight' must be R on the data-parallel axis"):
        composable.fully_shard(linear({axes["dp"]: spmd.I, axes["tp"]: spmd.R}), mesh=mesh, dp_mesh_dims=dims)
    with pytest.raises(ValueError, match="'weight' has spmd_types annotations on .* only, which cannot be restored"):
        composable.fully_shard(linear({axes["tp"]: spmd.R}), mesh=mesh, dp_mesh_dims=dims)
    with spmd.set_current_mesh(mesh):  # the typechecking mesh fills in dp; tp is still needed
        with pytest.raises(ValueError, match="'weight' has no spmd_types annotation on the storage axes"):
            composable.fully_shard(linear({axes["dp"]: spmd.R}), mesh=mesh, dp_mesh_dims=dims)
    # A typechecking mesh over fewer ranks (tp alone) than the storage mesh (dp x tp).
    with spmd.set_current_mesh(mesh["tp"]):
        with pytest.raises(
            ValueError, match="'weight' is annotated on the typechecking mesh .*, which spans other ranks"
        ):
            composable.fully_shard(linear({axes["tp"]: spmd.R}), mesh=mesh, dp_mesh_dims=dims)
    world_axis = spmd.MeshAxis.of(dist.group.WORLD)
    with pytest.raises(ValueError, match="'weight' is annotated on .*, neither a storage-mesh axis nor inside"):
        composable.fully_shard(linear({world_axis: spmd.R}), mesh=mesh, dp_mesh_dims=dims)


def test_errors() -> None:
    """Every misuse fails at the call, naming the API and the parameter; annotated tensors are
    never taken as whole parameters (without dp_mesh_dims they are refused, on any torch)."""
    run_on_ranks(_errors, 4)
