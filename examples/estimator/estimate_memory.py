"""Per-rank peak memory of a training step, from an analytic model of the engine.

Sizes per rank, for `Setup` (estimate_setup.py); c = bytes of the compute (param) dtype:
- parameters, gradients: the local shards in the parameter's own dtype (fp32), rank 0's
  (the largest: dim 0 rounded up to a multiple of the shard count, the engine's padding);
  optimizer state: fp32 tensors of the same size (AdamW: 2). With CPU offload (`host`) all
  three live on the host and count 0 on the GPU; `compute-shard-on-device` also keeps the
  shards in the compute dtype on the GPU (c bytes); `optimizer-state` moves only the state
  to the host, and the optimizer step holds two buckets of it on the GPU (all of it under
  fully_shard without activation checkpointing: the main job copies it in during backward).
- buffers: unsharded parameters (c bytes) of the groups gathered at that moment, their
  unsharded gradients (c), gradient-reduction inputs (fp32), `replicate`'s persistent
  replica (c, only when c differs from the parameter dtype) and its buckets.
- activations, per token and block, what autograd saves in examples/models/model.py (checked
  against saved tensors on CPU by tests/test_estimate.py): each RMSNorm keeps its fp32
  input (4D) and its output (cD); the q/k/v and w1/w3 Linears share one input (cD each);
  SDPA keeps q, k, v, its output (which `wo` shares) and an fp32 logsumexp per head; SwiGLU
  keeps w1 x, w3 x, silu(w1 x) and the product (4cF). Rotary saves nothing large (its fp32
  multiplicands are the constant tables). With tensor parallelism (torchtitan's recipe) the
  head- and ffn-sharded tensors are divided by the TP size, and so are the norms' (they see
  the T/tp tokens of the sequence shard); the Linears' shared inputs are the all-gathered
  whole sequence (cD each, not divided), and the vocabulary-parallel head's fp32 outputs
  are divided by the TP size. With
  activation checkpointing a block keeps only its input (cD); its full set comes back
  during its own backward. Root: the final norm (4D + cD), the head's input (cD) and
  log_softmax's fp32 output (4V); backward starts with two more fp32 (B, T, V) tensors
  (the loss gradient and log_softmax's input gradient).

The peak is the largest of: the start of backward (the loss), backward through block i for
every i (activations of blocks < i, gradients of blocks > i), and the optimizer step, in a
steady-state step (optimizer state exists; gradients were set to None by zero_grad).
Assumed: fused AdamW (no per-step temporaries), FSDP2's one-group backward prefetch, the
root group (embeddings, final norm, head) gathered from forward to the end of backward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from estimator.estimate_setup import OPTIMIZER_STATES, Setup
from models.model import ModelConfig
from trainer.parallel import PARAMS_ON_HOST

FP32 = 4
REPLICATE_BUCKET_BYTES = 25 * 2**20  # replicate's default bucket_cap_mb
STATE_BUCKET_BYTES = 256 * 2**20  # offload_optimizer_state's default bucket_bytes (two on the GPU at a step)
BUCKETS_IN_FLIGHT = 2


def _shard(rows: int, cols: int, n: int) -> int:
    """Rank 0's elements of a (rows, cols) parameter sharded on dim 0 over n ranks (padded)."""
    return math.ceil(rows / n) * cols


