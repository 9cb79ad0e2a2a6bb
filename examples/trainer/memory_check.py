"""The main job's memory check before it builds anything: a deliberately low estimate of one
rank's training memory, refused at once (one line naming the flags) when it exceeds the GPU's
memory or the host's share per rank, rather than OOM-killed minutes later."""

from __future__ import annotations

import argparse
import os

from models.model import ModelConfig
from trainer.parallel import UsageError


def estimate_memory_bytes(args: argparse.Namespace, cfg: ModelConfig, seq_len: int, dp_size: int) -> int:
    """A deliberately low estimate of one rank's training memory: what autograd must keep per
    block, the logits (the compute dtype's, their fp32 copy and its gradient; one chunk's with
    `--loss-chunk`) and the fp32 parameters, gradients and AdamW moments (sharded over
    `dp_size` unless replicated).
    Low on purpose: it is used to refuse what cannot fit, never what might."""
    width = 4 if args.mp in (None, "fp32") else 2
    tokens = args.batch_size * seq_len
    # Per token, a Llama block keeps about 10 dim-wide tensors (norm in/out, q, k, v, rotated
    # q/k, attention out, residual) and 4 ffn-wide ones (w1, w3, silu, product).
    block = tokens * (10 * cfg.dim + 4 * cfg.ffn_dim) * width
    blocks = cfg.n_layers * tokens * cfg.dim * width + block if args.activation_checkpointing else cfg.n_layers * block
    # --loss-chunk: the head keeps one chunk's logits at a time.
    logit_rows = min(tokens, args.loss_chunk) if getattr(args, "loss_chunk", 0) else tokens
    logits = logit_rows * cfg.vocab_size * (width + 8)
    n_params = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * (
        4 * cfg.dim**2 + 3 * cfg.dim * cfg.ffn_dim
    )
    states = 16 * n_params // (1 if args.parallel == "replicate" else dp_size)
    return blocks + logits + states


def check_memory(
    args: argparse.Namespace, cfg: ModelConfig, seq_len: int, dp_size: int, available: int, where: str
) -> None:
    """Raise UsageError when the estimate exceeds `available` bytes (the GPU's memory, or the
    host's divided by the ranks on it): such a run would only be OOM-killed minutes later."""
    need = estimate_memory_bytes(args, cfg, seq_len, dp_size)
    if need > available:
        raise UsageError(
            f"--seq-len {seq_len} with --batch-size {args.batch_size} needs at least {need / 2**30:.1f} GiB per rank, "
            f"more than the {available / 2**30:.1f} GiB {where}; lower --seq-len or --batch-size"
            + ("" if args.activation_checkpointing else ", or add --ac full")
        )


def host_memory_bytes() -> int:
    """Physical memory of this host (0 if the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
