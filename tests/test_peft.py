"""PEFT LoRA (frozen base weights, trainable adapters) under composable through accelerate's FSDP2
path (`use_composable_in_accelerate()`), step by step as with PyTorch FSDP2: losses, adapters, and base weights
that never move. CPU, gloo, 2 ranks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

import _hf  # noqa: E402
from _harness import run_on_ranks  # noqa: E402


def _lora_train(rank: int, world_size: int, composable: bool, steps: int) -> dict:
    from peft import LoraConfig, get_peft_model

    from composable import fully_shard

    with _hf.accelerate_path(rank, world_size, composable):
        accelerator = _hf.make_accelerator()
        base = _hf.tiny_llama(seed=11)
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        )
        model = get_peft_model(base, config)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        assert (fully_shard.state(model) is not None) == composable
        before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        losses = _hf.train_steps(model, accelerator, optimizer, rank, steps, max_norm=1.0)
        after = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
        return dict(losses=losses, before=before, after=after, frozen=frozen)


def test_lora_matches_fsdp2() -> None:
    ours = run_on_ranks(_lora_train, 2, True, 3, timeout=180)
    theirs = run_on_ranks(_lora_train, 2, False, 3, timeout=180)
    for rank in range(2):
        mine = ours[rank]
        assert mine["frozen"] == theirs[rank]["frozen"] and mine["frozen"]
        assert any("lora_" in n for n in mine["after"]) and not any("lora_" in n for n in mine["frozen"])
        torch.testing.assert_close(mine["losses"], theirs[rank]["losses"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mine["after"], theirs[rank]["after"], rtol=1e-6, atol=1e-7)
        for name in mine["after"]:  # the base stays frozen, the adapters train
            assert torch.equal(mine["after"][name], mine["before"][name]) == (name in mine["frozen"]), name
    assert ours[0]["losses"][0] != ours[0]["losses"][-1]
