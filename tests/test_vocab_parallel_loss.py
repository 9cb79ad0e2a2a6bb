"""examples/models/vocab_parallel_loss.py: cross entropy of vocabulary-sharded logits (the tensor-parallel
head's loss), on 2 gloo ranks against `F.cross_entropy` of the whole logits in one process.

- The loss and the logits' gradient, fp32 and bf16, with a vocabulary that does not split evenly
  (13 columns: 7 + 6) and targets in both ranks' columns; eager and with the three passes
  compiled (`compile_kernels`, aot_eager: the compiled path's graphs without inductor's build).
- What backward keeps: the local logits and two numbers per row, never an fp32 copy of the logits.
- Logits that are not sharded on the vocabulary are refused with one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _harness import assert_close_tensors, run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from models import vocab_parallel_loss
from models.vocab_parallel_loss import vocab_parallel_cross_entropy

ROWS, SEQ, VOCAB = 3, 5, 13  # 13 columns over 2 ranks: 7 + 6


def _logits_and_targets(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(ROWS, SEQ, VOCAB, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    targets[0, :2] = torch.tensor([0, VOCAB - 1])  # the first and the last column: both ranks hold a target
    return logits, targets


def _matches_cross_entropy(rank: int, world: int, dtype: torch.dtype, compiled: bool) -> None:
    mesh = init_device_mesh("cpu", (world,))
    passes = dict(vocab_parallel_loss._passes)
    if compiled:
        torch.compiler.reset()
        vocab_parallel_loss.compile_kernels("aot_eager")
    try:
        logits, targets = _logits_and_targets(dtype)
        full = logits.clone().requires_grad_()
        expected = F.cross_entropy(full.float().flatten(0, 1), targets.flatten())
        (3 * expected).backward()
        sharded = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
        loss = vocab_parallel_cross_entropy(sharded, targets)
        assert type(loss) is torch.Tensor and loss.dim() == 0 and loss.dtype == torch.float32
        (3 * loss).backward()
    finally:
        vocab_parallel_loss._passes.update(passes)
    assert_close_tensors(loss, expected, rtol=1e-6, atol=1e-6, msg="loss")
    assert sharded.grad is not None and sharded.grad.placements == (Shard(2),) and sharded.grad.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    assert_close_tensors(sharded.grad.full_tensor(), full.grad, **tol, msg="logits' gradient")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loss_and_gradient_match_cross_entropy(dtype: torch.dtype, compiled: bool) -> None:
    run_on_ranks(_matches_cross_entropy, 2, dtype, compiled)


def _keeps_only_logits_and_row_stats(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    logits, targets = _logits_and_targets(torch.bfloat16)
    sharded = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(sharded, targets)
    rows, local_columns = ROWS * SEQ, sharded.to_local().shape[-1]
    logits_saved = [t for t in saved if t.dim() == 2]
    assert [(t.shape, t.dtype) for t in logits_saved] == [((rows, local_columns), torch.bfloat16)], saved
    assert sum(t.numel() for t in saved) == rows * local_columns + 2 * rows, [t.shape for t in saved]
    loss.backward()


def test_backward_keeps_the_local_logits_and_two_numbers_per_row() -> None:
    run_on_ranks(_keeps_only_logits_and_row_stats, 2)


def _refuses_replicated_logits(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    logits, targets = _logits_and_targets(torch.float32)
    with pytest.raises(ValueError, match=r"^vocab_parallel_cross_entropy: logits must be sharded .*Replicate"):
        vocab_parallel_cross_entropy(distribute_tensor(logits, mesh, [Replicate()]), targets)


def test_logits_not_sharded_on_the_vocabulary_are_refused() -> None:
    run_on_ranks(_refuses_replicated_logits, 2)
