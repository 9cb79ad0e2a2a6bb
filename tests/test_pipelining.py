"""Pipeline parallelism over composable stages (`composable.integrations.pipelining`): every
schedule torch ships equals the single-process model (losses and every parameter over 3 steps)
on a (pp=2, dp=2) gloo mesh, and communicates as FSDP2 does under the same schedule: one
reduce-scatter per group per step, not one per microbatch."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import count_collectives, run_on_ranks
from _pipeline_models import (
    BATCH,
    DIM,
    SCHEDULES,
    full_model,
    make_schedule,
    run_step,
    stage_ids,
    stage_module,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from composable import MixedPrecisionPolicy, checkpoint, fully_shard, replicate
from composable.integrations.fsdp2_module import as_fsdp_modules
from composable.integrations.pipelining import clip_pipeline_grad_norm_, pipeline_stage

STEPS = 3
LR = 0.1
TOL = dict(rtol=1e-5, atol=1e-6)


def _data(dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, dp * BATCH, DIM, generator=g)
    y = torch.randn(STEPS, dp * BATCH, DIM, generator=g)
    rows = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    return x, y, x[:, rows], y[:, rows]


def _reference(
    x: torch.Tensor, y: torch.Tensor, clip: float | None, steps: int = STEPS
) -> tuple[nn.Module, list[float]]:
    ref = full_model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for s in range(steps):
        loss = F.mse_loss(ref(x[s]), y[s])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return ref, losses


def _apply(stage: nn.Module, how: str, mesh: Any) -> None:
    """Data parallelism on one stage module, per block and on the stage, as users wrap LMs."""
    if how == "replicate":
        replicate(stage, mesh=mesh["dp"])
        return
    dp_mesh = mesh["rep", "shard"] if how == "hsdp" else mesh["dp"]
    if how in ("tp", "3d"):  # tensor parallelism inside each block first, then data parallelism
        for block in stage.blocks.values():
            parallelize_module(block, mesh["tp"], {"lin": ColwiseParallel(), "out": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if how == "bf16" else None
    options: dict[str, Any] = dict(mesh=dp_mesh, reshard_after_forward=False)
    if mp is not None:
        options["mp_policy"] = mp
    for block in stage.blocks.values():
        if how == "checkpoint":
            checkpoint(block)
        fully_shard(block, **options)
    fully_shard(stage, **options)
    if how in ("adapter", "torch_adapter"):  # FSDP2's module interface: the schedule's UNSHARD/RESHARD actions run
        as_fsdp_modules(stage)


# torch 2.15's stages finalize an FSDPModule stage's backward through `finalize_backward`.
TORCH_FINALIZES = hasattr(FSDPModule, "finalize_backward")


def _torch_schedule(
    name: str, stages: list[nn.Module], ids: list[int], n_stages: int, pp_group: Any, stage_cls: Any = None
) -> Any:
    """`name` over torch's own `PipelineStage`s (not composable's `pipeline_stage`)."""
    from torch.distributed.pipelining import schedules as S

    stage_cls = stage_cls or PipelineStage
    built = [stage_cls(m, i, n_stages, "cpu", group=pp_group) for m, i in zip(stages, ids)]
    return getattr(S, name)(built[0] if len(built) == 1 else built, n_microbatches=4, loss_fn=F.mse_loss)


class _TorchStageOnGloo(PipelineStage):
    """torch's `PipelineStage` less the warm-up exchange with its own rank, as composable's stage
    (torch 2.11 attempts it under V-shaped schedules, which gloo cannot do; only the schedule
    calls it, and only up to torch 2.14). FSDP2's collectives under the schedule are untouched:
    the reference of the collective counts."""

    def _get_init_p2p_neighbors_ops(self) -> list:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


def _train(rank: int, world: int, schedules: list[str], how: str, clip: float | None = None) -> dict:
    if how == "hsdp":
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "rep", "shard"))
        dp_group = mesh["shard"].get_group()
    elif how in ("tp", "3d"):  # pp x tp (a data-parallel dim of 1), pp x dp x tp
        dims = (2, 1, 2) if how == "tp" else (2, 2, 2)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("pp", "dp", "tp"))
        dp_group = mesh["dp"].get_group()
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        dp_group = mesh["dp"].get_group()
    pp_group = mesh["pp"].get_group()
    pp_rank, dp_rank = pp_group.rank(), dp_group.rank()
    x, y, x_local, y_local = _data(dp_rank, dist.get_world_size(dp_group))
    ref, ref_losses = _reference(x, y, clip)
    ref_params = dict(ref.named_parameters())
    report = {}
    for name in schedules:
        n_stages = 2 * SCHEDULES[name]
        ids = stage_ids(name, pp_rank, 2)
        stages = [stage_module(full_model(), i, n_stages) for i in ids]
        for stage in stages:
            _apply(stage, how, mesh)
        if how == "torch_adapter":
            schedule = _torch_schedule(name, stages, ids, n_stages, pp_group)
        else:
            schedule = make_schedule(name, stages, n_stages, pp_group)
        params = [p for s in stages for p in s.parameters()]
        opt = torch.optim.SGD(params, lr=LR)
        for s in range(STEPS):
            losses = run_step(schedule, name, ids, n_stages, x_local[s], y_local[s])
            if clip is not None:
                # The norm of the whole model: every stage's parameters, combined over pp too.
                clip_pipeline_grad_norm_(params, clip, pp_group)
            opt.step()
            opt.zero_grad()
            if losses:
                mean = torch.stack([loss.detach().float() for loss in losses]).mean()
                dist.all_reduce(mean, group=dp_group)
                got = mean.item() / dist.get_world_size(dp_group)
                tol = 2e-2 if how == "bf16" else 1e-5
                assert abs(got - ref_losses[s]) <= tol * abs(ref_losses[s]), (name, s, got, ref_losses[s])
        for stage in stages:
            for fqn, p in stage.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                want = ref_params[fqn.removeprefix("blocks.")]
                if how == "bf16":
                    torch.testing.assert_close(full, want, rtol=2e-2, atol=2e-3, msg=f"{name} {fqn}")
                else:
                    torch.testing.assert_close(full, want, **TOL, msg=lambda m: f"{name} {fqn}: {m}")
        report[name] = "ok"
    return report


ALL = list(SCHEDULES)


@pytest.mark.parametrize("how", ["fsdp", "checkpoint", "replicate"])
def test_schedules_match_single_process(how: str) -> None:
    results = run_on_ranks(_train, 4, ALL, how, timeout=240)
    assert all(r == {s: "ok" for s in ALL} for r in results)


def test_mixed_precision_hsdp_and_clipping() -> None:
    two = ["Schedule1F1B", "ScheduleInterleaved1F1B"]
    run_on_ranks(_train, 4, two, "bf16", timeout=120)
    run_on_ranks(_train, 4, two, "hsdp", timeout=120)
    run_on_ranks(_train, 4, two, "fsdp", 0.05, timeout=120)


def test_tensor_parallel_inside_stages() -> None:
    run_on_ranks(_train, 4, ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"], "tp", timeout=120)


@pytest.mark.skipif(os.environ.get("COMPOSABLE_SLOW_TESTS") != "1", reason="8 ranks: COMPOSABLE_SLOW_TESTS=1")
def test_pp_dp_tp_3d() -> None:
    run_on_ranks(_train, 8, ["Schedule1F1B", "ScheduleInterleaved1F1B"], "3d", 0.05, timeout=240)


def test_fsdp2_module_adapter_stages() -> None:
    """Stage modules with FSDP2's interface (`as_fsdp_modules`): `pipeline_stage` runs them, and
    the schedules that issue UNSHARD/RESHARD for `FSDPModule` stages call composable's."""
    run_on_ranks(_train, 4, ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"], "adapter")


def _torch_stage_fails(rank: int, world: int, how: str) -> None:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))  # every rank fails alike
    pp_group = mesh["pp"].get_group()
    _, _, x_local, y_local = _data(mesh["dp"].get_local_rank(), 2)
    stage = stage_module(full_model(), 0, 1)
    _apply(stage, how, mesh)
    schedule = _torch_schedule("Schedule1F1B", [stage], [0], 1, pp_group)
    with (
        count_collectives() as c,
        pytest.raises(
            RuntimeError,
            match=r"^fully_shard: torch.distributed.pipelining's PipelineStage runs .*once per microbatch.*pipeline_stage",
        ),
    ):
        run_step(schedule, "Schedule1F1B", [0], 1, x_local[0], y_local[0])
    assert all(p.grad is None for p in stage.parameters())  # it failed at the first forward,
    assert c.counts.get("all_gather", 0) == c.counts.get("reduce_scatter", 0) == 0  # before any collective
    schedule = make_schedule("Schedule1F1B", [stage], 1, pp_group)  # composable's stage runs the same module
    run_step(schedule, "Schedule1F1B", [0], 1, x_local[0], y_local[0])
    assert all(p.grad is not None for p in stage.parameters())


