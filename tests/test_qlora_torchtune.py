"""torchtune's own QLoRA model builders under `fully_shard`, against PyTorch's FSDP2 as
torchtune's distributed recipe applies it (each transformer layer, then the root), bit for bit:
losses, adapter gradients and trained adapters over three AdamW steps on 2 gloo ranks, the
frozen NF4 shards byte for byte; and against one process on every rank's batch.

Skipped without torchtune. torchtune 0.6.1 imports `NF4Tensor` from `torchao.dtypes.nf4tensor`,
which torchao 0.18 moved to `torchao.quantization.quantize_.workflows.nf4.nf4_tensor`: the old
name is pointed at the new module here (the test's process only), so torchtune's builders run
with the torchao this project supports.
"""

from __future__ import annotations

import copy
import importlib
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors, run_on_ranks, step_and_match

from composable import fully_shard

pytest.importorskip("torchao", reason="QLoRA needs torchao's NF4Tensor: pip install torchao")
if "torchao.dtypes.nf4tensor" not in sys.modules:
    try:
        importlib.import_module("torchao.dtypes.nf4tensor")
    except ImportError:  # torchao >= 0.18: the module moved
        sys.modules["torchao.dtypes.nf4tensor"] = importlib.import_module(
            "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
        )
pytest.importorskip("torchtune", reason="torchtune's builders: pip install torchtune")

VOCAB, SEQ = 256, 16


def _build() -> nn.Module:
    """A small Llama 3.2 through torchtune's LoRA component builder with NF4 base weights
    (`quantize_base=True`, as its `qlora_llama3_2_*` builders), only the adapters trainable.
    NF4 quantizes in blocks of 64 values with scalers in blocks of 256: every weight's size is
    a multiple of 64 * 256."""
    from torchtune.models.llama3_2._component_builders import lora_llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(0)
    model = lora_llama3_2(
        lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
        apply_lora_to_mlp=True,
        apply_lora_to_output=False,
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=256,
        max_seq_len=SEQ,
        intermediate_dim=512,
        lora_rank=4,
        lora_alpha=8.0,
        quantize_base=True,
    )
    set_trainable_params(model, get_adapter_params(model))
    for name, param in model.named_parameters():  # LoRA's B starts at zero: nonzero so every adapter trains at once
        if name.endswith("lora_b.weight"):
            nn.init.normal_(param, std=0.02)
    return model


def _shard(model: nn.Module, api: str) -> nn.Module:
    if api == "fsdp2":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fully_shard
    for layer in [*model.layers, model]:
        shard(layer)
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(10 * step + rank))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _nf4_bytes(t: Any) -> dict[str, torch.Tensor]:
    names, _ = t.__tensor_flatten__()
    return {n: getattr(t, n) for n in names}


def _torchtune_qlora_vs_fsdp2(rank: int, world: int) -> None:
    import torch.distributed as dist

    single = _build()
    ours, theirs = _shard(copy.deepcopy(single), "composable"), _shard(copy.deepcopy(single), "fsdp2")
    nf4_type = type(single.layers[0].attn.q_proj.weight)
    assert nf4_type.__name__ == "NF4Tensor"
    models = (ours, theirs, single)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    for step in range(3):
        x, y = _batch(step, rank)
        losses = [_loss(m, x, y) for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        batches = [_batch(step, r) for r in range(world)]
        single_loss = _loss(single, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        mean = losses[0].detach().clone()
        dist.all_reduce(mean)
        assert_close_tensors(mean / world, single_loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step} single")
        single_loss.backward()
        step_and_match(ours, theirs, opts, f"step {step}", losses=(losses[0], losses[1]))
    trained = 0
    for (name, a), (_, b), (_, c) in zip(ours.named_parameters(), theirs.named_parameters(), single.named_parameters()):
        if a.requires_grad:
            trained += 1
            assert_close_tensors(a.full_tensor(), b.full_tensor(), exact=True, msg=name)
            # AdamW divides by the root of the squared gradient: an element whose gradient is near
            # zero amplifies the summation-order rounding of one process against two.
            assert_close_tensors(a.full_tensor(), c, rtol=1e-3, atol=5e-5, msg=f"{name} vs one process")
        elif type(a.to_local()) is nf4_type:  # frozen NF4 shards: FSDP2's bytes exactly
            for key, value in _nf4_bytes(a.to_local()).items():
                assert torch.equal(value, _nf4_bytes(b.to_local())[key]), f"{name}.{key}"
    assert trained == 2 * 7 * 2, trained  # A and B of q, k, v, output and the three MLP projections, 2 layers


def test_torchtune_qlora_builder_matches_fsdp2_and_one_process() -> None:
    run_on_ranks(_torchtune_qlora_vs_fsdp2, 2, timeout=300)
