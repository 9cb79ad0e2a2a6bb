"""The 2D layouts on 4 ranks, the way train.py lays out examples/models/model.py's Transformer
(examples/trainer/parallel.py: its TP plan, its sharding units), on 4 GPUs with NCCL and, where that
form is not covered elsewhere, on 4 gloo ranks on the CPU:

- TP x FSDP (dp 2 x tp 2): train.py's TP plan on every block, then `fully_shard` over dp,
  bf16 compute / fp32 reduction, equal bit for bit to FSDP2 with the same plan on the same
  mesh (losses, gradients and parameters over 3 AdamW steps);
- HSDP (2 replicas x 2 shards): `fully_shard` on the 2D mesh, equal bit for bit to FSDP2's
  HSDP (the CPU form: tests/test_hsdp_no_shard.py);
- clipping over dp x tp: `composable.clip_grad_norm_` on the TP x FSDP model (its blocks on
  the 2D mesh, its ends on the dp mesh), fp32, against torch's clip on the single-process
  model: the total norm, the clipped gradients and the parameters over 3 SGD steps;
- pp x dp (2 stages x dp 2): composable pipeline stages under 1F1B and interleaved 1F1B
  against the single-process model (the CPU form: tests/test_pipelining.py).

With fewer than 4 GPUs the GPU forms skip (`pytest -m gpu` selects them).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import assert_close_tensors, on_gpus, run_on_ranks, step_and_match
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import composable  # noqa: E402
from models.model import ModelConfig, Transformer, lm_loss
from trainer.parallel import sharding_units, tp_plan

CFG = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=16)
BATCH = 2  # rows per data-parallel rank
STEPS = 3
GPU = on_gpus("cuda", 4, id="nccl")
CPU = pytest.param("cpu", id="gloo")


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _model(device: str) -> Transformer:
    torch.manual_seed(0)
    with _device(device):
        return Transformer(CFG)


def _tokens(step: int, dp_rank: int | None, dp: int, device: str) -> torch.Tensor:
    """Step `step`'s tokens: all dp * BATCH rows (dp_rank None, the reference's) or one dp rank's."""
    g = torch.Generator().manual_seed(100 + step)
    full = torch.randint(0, CFG.vocab_size, (dp * BATCH, CFG.max_seq_len + 1), generator=g)
    rows = full if dp_rank is None else full[dp_rank * BATCH : (dp_rank + 1) * BATCH]
    return rows.to(_device(device))


