"""Shared helpers of the HuggingFace tests (transformers, accelerate, peft): a tiny Llama, the
launcher's environment for accelerate inside harness ranks, accelerate's shared state reset."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
SEQ = 16


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised `LlamaForCausalLM` (hidden 32, 2 layers, vocab 128), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    config._attn_implementation = "eager"  # the same kernels on every rank and in every run
    return LlamaForCausalLM(config)


def save_tiny_llama(path: str, seed: int = 0, **overrides: Any) -> str:
    """`save_pretrained` of `tiny_llama(seed)` (safetensors) into `path`; returns `path`."""
    tiny_llama(seed, **overrides).save_pretrained(path)
    return path


def accelerate_env(rank: int, world_size: int) -> None:
    """The launcher's variables accelerate and Trainer read; the harness already made the group."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def reset_accelerate() -> None:
    """Forget accelerate's process-wide singletons and FSDP environment (harness workers persist)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        del os.environ[key]


def cpu_peak_bytes(prof: Any) -> int:
    """Peak growth of CPU tensor memory (bytes allocated minus freed, running maximum) over a
    `torch.profiler.profile(profile_memory=True)` window."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def make_accelerator(**plugin_options: Any) -> Any:
    """An `Accelerator` on accelerate's FSDP2 path on CPU (gloo), Llama decoder layers as wrap units."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
        **plugin_options,
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    force_fsdp_on_cpu(accelerator, plugin)
    return accelerator


def force_fsdp_on_cpu(accelerator: Any, plugin: Any) -> None:
    """accelerate takes its FSDP path only with accelerators (MULTI_CPU is not FSDP-capable in its
    eyes); everything on that path works on CPU with gloo, so force it in both shared states."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2, "accelerate did not take its FSDP2 path"


def batches(rank: int, steps: int, batch: int = 2, vocab: int = 128) -> list:
    """`steps` batches of token ids (this rank's share), the same in every run."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(vocab, (batch, SEQ), generator=gen) for _ in range(steps)]


@contextlib.contextmanager
def accelerate_path(rank: int, world_size: int, composable: bool) -> Iterator[None]:
    """Inside a harness rank: the launcher's variables set, accelerate's FSDP2 path taken by
    composable (`use_composable_in_accelerate()`) or by PyTorch FSDP2, and afterwards FSDP2 restored and
    accelerate's process-wide state reset (harness workers serve later tests)."""
    from composable.integrations import accelerate as integration

    accelerate_env(rank, world_size)
    if composable:
        integration.use_composable_in_accelerate()
    try:
        yield
    finally:
        integration.use_fsdp2()
        reset_accelerate()


def train_steps(
    model: Any, accelerator: Any, optimizer: Any, rank: int, steps: int, max_norm: float | None = None
) -> list[torch.Tensor]:
    """accelerate's loop over `batches(rank, steps)` (clipping to `max_norm` where given); the losses."""
    losses = []
    for tokens in batches(rank, steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        if max_norm is not None:
            accelerator.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return losses