def test_torch_stage_over_a_plain_composable_module_fails_at_once() -> None:
    """torch's own `PipelineStage` would reduce a composable stage's gradients once per
    microbatch (it sees a plain module): the first forward fails, naming `pipeline_stage`."""
    run_on_ranks(_torch_stage_fails, 2, "fsdp")


@pytest.mark.skipif(TORCH_FINALIZES, reason="torch's stage finalizes FSDPModule stages through finalize_backward")
def test_torch_stage_over_the_fsdp2_module_adapter_fails_at_once() -> None:
    run_on_ranks(_torch_stage_fails, 2, "adapter")


@pytest.mark.skipif(not TORCH_FINALIZES, reason="this torch's stages do not finalize through finalize_backward")
def test_torch_stage_drives_the_fsdp2_module_adapter() -> None:
    """torch 2.15's own `PipelineStage` over stage modules with composable's FSDP2 interface:
    it calls `set_manual_backward_finalization` / `finalize_backward` as on FSDP2, and the
    results equal the single-process model (the counts: `test_one_reduce_scatter_...`)."""
    run_on_ranks(_train, 4, ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"], "torch_adapter")


def _warm_up_peers(rank: int, world: int) -> tuple[list[int], list[int]]:
    """The pipeline ranks this rank's stages of a V-shaped schedule exchange with at the
    schedule's warm-up: composable's stage, and torch's `PipelineStage` method over the same."""
    from torch.distributed.pipelining import schedules as S

    ids = stage_ids("ScheduleZBVZeroBubble", rank, world)  # rank 1 holds the middle stages 1 and 2
    stages = [pipeline_stage(stage_module(full_model(), i, 4), i, 4, "cpu") for i in ids]
    S.ScheduleZBVZeroBubble(stages, n_microbatches=4, loss_fn=F.mse_loss)  # maps the stages to ranks
    ours = [op.group_peer for st in stages for op in st._get_init_p2p_neighbors_ops()]
    torch_ops = [op.group_peer for st in stages for op in PipelineStage._get_init_p2p_neighbors_ops(st)]
    return ours, torch_ops


@pytest.mark.skipif(
    not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"), reason="this torch's stages warm up otherwise"
)
def test_v_shaped_warm_up_exchanges_nothing_with_its_own_rank() -> None:
    """Two neighbouring stages on one rank: torch 2.11's schedules warm them up by a send to and
    a receive from that rank itself, which gloo cannot do; composable's stage leaves those out
    (the V-shaped schedules above run on gloo with every torch) and keeps the other neighbours."""
    (ours0, torch0), (ours1, torch1) = run_on_ranks(_warm_up_peers, 2)
    assert torch1.count(1) == 4 and 1 not in ours1  # stages 1 <-> 2: a send and a receive each way
    assert ours1 == [p for p in torch1 if p != 1] and ours1.count(0) == 4
    assert ours0 == torch0 and set(ours0) == {1}  # stages 0 and 3 have no neighbour on rank 0


# -------------------------------------------------------------------------- checkpoints


def _save_pipelined_load_flat(rank: int, world: int, path: str) -> None:
    """Train one step pipelined on (pp=2, dp=2), save with DCP; load into the whole model on
    (dp=4), as one stage, and find the single-process model's parameters after that step."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group = mesh["pp"].get_group()
    x, y, x_local, y_local = _data(mesh["dp"].get_local_rank(), 2)
    name = "ScheduleInterleaved1F1B"
    ids = stage_ids(name, pp_group.rank(), 2)
    stages = [stage_module(full_model(), i, 4) for i in ids]
    for stage in stages:
        _apply(stage, "fsdp", mesh)
    schedule = make_schedule(name, stages, 4, pp_group)
    opt = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=LR)
    run_step(schedule, name, ids, 4, x_local[0], y_local[0])
    opt.step()
    state = {k: v for stage in stages for k, v in stage.state_dict().items()}
    dcp.save(state, checkpoint_id=path)

    flat = stage_module(full_model(seed=5), 0, 1)  # other values, all 4 blocks, dp over the world
    for block in flat.blocks.values():
        fully_shard(block)
    fully_shard(flat)
    loaded = flat.state_dict()
    dcp.load(loaded, checkpoint_id=path)
    ref = dict(_reference(x, y, None, steps=1)[0].named_parameters())
    for fqn, p in flat.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref[fqn.removeprefix("blocks.")], **TOL, msg=fqn)


def test_dcp_checkpoint_of_a_pipelined_run_loads_into_another_layout(tmp_path: Any) -> None:
    run_on_ranks(_save_pipelined_load_flat, 4, str(tmp_path / "ckpt"), timeout=120)


# -------------------------------------------------------------------------- communication


def _fsdp2_apply(stage: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for block in stage.blocks.values():
        torch_fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    torch_fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)


def _count(rank: int, world: int, schedules: list[str]) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group = mesh["pp"].get_group()
    pp_rank, dp_rank = pp_group.rank(), mesh["dp"].get_local_rank()
    _, _, x_local, y_local = _data(dp_rank, 2)
    out = {}
    for name in schedules:
        n_stages = 2 * SCHEDULES[name]
        ids = stage_ids(name, pp_rank, 2)
        counts = {}
        impls = ("composable", "adapter", "fsdp2") + (("torch_adapter",) if TORCH_FINALIZES else ())
        for impl in impls:
            stages = [stage_module(full_model(), i, n_stages) for i in ids]
            for stage in stages:
                if impl == "fsdp2":
                    _fsdp2_apply(stage, mesh)
                else:
                    _apply(stage, "fsdp" if impl == "composable" else "adapter", mesh)
            if impl in ("composable", "adapter"):
                schedule = make_schedule(name, stages, n_stages, pp_group)
            else:  # torch's own stages: FSDP2, or (torch 2.15) composable's FSDP2 interface
                stage_cls = _TorchStageOnGloo if impl == "fsdp2" else None
                schedule = _torch_schedule(name, stages, ids, n_stages, pp_group, stage_cls)
            run_step(schedule, name, ids, n_stages, x_local[0], y_local[0])  # warm-up (shape inference)
            with count_collectives() as c:
                run_step(schedule, name, ids, n_stages, x_local[1], y_local[1])
            counts[impl] = {k: c.counts.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")}
        # The stage modules own no parameters of their own (the blocks claimed them all).
        groups = sum(len(stage.blocks) for stage in stages)
        assert counts["composable"]["reduce_scatter"] == groups, (name, counts, groups)
        assert counts["composable"]["reduce_scatter"] == counts["fsdp2"]["reduce_scatter"], (name, counts)
        assert counts["composable"]["all_gather"] <= counts["fsdp2"]["all_gather"], (name, counts)
        # With FSDP2's interface the schedule's own UNSHARD/RESHARD actions run: as FSDP2 there.
        assert counts["adapter"]["reduce_scatter"] == groups, (name, counts)
        assert counts["adapter"]["all_gather"] <= counts["fsdp2"]["all_gather"], (name, counts)
        if "torch_adapter" in counts:  # torch's stage reaches composable through finalize_backward: once per step
            assert counts["torch_adapter"]["reduce_scatter"] == groups, (name, counts)
            assert counts["torch_adapter"]["all_gather"] == counts["fsdp2"]["all_gather"], (name, counts)
        out[name] = counts
    return out


def test_one_reduce_scatter_per_group_per_step_as_fsdp2() -> None:
    results = run_on_ranks(_count, 4, ALL, timeout=240)
    assert results[0]["Schedule1F1B"]["composable"]["reduce_scatter"] == 2  # one per block


# -------------------------------------------------------------------------- errors


def test_pipeline_stage_rejects_a_bad_stage_index() -> None:
    with pytest.raises(ValueError, match=r"pipeline_stage: stage_index .* got 2"):
        pipeline_stage(nn.Linear(2, 2), 2, 2, "cpu")