def block_param_shapes(cfg: ModelConfig, tp: int = 1) -> list[tuple[int, int]]:
    """(rows, cols) of one block's parameters on one TP rank (dim 0 as the shard dim sees it)."""
    d, f = cfg.dim, cfg.ffn_dim
    col = [(d // tp, d)] * 3 + [(f // tp, d)] * 2  # wq wk wv, w1 w3: output features split
    row = [(d, d // tp), (d, f // tp)]  # wo, w2: input features split
    return col + row + [(d, 1)] * 2  # two RMSNorm weights, replicated over TP


def root_param_shapes(cfg: ModelConfig, tp: int = 1) -> list[tuple[int, int]]:
    """(rows, cols) of the embeddings, final norm and head on one TP rank: the recipe splits
    the embedding table and the head by vocabulary rows (rank 0's rounded-up share)."""
    v = math.ceil(cfg.vocab_size / tp)
    head = [] if cfg.tie_embeddings else [(v, cfg.dim)]
    return [(v, cfg.dim), (cfg.dim, 1)] + head


def n_params(cfg: ModelConfig) -> int:
    """Parameters of the full model (tied weights once)."""

    def count(shapes: list[tuple[int, int]]) -> int:
        return sum(r * c for r, c in shapes)

    return cfg.n_layers * count(block_param_shapes(cfg)) + count(root_param_shapes(cfg))


@dataclass(frozen=True)
class Sizes:
    """Elements per rank: sharded (held) and unsharded (gathered) per group."""

    block_local: int
    root_local: int
    block_unsharded: int
    root_unsharded: int

    @property
    def local(self) -> int:
        return self.block_local + self.root_local


def sizes(s: Setup) -> Sizes:
    n = s.shard_size
    blocks, root = block_param_shapes(s.cfg, s.tp), root_param_shapes(s.cfg, s.tp)
    return Sizes(
        block_local=s.cfg.n_layers * sum(_shard(r, c, n) for r, c in blocks),
        root_local=sum(_shard(r, c, n) for r, c in root),
        block_unsharded=sum(r * c for r, c in blocks),
        root_unsharded=sum(r * c for r, c in root),
    )


def activation_bytes_per_token(cfg: ModelConfig, c: int, tp: int = 1) -> dict[str, float]:
    """Bytes autograd keeps per token: `block` (one block, no checkpointing), `block_ckpt`
    (one checkpointed block), `root` (final norm, head input, log_softmax output),
    `loss_grads` (the extra fp32 tensors at the start of backward), `block_transient`
    (gradients alive inside one block's backward: the FFN's, the largest)."""
    d, f, h, v = cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.vocab_size
    norms = 2 * (FP32 * d + c * d) / tp  # sequence-parallel: T/tp tokens per rank
    shared_inputs = 2 * c * d  # attention and feed-forward input (all-gathered), each shared by its Linears
    split = (4 * c * d + FP32 * h + 4 * c * f) / tp  # q, k, v, attn out, logsumexp, SwiGLU
    return {
        "block": norms + shared_inputs + split,
        "block_ckpt": c * d / tp,  # the block's input: a sequence shard
        "root": (FP32 * d + c * d) / tp + c * d + FP32 * v / tp,  # final norm, head input, vocab-sharded log_softmax
        "loss_grads": 2 * FP32 * v / tp,
        "block_transient": (3 * c * f) / tp + 2 * c * d,
    }


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at the peak (`peak_at` says where), and what each category holds."""

    parameters: float
    gradients: float
    optimizer: float
    buffers: float
    activations: float
    peak_at: str
    held_parameters: float  # the sharded parameters, gradients and optimizer state in full
    held_gradients: float
    held_optimizer: float
    host: float  # CPU memory per rank with offload (parameters, gradients, optimizer state)

    @property
    def peak(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.activations

    def as_dict(self) -> dict[str, float | str]:
        return {**asdict(self), "peak": self.peak}


def estimate_memory(s: Setup) -> MemoryEstimate:
    """The largest of the candidate moments of a steady-state step (module docstring)."""
    z, cfg, L = sizes(s), s.cfg, s.cfg.n_layers
    c = s.param_dtype.itemsize
    tokens = s.batch_size * s.seq_len
    act = {k: v * tokens for k, v in activation_bytes_per_token(cfg, c, s.tp).items()}
    params = z.local * FP32
    grads_full = z.local * FP32
    opt = OPTIMIZER_STATES[s.optimizer] * z.local * FP32
    on_host = s.offload in PARAMS_ON_HOST
    gpu = 0.0 if on_host else 1.0  # the sharded parameters and gradients on the GPU
    opt_gpu = 0.0 if s.offload else 1.0
    # What the GPU holds of the state while it steps (optimizer-state: two buckets streamed through;
    # under fully_shard without activation checkpointing the main job copies all of it in during
    # backward, and it waits on the GPU for the step).
    prefetched = s.parallel != "replicate" and not s.activation_checkpointing
    stepping = (opt if prefetched else min(opt, 2 * STATE_BUCKET_BYTES)) if s.offload == "optimizer-state" else 0.0
    compute_copy = z.local * c if s.offload == "compute-shard-on-device" else 0.0
    per_block_grad = z.block_local * FP32 / L  # one block's sharded gradient
    saved = act["block_ckpt"] if s.activation_checkpointing else act["block"]
    ub, ur = z.block_unsharded * c, z.root_unsharded * c  # one gathered block / root

    candidates: list[tuple[str, float, float, float]] = []  # (where, grads, buffers, activations)
    if s.parallel == "replicate":
        replica = (z.block_unsharded * L + z.root_unsharded) * c if c != FP32 else 0.0
        buckets = BUCKETS_IN_FLIGHT * REPLICATE_BUCKET_BYTES
        candidates.append(("start of backward", 0.0, replica, L * saved + act["root"] + act["loss_grads"]))
        for i in reversed(range(L)):  # gradients of the head and of blocks > i are reduced (fp32)
            g = z.root_unsharded * FP32 + (L - 1 - i) * per_block_grad
            a = i * saved + act["block"] + act["block_transient"]
            candidates.append((f"backward of block {i}", g, replica + buckets + ub, a))
        candidates.append(("optimizer step", grads_full, replica + stepping, 0.0))
    else:
        keep = s.reshard_after_forward is False  # blocks stay gathered from forward to backward
        head = math.ceil(cfg.vocab_size / s.tp) * cfg.dim if not cfg.tie_embeddings else 0
        if s.wrap == "separate-ends":  # the head: its own group, gathered for its backward, reduced at once
            ur_start, ur, head_grad = (head + cfg.dim) * c, cfg.dim * c, 0.0
            head_sharded_grad = _shard(head // cfg.dim, cfg.dim, s.shard_size) * FP32 if head else 0
        else:  # the root group holds embeddings and head, gathered (and its gradients unreduced) to the end
            ur_start, head_grad, head_sharded_grad = ur, head * c, 0
        candidates.append(
            (
                "start of backward",
                0.0,
                ur_start + (L * ub if keep else 0.0),
                L * saved + act["root"] + act["loss_grads"],
            )
        )
        for i in reversed(range(L)):
            gathered = (i + 1) * ub if keep else ub * (2 if i > 0 else 1)  # block i + the prefetched i-1
            reducing = z.block_unsharded * FP32 if i < L - 1 else 0.0  # block i+1's reduce-scatter input
            buffers = ur + head_grad + gathered + ub + reducing  # ... + block i's unsharded gradients
            a = i * saved + act["block"] + act["block_transient"]
            g = ((L - 1 - i) * per_block_grad + head_sharded_grad) * gpu
            candidates.append((f"backward of block {i}", g, buffers, a))
        candidates.append(("optimizer step", grads_full * gpu, stepping, 0.0))
    where, g, b, a = max(candidates, key=lambda t: t[1] + t[2] + t[3])
    return MemoryEstimate(
        parameters=params * gpu + compute_copy,
        gradients=g,
        optimizer=opt * opt_gpu,
        buffers=float(b),
        activations=a,
        peak_at=where,
        held_parameters=params,
        held_gradients=grads_full,
        held_optimizer=opt,
        host=(params + grads_full + opt) if on_host else opt * (1 - opt_gpu),
    )
