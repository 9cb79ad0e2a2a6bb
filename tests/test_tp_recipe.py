"""The tensor-parallel recipe of the examples (examples/trainer/parallel.py's `apply_tensor_parallel`:
sequence-parallel norms, embeddings to sequence shards, head to vocabulary shards with the loss
computed shard by shard) x fully_shard over dp, on a 2 x 2 (dp, tp) mesh of 4 gloo ranks; with
fused projections (one wqkv and one w13 linear per block) also on 1 x 4, where each rank holds
one head and a quarter of the feed-forward.

- Against a single-process model trained on both dp ranks' rows: losses, every gradient (the
  sequence-parallel norms' included: replicated over tp, their `Partial` gradients are
  all-reduced over tp before the dp reduce-scatter) and the parameters over several AdamW
  steps, to fp32 rounding.
- Against PyTorch FSDP2 with the same plan, mesh, data and policy: losses, gradients and
  parameters bit for bit, in fp32 and with bf16 compute (the jobs' `--mp bf16`).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from _harness import assert_close_tensors, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import composable  # noqa: E402
from models.model import ModelConfig, Transformer, lm_loss
from trainer.parallel import apply_tensor_parallel

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)
FUSED_CFG = dataclasses.replace(CFG, fused_projections=True)
SEQ = 8  # split 4 + 4 over tp (2 x 4 over tp 4)
BATCH_PER_DP = 2
STEPS = 3
LR = 1e-2
# fp32 on CPU: TP sums partial products in another order than the single process.
TOL = dict(rtol=1e-5, atol=1e-6)
# Adam moves each weight by lr * m / (sqrt(v) + eps): with the default eps (1e-8) a gradient
# near 0 becomes a whole step of either sign, which turns the rounding above into differences of
# lr. An eps above the smallest gradients keeps the update a smooth function of them.
EPS = 1e-4


def _parallelize(model: Transformer, mesh: DeviceMesh, api: str, bf16: bool) -> Transformer:
    """The recipe on mesh["tp"], then `api`'s fully_shard over mesh["dp"] as train.py groups it."""
    if api == "composable":
        shard, policy = composable.fully_shard, composable.MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        shard, policy = fully_shard, MixedPrecisionPolicy
    mp = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else policy()
    apply_tensor_parallel(model, mesh["tp"])
    for module in (model.tok_embeddings, model.output, *model.layers, model):
        shard(module, mesh=mesh["dp"], mp_policy=mp)
    return model


def _tokens(step: int, dp_size: int = 2) -> torch.Tensor:
    """Every dp rank's rows; each rank of a tp group reads the same ones."""
    size = (dp_size * BATCH_PER_DP, SEQ + 1)
    return torch.randint(0, CFG.vocab_size, size, generator=torch.Generator().manual_seed(step))


def _step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    assert type(loss) is torch.Tensor and loss.dim() == 0  # a plain scalar, whatever the head's logits
    loss.backward()
    return loss.detach()


def _grads(model: nn.Module) -> dict[str, DTensor]:
    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), f"{name}: {type(p.grad).__name__}"
        assert p.grad.placements == p.placements and p.grad.device_mesh == p.device_mesh, (name, p.grad.placements)
        out[name] = p.grad
    return out


def _recipe(rank: int, world: int, bf16: bool, cfg: ModelConfig = CFG, tp: int = 2) -> None:
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    ref = Transformer(cfg)  # the same seed on every rank: the same initial weights
    ours = _parallelize(copy.deepcopy(ref), mesh, "composable", bf16)
    theirs = _parallelize(copy.deepcopy(ref), mesh, "fsdp2", bf16)
    norm = dict(ours.named_parameters())["layers.0.attention_norm.weight"]
    assert norm.device_mesh.mesh_dim_names == ("dp", "tp") and norm.placements == (Shard(0), Replicate())
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS) for m in (ours, theirs, ref)]
    for step in range(STEPS):
        tokens = _tokens(step, world // tp)
        rows = tokens[dp * BATCH_PER_DP : (dp + 1) * BATCH_PER_DP]
        loss, their_loss = _step(ours, rows), _step(theirs, rows)
        assert torch.equal(loss, their_loss), f"step {step}: loss {loss} vs FSDP2's {their_loss}"
        grads, their_grads = _grads(ours), _grads(theirs)
        for name, g in grads.items():
            assert torch.equal(g.to_local(), their_grads[name].to_local()), f"step {step}: grad of {name} vs FSDP2's"
        if not bf16:
            ref_loss = _step(ref, tokens)
            mean = loss.clone()
            dist.all_reduce(mean)  # each dp rank's mean tp times (its tp ranks): / world is the mean of all
            assert_close_tensors(mean / world, ref_loss, **TOL, msg=f"step {step}: loss")
            for name, r in ref.named_parameters():  # norms first among what could go wrong
                assert_close_tensors(grads[name], r.grad, **TOL, msg=f"step {step}: grad of {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), f"step {step}: {name} vs FSDP2's"
        if not bf16:
            for (name, p), r in zip(ours.named_parameters(), ref.parameters()):
                assert_close_tensors(p, r, **TOL, msg=f"step {step}: {name}")


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_recipe_matches_single_process_and_fsdp2(bf16: bool) -> None:
    run_on_ranks(_recipe, 4, bf16, timeout=300)


@pytest.mark.parametrize("tp", [2, 4], ids=["dp2xtp2", "dp1xtp4"])
def test_fused_projections_recipe_matches_single_process_and_fsdp2(tp: int) -> None:
    """wqkv / w13 split over tp by contiguous rows (ColwiseParallel) against the same fused
    model in one process (itself the unfused model's computation: test_fused_projections.py)."""
    run_on_ranks(_recipe, 4, False, FUSED_CFG, tp, timeout=300)
