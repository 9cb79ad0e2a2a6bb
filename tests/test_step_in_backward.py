"""`composable.optim.step_in_backward`: CPU-offloaded parameters step during backward, each group's
as its reduced gradients reach the host; the numbers are PyTorch FSDP2 + `CPUOffloadPolicy`'s with
a plain step after backward, bit for bit (AdamW fused and not, bf16 compute, the compute-dtype
shard kept on the device, HSDP, accumulation under no_sync, an LR scheduler, parameters no
reduction hands over). What cannot be exact is refused in one line each."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _harness import requires_gpus, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from composable import CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_, fully_shard, replicate
from composable._engine.optimizer.optim_state import first_stepped_in_backward
from composable.optim import Muon, offload_optimizer_state, step_in_backward

STEPS = 3
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _wrap(model: nn.Module, **kwargs: object) -> nn.Module:
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _assert_same(ours: nn.Module, theirs: nn.Module, opts: list[torch.optim.Optimizer], step: int) -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(_local(p).cpu(), _local(q).cpu()), f"step {step} parameter {name}"
        for key, value in opts[0].state[p].items():
            assert torch.equal(_local(value).cpu(), _local(opts[1].state[q][key]).cpu()), (step, name, key)


def _against_fsdp2(rank: int, world_size: int, device: str, on_device: bool, fused: bool) -> None:
    """Ours stepping in backward against FSDP2's offload stepping after it: losses, parameters and
    AdamW state equal every step; every parameter has stepped once by the end of backward, and
    optimizer.step() runs the user's hooks once."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh(device, (world_size,))
    dtypes = BF16 if on_device or device == "cuda" else {}
    pin = device == "cuda"
    torch.manual_seed(0)
    ours = _wrap(
        TinyTransformer().to(device),
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(**dtypes),
        offload_policy=CPUOffloadPolicy(pin_memory=pin, compute_shard_on_device=on_device),
    )
    torch.manual_seed(0)
    theirs = TinyTransformer().to(device)
    their_mp, their_offload = TorchMixedPrecisionPolicy(**dtypes), TorchCPUOffloadPolicy(pin_memory=pin)
    for layer in theirs.layers:
        torch_fully_shard(layer, mesh=mesh, mp_policy=their_mp, offload_policy=their_offload)
    torch_fully_shard(theirs, mesh=mesh, mp_policy=their_mp, offload_policy=their_offload)
    models = [ours, theirs]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=fused) for m in models]
    handle = step_in_backward(opts[0], ours)
    calls: list[str] = []
    opts[0].register_step_pre_hook(lambda *_: calls.append("pre"))
    opts[0].register_step_post_hook(lambda *_: calls.append("post"))
    # Made after step_in_backward, as its docstring asks: the lr each group steps with follows it.
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) for opt in opts]
    for step in range(STEPS):
        before = [_local(p).clone() for p in ours.parameters()]
        losses = []
        for model, opt, sched in zip(models, opts, scheds):
            loss = lm_loss(model, batch_for(step, world_size, rank).to(device))
            loss.backward()
            if model is ours:  # stepped during backward, before optimizer.step()
                handle.wait()
                moved = [not torch.equal(b, _local(p)) for b, p in zip(before, ours.parameters())]
                assert all(moved), f"step {step}: not stepped in backward: {moved}"
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
        assert torch.equal(losses[0], losses[1]), f"step {step} loss {losses}"
        _assert_same(ours, theirs, opts, step)
        assert calls == ["pre", "post"] * (step + 1), calls
        assert all(int(_local(s["step"]).item()) == step + 1 for s in opts[0].state.values())
    handle.close()
    assert "step" not in opts[0].__dict__ or hasattr(opts[0].step, "_wrapped_by_lr_sched")


@pytest.mark.parametrize(("on_device", "fused"), [(False, False), (True, True)], ids=["host", "on_device_fused"])
def test_equals_fsdp2_offload_bit_for_bit(on_device: bool, fused: bool) -> None:
    run_on_ranks(_against_fsdp2, 2, "cpu", on_device, fused)


