"""`composable.optim.overlap_host_step`: a CPU-offloaded model's optimizer step runs on a host
thread behind the next forward, and gives bit for bit what the plain step gives.

Every run here trains the same model side by side with the plain offloaded step (composable's
`CPUOffloadPolicy`, which tests/test_offload.py holds equal to training without offload) and,
where it runs on this machine, with PyTorch FSDP2's `CPUOffloadPolicy`: losses, parameters and
optimizer state equal with `torch.equal` after every step.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import requires_gpus, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

import composable
from composable import CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from composable.optim import overlap_host_step

STEPS = 4
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"  # the main job's options
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


def _offloaded(mesh: object, fsdp2: bool = False, **kwargs: object) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer()
    if fsdp2:
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for layer in model.layers:
            torch_fully_shard(layer, mesh=mesh, offload_policy=TorchOffload(pin_memory=False), **kwargs)
        return torch_fully_shard(model, mesh=mesh, offload_policy=TorchOffload(pin_memory=False), **kwargs)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(), **kwargs)
    return fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(), **kwargs)


def _adamw(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1, fused=fused
    )


def _assert_same(models: list[nn.Module], opts: list[torch.optim.Optimizer], what: str) -> None:
    ref_params = dict(models[0].named_parameters())
    for model, opt in zip(models[1:], opts[1:]):
        for name, p in model.named_parameters():
            assert torch.equal(p.to_local(), ref_params[name].to_local()), f"{what}: parameter {name}"
        pairs = zip(
            [p for pg in opts[0].param_groups for p in pg["params"]], [q for pg in opt.param_groups for q in pg["params"]]
        )
        for p, q in pairs:
            for key, value in opts[0].state[p].items():
                other = opt.state[q][key]
                local = value.to_local() if isinstance(value, DTensor) else value
                assert torch.equal(local, other.to_local() if isinstance(other, DTensor) else other), f"{what}: {key}"


def _train_side_by_side(rank: int, world_size: int, clip: bool, fused: bool, accumulate: int, bf16: bool) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    models = [_offloaded(mesh, mp_policy=mp), _offloaded(mesh, mp_policy=mp)]
    opts = [_adamw(m, fused) for m in models]
    overlap = overlap_host_step(opts[1], models[1])
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    for step in range(STEPS):
        losses = []
        for model, opt, sched in zip(models, opts, scheds):
            for micro in range(accumulate):
                sync = micro == accumulate - 1
                with contextlib.nullcontext() if sync else composable.no_sync(model):
                    loss = lm_loss(model, batch_for(step * accumulate + micro, world_size, rank))
                    loss.backward()
            if clip:
                clip_grad_norm_(model.parameters(), max_norm=0.05)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step} loss"
    overlap.wait()
    _assert_same(models, opts, "after the last step")
    for p in models[1].parameters():
        assert p.grad is None


@pytest.mark.parametrize(
    "clip,fused,accumulate,bf16",
    [(False, False, 1, False), (True, True, 1, False), (True, False, 2, True)],
    ids=["adamw", "fused-clipped", "accumulated-bf16-clipped"],
)
def test_overlapped_step_equals_plain_step(clip: bool, fused: bool, accumulate: int, bf16: bool) -> None:
    """Overlapped against plain: AdamW (fused and not), an LR schedule, clipping, gradient
    accumulation and bf16 compute, 2 ranks, bit for bit every step."""
    run_on_ranks(_train_side_by_side, 2, clip, fused, accumulate, bf16)


def _against_fsdp2(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    models = [_offloaded(mesh, fsdp2=True), _offloaded(mesh)]
    opts = [_adamw(m, fused=False) for m in models]
    overlap = overlap_host_step(opts[1], models[1])
    for step in range(STEPS):
        losses = []
        for model, opt in zip(models, opts):
            loss = lm_loss(model, batch_for(step, world_size, rank))
            loss.backward()
            clip_grad_norm_(model.parameters(), max_norm=0.05)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step} loss"
    overlap.wait()
    _assert_same(models, opts, "against FSDP2 + CPUOffloadPolicy")


def test_overlapped_step_equals_fsdp2_offload() -> None:
    """Against PyTorch FSDP2 with its CPUOffloadPolicy and the plain step: bit for bit."""
    run_on_ranks(_against_fsdp2, 2)


def _hsdp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    models = [_offloaded(mesh), _offloaded(mesh)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    overlap = overlap_host_step(opts[1], models[1])
    for step in range(STEPS):
        for model, opt in zip(models, opts):
            lm_loss(model, batch_for(step, world_size, rank)).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    overlap.wait()
    _assert_same(models, opts, "HSDP")
    for p in models[1].parameters():
        assert p.grad is not None and not p.grad.to_local().any()


def test_overlapped_step_hsdp() -> None:
    """HSDP (2 x 2) with SGD and zero_grad(set_to_none=False): bit for bit, zeroed gradients."""
    run_on_ranks(_hsdp, 4)


def _steps_behind_forward(rank: int, world_size: int) -> None:
    """The forward of a group waits for its own step, not for all: while the last group's step
    is held back, the first layer's forward runs."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = _offloaded(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    overlap = overlap_host_step(opt, model)
    release = threading.Event()
    last = model.layers[-1]
    held = {id(p) for p in last.parameters()}
    seen: list[str] = []

    def hold_last_group(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if any(id(p) in held for pg in optimizer.param_groups for p in pg["params"]):
            seen.append("last group's step starts")
            release.wait(timeout=30)

    handle = register_optimizer_step_pre_hook(hold_last_group)
    try:
        lm_loss(model, batch_for(0, world_size, rank)).backward()
        opt.step()
        opt.zero_grad()
        model.layers[0].register_forward_hook(lambda *_: seen.append("first layer's forward"))
        last.register_forward_pre_hook(lambda *_: seen.append("last layer's pre-forward"))
        timer = threading.Timer(0.5, release.set)
        timer.start()
        lm_loss(model, batch_for(1, world_size, rank)).backward()
        timer.join()
    finally:
        handle.remove()
    assert seen.index("first layer's forward") < seen.index("last layer's pre-forward"), seen
    assert "last group's step starts" in seen
    overlap.close()


def test_forward_waits_per_group() -> None:
    run_on_ranks(_steps_behind_forward, 2)


def _checkpoint(rank: int, world_size: int, path: str) -> None:
    """A DCP checkpoint taken right after `step()` (the steps still running) holds the stepped
    state; loaded into a new run with the overlap, it trains on as the run that never stopped."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = _offloaded(mesh)
    opt = _adamw(model, fused=False)
    overlap_host_step(opt, model)
    for step in range(2):
        lm_loss(model, batch_for(step, world_size, rank)).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    lm_loss(model, batch_for(2, world_size, rank)).backward()
    opt.step()
    opt.zero_grad()

    resumed = _offloaded(mesh)
    resumed_opt = _adamw(resumed, fused=False)
    overlap = overlap_host_step(resumed_opt, resumed)
    msd, osd = get_state_dict(resumed, resumed_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    lm_loss(resumed, batch_for(2, world_size, rank)).backward()
    resumed_opt.step()
    resumed_opt.zero_grad()
    overlap.wait()
    _assert_same([model, resumed], [opt, resumed_opt], "resumed")


def test_checkpoint_resume(tmp_path: Path) -> None:
    run_on_ranks(_checkpoint, 2, str(tmp_path))


def _failure_surfaces(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    model = _offloaded(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    overlap_host_step(opt, model)

    def fail(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        raise RuntimeError("the host step broke")

    lm_loss(model, batch_for(0, world_size, rank)).backward()
    handle = register_optimizer_step_pre_hook(fail)
    try:
        opt.step()
        time.sleep(0.05)
    finally:
        handle.remove()
    with pytest.raises(RuntimeError, match="the host step broke"):
        lm_loss(model, batch_for(1, world_size, rank))


def test_host_step_failure_raises_at_next_forward() -> None:
    """An exception of the host step is raised in the training loop, at the next forward."""
    run_on_ranks(_failure_surfaces, 2)


def _errors(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    model = _offloaded(mesh)
    with pytest.raises(TypeError, match=r"composable.optim.overlap_host_step: 'optimizer' must be a torch.optim"):
        overlap_host_step("adamw", model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"composable.optim.overlap_host_step: 'module' must be an nn.Module"):
        overlap_host_step(torch.optim.SGD(model.parameters(), lr=0.1), "model")  # type: ignore[arg-type]
    torch.manual_seed(0)
    plain = fully_shard(TinyTransformer(), mesh=mesh)
    with pytest.raises(ValueError, match=r"overlap_host_step: parameter 'head.weight' of 'optimizer' is not in a"):
        overlap_host_step(torch.optim.SGD(plain.parameters(), lr=0.1), plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    overlap = overlap_host_step(opt, model)
    with pytest.raises(ValueError, match=r"overlap_host_step: 'optimizer' already overlaps its step"):
        overlap_host_step(opt, model)
    with pytest.raises(ValueError, match=r"overlap_host_step: optimizer.step\(closure\) is not supported"):
        opt.step(lambda: 0.0)
    overlap.close()
    assert composable.optim.overlap_host_step(opt, model) is not overlap


def test_errors() -> None:
    run_on_ranks(_errors, 2)


# ----------------------------------------------------------------------------- the main job's flag


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--cpu-offload", "--optimizer", "muon"],
            "--cpu-offload overlap steps on a host thread behind the forward and Muon's step communicates: "
            "pass --cpu-offload after-backward",
        ),
        (["--cpu-offload", "later"], "argument --cpu-offload: invalid choice: 'later' (choose from"),
    ],
)
def test_main_job_flag_refusals(flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from options import parse_args

    with pytest.raises(SystemExit):
        parse_args([*flags, "--out", str(tmp_path)])
    assert capsys.readouterr().err.startswith(f"train.py: error: {message}")


def test_main_job_flag_choices(tmp_path: Path) -> None:
    from options import parse_args

    out = ["--out", str(tmp_path)]
    assert parse_args(["--cpu-offload", *out]).cpu_offload == "overlap"
    assert parse_args(["--cpu-offload", "after-backward", *out]).cpu_offload == "after-backward"
    assert parse_args(out).cpu_offload is None


@requires_gpus(1)
def test_overlapped_step_gpu() -> None:
    """On a GPU (pinned host memory, gradients copied to the host as they are reduced): the
    overlapped step equals the plain one bit for bit, bf16 compute, clipping, fused AdamW."""
    run_on_ranks(_train_gpu, 1, backend="nccl")


def _train_gpu(rank: int, world_size: int) -> None:
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = TinyTransformer().cuda()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        models.append(fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy()))
    opts = [_adamw(m, fused=True) for m in models]
    overlap = overlap_host_step(opts[1], models[1])
    for step in range(STEPS):
        losses = []
        for model, opt in zip(models, opts):
            loss = lm_loss(model, batch_for(step, world_size, rank).cuda())
            loss.backward()
            clip_grad_norm_(model.parameters(), max_norm=0.05)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
        assert torch.equal(losses[0], losses[1]), f"step {step} loss"
    overlap.wait()
    _assert_same(models, opts, "GPU")
