"""The language-model head, and its loss computed a chunk of tokens at a time (`--loss-chunk`).

The plain loss, `lm_loss(model(x), y)`, materialises the logits of every token: at batch 4,
sequence 8192 and vocabulary 32000 the compute-dtype logits, their fp32 copy, the log-softmax
and their gradients come to about 10 GiB, most of what a step keeps on the GPU once parameters,
gradients and optimizer state are offloaded to the host. `LMHead` computes the same mean cross
entropy from the final hidden states instead: the head's matmul and the fp32 cross entropy
run over `chunk_tokens` tokens at a time, each chunk inside a non-reentrant activation
checkpoint, so forward keeps only the hidden states and backward recomputes one chunk's
logits at a time (the field's "chunked" or "fused linear + cross entropy" loss).

The head's weight is read once, in the head module's own forward call, and handed to every
chunk: fully_shard (composable's or PyTorch's FSDP2) unshards a group around its module's
forward, so one call all-gathers the weight once per step, where a call per chunk would gather
it once per chunk. The checkpoint keeps that same unsharded tensor for its recompute; both
APIs free its storage after forward (the head is a group of its own) and all-gather into the
same tensor again in the head's pre-backward hook, which runs on the loss's gradient, before
autograd reaches any chunk's recompute (tests/test_chunked_loss.py checks this).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint


class LMHead(nn.Linear):
    """The output head: an `nn.Linear` (same parameters, state-dict names and tensor-parallel
    styles) whose forward also computes the loss. `head(h)` returns the logits `h @ W.T`;
    `head(h, targets, chunk_tokens)` returns the mean cross entropy of those logits against
    `targets`, computed by `chunked_cross_entropy` without materialising all of them."""

    def forward(
        self, hidden: torch.Tensor, targets: torch.Tensor | None = None, chunk_tokens: int | None = None
    ) -> torch.Tensor:
        if targets is None:
            return super().forward(hidden)
        if chunk_tokens is None:
            raise ValueError("LMHead: targets given without chunk_tokens (tokens per chunk of the loss)")
        return chunked_cross_entropy(hidden, self.weight, targets, chunk_tokens, self.bias)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross entropy of the logits `F.linear(hidden, weight, bias)` against `targets`: what
    `lm_loss` computes from those logits (a 0-dim fp32 tensor; every target a class index, no
    ignore_index), up to fp32 rounding of the sum.

    `hidden` (..., dim) and `targets` (...) are flattened to N tokens and split into chunks of
    `chunk_tokens` (the last one shorter where it does not divide N; one chunk when it is >= N).
    Each chunk's logits are computed in the dtype of `hidden` and `weight` (or autocast's), and
    its cross entropy summed in fp32. With gradients enabled every chunk runs in a non-reentrant
    checkpoint: its logits are freed as soon as its loss is summed and recomputed in backward, one
    chunk at a time. Under no_grad nothing is kept and nothing is checkpointed.

    `weight` must be a plain tensor: a vocabulary-sharded DTensor (the tensor-parallel head)
    takes `lm_loss`, which reduces its logits shard by shard. ValueError for `chunk_tokens` < 1,
    a DTensor, or shapes that do not match."""
    if chunk_tokens < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    if any(isinstance(t, DTensor) for t in (hidden, weight, bias)):
        raise ValueError(
            "chunked_cross_entropy: the head's weight or input is a DTensor (tensor parallel); "
            "its vocabulary-sharded logits take lm_loss"
        )
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"chunked_cross_entropy: hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} "
            "must have the same leading shape"
        )
    flat_hidden, flat_targets = hidden.flatten(0, -2), targets.flatten()
    keep_graph = torch.is_grad_enabled()
    sums = []
    for h, t in zip(flat_hidden.split(chunk_tokens), flat_targets.split(chunk_tokens)):
        if keep_graph:
            # No random op inside: nothing to replay, so the RNG state is not stashed per chunk.
            sums.append(checkpoint(_chunk_loss_sum, h, weight, bias, t, use_reentrant=False, preserve_rng_state=False))
        else:
            sums.append(_chunk_loss_sum(h, weight, bias, t))
    return torch.stack(sums).sum() / flat_targets.numel()


def _chunk_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """The summed fp32 cross entropy of one chunk's logits: (n, dim) hidden states, (n,) targets."""
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), targets, reduction="sum")