def _clipped_against_fsdp2(
    rank: int, world_size: int, max_norm: float, fused: bool, speculate: bool, device: str = "cpu"
) -> list[tuple[float, bool, int]]:
    """Ours stepping in backward with `max_norm` against FSDP2's offload with
    `composable.clip_grad_norm_` between backward and the step: the same total norm, losses,
    parameters and AdamW state every step, whether the norm clips or not. Returns each step's
    norm, whether it stepped during backward, and how many steps were taken back so far."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh(device, (world_size,))
    pin = device == "cuda"
    torch.manual_seed(0)
    ours = _wrap(TinyTransformer().to(device), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
    torch.manual_seed(0)
    theirs = TinyTransformer().to(device)
    for layer in theirs.layers:
        torch_fully_shard(layer, mesh=mesh, offload_policy=TorchCPUOffloadPolicy(pin_memory=pin))
    torch_fully_shard(theirs, mesh=mesh, offload_policy=TorchCPUOffloadPolicy(pin_memory=pin))
    models = [ours, theirs]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=fused) for m in models]
    handle = step_in_backward(opts[0], ours, max_norm=max_norm, speculate=speculate)
    norms = []
    for step in range(STEPS + 1):
        tokens = batch_for(step, world_size, rank).to(device)
        loss = lm_loss(ours, tokens)
        loss.backward()
        opts[0].step()
        opts[0].zero_grad()
        their_loss = lm_loss(theirs, tokens)
        their_loss.backward()
        their_norm = clip_grad_norm_(theirs.parameters(), max_norm)
        opts[1].step()
        opts[1].zero_grad()
        assert torch.equal(loss, their_loss), f"step {step} loss"
        assert handle.total_norm is not None and torch.equal(handle.total_norm, their_norm), (
            f"step {step} norm {handle.total_norm} against {their_norm}"
        )
        _assert_same(ours, theirs, opts, step)
        norms.append((float(their_norm), handle.stepped_ahead, handle.steps_taken_back))
    return norms


@pytest.mark.parametrize(
    ("max_norm", "fused", "speculate", "expected"),
    [
        (1e-3, False, False, "always"),
        (1e6, True, True, "never"),
        (3.7, True, True, "sometimes"),
        (3.7, False, False, "sometimes"),
    ],
    ids=["always_clips", "never_clips_fused_speculating", "clips_sometimes_fused_speculating", "clips_sometimes"],
)
def test_clipping_equals_clip_grad_norm_bit_for_bit(
    max_norm: float, fused: bool, speculate: bool, expected: str
) -> None:
    steps = run_on_ranks(_clipped_against_fsdp2, 2, max_norm, fused, speculate)[0]
    clipped = [norm > max_norm for norm, _, _ in steps]
    seen = "always" if all(clipped) else "never" if not any(clipped) else "sometimes"
    assert seen == expected, steps
    _assert_bets(steps, clipped, speculate)
    if expected == "sometimes" and speculate:  # a step that stepped ahead, then clipped: taken back and again
        assert steps[-1][2] >= 1, steps


def _assert_bets(steps: list[tuple[float, bool, int]], clipped: list[bool], speculate: bool) -> None:
    """Speculating, each step stepped during backward exactly when the one before clipped
    nothing (else never), and a step was taken back exactly when it had and then clipped."""
    ahead = [stepped_ahead for _, stepped_ahead, _ in steps]
    assert ahead == [False] + [speculate and not c for c in clipped[:-1]], steps
    lost = [a and c for a, c in zip(ahead, clipped)]
    assert [taken_back for _, _, taken_back in steps] == [sum(lost[: k + 1]) for k in range(len(steps))], steps


def _against_plain(rank: int, world_size: int, hsdp: bool, accumulate: bool) -> None:
    """Ours stepping in backward against our own offload stepping after it, on an HSDP mesh or
    with two micro-batches (the first under no_sync), and with a parameter outside the model
    (handed over by no reduction: stepped by optimizer.step())."""
    mesh = init_device_mesh("cpu", (2, world_size // 2) if hsdp else (world_size,), mesh_dim_names=None)
    models, opts, extras = [], [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(_wrap(TinyTransformer(), mesh=mesh, offload_policy=CPUOffloadPolicy()))
        extras.append(nn.Parameter(torch.ones(3)))
        opts.append(torch.optim.AdamW([*models[-1].parameters(), extras[-1]], lr=1e-2))
    step_in_backward(opts[0], models[0])
    for step in range(STEPS):
        for model, opt, extra in zip(models, opts, extras):
            micro = 2 if accumulate else 1
            for m in range(micro):
                fully_shard.state(model).set_requires_gradient_sync(m == micro - 1)
                lm_loss(model, batch_for(2 * step + m, world_size, rank)).backward()
            if model is models[0]:  # HSDP's reductions hand over; accumulated gradients wait for step()
                assert (first_stepped_in_backward(list(model.parameters())) is not None) == hsdp
            extra.grad = torch.full((3,), float(step + 1))
            opt.step()
            opt.zero_grad()
        _assert_same(models[0], models[1], opts, step)
        assert torch.equal(extras[0], extras[1]) and not torch.equal(extras[0], torch.ones(3))


@pytest.mark.parametrize(
    ("world_size", "hsdp", "accumulate"),
    [(2, True, False), (4, True, False), (2, False, True)],
    ids=["hsdp_2x1", "hsdp_2x2", "no_sync"],
)
def test_equals_plain_offload(world_size: int, hsdp: bool, accumulate: bool) -> None:
    run_on_ranks(_against_plain, world_size, hsdp, accumulate)


def _checkpoint_resume(rank: int, world_size: int, path: str) -> None:
    """A DCP checkpoint taken between steps (get_state_dict waits for the steps begun in backward)
    resumes bit for bit, clipping included, as the run that never stopped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = init_device_mesh("cpu", (world_size,))

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _wrap(TinyTransformer(), mesh=mesh, offload_policy=CPUOffloadPolicy())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        step_in_backward(opt, model, max_norm=3.7)
        return model, opt

    def train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        lm_loss(model, batch_for(step, world_size, rank)).backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    for step in range(2):
        train(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    for step in (2, 3):
        train(model, opt, step)
    resumed, resumed_opt = build()
    msd, osd = get_state_dict(resumed, resumed_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in (2, 3):
        train(resumed, resumed_opt, step)
    _assert_same(resumed, model, [resumed_opt, opt], 3)


def test_checkpoint_resumes_bit_for_bit(tmp_path: Path) -> None:
    run_on_ranks(_checkpoint_resume, 2, str(tmp_path))


def _refusals_in_the_loop(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = _wrap(TinyTransformer(), mesh=mesh, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step_in_backward(opt, model)
    lm_loss(model, batch_for(0, world_size, rank)).backward()
    with pytest.raises(RuntimeError, match=r"^composable.clip_grad_norm_: a parameter .* already stepped in this "):
        clip_grad_norm_(model.parameters(), 1.0)
    # A second backward without no_sync: its reductions would be summed into gradients already stepped.
    with pytest.raises(RuntimeError, match=r"^composable.optim.step_in_backward: the gradient of '.*' was reduced a "):
        lm_loss(model, batch_for(1, world_size, rank)).backward()


def test_clipping_and_accumulation_without_no_sync_are_refused() -> None:
    run_on_ranks(_refusals_in_the_loop, 2)


def test_a_mark_dies_with_its_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter dropped while marked as stepped (its backward raised) leaves no mark on the
    tensor that takes its memory, and so its id, next: clip_grad_norm_ would refuse a parameter
    never stepped. The allocator's reuse of the id is made certain by answering `id` in the
    marks' module with the dropped parameter's id for the new one."""
    import builtins

    from composable._engine.optimizer import optim_state

    dropped = nn.Parameter(torch.zeros(3))
    optim_state.mark_stepped_in_backward([dropped], True)
    dropped_id = id(dropped)
    del dropped
    gc.collect()
    fresh = nn.Parameter(torch.zeros(3))
    monkeypatch.setattr(optim_state, "id", lambda obj: dropped_id if obj is fresh else builtins.id(obj), raising=False)
    assert optim_state.first_stepped_in_backward([fresh]) is None


def _refusals_at_the_call(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    api = r"^composable.optim.step_in_backward: "
    torch.manual_seed(0)
    plain = _wrap(TinyTransformer(), mesh=mesh)
    model = _wrap(TinyTransformer(), mesh=mesh, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=api + "'optimizer' must be a torch.optim.Optimizer, got list"):
        step_in_backward([], model)  # type: ignore[arg-type]  # the wrong call under test
    with pytest.raises(TypeError, match=api + "'model' must be an nn.Module, got str"):
        step_in_backward(opt, "model")  # type: ignore[arg-type]  # the wrong call under test
    with pytest.raises(ValueError, match=api + "'max_norm' must be a number >= 0 or None, got -1.0"):
        step_in_backward(opt, model, max_norm=-1.0)
    with pytest.raises(ValueError, match=api + r"'norm_type' must be a number > 0 \(or inf\), got 0"):
        step_in_backward(opt, model, max_norm=1.0, norm_type=0)
    with pytest.raises(ValueError, match=api + "'max_norm' must be a number >= 0 or None, got '1'"):
        step_in_backward(opt, model, max_norm="1")  # type: ignore[arg-type]  # the wrong call under test
    with pytest.raises(ValueError, match=api + "'speculate' must be a bool, got 1"):
        step_in_backward(opt, model, max_norm=1.0, speculate=1)  # type: ignore[arg-type]  # the wrong call under test
    with pytest.raises(ValueError, match=api + "'speculate' needs 'max_norm': without clipping every group steps"):
        step_in_backward(opt, model, speculate=True)
    with pytest.raises(ValueError, match=api + "composable.optim.Muon's step sends whole matrices"):
        step_in_backward(Muon([nn.Parameter(torch.zeros(4, 4))]), model)
    with pytest.raises(ValueError, match=api + r"no parameter of 'optimizer' is in a fully_shard group of 'model' "):
        step_in_backward(torch.optim.AdamW(plain.parameters()), plain)
    replicated = replicate(TinyTransformer(), mesh=mesh)  # replicate has no offload policy
    with pytest.raises(ValueError, match=api + r"no parameter of 'optimizer' is in a fully_shard group of 'model' "):
        step_in_backward(torch.optim.AdamW(replicated.parameters()), replicated)
    fp16 = _wrap(
        TinyTransformer(),
        mesh=mesh,
        offload_policy=CPUOffloadPolicy(),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16),
    )
    with pytest.raises(ValueError, match=api + "a fully_shard group of 'model' computes in float16"):
        step_in_backward(torch.optim.AdamW(fp16.parameters()), fp16)
    offloaded_state = torch.optim.AdamW(model.parameters())
    offload_optimizer_state(offloaded_state)
    with pytest.raises(ValueError, match=api + r"'optimizer' has its state offloaded \(offload_optimizer_state\)"):
        step_in_backward(offloaded_state, model)
    handle = step_in_backward(opt, model)
    with pytest.raises(ValueError, match=api + "'optimizer' already steps in backward"):
        step_in_backward(opt, model)
    with pytest.raises(ValueError, match=api + r"optimizer.step\(closure\) is not supported"):
        opt.step(lambda: None)
    handle.close()
    step_in_backward(opt, model).close()  # closed: it can be made again


def test_wrong_calls_raise_one_line() -> None:
    run_on_ranks(_refusals_at_the_call, 1)


@requires_gpus(1)
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "on_device"])
def test_gpu_equals_fsdp2_offload_bit_for_bit(on_device: bool) -> None:
    """Compute on CUDA in bf16, the gradients copied to pinned host memory as they are reduced and
    stepped there by a worker thread while backward goes on: FSDP2's numbers, fused AdamW."""
    run_on_ranks(_against_fsdp2, 1, "cuda", on_device, True, backend="cpu:gloo,cuda:nccl")


@requires_gpus(1)
@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["always_clips", "never_clips"])
def test_gpu_clipping_equals_clip_grad_norm_bit_for_bit(max_norm: float) -> None:
    """On CUDA: the gradients' norms taken on the host as they land, the steps speculative, taken
    back when the norm clips; FSDP2's offload with clip_grad_norm_'s numbers."""
    steps = run_on_ranks(_clipped_against_fsdp2, 1, max_norm, True, True, "cuda", backend="cpu:gloo,cuda:nccl")[0]
    clipped = [norm > max_norm for norm, _, _ in steps]
    assert all(c == (max_norm < 1) for c in clipped), steps
    _assert_bets(steps, clipped, True)
