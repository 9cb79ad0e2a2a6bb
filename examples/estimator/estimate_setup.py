"""What `estimate.py` estimates for: the model shape and the training setup, validated.

`Setup` is the single description the communication probe (estimate_comm.py), the memory
model (estimate_memory.py) and the timing model (estimate_time.py) all read; `UsageError` (the
main job's) carries a one-line message naming the flag and its value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from composable import MixedPrecisionPolicy
from models.model import ModelConfig
from trainer.parallel import PARAMS_ON_HOST, UsageError  # noqa: F401 (UsageError: this module's callers')

OFFLOADS = (*PARAMS_ON_HOST, "optimizer-state")  # --cpu-offload's values, as train.py's

PARALLEL = ("fsdp", "hsdp", "tp", "replicate")
MP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
WRAPS = ("blocks", "separate-ends")
OPTIMIZER_STATES = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}  # fp32 tensors per parameter


@dataclass(frozen=True)
class Setup:
    cfg: ModelConfig
    world_size: int
    parallel: str = "fsdp"
    hsdp_shard_size: int | None = None  # hsdp: ranks one replica is sharded over
    tp_size: int = 1  # tp: tensor-parallel ranks (the inner mesh dimension)
    reshard_after_forward: bool | None = None  # None: the engine's default (True for blocks)
    batch_size: int = 1  # local (per data-parallel rank)
    seq_len: int = 2048
    mp: str = "bf16"  # fp32 | bf16 (fp32 gradient reduction) | fp16 (fp32 reduction)
    activation_checkpointing: bool = False
    offload: str | None = None  # train.py's --cpu-offload value: host | compute-shard-on-device | optimizer-state
    optimizer: str = "adamw"
    wrap: str = "blocks"  # fully_shard groups: blocks + root, or also embeddings and head on their own

    def __post_init__(self) -> None:
        check(self)

    @property
    def shard_size(self) -> int:
        """Ranks a parameter is sharded over (1 for replicate)."""
        if self.parallel == "hsdp":
            return self.hsdp_shard_size or max(1, self.world_size // 2)
        if self.parallel == "tp":
            return self.world_size // self.tp_size
        return 1 if self.parallel == "replicate" else self.world_size

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size if self.parallel == "tp" else 1)

    @property
    def tp(self) -> int:
        return self.tp_size if self.parallel == "tp" else 1

    @property
    def param_dtype(self) -> torch.dtype:
        return MP[self.mp] or torch.float32

    def mp_policy(self) -> MixedPrecisionPolicy:
        # As train.py: low-precision compute, gradients reduced in fp32.
        dtype = MP[self.mp]
        return (
            MixedPrecisionPolicy()
            if dtype is None
            else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        )

    def describe(self) -> str:
        lay = {
            "fsdp": f"fsdp over {self.world_size}",
            "replicate": f"replicate over {self.world_size}",
            "hsdp": f"hsdp {self.world_size // self.shard_size} replicas x {self.shard_size} shards",
            "tp": f"tp {self.tp_size} x fsdp {self.dp_size}",
        }[self.parallel]
        extras = [f"--mp {self.mp}", f"local batch {self.batch_size} x seq {self.seq_len}", self.optimizer]
        if self.wrap != "blocks":
            extras.append(f"--wrap {self.wrap}")
        if self.reshard_after_forward is not None:
            extras.append(f"reshard_after_forward={self.reshard_after_forward}")
        extras += ["activation checkpointing"] * self.activation_checkpointing
        extras += [f"CPU offload ({self.offload})"] if self.offload else []
        return f"{lay}, " + ", ".join(extras)


def check(s: Setup) -> None:
    """Raise UsageError (flag and value named) for a setup the engine or the model cannot run."""
    positive = {
        "--world-size": s.world_size,
        "--batch-size": s.batch_size,
        "--seq-len": s.seq_len,
        "--tp-size": s.tp_size,
    }
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if s.parallel not in PARALLEL:
        raise UsageError(f"--parallel must be one of {', '.join(PARALLEL)}, got {s.parallel!r}")
    if s.mp not in MP:
        raise UsageError(f"--mp must be one of {', '.join(MP)}, got {s.mp!r}")
    if s.optimizer not in OPTIMIZER_STATES:
        raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {s.optimizer!r}")
    if s.wrap not in WRAPS:
        raise UsageError(f"--wrap must be one of {', '.join(WRAPS)}, got {s.wrap!r}")
    if s.parallel == "replicate" and s.wrap != "blocks":
        raise UsageError(f"--wrap {s.wrap} applies to fully_shard layouts, not --parallel replicate")
    if s.parallel == "hsdp" and s.world_size % s.shard_size:
        raise UsageError(f"--hsdp-shard-size {s.shard_size} does not divide --world-size {s.world_size}")
    if s.parallel == "tp":
        if s.world_size % s.tp_size:
            raise UsageError(f"--tp-size {s.tp_size} does not divide --world-size {s.world_size}")
        if s.cfg.n_heads % s.tp_size or s.cfg.ffn_dim % s.tp_size:
            raise UsageError(
                f"--tp-size {s.tp_size} must divide --n-heads {s.cfg.n_heads} and --ffn-dim {s.cfg.ffn_dim}"
            )
        if s.seq_len % s.tp_size:  # the recipe's sequence-parallel norms split the sequence evenly
            raise UsageError(f"--tp-size {s.tp_size} must divide --seq-len {s.seq_len}")
    elif s.tp_size != 1:
        raise UsageError(f"--tp-size {s.tp_size} needs --parallel tp, got --parallel {s.parallel}")
    if s.offload is not None and s.offload not in OFFLOADS:
        raise UsageError(f"--cpu-offload must be one of {', '.join(OFFLOADS)}, got {s.offload!r}")
    if s.parallel == "replicate" and (s.offload in PARAMS_ON_HOST or s.reshard_after_forward is not None):
        flag = "--cpu-offload" if s.offload in PARAMS_ON_HOST else "--reshard-after-forward"
        raise UsageError(f"{flag} applies to fully_shard layouts, not --parallel replicate")


def config_from_hf(name: str, seq_len: int) -> ModelConfig:
    """ModelConfig with the shapes of a HuggingFace Llama config (`transformers` needed; a local
    directory or a hub name). Grouped-query attention is not modelled: k/v count as full width."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise UsageError(f"--hf-model {name}: needs the transformers package (pip install transformers)") from None
    try:
        hf = AutoConfig.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - network, missing file, unknown model: one line
        raise UsageError(
            f"--hf-model {name}: cannot load its config ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None
    return ModelConfig(
        vocab_size=hf.vocab_size,
        dim=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        ffn_dim=hf.intermediate_size,
        max_seq_len=seq_len,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )
