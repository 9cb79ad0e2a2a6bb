"""Cross entropy of vocabulary-sharded logits: the tensor-parallel head's loss (parallel.py's
`tp_ends_plan` leaves the head's logits a DTensor sharded on the vocabulary over tp).

The loss is computed where the logits are, without gathering them, as `loss_parallel` does,
but in three passes over the local logits, in their own dtype (bf16 under mixed precision):
- forward, pass 1: each row's local maximum, all-reduced (MAX) over tp;
- forward, pass 2: each row's local sum of exp(logit - max) and the target's logit where this
  rank holds the target's column, both all-reduced (SUM) over tp in one collective;
- backward, one pass: softmax minus the one-hot target, scaled by the incoming gradient over the
  number of rows, straight into the logits' dtype; no communication (each rank's columns of
  the gradient depend only on its own logits and the two reduced row statistics).
Backward keeps only the local logits and, per row, its log-normaliser and its target. `loss_parallel`
materialises fp32 copies of the whole logits several times in each direction (log-softmax,
its reductions, its backward), the largest tensors of the step: on 4 x H100 they were about a
quarter of the 2D step's extra GPU work over data parallelism at width 4096.

`compile_kernels` compiles the three passes (one fused kernel each under inductor); the jobs
call it when they compile the blocks. Eager, the same passes run as a few plain ops each.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

_Pass = Callable[..., torch.Tensor]


def _row_max(logits: torch.Tensor) -> torch.Tensor:
    """(N, V_local) -> (N,) fp32: each row's largest local logit."""
    return logits.float().amax(-1)


def _row_sums(logits: torch.Tensor, row_max: torch.Tensor, targets: torch.Tensor, first_column: int) -> torch.Tensor:
    """(2, N) fp32: each row's local sum of exp(logit - row_max), and the target's logit where
    this rank holds its column (0 elsewhere, so that the sum over tp is the target's logit)."""
    x = logits.float()
    sum_exp = (x - row_max.unsqueeze(-1)).exp().sum(-1)
    column = targets - first_column
    here = (column >= 0) & (column < x.shape[-1])
    picked = x.gather(-1, column.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return torch.stack((sum_exp, torch.where(here, picked, torch.zeros_like(picked))))


def _logits_grad(
    logits: torch.Tensor, log_norm: torch.Tensor, targets: torch.Tensor, first_column: int, scale: torch.Tensor
) -> torch.Tensor:
    """(softmax - one_hot(target)) * scale in the logits' dtype; `log_norm` is each row's
    max + log(sum of exp): softmax = exp(logit - log_norm)."""
    probs = (logits.float() - log_norm.unsqueeze(-1)).exp()
    columns = torch.arange(logits.shape[-1], device=logits.device) + first_column
    one_hot = (columns == targets.unsqueeze(-1)).to(probs.dtype)
    return ((probs - one_hot) * scale).to(logits.dtype)


_EAGER_PASSES: dict[str, _Pass] = {"row_max": _row_max, "row_sums": _row_sums, "logits_grad": _logits_grad}
_passes: dict[str, _Pass] = dict(_EAGER_PASSES)  # what the loss runs: these, or their compiled versions


def compile_kernels(backend: str = "inductor") -> None:
    """Compile the loss's three passes with `backend` (process-wide, like the blocks' compile:
    every later call of `vocab_parallel_cross_entropy` runs them compiled)."""
    # No collective in these graphs: inductor's async-TP pass (on for the blocks under --async-tp)
    # would only warn, per graph and rank, that it found nothing to fuse.
    options = {"_micro_pipeline_tp": False} if backend == "inductor" else None
    for name, fn in _EAGER_PASSES.items():
        _passes[name] = torch.compile(fn, backend=backend, dynamic=False, options=options)


def vocab_parallel_cross_entropy(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of `logits` (B, T, V), a DTensor on a 1-D mesh sharded on its last
    dim (the vocabulary), against `targets` (B, T) int64, the same on every rank of that mesh.
    Returns a plain 0-dim fp32 tensor, equal on every rank of the mesh; its gradient flows back
    to `logits` as a DTensor of the same placement."""
    mesh, placement = logits.device_mesh, logits.placements[0]
    if mesh.ndim != 1 or not (placement.is_shard(logits.ndim - 1) or placement.is_shard(-1)):
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits must be sharded on the vocabulary (last dim) over a 1-D mesh, "
            f"got placements {logits.placements} on a {mesh.ndim}-D mesh"
        )
    vocab, ranks = logits.shape[-1], mesh.size()
    # DTensor's Shard splits like torch.chunk: every rank but the last holds ceil(V / ranks) columns.
    first_column = mesh.get_local_rank() * -(-vocab // ranks)
    local = logits.to_local()
    return _VocabParallelCrossEntropy.apply(local.flatten(0, 1), targets.flatten(), first_column, mesh.get_group())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, first_column: int, group: Any) -> torch.Tensor:
        row_max = funcol.all_reduce(_passes["row_max"](logits), "max", group)
        sums = funcol.all_reduce(_passes["row_sums"](logits, row_max, targets, first_column), "sum", group)
        log_norm = row_max + sums[0].log()
        ctx.save_for_backward(logits, log_norm, targets)
        ctx.first_column = first_column
        return (log_norm - sums[1]).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, log_norm, targets = ctx.saved_tensors
        scale = grad / logits.shape[0]
        return _passes["logits_grad"](logits, log_norm, targets, ctx.first_column, scale), None, None, None
