"""`graphed_step`: a whole training step captured in a CUDA graph.

CPU: the argument checks, and the checks made before every replay (what a graph would
silently ignore: train/eval, composable settings, optimizer hyperparameters, replaced
tensors) on a real model, without a graph. GPUs (NCCL, 1 and 2 ranks): the graphed step
trains exactly like the same step run eagerly (every loss and every parameter, several
steps) under fully_shard, replicate, HSDP, compiled blocks, checkpoint, no_sync
accumulation with clip_grad_norm_, and fp16 with ShardedGradScaler; and each promised
error on a real capture.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from _harness import requires_gpus, run_on_ranks
from _models import TinyTransformer, lm_loss
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import composable
from composable import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardedGradScaler,
    checkpoint,
    clip_grad_norm_,
    fully_shard,
    graphed_step,
    no_sync,
    replicate,
    set_requires_gradient_sync,
)
from composable._graphed_checks import Recorder as _Recorder
from composable._graphed_checks import Snapshot as _Snapshot
from composable.graphed_step import _Inputs

# ------------------------------------------------------------------------------ CPU: arguments


def test_step_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"graphed_step: 'step' must be callable, got int: 3"):
        graphed_step(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("warmup", [0, -1, True, 1.5, "2"])
def test_warmup_must_be_a_positive_int(warmup: object) -> None:
    with pytest.raises(ValueError, match=r"graphed_step: 'warmup' must be an int >= 1 .*got " + repr(warmup)[:3]):
        graphed_step(lambda: None, warmup=warmup)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_without_cuda_the_first_call_says_so() -> None:
    step = graphed_step(lambda x: x)
    with pytest.raises(RuntimeError, match=r"graphed_step: CUDA graphs need a CUDA device"):
        step(torch.ones(2))


def test_cpu_tensors_and_tensors_with_history_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks come before any CUDA work
    step = graphed_step(lambda x, y=None: x)
    with pytest.raises(ValueError, match=r"graphed_step: argument args\[0\] is on cpu: .*must be on CUDA"):
        step(torch.ones(2))
    with pytest.raises(ValueError, match=r"graphed_step: argument kwargs\['y'\] is on cpu"):
        step(1, y=torch.ones(1))
    with pytest.raises(ValueError, match=r"graphed_step: argument args\[0\] requires grad: .*pass it detached"):
        step(torch.ones(2, requires_grad=True))


def test_replay_arguments_must_match_the_captured_ones() -> None:
    inputs = _Inputs(((torch.zeros(2, 3), 4), {"mode": "train"}))
    inputs.load(((torch.ones(2, 3), 4), {"mode": "train"}))
    assert torch.equal(inputs.args[0], torch.ones(2, 3))  # copied into the captured buffer
    with pytest.raises(ValueError, match=r"argument args\[0\] is \(3, 3\) torch.float32 on cpu, captured as \(2, 3\)"):
        inputs.load(((torch.ones(3, 3), 4), {"mode": "train"}))
    with pytest.raises(ValueError, match=r"argument args\[0\] is \(2, 3\) torch.float64 on cpu, captured as"):
        inputs.load(((torch.ones(2, 3, dtype=torch.float64), 4), {"mode": "train"}))
    with pytest.raises(ValueError, match=r"argument args\[1\] is 5, captured as 4: non-tensor arguments are frozen"):
        inputs.load(((torch.ones(2, 3), 5), {"mode": "train"}))
    with pytest.raises(ValueError, match=r"argument kwargs\['mode'\] is 'eval', captured as 'train'"):
        inputs.load(((torch.ones(2, 3), 4), {"mode": "eval"}))
    with pytest.raises(ValueError, match=r"the arguments' structure changed since capture"):
        inputs.load(((torch.ones(2, 3),), {"mode": "train"}))
    with pytest.raises(ValueError, match=r"argument args\[0\] must be a tensor as at capture, got 1.0"):
        inputs.load(((1.0, 4), {"mode": "train"}))


# --------------------------------------------------------------- CPU: the checks before a replay


def _recorded(model: nn.Module, opt: torch.optim.Optimizer) -> _Snapshot:
    """A snapshot of what one eager step of `model` runs, as graphed_step takes it."""
    recorder = _Recorder()
    with recorder:
        lm_loss(model, torch.randint(0, 13, (2, 8))).backward()
        opt.step()
        opt.zero_grad()
    return _Snapshot(recorder)


def _sharded(world2: Any, api: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformer()
    if api == "fully_shard":
        for layer in model.layers:
            fully_shard(layer, mesh=world2)
        fully_shard(model, mesh=world2)
    else:
        replicate(model, mesh=world2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=False)


CHANGES: list[tuple[str, Callable[[nn.Module, torch.optim.Optimizer], Any], str]] = [
    ("eval", lambda m, o: m.eval(), r"TinyTransformer changed since capture: training was True, is False"),
    (
        "no_sync",
        lambda m, o: set_requires_gradient_sync(m, False),
        r"TinyTransformer changed since capture: (fully_shard|replicate) requires_gradient_sync was True, is False",
    ),
    (
        "freeze",
        lambda m, o: m.norm.weight.requires_grad_(False),
        r"LayerNorm changed since capture: weight.requires_grad was True, is False",
    ),
    (
        "lr",
        lambda m, o: o.param_groups[0].__setitem__("lr", 5e-4),
        r"AdamW changed since capture: lr was 0.001, is 0.0005 .*give lr as a tensor",
    ),
    (
        "parameters",
        lambda m, o: m.load_state_dict(copy.deepcopy(m.state_dict()), assign=True),
        r"Embedding changed since capture: parameter weight replaced by other tensors \(a graph keeps using",
    ),
    (
        "optimizer state",
        lambda m, o: o.load_state_dict(copy.deepcopy(o.state_dict())),
        r"AdamW changed since capture: state replaced by other tensors \(a graph keeps using the captured",
    ),
]


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
@pytest.mark.parametrize("change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_change_since_capture_is_named_before_the_replay(world2: Any, api: str, change: tuple) -> None:
    _, apply, message = change
    model, opt = _sharded(world2, api)
    snapshot = _recorded(model, opt)
    snapshot.check()  # nothing changed: passes
    lm_loss(model, torch.randint(0, 13, (2, 8))).backward()  # an eager step in between is fine
    opt.step()
    snapshot.check()
    apply(model, opt)
    with pytest.raises(RuntimeError, match=r"graphed_step: " + message):
        snapshot.check()


def test_a_tensor_lr_may_change_in_place(world2: Any) -> None:
    model, _ = _sharded(world2, "fully_shard")
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    snapshot = _recorded(model, opt)
    opt.param_groups[0]["lr"].fill_(5e-4)  # read by the graph at every replay
    snapshot.check()


def test_a_non_capturable_optimizer_is_refused_before_capture(world2: Any) -> None:
    model, opt = _sharded(world2, "fully_shard")
    lm_loss(model, torch.randint(0, 13, (2, 8))).backward()
    recorder = _Recorder()
    with recorder:
        opt.step()  # a step that only steps the optimizer
    with pytest.raises(ValueError, match=r"graphed_step: AdamW's param_groups\[0\] has capturable=False; build"):
        recorder.check_capturable()
    assert composable.GraphedStep is type(graphed_step(print))


def test_parameters_off_the_gpu_are_refused_before_capture(world2: Any) -> None:
    """CPU offload: the CPU's share of the step would run once, at capture, never on replay."""
    model, opt = _sharded(world2, "fully_shard")
    recorder = _Recorder()
    with recorder:
        lm_loss(model, torch.randint(0, 13, (2, 8))).backward()
    with pytest.raises(ValueError, match=r"graphed_step: parameter weight of Embedding is on cpu \(CPU offload\?\): "):
        recorder.check_capturable()


