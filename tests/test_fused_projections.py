"""examples/models/model.py's fused projections (`ModelConfig.fused_projections`): one `wqkv` and one
`w13` linear per block instead of wq/wk/wv and w1/w3, in one process.

- The fused model loading an unfused one's weights (`fuse_state_dict`) computes the same
  logits and the same gradients (laid out the fused way), MoE feed-forwards included.
- The row layouts split correctly by contiguous chunks (ColwiseParallel's `Shard(0)`) for
  every tp that divides the heads / the feed-forward width: chunk r holds rank r's heads with
  their q, k and v, and rank r's w1 rows with the matching w3 rows.
- init_weights draws the fused weights from the distribution of the separate ones.
- The tensor-parallel plans name the fused linears, which exist in the fused model.
The recipe on dp x tp meshes: tests/test_tp_recipe.py; compiled: tests/test_tp_recipe_compile.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.model import ModelConfig, Transformer, fuse_state_dict, lm_loss
from trainer.parallel import tp_block_plan, tp_plan

CFG = ModelConfig(vocab_size=64, dim=48, n_layers=2, n_heads=6, ffn_dim=60, max_seq_len=16)


def _fused(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, fused_projections=True)


def _loss_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, n_experts=2)], ids=["dense", "moe"])
def test_fused_model_computes_the_unfused_one(cfg: ModelConfig) -> None:
    torch.manual_seed(0)
    separate = Transformer(cfg)
    fused = Transformer(_fused(cfg))
    fused.load_state_dict(fuse_state_dict(separate.state_dict(), cfg))
    names = {name for name, _ in fused.named_parameters()}
    assert "layers.0.attention.wqkv.weight" in names and "layers.0.attention.wq.weight" not in names
    assert ("layers.0.feed_forward.w13.weight" in names) is not bool(cfg.n_experts)  # MoE keeps its experts
    tokens = torch.randint(0, cfg.vocab_size, (3, 13))
    loss, grads = _loss_and_grads(separate, tokens)
    fused_loss, fused_grads = _loss_and_grads(fused, tokens)
    # One matmul over the stacked rows sums each output in the same order as the separate ones:
    # fp32 rounding at most, from the kernels' blocking.
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=1e-6)
    expected = fuse_state_dict(grads, cfg)
    assert expected.keys() == fused_grads.keys()
    for name, g in fused_grads.items():
        torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_contiguous_row_chunks_hold_whole_heads_and_matching_rows() -> None:
    """What ColwiseParallel gives rank r of tp: the r-th contiguous chunk of the fused rows."""
    separate = Transformer(CFG)
    state = fuse_state_dict(separate.state_dict(), CFG)
    wqkv, w13 = state["layers.0.attention.wqkv.weight"], state["layers.0.feed_forward.w13.weight"]
    attn, ff = separate.layers[0].attention, separate.layers[0].feed_forward
    for tp in (1, 2, 3, 6):  # every divisor of n_heads (6), each also divides ffn_dim (60)
        for r, (qkv, gate_up) in enumerate(zip(wqkv.chunk(tp), w13.chunk(tp))):
            q, k, v = (w.weight.chunk(tp)[r] for w in (attn.wq, attn.wk, attn.wv))  # rank r's heads
            heads = qkv.view(-1, 3, CFG.head_dim, CFG.dim)  # (local heads, q/k/v, head_dim, dim)
            for i, w in enumerate((q, k, v)):
                assert torch.equal(heads[:, i].flatten(0, 1), w), (tp, r, "qkv"[i])
            rows = gate_up.view(-1, 2, CFG.dim)  # (local hidden features, w1/w3, dim)
            assert torch.equal(rows[:, 0], ff.w1.weight.chunk(tp)[r]), (tp, r, "w1")
            assert torch.equal(rows[:, 1], ff.w3.weight.chunk(tp)[r]), (tp, r, "w3")


def test_init_weights_draws_fused_weights_like_separate_ones() -> None:
    cfg = dataclasses.replace(CFG, dim=128, n_heads=4, ffn_dim=256)
    torch.manual_seed(0)
    fused = Transformer(_fused(cfg))
    block = fused.layers[0]
    for weight in (block.attention.wqkv.weight, block.feed_forward.w13.weight):
        assert abs(weight.std().item() - 0.987 * cfg.init_std) < 0.05 * cfg.init_std  # N(0, s) cut at 3s
        assert weight.abs().max().item() <= 3 * cfg.init_std
    separate = Transformer(cfg).layers[0].attention.wq.weight
    assert abs(separate.std().item() - block.attention.wqkv.weight.std().item()) < 0.05 * cfg.init_std


@pytest.mark.parametrize("plan", [tp_plan, tp_block_plan], ids=["textbook", "recipe"])
def test_tp_plans_name_the_fused_linears(plan) -> None:
    """Every key of the fused plan is a module of the fused block, and no separate one is left."""
    modules = dict(Transformer(_fused(CFG)).layers[0].named_modules())
    keys = set(plan(fused=True))
    assert keys <= modules.keys(), keys - modules.keys()
    assert {"attention.wqkv", "feed_forward.w13"} <= keys and "attention.wq" not in keys
