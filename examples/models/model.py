"""A Llama-style decoder-only transformer: RMSNorm, rotary positions, SwiGLU, causal SDPA.

Written for data parallelism and tensor parallelism to be applied from outside:
- every block is one `TransformerBlock` (the unit `fully_shard`, `checkpoint` apply to);
- attention and feed-forward use separate `nn.Linear`s (`wq`, `wk`, `wv`, `wo`, `w1`, `w2`,
  `w3`), so ColwiseParallel / RowwiseParallel shard them by name, and the head count per
  rank is read from the local width (`view(B, T, -1, head_dim)`), so TP needs no flag;
- `fused_projections=True` fuses the linears that read the same input: `wqkv` (q, k, v) and
  `w13` (w1, w3), one matmul each, with their rows ordered so that any contiguous split of
  them over tp ranks (ColwiseParallel's `Shard(0)`) keeps whole heads / matching w1, w3 rows
  together (`fuse_state_dict` converts an unfused model's weights);
- the model can be built on the meta device and materialised later: `init_weights()`
  (re)initialises every parameter and recomputes the rotary tables (a non-persistent buffer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.chunked_loss import LMHead
from models.moe import MoEFeedForward
from models.vocab_parallel_loss import vocab_parallel_cross_entropy


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 352
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    n_experts: int = 0  # > 0: every block's feed-forward is a mixture of experts (moe.py)
    top_k: int = 2  # experts per token
    # > 0: each rank sends each expert at most this many times an even share of its routed rows
    # (the rest are dropped): fixed shapes, no host synchronisation (moe.py). 0: no token dropped.
    moe_capacity_factor: float = 0.0
    # One wqkv and one w13 linear instead of wq/wk/wv and w1/w3 (the MoE feed-forward keeps its
    # experts): one matmul per shared input, whose input gradient under sequence-parallel TP
    # is a single matmul that async TP can fuse with its reduce-scatter.
    fused_projections: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig: dim {self.dim} must be divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"ModelConfig: head dim {self.dim // self.n_heads} must be even (rotary pairs)")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"ModelConfig: top_k {self.top_k} must be in 1..n_experts ({self.n_experts})")
        if self.moe_capacity_factor < 0 or (self.moe_capacity_factor and not self.n_experts):
            raise ValueError(
                f"ModelConfig: moe_capacity_factor {self.moe_capacity_factor} must be 0, or > 0 with n_experts > 0"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    # Trains in about two minutes on 2 CPU cores (2 ranks) with a clearly falling loss.
    "tiny": ModelConfig(),
    # A few minutes per hundred steps on CPU; seconds on a GPU.
    "small": ModelConfig(dim=256, n_layers=6, n_heads=8, ffn_dim=704, max_seq_len=512),
    # The benchmark model: 953M parameters (dim 2048, 16 layers, ffn 5632, vocab 32000, seq 2048).
    "1b": ModelConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, max_seq_len=2048),
}

# Peak AdamW learning rate per preset. With Adam every weight moves by about `lr` per step
# whatever its gradient's size, so the change of a layer's output grows with its width: the
# rate has to fall as 1/width for the same relative update (muP's rule for hidden matrices).
# tiny's 3e-3 at dim 128 scaled this way gives 1.5e-3 at 256 and 1.9e-4 at 2048; GPT-3's
# published rates (6e-4 at d=768 ... 2e-4 for the 1.3B model at d=2048) follow the same line.
# 1b uses 3e-4 (between that and Llama/TinyLlama's 3e-4..4e-4 at this size): tiny's 3e-3 on
# the 953M model drove the loss from 10.7 up to 16.3 in its first steps on 2 x H200.
PRESET_LR: dict[str, float] = {"tiny": 3e-3, "small": 1.5e-3, "1b": 3e-4}


def get_config(preset: str, **overrides: object) -> ModelConfig:
    """The named preset with `overrides` (fields whose value is None are left alone)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


