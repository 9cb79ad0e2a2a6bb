"""The main job's optimizer, learning-rate schedule and held-out evaluation."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from models.model import model_loss
from trainer.data import ByteCorpus, get_batch
from trainer.muon_adamw import build_muon_adamw


def build_optimizer(model: nn.Module, args: argparse.Namespace, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW, or with `--optimizer muon` Muon on the hidden matrices and AdamW on the rest (one
    optimizer: examples/trainer/muon_adamw.py); `fused`: one AdamW kernel per step for every parameter
    (CUDA), as the TP recipe runs."""
    if getattr(args, "optimizer", "adamw") == "muon":
        return build_muon_adamw(model, args.lr, args.weight_decay, fused=fused or None)
    # No weight decay on gains (1D): decaying RMSNorm weights towards 0 only hurts.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to `--lr`, then cosine decay to 10% of it at `--steps` (1-based step)."""
    # 10% of the run, at most 100 steps, at least 10 (or half a short run): a warmup of 4 steps
    # to the 1b preset's peak made its loss jump 7.9 -> 14.3 at step 4 on 2 x H200.
    warmup = (
        args.warmup_steps
        if args.warmup_steps is not None
        else min(100, max(min(10, args.steps // 2), args.steps // 10, 1))
    )
    if step <= warmup:
        return args.lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    corpus: ByteCorpus,
    args: argparse.Namespace,
    seq_len: int,
    dp_rank: int,
    device: torch.device,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Mean loss over `--eval-batches` fixed held-out batches per data-parallel rank.
    `loss_of(x, y)` computes a batch's loss (default `lm_loss(model(x), y)`, or the head's
    chunked loss with `--loss-chunk`; a pipelined model passes its forward through the stages)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(args.eval_batches):
        x, y = get_batch(
            corpus.val, args.batch_size, seq_len, seed=args.seed, step=i, rank=dp_rank, split_id=1, device=device
        )
        total += loss_of(x, y) if loss_of is not None else model_loss(model, x, y, getattr(args, "loss_chunk", 0))
    model.train(was_training)
    return world_mean(total / args.eval_batches)


def world_mean(value: torch.Tensor) -> float:
    """The mean of `value` over every rank of the default group."""
    value = value.detach().float().clone()
    dist.all_reduce(value)  # SUM (gloo has no AVG); tp ranks of one dp rank hold equal values
    return value.item() / dist.get_world_size()