def test_parameters_off_the_gpu_are_refused_from_the_optimizer_too() -> None:
    """A model compiled as a whole in place runs its modules inside the graph, where the
    recorder records none: the parameters the optimizer steps are checked as well."""
    weight = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.ones(2)
    recorder = _Recorder()
    with recorder:
        opt.step()
    with pytest.raises(
        ValueError, match=r"graphed_step: SGD's param_groups\[0\] steps a parameter on cpu \(CPU offload\?\): "
    ):
        recorder.check_capturable()


def test_optimizer_state_on_the_host_is_refused_before_capture() -> None:
    """`offload_optimizer_state`: its copies through host memory would run once, at capture."""
    from composable.optim import offload_optimizer_state

    weight = nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([weight], lr=0.1)
    handle = offload_optimizer_state(opt)
    weight.grad = torch.ones(2)
    recorder = _Recorder()
    with recorder:
        opt.step()
    with pytest.raises(
        ValueError,
        match=r"graphed_step: AdamW's state is kept on the host \(composable.optim.offload_optimizer_state\): ",
    ):
        recorder.check_capturable()
    handle.close()  # the plain step again: its own refusals, not this one
    recorder = _Recorder()
    with recorder:
        opt.step()
    with pytest.raises(ValueError, match=r"graphed_step: AdamW's param_groups\[0\] has capturable=False"):
        recorder.check_capturable()