def _deterministic_attention(device: str) -> contextlib.AbstractContextManager[object]:
    """On GPUs, SDPA's math kernel: the flash kernel's backward may accumulate in any order,
    and bit-for-bit parity must compare the libraries, not the attention kernel's atomics."""
    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _lay_out(model: Transformer, mesh: DeviceMesh, kind: str, api: str, mixed: bool) -> Transformer:
    """train.py's layout: TP plan on every block (kind 'tp'), then `api`'s fully_shard on every
    sharding unit, over mesh['dp'] (tp) or the whole 2D mesh (hsdp)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if api == "composable":
        shard, policy = composable.fully_shard, composable.MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        shard, policy = fully_shard, MixedPrecisionPolicy
    mp = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else policy()
    if kind == "tp":
        for block in model.layers:
            parallelize_module(block, mesh["tp"], tp_plan())
    dp_mesh = mesh["dp"] if kind == "tp" else mesh
    for module in sharding_units(model):
        shard(module, mesh=dp_mesh, mp_policy=mp)
    return model


def _mesh(kind: str, device: str) -> tuple[DeviceMesh, int, int]:
    """(the 2 x 2 mesh, this rank's data-parallel rank, the data-parallel size)."""
    if kind == "tp":
        mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
        return mesh, mesh["dp"].get_local_rank(), 2
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard"))
    return mesh, dist.get_rank(), 4


# ----------------------------------------------------------------------------- vs FSDP2


def _vs_fsdp2(rank: int, world: int, kind: str, device: str) -> list[float]:
    mesh, dp_rank, dp = _mesh(kind, device)
    ours = _lay_out(_model(device), mesh, kind, "composable", mixed=True)
    theirs = _lay_out(_model(device), mesh, kind, "torch", mixed=True)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.device_mesh == q.device_mesh and p.placements == q.placements, (name, p.placements, q.placements)
        assert_close_tensors(p, q, exact=True, msg=f"initial {name}")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    losses = []
    for step in range(STEPS):
        tokens = _tokens(step, dp_rank, dp, device)
        got = []
        for m in (ours, theirs):
            with _deterministic_attention(device):
                loss = lm_loss(m(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
            got.append(loss.detach())
        assert torch.equal(got[0], got[1]), (step, got)
        step_and_match(ours, theirs, opts, f"step {step}", same_placements=True)
        losses.append(got[0].item())
    return losses


@pytest.mark.parametrize("device", [CPU, GPU])
def test_tp_fsdp_matches_fsdp2_with_the_same_plan(device: str) -> None:
    losses = run_on_ranks(_vs_fsdp2, 4, "tp", device, backend=_backend(device), timeout=300)
    assert losses[0] == losses[1] and losses[2] == losses[3]  # one tp group, one batch
    assert losses[0] != losses[2]  # the other dp rank's batch


@pytest.mark.parametrize("device", [GPU])
def test_hsdp_matches_fsdp2_hsdp(device: str) -> None:
    losses = run_on_ranks(_vs_fsdp2, 4, "hsdp", device, backend=_backend(device), timeout=300)
    assert len({tuple(v) for v in losses}) == 4  # every rank its own batch


# ----------------------------------------------------------------------------- clipping over dp x tp


def _clip_dp_tp(rank: int, world: int, device: str) -> float:
    """TP x FSDP in fp32 against the single-process model on all rows, both clipped to half
    the reference's gradient norm at every step (so clipping really scales)."""
    mesh, dp_rank, dp = _mesh("tp", device)
    ref = _model(device)
    model = _lay_out(copy.deepcopy(ref), mesh, "tp", "composable", mixed=False)
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
    assert meshes == {("dp", "tp"), ("dp",)}, meshes  # blocks on the 2D mesh, the ends on dp
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    tol = dict(rtol=1e-4, atol=1e-5) if device == "cuda" else dict(rtol=1e-5, atol=1e-6)
    for step in range(STEPS):
        tokens, all_rows = _tokens(step, dp_rank, dp, device), _tokens(step, None, dp, device)
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        lm_loss(ref(all_rows[:, :-1]), all_rows[:, 1:]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), ref_norm / 2)
        norm = composable.clip_grad_norm_(model.parameters(), ref_norm / 2)
        assert type(norm) is torch.Tensor, type(norm)
        assert_close_tensors(norm, torch.tensor(ref_norm, device=norm.device), **tol, msg=f"step {step} norm")
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert_close_tensors(p.grad, r.grad, **tol, msg=f"step {step} clipped grad {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert_close_tensors(p, r, **tol, msg=f"step {step} param {name}")
    return ref_norm


@pytest.mark.parametrize("device", [CPU, GPU])
def test_clip_grad_norm_over_dp_x_tp_matches_single_process(device: str) -> None:
    norms = run_on_ranks(_clip_dp_tp, 4, device, backend=_backend(device), timeout=300)
    assert len(set(norms)) == 1 and norms[0] > 0


# ----------------------------------------------------------------------------- pp x dp


def _pp_dp(rank: int, world: int, schedules: list[str]) -> dict[str, list[float]]:
    """2 pipeline stages x dp 2, each stage's blocks and the stage fully_shard over dp,
    against the single-process model (SGD, mse), on the GPU."""
    from _pipeline_models import BATCH as ROWS
    from _pipeline_models import DIM, SCHEDULES, full_model, make_schedule, run_step, stage_ids, stage_module

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    pp_rank, dp_rank = pp_group.rank(), dp_group.rank()
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(STEPS, 2 * ROWS, DIM, generator=g) for _ in range(2))
    ref = full_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for s in range(STEPS):
        loss = F.mse_loss(ref(x[s]), y[s])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    device = torch.device("cuda", torch.cuda.current_device())
    x_local, y_local = x[:, rows].to(device), y[:, rows].to(device)
    report: dict[str, list[float]] = {}
    for name in schedules:
        n_stages = 2 * SCHEDULES[name]
        ids = stage_ids(name, pp_rank, 2)
        stages = [stage_module(full_model(), i, n_stages).to(device) for i in ids]
        for stage in stages:
            for block in stage.blocks.values():
                composable.fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            composable.fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)
        schedule = make_schedule(name, stages, n_stages, pp_group, device=device)
        opt = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.1)
        got = []
        for s in range(STEPS):
            losses = run_step(schedule, name, ids, n_stages, x_local[s], y_local[s])
            opt.step()
            opt.zero_grad()
            if losses:  # the last stage's ranks: the dp mean of the microbatch means
                mean = torch.stack([loss.detach().float() for loss in losses]).mean()
                dist.all_reduce(mean, group=dp_group)
                got.append(mean.item() / 2)
                assert got[-1] == pytest.approx(ref_losses[s], rel=1e-4), (name, s, got[-1], ref_losses[s])
        ref_params = dict(ref.named_parameters())
        for stage in stages:
            for fqn, p in stage.named_parameters():
                want = ref_params[fqn.removeprefix("blocks.")].to(device)
                assert_close_tensors(p, want, rtol=1e-4, atol=1e-5, msg=f"{name} {fqn}")
        report[name] = got
    return report


@pytest.mark.parametrize("device", [GPU])
def test_pp_x_dp_matches_single_process(device: str) -> None:
    schedules = ["Schedule1F1B", "ScheduleInterleaved1F1B"]
    results = run_on_ranks(_pp_dp, 4, schedules, backend="nccl", timeout=300)
    for rank, report in enumerate(results):
        last_stage = rank >= 2  # pp rank 1 holds the last stage of both schedules
        assert all(len(report[s]) == (STEPS if last_stage else 0) for s in schedules), (rank, report)
