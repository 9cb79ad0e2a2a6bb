"""`composable.optim.offload_optimizer_state`: the optimizer's state in host memory between steps,
stepped on the parameters' device in buckets, bit for bit the plain optimizer's step.

Every run trains the same model twice side by side, with and without the offload, and compares
losses, parameters and optimizer state with `torch.equal` after every step. On this CPU-only
machine the parameters' device is the CPU too, so the copies in and out are real copies between
separate tensors (the same code path as on a GPU, without streams); the GPU form checks pinned
host state and the side streams.
"""

from __future__ import annotations

import copy
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

from composable import clip_grad_norm_, fully_shard
from composable.optim import Muon, offload_optimizer_state

STEPS = 4
SMALL_BUCKETS = 20_000  # bytes of state: several buckets for the tiny model


def _adamw(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(
        groups, lr=1e-2, weight_decay=0.1, fused=kind == "fused", foreach=kind == "foreach" or None
    )


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    la = a.to_local() if isinstance(a, DTensor) else a
    lb = b.to_local() if isinstance(b, DTensor) else b
    assert torch.equal(la.cpu(), lb.cpu()), what


def _train_side_by_side(models: list[nn.Module], opts: list[torch.optim.Optimizer], tokens_for, steps: int) -> None:
    """Both models on the same data, the second with its state offloaded: the same losses,
    parameters and state every step; the second's state in its host memory between steps."""
    offload = opts[1].__dict__["_composable_state_offload"]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1)) for opt in opts]
    for step in range(steps):
        losses = []
        for model, opt, sched in zip(models, opts, schedulers):
            loss = lm_loss(model, tokens_for(step))
            loss.backward()
            clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.detach())
        _assert_same(losses[0], losses[1], f"step {step} loss")
        for (name, p), q in zip(models[1].named_parameters(), models[0].parameters()):
            _assert_same(p, q, f"step {step} parameter {name}")
            if p.grad is None and not opts[1].state.get(p):
                continue
            for key, value in opts[1].state[p].items():
                _assert_same(value, opts[0].state[q][key], f"step {step} state {name}.{key}")
                if value.dim() > 0:  # moments: the host memory made at the first step, reused
                    assert value is offload._host[id(p)][key], (name, key)
                    assert (value.to_local() if isinstance(value, DTensor) else value).device.type == "cpu"


@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop", "sgd"])
def test_single_process_equals_plain_step(kind: str) -> None:
    """Plain parameters, two param groups, a frozen parameter, an LR scheduler, clipping, small
    buckets: bit for bit the plain optimizer's step."""
    torch.manual_seed(0)
    base = TinyTransformer()
    base.layers[0].qkv.bias.requires_grad_(False)  # frozen: no gradient, no state, skipped
    models = [base, copy.deepcopy(base)]
    opts = [_adamw(m, kind) for m in models]
    offload_optimizer_state(opts[1], bucket_bytes=SMALL_BUCKETS)
    _train_side_by_side(models, opts, lambda step: batch_for(step, 1, 0), STEPS)


def test_grad_scaler_scales_every_bucket() -> None:
    """A GradScaler hands a fused optimizer its scale and inf flag for the step: every bucket
    steps with them, as the plain step does (and skips the step after an overflow)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in models]
    offload_optimizer_state(opts[1], bucket_bytes=1)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in models]
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        if step == 2:
            x[0, 0] = float("inf")  # an overflow: the step is skipped, the scale halved
        for model, opt, scaler in zip(models, opts, scalers):
            scaler.scale(model(x).square().sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        for p, q in zip(models[1].parameters(), models[0].parameters()):
            _assert_same(p, q, f"step {step}")
    assert scalers[1].get_scale() == scalers[0].get_scale() == 2.0**7


def _sharded(rank: int, world_size: int, tmp: str) -> None:
    """fully_shard: the state is DTensors sharded as their parameters, on the host; a DCP
    checkpoint of it resumes bit for bit, into an offloaded optimizer or a plain one."""
    mesh = init_device_mesh("cpu", (world_size,))

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = TinyTransformer()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    models = [build(), build()]
    opts = [_adamw(m, "fused") for m in models]
    offload_optimizer_state(opts[1], bucket_bytes=SMALL_BUCKETS)
    _train_side_by_side(models, opts, lambda step: batch_for(step, world_size, rank), 2)
    for p in models[1].parameters():
        for key, value in opts[1].state[p].items():
            if value.dim() > 0:
                assert isinstance(value, DTensor) and value.placements == p.placements, key
    model_sd, optim_sd = get_state_dict(models[1], opts[1])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    for offloaded in (True, False):
        resumed = build()
        opt = _adamw(resumed, "fused")
        if offloaded:
            offload_optimizer_state(opt, bucket_bytes=SMALL_BUCKETS)
        resumed(batch_for(0, world_size, rank)[:, :-1]).sum().backward()  # state to load into
        opt.step()
        opt.zero_grad()
        model_sd, optim_sd = get_state_dict(resumed, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        set_state_dict(resumed, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        for step in range(2, 4):
            for model, o in ((models[1], opts[1]), (resumed, opt)) if offloaded else ((resumed, opt),):
                loss = lm_loss(model, batch_for(step, world_size, rank))
                loss.backward()
                o.step()
                o.zero_grad()
        if offloaded:  # the same steps after the resume as in the run that never stopped
            for (name, p), q in zip(resumed.named_parameters(), models[1].parameters()):
                _assert_same(p, q, f"resumed {name}")


def test_fully_shard_state_sharded_on_the_host_and_checkpoints(tmp_path: Path) -> None:
    run_on_ranks(_sharded, 2, str(tmp_path))


def _prefetched_in_backward(rank: int, world_size: int, device: str) -> None:
    """`prefetch_in_backward`: after backward, the state of every block whose backward is done
    is on the device already, set aside (the optimizer's state still the host's), and the steps
    are bit for bit the plain optimizer's, clipping included; the root's own parameters (its
    backward ends last) and the first block's are copied in by the step."""
    mesh = init_device_mesh(device, (world_size,))

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = TinyTransformer().to(device)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    models = [build(), build()]
    opts = [_adamw(m, "fused" if device == "cuda" else "foreach") for m in models]
    offload = offload_optimizer_state(opts[1], bucket_bytes=SMALL_BUCKETS, prefetch_in_backward=models[1])
    _train_side_by_side(models, opts, lambda step: batch_for(step, world_size, rank).to(device), STEPS)
    lm_loss(models[1], batch_for(STEPS, world_size, rank).to(device)).backward()
    left = {id(p) for layer in models[1].layers[1:] for p in layer.parameters()}
    assert set(offload._prefetched) == left, "the blocks backward has left, and only those"
    for p in models[1].parameters():
        assert opts[1].state[p]["exp_avg"] is offload._host[id(p)]["exp_avg"], "set aside until the step"
    opts[1].step()
    assert not offload._prefetched