# ------------------------------------------------------------------------------- GPUs (NCCL)

STEPS = 6


def _build(config: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model, optimizer and grad scaler (or None) of `config`, on this rank's GPU."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, dim=32, heads=4, layers=3, seq=16).cuda()
    fp16 = config == "fp16_scaler"
    mp = MixedPrecisionPolicy(param_dtype=torch.float16 if fp16 else torch.bfloat16, reduce_dtype=torch.float32)
    if config == "compiled":
        for layer in model.layers:
            layer.compile(backend="inductor")
    if config == "checkpoint":
        for layer in model.layers:
            checkpoint(layer)
    if config == "replicate":
        replicate(model, mp_policy=mp)
    else:
        mesh = init_device_mesh("cuda", (world, 1) if config == "hsdp" else (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), fused=True, capturable=True)
    return model, opt, ShardedGradScaler(init_scale=2.0**10) if fp16 else None


def _step_fn(config: str, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> Callable[..., Any]:
    def step(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        micro = tokens.chunk(2) if config == "accumulate_clip" else [tokens]
        total = torch.zeros((), device=tokens.device)
        for i, mb in enumerate(micro):
            ctx = no_sync(model) if i < len(micro) - 1 else contextlib.nullcontext()
            with ctx:
                loss = lm_loss(model, mb) / len(micro)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach()
        norm = torch.zeros((), device=tokens.device)
        if config in ("accumulate_clip", "fp16_scaler"):
            if scaler is not None:
                scaler.unscale_(opt)
            norm = clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return total, norm

    return step


def _train(rank: int, world: int, config: str) -> None:
    results = {}
    for mode in ("eager", "graphed"):
        if config == "compiled":
            torch._dynamo.reset()
        model, opt, scaler = _build(config, world)
        step = _step_fn(config, model, opt, scaler)
        run = graphed_step(step, warmup=2) if mode == "graphed" else step
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        history = []
        for i in range(STEPS):
            tokens = torch.randint(0, 64, (4, 16), device="cuda", generator=gen)
            loss, norm = run(tokens)
            if mode == "graphed" and i == 3:
                opt.param_groups[0]["lr"].fill_(5e-3)  # a schedule: the graph reads the tensor
            elif mode == "eager" and i == 3:
                opt.param_groups[0]["lr"].fill_(5e-3)
            history.append((loss.item(), norm.item()))
        if mode == "graphed":
            assert run.graph is not None, "the step was never captured"
        params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}
        results[mode] = (history, {n: p.float().cpu() for n, p in params.items()})
    (eager_hist, eager_params), (graph_hist, graph_params) = results["eager"], results["graphed"]
    assert eager_hist == graph_hist, f"{config}: losses/norms eager {eager_hist} vs graphed {graph_hist}"
    for name, p in eager_params.items():
        assert torch.equal(p, graph_params[name]), f"{config}: parameter {name} differs after {STEPS} steps"
    dist.barrier()


CONFIGS = ["fully_shard", "replicate", "hsdp", "compiled", "checkpoint", "accumulate_clip", "fp16_scaler"]


@requires_gpus(1)
@pytest.mark.parametrize("config", CONFIGS)
def test_gpu_graphed_step_trains_like_eager_on_one_gpu(config: str) -> None:
    run_on_ranks(_train, 1, config, backend="nccl", timeout=600)


@requires_gpus(2)
@pytest.mark.parametrize("config", CONFIGS)
def test_gpu_graphed_step_trains_like_eager_on_two_gpus(config: str) -> None:
    run_on_ranks(_train, 2, config, backend="nccl", timeout=600)


def _errors(rank: int, world: int) -> None:
    model, opt, _ = _build("fully_shard", world)
    step = graphed_step(_step_fn("fully_shard", model, opt, None), warmup=1)
    tokens = torch.randint(0, 64, (4, 16), device="cuda")
    for _ in range(3):
        step(tokens)
    with pytest.raises(
        ValueError, match=r"graphed_step: argument args\[0\] is \(2, 16\) torch.int64 on cuda:0, captured"
    ):
        step(tokens[:2])
    model.eval()
    with pytest.raises(RuntimeError, match=r"graphed_step: TinyTransformer changed since capture: training was True"):
        step(tokens)
    model.train()
    step(tokens)  # restored: replays again

    offloaded = TinyTransformer(vocab=64, dim=32, heads=4, layers=1, seq=16).cuda()
    fully_shard(offloaded, offload_policy=CPUOffloadPolicy())
    off_opt = torch.optim.AdamW(offloaded.parameters(), lr=1e-3)
    off_step = graphed_step(lambda t: (lm_loss(offloaded, t).backward(), off_opt.step(), off_opt.zero_grad()), warmup=1)
    off_step(tokens)
    with pytest.raises(ValueError, match=r"graphed_step: parameter weight of Embedding is on cpu \(CPU offload\?\)"):
        off_step(tokens)
    plain, plain_opt, _ = _build("fully_shard", world)
    plain_opt.param_groups[0]["capturable"] = False
    opt_step = graphed_step(_step_fn("fully_shard", plain, plain_opt, None), warmup=1)
    opt_step(tokens)
    with pytest.raises(ValueError, match=r"graphed_step: AdamW's param_groups\[0\] has capturable=False"):
        opt_step(tokens)

    def syncing(tokens: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model, tokens)
        if loss.item() > 0:  # a CPU synchronisation: cannot be captured
            loss.backward()
        return loss.detach()

    sync_step = graphed_step(syncing, warmup=1)
    sync_step(tokens)
    with pytest.raises(RuntimeError, match=r"graphed_step: capturing the step failed .*must not synchronise"):
        sync_step(tokens)
    torch.randn(4, device="cuda").normal_()  # a failed capture leaves the random generator usable
    dist.barrier()


@requires_gpus(1)
def test_gpu_graphed_step_errors() -> None:
    run_on_ranks(_errors, 1, backend="nccl", timeout=300)


def _warmups_and_capture_hold_no_memory(rank: int, world: int) -> None:
    """The warm-up steps and the capture share one side stream: after the first step, no step
    leaves more memory allocated than the one before (cuBLAS keeps a workspace per stream for
    the process's life, so a stream per warm-up step grew allocated memory at every one)."""
    model, opt, _ = _build("fully_shard", world)
    step = graphed_step(_step_fn("fully_shard", model, opt, None), warmup=4)
    tokens = torch.randint(0, 64, (4, 16), device="cuda")
    allocated = []
    for _ in range(6):  # 4 warm-ups, the capture, a replay
        step(tokens)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert step.graph is not None
    assert allocated[1] == allocated[2] == allocated[3], allocated
    assert allocated[4] - allocated[3] < 2**20 and allocated[5] == allocated[4], allocated  # the graph's outputs
    dist.barrier()


@requires_gpus(1)
def test_gpu_graphed_step_warmups_and_capture_hold_no_memory() -> None:
    run_on_ranks(_warmups_and_capture_hold_no_memory, 1, backend="nccl", timeout=300)
