"""`step_in_backward(..., finish_in_forward=True)`: `optimizer.step()` returns with the host's steps
still queued (in forward order), and each fully_shard module's next forward waits for its own
groups' steps. The numbers are PyTorch FSDP2 + `CPUOffloadPolicy`'s with a plain step (and
`clip_grad_norm_` before it) bit for bit, with an LR scheduler stepped and the gradients zeroed
while the steps still run; what reads the parameters in between (state dicts) waits for them."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from _harness import requires_gpus, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from composable import CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from composable.optim import step_in_backward
from composable.optim._queued_steps import QueuedSteps

STEPS = 4
SLOW_S = 0.05  # each queued step sleeps first, so the loop certainly runs ahead of it


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _models(device: str, world_size: int) -> tuple[nn.Module, nn.Module]:
    """Ours (composable, offloaded) and theirs (FSDP2, offloaded), the same weights."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh(device, (world_size,))
    pin = device == "cuda"
    dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if device == "cuda" else {}
    torch.manual_seed(0)
    ours = TinyTransformer().to(device)
    for module in [*ours.layers, ours]:
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(**dtypes), offload_policy=CPUOffloadPolicy(pin))
    torch.manual_seed(0)
    theirs = TinyTransformer().to(device)
    mp, offload = TorchMixedPrecisionPolicy(**dtypes), TorchCPUOffloadPolicy(pin_memory=pin)
    for module in [*theirs.layers, theirs]:
        torch_fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return ours, theirs


def _slow_steps() -> None:
    """Each queued step sleeps first (in this rank's process only)."""
    original = QueuedSteps._step

    def slow(self: QueuedSteps, *args: object) -> None:
        time.sleep(SLOW_S)
        original(self, *args)  # type: ignore[arg-type]  # the patched method's own arguments

    setattr(QueuedSteps, "_step", slow)


def _against_fsdp2(rank: int, world_size: int, device: str, max_norm: float | None, fused: bool) -> list[bool]:
    """Ours finishing its steps in the next forward against FSDP2's offload stepping after
    backward (clip_grad_norm_ first with `max_norm`): losses, norms, parameters and AdamW state
    equal every step. Returns, per step, whether a parameter still held its old value when
    optimizer.step() returned (the steps ran on past it)."""
    _slow_steps()
    ours, theirs = _models(device, world_size)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=fused) for m in (ours, theirs)]
    handle = step_in_backward(opts[0], ours, max_norm=max_norm, finish_in_forward=True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) for opt in opts]
    ran_on = []
    for step in range(STEPS):
        tokens = batch_for(step, world_size, rank).to(device)
        loss = lm_loss(ours, tokens)  # waits, module by module, for the last step's groups
        loss.backward()
        before = [_local(p).clone() for p in ours.parameters()]
        opts[0].step()
        ran_on.append(any(torch.equal(b, _local(p)) for b, p in zip(before, ours.parameters())))
        scheds[0].step()  # the queued steps keep the lr they were queued with
        opts[0].zero_grad()  # and the gradients they were queued with
        their_loss = lm_loss(theirs, tokens)
        their_loss.backward()
        their_norm = clip_grad_norm_(theirs.parameters(), max_norm) if max_norm is not None else None
        opts[1].step()
        scheds[1].step()
        opts[1].zero_grad()
        assert torch.equal(loss, their_loss), f"step {step} loss {loss} against {their_loss}"
        if max_norm is not None:
            assert handle.total_norm is not None and torch.equal(handle.total_norm, their_norm), step
    # The model's state dict waits for the queued steps: what it shows is the last step's result.
    theirs_sd = theirs.state_dict()
    for name, value in ours.state_dict().items():
        assert torch.equal(_local(value).cpu(), _local(theirs_sd[name]).cpu()), name
    for p, q in zip(ours.parameters(), theirs.parameters()):
        for key, value in opts[0].state[p].items():
            assert torch.equal(_local(value).cpu(), _local(opts[1].state[q][key]).cpu()), key
    handle.close()
    assert "zero_grad" not in opts[0].__dict__  # closed: the optimizer's own zero_grad again
    return ran_on


@pytest.mark.parametrize(
    ("max_norm", "fused"),
    [(None, False), (None, True), (1e-3, False), (3.7, True), (1e6, False)],
    ids=["no_clip", "no_clip_fused", "always_clips", "clips_sometimes_fused", "never_clips"],
)
def test_equals_fsdp2_offload_bit_for_bit(max_norm: float | None, fused: bool) -> None:
    ran_on = run_on_ranks(_against_fsdp2, 2, "cpu", max_norm, fused)[0]
    assert all(ran_on), ran_on


def _zero_in_place_waits(rank: int, world_size: int) -> None:
    """zero_grad(set_to_none=False) zeroes the gradients the queued steps read: it waits for them
    first, and the step is the one without zeroing."""
    _slow_steps()
    models = _models("cpu", world_size)
    models = (models[0], _models("cpu", world_size)[0])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    step_in_backward(opts[0], models[0], finish_in_forward=True)
    step_in_backward(opts[1], models[1])
    for model, opt in zip(models, opts):
        lm_loss(model, batch_for(0, world_size, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(_local(p), _local(q)) and not bool(_local(p.grad).any())


def test_zero_grad_in_place_waits_for_the_steps() -> None:
    run_on_ranks(_zero_in_place_waits, 2)


def _refusals(rank: int, world_size: int) -> None:
    model = TinyTransformer()
    for module in [*model.layers, model]:
        fully_shard(module, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ValueError, match=r"^composable.optim.step_in_backward: 'finish_in_forward' must be a bool, got 1$"
    ):
        step_in_backward(opt, model, finish_in_forward=1)  # type: ignore[arg-type]  # the wrong call under test
    with pytest.raises(
        ValueError,
        match=r"^composable.optim.step_in_backward: 'speculate' and 'finish_in_forward' are two ways to overlap "
        r"a clipped step; pass one of them$",
    ):
        step_in_backward(opt, model, max_norm=1.0, speculate=True, finish_in_forward=True)


def test_wrong_calls_raise_one_line() -> None:
    run_on_ranks(_refusals, 1)


@requires_gpus(1)
@pytest.mark.parametrize("max_norm", [None, 1e-3], ids=["no_clip", "always_clips"])
def test_gpu_equals_fsdp2_offload_bit_for_bit(max_norm: float | None) -> None:
    """On CUDA, bf16 compute, gradients copied to pinned host memory as they are reduced: the
    steps left running past optimizer.step() and waited for by each module's forward give FSDP2's
    numbers (fused AdamW)."""
    ran_on = run_on_ranks(_against_fsdp2, 1, "cuda", max_norm, True, backend="cpu:gloo,cuda:nccl")[0]
    assert all(ran_on), ran_on