def width_overrides(preset: str, dim: int | None, n_heads: int | None, ffn_dim: int | None) -> dict[str, int]:
    """The config fields that `--dim` / `--n-heads` / `--ffn-dim` change. With `--dim` alone,
    heads keep the preset's head dim and the ffn is Llama's: 8/3 of the width rounded up to a
    multiple of 256 (2048 -> 5632, the 1b preset's; 4096 -> 11008 with 32 heads, Llama-7B's)."""
    out = {"dim": dim, "n_heads": n_heads, "ffn_dim": ffn_dim}
    if dim is not None:
        if n_heads is None:
            out["n_heads"] = max(1, dim // PRESETS[preset].head_dim)
        if ffn_dim is None:
            out["ffn_dim"] = -(-(8 * dim // 3) // 256) * 256
    return {k: v for k, v in out.items() if v is not None}


def config_from_flags(
    preset: str,
    *,
    seq_len: int | None,
    exact_seq_len: bool = False,
    derive_width: bool = False,
    dim: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    ffn_dim: int | None = None,
    vocab_size: int | None = None,
    tie_embeddings: bool | None = None,
    n_experts: int | None = None,
    moe_capacity_factor: float | None = None,
    fused_projections: bool | None = None,
) -> ModelConfig:
    """The ModelConfig a command line describes: `preset` with each field a flag set (None: the
    preset's). `derive_width`: `--dim` alone also sets the heads and the ffn width
    (`width_overrides`). max_seq_len grows to `seq_len` when that is longer; with `exact_seq_len`
    it is `seq_len`, shorter too. ValueError (from ModelConfig or `get_config`) for a bad shape."""
    width = {"dim": dim, "n_heads": n_heads, "ffn_dim": ffn_dim}
    if derive_width:
        width.update(width_overrides(preset, dim, n_heads, ffn_dim))
    cfg = get_config(
        preset,
        **width,
        n_layers=n_layers,
        vocab_size=vocab_size,
        tie_embeddings=tie_embeddings,
        n_experts=n_experts,
        moe_capacity_factor=moe_capacity_factor,
        fused_projections=fused_projections,
        max_seq_len=seq_len if exact_seq_len else None,
    )
    if seq_len is not None and seq_len > cfg.max_seq_len:
        cfg = replace(cfg, max_seq_len=seq_len)
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16/fp16 sums of squares lose too much), return the input dtype.
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x)
        return out * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """(seq_len, head_dim // 2, 2) fp32: cos and sin of position * frequency."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of `x` (B, T, H, D) by the angles of positions 0..T-1."""
    T = x.shape[1]
    cos, sin = tables[:T, :, 0][None, :, None, :], tables[:T, :, 1][None, :, None, :]
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.fused = cfg.fused_projections
        if self.fused:
            # Rows laid out (n_heads, 3, head_dim): a contiguous row chunk (ColwiseParallel's
            # Shard(0)) holds whole heads, each with its q, k and v, for any tp dividing n_heads.
            self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def in_weights(self) -> tuple[torch.Tensor, ...]:
        """The input projections' weights: (wqkv,) when fused, else (wq, wk, wv)."""
        return (self.wqkv.weight,) if self.fused else (self.wq.weight, self.wk.weight, self.wv.weight)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        if self.fused:
            q, k, v = self.wqkv(x).view(B, T, -1, 3, self.head_dim).unbind(3)
        else:
            q = self.wq(x).view(B, T, -1, self.head_dim)
            k = self.wk(x).view(B, T, -1, self.head_dim)
            v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fused = cfg.fused_projections
        if self.fused:
            # Rows interleaved (ffn_dim, 2): w1's row i, then w3's. A contiguous row chunk holds
            # the matching w1 and w3 rows of the same hidden features (those w2's RowwiseParallel
            # chunk of columns reads), for any tp dividing ffn_dim.
            self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        else:
            self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
            self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def in_weights(self) -> tuple[torch.Tensor, ...]:
        """The input projections' weights: (w13,) when fused, else (w1, w3)."""
        return (self.w13.weight,) if self.fused else (self.w1.weight, self.w3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.w13(x).unflatten(-1, (-1, 2)).unbind(-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg) if not cfg.n_experts else MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """tokens (B, T) int64 -> logits (B, T, vocab_size); with targets, the mean loss (`forward`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # An nn.Linear whose forward can also return the chunked loss (chunked_loss.py).
        self.output = LMHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from the config, never checkpointed, recomputed by init_weights.
        self.register_buffer("rope", rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and the rotary tables; works on sharded (DTensor)
        parameters too, so a model built on the meta device can be materialised after
        `fully_shard` with `model.to_empty(device=...)` and this."""
        cfg = self.cfg
        if self.rope.device.type != "meta" or buffer_device is not None:
            device = buffer_device if buffer_device is not None else self.rope.device
            self.rope = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
        # Untied: unit-variance embeddings (the first RMSNorm rescales anyway). Tied: the same
        # matrix is the head, so keep logits O(1) at init with std dim**-0.5.
        std = cfg.dim**-0.5 if cfg.tie_embeddings else 1.0
        init_random(self.tok_embeddings.weight, lambda w: nn.init.normal_(w, std=std))
        # Residual projections scaled down by depth (GPT-2 / Llama practice) so the residual
        # stream's variance does not grow with the number of layers.
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for block in self.layers:
            ff = block.feed_forward
            # Fused weights get the same elementwise distribution as the separate ones they stack.
            ins = (ff.experts.w1, ff.experts.w3, ff.router.weight) if cfg.n_experts else ff.in_weights()
            for weight in (*block.attention.in_weights(), *ins):
                init_random(weight, _trunc_normal(cfg.init_std))
            for weight in (block.attention.wo.weight, ff.experts.w2 if cfg.n_experts else ff.w2.weight):
                init_random(weight, _trunc_normal(out_std))
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not cfg.tie_embeddings:
            init_random(self.output.weight, _trunc_normal(cfg.dim**-0.5))

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, chunk_tokens: int | None = None
    ) -> torch.Tensor:
        """The logits (B, T, vocab_size) of `tokens` (B, T); with `targets` (B, T) instead the
        mean next-token cross entropy against them, computed by the head `chunk_tokens` tokens
        at a time, so that the logits of the whole batch never exist (chunked_loss.py): the
        value and gradients of `lm_loss(model(tokens), targets)`, up to fp32 rounding."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, self.rope)
        if targets is None:
            return self.output(self.norm(h))
        return self.output(self.norm(h), targets, chunk_tokens)


def _trunc_normal(std: float) -> Callable[[torch.Tensor], object]:
    """`nn.init.trunc_normal_` at `std`, cut at 3 standard deviations."""
    return lambda weight: nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std)


def init_random(weight: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
    """`init(weight)` (an in-place `nn.init` function), for a sharded weight whose shard lives on
    the host (CPU offload) through a twin on its mesh's accelerator. DTensor draws a random op's
    values inside an RNG region that forks the accelerator's generator and, on leaving, restores
    the host's as well (pytorch/pytorch#196562): host draws on such a weight would start from the
    same host state every time, so every layer would get the same values (and a rejection
    sampler such as trunc_normal_ could loop forever). On the twin the values are the ones the
    same weight gets without offload, whatever the world size."""
    mesh_device = weight.device_mesh.device_type if isinstance(weight, DTensor) else "cpu"
    if not isinstance(weight, DTensor) or weight.to_local().device.type != "cpu" or mesh_device == "cpu":
        init(weight)
        return
    local = torch.empty_like(weight.to_local(), device=mesh_device)
    twin = DTensor.from_local(
        local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
    )
    init(twin)
    weight.copy_(twin)


def fuse_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An unfused `Transformer(cfg)`'s state dict (full tensors) in the layout of
    `fused_projections=True`: every block's wq/wk/wv become one wqkv with rows (n_heads, 3,
    head_dim), and w1/w3 (unless MoE) one w13 with rows (ffn_dim, 2); the rest is kept. The
    fused model loading it computes what the unfused one does."""
    out = dict(state)
    for i in range(cfg.n_layers):
        attn, ff = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        qkv = [out.pop(f"{attn}{n}.weight").unflatten(0, (cfg.n_heads, cfg.head_dim)) for n in ("wq", "wk", "wv")]
        out[f"{attn}wqkv.weight"] = torch.stack(qkv, dim=1).flatten(0, 2)
        if not cfg.n_experts:
            w13 = (out.pop(f"{ff}w1.weight"), out.pop(f"{ff}w3.weight"))
            out[f"{ff}w13.weight"] = torch.stack(w13, dim=1).flatten(0, 1)
    return out


def count_parameters(model: nn.Module) -> int:
    """Parameters of the full (unsharded) model; tied weights counted once."""
    # .parameters() yields a tied parameter once; a DTensor's numel is its global size.
    return sum(p.numel() for p in model.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32: a plain 0-dim tensor. `logits` may be a
    DTensor sharded on the vocabulary (the tensor-parallel head, parallel.py): its loss is
    computed on each rank's shard without gathering the logits (vocab_parallel_loss.py)."""
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits, targets)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_chunk: int = 0) -> torch.Tensor:
    """The mean next-token loss of `model` (a `Transformer`, or a wrapper such as DDP that passes
    its forward's arguments on) on inputs `x` and targets `y`: `lm_loss` of its logits, or with
    `loss_chunk` > 0 the head's chunked loss, `loss_chunk` tokens at a time (`--loss-chunk`)."""
    if loss_chunk:
        return model(x, y, loss_chunk)
    return lm_loss(model(x), y)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (6N for the matmuls + attention scores), for MFU."""
    ffn = 3 * cfg.dim * cfg.ffn_dim * (cfg.top_k if cfg.n_experts else 1) + cfg.dim * cfg.n_experts  # active
    n_matmul = cfg.n_layers * (4 * cfg.dim * cfg.dim + ffn) + cfg.vocab_size * cfg.dim
    attn = cfg.n_layers * 12 * cfg.dim * seq_len / 2  # causal: half the score matrix
    return 6 * n_matmul + attn
