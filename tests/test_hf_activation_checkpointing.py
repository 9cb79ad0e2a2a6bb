"""accelerate's `activation_checkpointing=True` (its checkpoint wrapper around each decoder layer)
under `use_composable_in_accelerate()`, step by step as with PyTorch FSDP2: losses and parameters of a tiny
`LlamaForCausalLM` (`use_cache=False`: a KV cache grows again in the recomputed forward, with FSDP2
alike). CPU, gloo, 2 ranks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import _hf  # noqa: E402
from _harness import run_on_ranks  # noqa: E402


def _train(rank: int, world_size: int, composable: bool, steps: int) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from composable import fully_shard

    with _hf.accelerate_path(rank, world_size, composable):
        accelerator = _hf.make_accelerator(activation_checkpointing=True)
        model = _hf.tiny_llama(seed=1, use_cache=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        layers = model.model.layers
        assert all(isinstance(layer, CheckpointWrapper) for layer in layers), [type(m) for m in layers]
        assert all((fully_shard.state(layer) is not None) == composable for layer in layers)
        losses = _hf.train_steps(model, accelerator, optimizer, rank, steps, max_norm=1.0)
        params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        return dict(losses=losses, params=params)


def test_activation_checkpointing_matches_fsdp2() -> None:
    ours = run_on_ranks(_train, 2, True, 3, timeout=180)
    theirs = run_on_ranks(_train, 2, False, 3, timeout=180)
    for rank in range(2):
        torch.testing.assert_close(ours[rank]["losses"], theirs[rank]["losses"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours[rank]["params"], theirs[rank]["params"], rtol=1e-6, atol=1e-7)
    assert ours[0]["losses"][0] != ours[0]["losses"][-1]
