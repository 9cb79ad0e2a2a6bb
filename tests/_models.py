"""Small models shared by the tests. Sizes deliberately do not divide world sizes 2 or 4."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int | None = None, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden or 3 * dim, bias=bias)
        self.fc2 = nn.Linear(hidden or 3 * dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + MLP."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.dropout(self.proj(att))
        return x + self.dropout(self.mlp(self.norm2(x)))


class TinyTransformer(nn.Module):
    """Decoder-only LM with tied input/output embeddings (vocab 13, width 10, 2 heads)."""

    def __init__(
        self, vocab: int = 13, dim: int = 10, heads: int = 2, layers: int = 2, seq: int = 7, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class NormMLPBlock(nn.Module):
    """A residual LayerNorm -> Linear -> ReLU -> Linear block: the shape the tensor-parallel tests
    split (norm sequence-parallel, w1 column-parallel, w2 row-parallel)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class NormMLPStack(nn.Module):
    """`layers` NormMLPBlocks in a ModuleList `layers`."""

    def __init__(self, dim: int, hidden: int, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NormMLPBlock(dim, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def batch_for(
    step: int, world_size: int, rank: int | None, per_rank: int = 2, vocab: int = 13, seq: int = 8
) -> torch.Tensor:
    """Deterministic token batch of step `step`: all ranks' rows, or only `rank`'s rows."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (world_size * per_rank, seq), generator=g)
    return tokens if rank is None else tokens[rank * per_rank : (rank + 1) * per_rank]