def test_prefetch_in_backward_equals_plain_step() -> None:
    run_on_ranks(_prefetched_in_backward, 2, "cpu")


def test_hooks_once_per_step_and_close_restores_the_plain_step() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    handle = offload_optimizer_state(opt, bucket_bytes=1)  # a bucket per parameter
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert calls == ["pre", "post"], calls
    assert opt.state[model.weight]["exp_avg"] is handle._host[id(model.weight)]["exp_avg"]
    handle.close()
    assert "step" not in opt.__dict__ and opt.state[model.weight]["exp_avg"] is not None
    opt.step()  # the plain step again
    assert calls == ["pre", "post", "pre", "post"], calls


def test_errors() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    api = "composable.optim.offload_optimizer_state"
    with pytest.raises(TypeError, match=f"{api}: 'optimizer' must be a torch.optim.Optimizer, got Linear"):
        offload_optimizer_state(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=f"{api}: 'bucket_bytes' must be an int, got float: 1.5"):
        offload_optimizer_state(opt, bucket_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"{api}: 'bucket_bytes' must be >= 1, got 0"):
        offload_optimizer_state(opt, bucket_bytes=0)
    with pytest.raises(ValueError, match=f"{api}: composable.optim.Muon's step sends whole matrices between ranks"):
        offload_optimizer_state(Muon([nn.Parameter(torch.randn(4, 4))]))
    with pytest.raises(TypeError, match=f"{api}: 'prefetch_in_backward' must be an nn.Module .* got str"):
        offload_optimizer_state(opt, prefetch_in_backward="model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"{api}: 'prefetch_in_backward' \\(Linear\\) has no module under fully_shard"):
        offload_optimizer_state(opt, prefetch_in_backward=nn.Linear(2, 2))
    offload_optimizer_state(opt)
    with pytest.raises(ValueError, match=f"{api}: 'optimizer' already has its state offloaded; call close"):
        offload_optimizer_state(opt)
    with pytest.raises(ValueError, match=rf"{api}: optimizer.step\(closure\) is not supported"):
        opt.step(lambda: 0.0)


# ----------------------------------------------------------------------------- GPU


@requires_gpus(1)
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_gpu_equals_plain_step_with_pinned_host_state(kind: str) -> None:
    """On CUDA: bit for bit the plain GPU step (the same kernels on the same values), the state
    in pinned host memory between steps, copied through two side streams."""
    torch.manual_seed(0)
    base = TinyTransformer().cuda()
    models = [base, copy.deepcopy(base)]
    opts = [_adamw(m, kind) for m in models]
    offload_optimizer_state(opts[1], bucket_bytes=SMALL_BUCKETS)
    _train_side_by_side(models, opts, lambda step: batch_for(step, 1, 0).cuda(), STEPS)
    for p in models[1].parameters():
        for value in opts[1].state[p].values():
            if value.dim() > 0:
                assert value.device.type == "cpu" and value.is_pinned()


@requires_gpus(1)
def test_gpu_prefetch_in_backward_equals_plain_step() -> None:
    """The copies in on the side stream during backward, waited for by the step: bit for bit."""
    run_on_ranks(_prefetched_in_backward, 1, "cuda", backend="cpu:gloo,cuda:nccl")
