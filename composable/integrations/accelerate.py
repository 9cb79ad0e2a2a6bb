"""HF accelerate's FSDP2 path (and so HF Trainer's) sharding with composable's `fully_shard`.

With `FullyShardedDataParallelPlugin(fsdp_version=2)` (or Trainer's `fsdp_config={"version": 2}`),
`Accelerator.prepare` hands the model to `accelerate.utils.fsdp_utils.fsdp2_prepare_model`, which
applies PyTorch FSDP2's `fully_shard` to the plugin's wrap units (auto-wrap policy, embeddings, the
tail `[final norm, lm_head]`, the root). `use_composable_in_accelerate()` makes that step shard with composable
instead and leaves every other line of accelerate as it is: the plugin's options
(`reshard_after_forward`, `mixed_precision_policy`, `cpu_offload`, `ignored_modules`, the
device mesh) are translated to composable's, the optimizer is re-pointed at the new parameters
by accelerate itself, and `accelerator.no_sync` / `accumulate`, `clip_grad_norm_`, `save_state`
and `get_state_dict` work on the result. `cpu_ram_efficient_loading` runs accelerate's own
broadcast of rank 0's weights into the shards, and `activation_checkpointing` its own wrapper. accelerate's own code calls FSDP2's module methods
(`model.set_requires_gradient_sync(False)` for gradient accumulation) and checks
`isinstance(m, FSDPModule)`, so each module composable shards is given FSDP2's module interface
(`composable.integrations.fsdp2_module`: an opt-in class swap; the core never swaps classes).

    from composable.integrations.accelerate import use_composable_in_accelerate
    use_composable_in_accelerate()        # before accelerator.prepare(...) / Trainer(...).train()

The patch point is the one name `Accelerator._prepare_fsdp2` calls,
`accelerate.accelerator.fsdp2_prepare_model`, wrapped (accelerate's function still runs) while
PyTorch's `torch.distributed.fsdp.fully_shard`, which that function imports when it runs, is
composable's for the duration of the call. If a future accelerate stops going through those
names, `prepare` raises instead of silently training with FSDP2. `use_fsdp2()` undoes it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from composable import fully_shard

from .fsdp2_module import fsdp2_fully_shard

__all__ = ["use_composable_in_accelerate", "use_fsdp2", "fsdp2_prepare_model"]

_original: Any = None  # accelerate's fsdp2_prepare_model, while ours is installed


@contextlib.contextmanager
def _fsdp2_fully_shard_is_composable(*namespaces: Any) -> Iterator[None]:
    """Within the block, `fully_shard` as looked up in each namespace is composable's."""
    saved = [(ns, ns.__dict__["fully_shard"]) for ns in namespaces if "fully_shard" in ns.__dict__]
    try:
        for ns, _ in saved:
            ns.fully_shard = fsdp2_fully_shard
        yield
    finally:
        for ns, value in saved:
            ns.fully_shard = value


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule


def fsdp2_prepare_model(accelerator: Any, model: nn.Module) -> nn.Module:
    """accelerate's `fsdp2_prepare_model`, sharding with composable; same arguments and result."""
    import torch.distributed.fsdp as torch_fsdp
    from accelerate.utils import fsdp_utils

    prepare = _original if _original is not None else fsdp_utils.fsdp2_prepare_model
    with _fsdp2_fully_shard_is_composable(torch_fsdp, fsdp_utils):
        model = prepare(accelerator, model)
    if fully_shard.state(_unwrap(model)) is None:
        raise RuntimeError(
            "composable.integrations.accelerate: accelerate prepared the model without composable's fully_shard "
            "(its FSDP2 code no longer looks up torch.distributed.fsdp.fully_shard when it runs); "
            "this accelerate version is not supported"
        )
    return model


def use_composable_in_accelerate() -> None:
    """From now on, accelerate's FSDP2 path (`fsdp_version=2`) shards with composable. Idempotent."""
    global _original
    accelerator_module = importlib.import_module("accelerate.accelerator")
    if _original is None:
        _original = accelerator_module.fsdp2_prepare_model
    setattr(accelerator_module, "fsdp2_prepare_model", fsdp2_prepare_model)


def use_fsdp2() -> None:
    """Undo `use_composable_in_accelerate()`: accelerate's FSDP2 path uses PyTorch FSDP2 again."""
    global _original
    if _original is not None:
        setattr(importlib.import_module("accelerate.accelerator"), "fsdp2_prepare_model", _original)
        _original = None
