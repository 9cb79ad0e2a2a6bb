"""HuggingFace safetensors straight into and out of composable's sharded parameters through
`torch.distributed.checkpoint`'s `HuggingFaceStorageWriter` / `HuggingFaceStorageReader`.

Saving: a model sharded on 2 ranks writes its shards and consolidates them into HF's layout
(`model-00001-of-00001.safetensors` + `model.safetensors.index.json`); the tensors equal those
that `save_pretrained` writes for the unsharded model and those PyTorch FSDP2 writes, and
`from_pretrained` loads the directory. Loading: a `save_pretrained` checkpoint (and the
consolidated one) read into a model sharded on 3 ranks (uneven shards) gives the shards FSDP2
gets, and the unsharded model's loss. CPU, gloo."""

from __future__ import annotations

import inspect
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import _hf  # noqa: E402
from _harness import run_on_ranks  # noqa: E402

from composable import fully_shard  # noqa: E402

# torch >= 2.10's spelling (`save_distributed`, `enable_consolidation`); earlier releases named
# the options differently and read through fsspec.
_writer = getattr(dcp, "HuggingFaceStorageWriter", None)
pytestmark = pytest.mark.skipif(
    _writer is None or "enable_consolidation" not in inspect.signature(_writer).parameters,
    reason="needs torch.distributed.checkpoint.HuggingFaceStorageWriter with enable_consolidation",
)


def _sharded_llama(seed: int, composable: bool) -> torch.nn.Module:
    """`tiny_llama(seed)` with each decoder layer and the root sharded, by composable or by FSDP2."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    shard = fully_shard if composable else fsdp2_fully_shard
    model = _hf.tiny_llama(seed)
    for layer in model.model.layers:
        shard(layer)
    shard(model)
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def _save(rank: int, world_size: int, path: str, composable: bool) -> None:
    model = _sharded_llama(seed=21, composable=composable)
    model.model.embed_tokens.weight.detach().to_local().add_(rank + 1)  # shards that differ from the seed's
    # every rank writes its own shards; the coordinator then consolidates them into HF's layout
    writer = dcp.HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=True)
    dcp.save(model.state_dict(), storage_writer=writer)
    if rank == 0:
        model.config.save_pretrained(path)


def _load(rank: int, world_size: int, path: str, composable: bool) -> dict:
    model = _sharded_llama(seed=99, composable=composable)  # other values: the checkpoint must replace them
    state = model.state_dict()
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
    model.load_state_dict(state)
    shards = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    return dict(params=_full(model), shards=shards, loss=_loss(model))


def _read(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files directly in `path` (not in subdirectories)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return tensors


def _loss(model: torch.nn.Module) -> torch.Tensor:
    tokens = _hf.batches(0, 1)[0]
    return model(input_ids=tokens, labels=tokens).loss.detach()


def _check_loaded(loaded: list[dict], fsdp2: list[dict], expected: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
    for rank, (ours, theirs) in enumerate(zip(loaded, fsdp2)):
        assert ours["params"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(ours["params"][name], value), name
            assert torch.equal(ours["shards"][name], theirs["shards"][name]), (rank, name)
        rows = ours["shards"]["model.layers.0.self_attn.k_proj.weight"].shape[0]
        assert rows == (6 if rank < 2 else 4), rows  # 16 rows on 3 ranks: uneven shards
        torch.testing.assert_close(ours["loss"], loss, rtol=1e-6, atol=1e-6)


def test_sharded_save_is_save_pretrained_and_loads_back() -> None:
    from transformers import LlamaForCausalLM

    unsharded = _hf.tiny_llama(21)
    with torch.no_grad():
        unsharded.model.embed_tokens.weight[:64] += 1  # rank 0's rows (of 128), as _save changes them
        unsharded.model.embed_tokens.weight[64:] += 2  # rank 1's
    with tempfile.TemporaryDirectory() as root:
        ours, theirs, reference = (os.path.join(root, d) for d in ("composable", "fsdp2", "save_pretrained"))
        run_on_ranks(_save, 2, ours, True)
        run_on_ranks(_save, 2, theirs, False)
        unsharded.save_pretrained(reference)
        assert os.path.isfile(os.path.join(ours, "model.safetensors.index.json"))
        written, expected = _read(ours), _read(reference)
        assert written.keys() == expected.keys() == _read(theirs).keys()
        for name, value in expected.items():
            assert torch.equal(written[name], value), name
            assert torch.equal(_read(theirs)[name], value), name
        pretrained = LlamaForCausalLM.from_pretrained(ours, attn_implementation="eager")
        for name, value in pretrained.named_parameters():
            assert torch.equal(value, expected[name]), name
        loss = _loss(pretrained)
        loaded = run_on_ranks(_load, 3, ours, True)
        fsdp2 = run_on_ranks(_load, 3, ours, False)
    _check_loaded(loaded, fsdp2, expected, loss)


def test_save_pretrained_checkpoint_loads_into_a_sharded_model() -> None:
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as path:
        _hf.save_tiny_llama(path, seed=4)
        expected = _read(path)
        loss = _loss(LlamaForCausalLM.from_pretrained(path, attn_implementation="eager"))
        loaded = run_on_ranks(_load, 3, path, True)
        fsdp2 = run_on_ranks(_load, 3, path, False)
    _check_loaded(loaded, fsdp2, expected, loss)
