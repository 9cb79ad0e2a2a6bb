"""One training step of train.py as a function of its batch, and what running it as a CUDA graph
(`composable.graphed_step`, `--cuda-graph`) takes around it.

`make_train_step` builds the step: the micro-batches (with `no_sync`, or HSDP's deferred
all-reduce), the unscale and clip, the optimizer and scaler step and `zero_grad`. It never
synchronises with the CPU (no `.item()`: the caller reads the loss and the norm afterwards),
so the same function runs eagerly or captured. A captured step replays kernels, not Python;
what changes between steps must therefore be a tensor changed in place:

- the learning rate: `build_graph_optimizer` gives the optimizer a tensor `lr` on the device
  (and `capturable=True`), `set_lr` fills it before every step;
- the batch: `graphed_step` copies each call's (xs, ys) into its captured buffers (the shapes
  never change: --batch-size x --grad-accum rows of --seq-len tokens).

Everything else the step depends on stays as it was between steps (train mode is restored after
an evaluation; `graphed_step` checks this before every replay). `checkpoint_ready` keeps
checkpoints of graphed and eager runs interchangeable.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from composable import ShardedGradScaler, clip_grad_norm_, fully_shard, no_sync
from composable.optim import HostStepInBackward
from models.model import model_loss
from models.moe import set_aux_grad_scale
from trainer.muon_adamw import MuonAdamW
from trainer.schedule import build_optimizer

TrainStep = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]

# param_groups entries that say how this run's optimizer computes, not what it computes: a
# checkpoint's values of them (another mode's) must not replace this run's.
_OWN_SETTINGS = ("lr", "capturable", "fused", "foreach")


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: ShardedGradScaler,
    args: argparse.Namespace,
    hsdp_accum: bool,
    in_backward: HostStepInBackward | None = None,
) -> TrainStep:
    """`step(xs, ys) -> (loss_sum, grad_norm)`: one optimizer step over the batch (xs, ys),
    split into `args.grad_accum` micro-batches. `loss_sum` is this rank's mean loss over the
    batch (a 0-dim tensor); `grad_norm` the norm before clipping (a 0-dim tensor), or None
    with `args.max_norm` 0. Neither is read here: a captured step must not synchronise.

    `hsdp_accum` (--parallel hsdp with --grad-accum > 1): the micro-batches keep
    reduce-scattering and only the all-reduce across replicas waits for the last one; else
    all but the last micro-batch run under `no_sync` (no communication at all).

    `in_backward` (--step-in-backward): the optimizer's offloaded groups step during backward,
    and it clips with --max-norm itself (exactly, as clip_grad_norm_ would), so the step only reads its norm."""
    grad_accum, max_norm = args.grad_accum, args.max_norm  # read once: a graph freezes them anyway
    loss_chunk = getattr(args, "loss_chunk", 0)  # --loss-chunk: the head's chunked loss
    # MoE layers' load-balancing gradient: scaled as the loss is (a fp16 scaler's scale is a tensor).
    moe = set_aux_grad_scale(model, 1.0 / grad_accum)

    def train_step(xs: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        loss_sum = torch.zeros((), device=xs.device)
        if moe and scaler.is_enabled():
            set_aux_grad_scale(model, scaler.scale(torch.ones((), device=xs.device)) / grad_accum)
        for micro, (x, y) in enumerate(zip(xs.chunk(grad_accum), ys.chunk(grad_accum))):
            last = micro == grad_accum - 1
            if hsdp_accum:
                fully_shard.state(model).set_requires_all_reduce(last)
                ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            else:
                ctx = contextlib.nullcontext() if last else no_sync(model)
            with ctx:
                loss = model_loss(model, x, y, loss_chunk) / grad_accum
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        grad_norm = None
        if max_norm > 0 and in_backward is None:
            scaler.unscale_(optimizer)  # clip the true gradients (no-op unless fp16)
            grad_norm = clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        if in_backward is not None and max_norm > 0:
            grad_norm = in_backward.total_norm
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    return train_step


def build_graph_optimizer(model: nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of `schedule.build_optimizer` (same groups and hyperparameters), built to
    step inside a CUDA graph: `capturable=True` (its step counters live on the GPU, where a
    replay advances them), `fused=True` (the kernel `graphed_step` was proven with, and the one
    that lets an fp16 `ShardedGradScaler` step without reading found_inf on the CPU), and `lr`
    a tensor on `device`, which `set_lr` changes in place. With `--optimizer muon` the same
    `MuonAdamW`, its Muon groups reading the same lr tensor (composable.optim.Muon steps with it
    without reading it on the host)."""
    eager = build_optimizer(model, args)
    lr = torch.tensor(args.lr, dtype=torch.float32, device=device)
    if isinstance(eager, MuonAdamW):
        muon_groups, adamw_groups = (_without_own_settings(o.param_groups) for o in (eager.muon, eager.adamw))
        return MuonAdamW(muon_groups, adamw_groups, lr=lr, weight_decay=args.weight_decay, fused=True, capturable=True)
    return type(eager)(_without_own_settings(eager.param_groups), lr=lr, fused=True, capturable=True)


def _without_own_settings(groups: list[dict]) -> list[dict]:
    """Each group's parameters and hyperparameters, for a new optimizer that sets its own lr and flags."""
    return [{k: v for k, v in g.items() if k not in _OWN_SETTINGS} for g in groups]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate: in place when it is a tensor (a graphed step reads the
    tensor at every replay; a new Python number would be ignored, and is refused by
    `graphed_step`), else as the number."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@contextlib.contextmanager
def checkpoint_ready(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around a checkpoint save or load: the learning rate is a Python number inside (as in an
    eager run's optimizer), so a checkpoint of a graphed run loads into an eager one and back;
    afterwards every group has this run's own lr, `capturable`, `fused` and `foreach` again
    (the same tensor lr object, which a captured graph keeps reading), whatever a loaded
    checkpoint said. The schedule sets the lr before every step, so the checkpoint's is never
    needed."""
    own = [{k: g[k] for k in _OWN_SETTINGS if k in g} for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = group["lr"].item()
    try:
        yield
    finally:
        # load_state_dict replaces the group dicts; the groups themselves (their order) stay.
        for group, kept in zip(optimizer.param_groups, own):
            group.update(kept)
