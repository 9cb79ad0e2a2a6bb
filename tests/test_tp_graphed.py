"""`graphed_step` over a 2D step: the examples' tensor-parallel recipe (examples/parallel.py's
`apply_tensor_parallel`: sequence-parallel norms, vocabulary-parallel embedding and head, the
loss under `loss_parallel`) x `fully_shard` over dp, bf16 compute / fp32 reduction, fused
capturable AdamW. The whole step (forward with its tp all-gathers and reduce-scatters,
backward, dp reduce-scatters, optimizer) is captured once and replayed, and trains exactly as
the same step run eagerly: losses and every local shard bit for bit, with the blocks eager and
compiled (`block.compile()`, as the examples run them on GPUs). On 2 GPUs (dp 1 x tp 2)
and 4 (dp 2 x tp 2); skipped with fewer (`pytest -m gpu` selects them).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from _harness import gpu_worlds, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from model import ModelConfig, Transformer, lm_loss  # noqa: E402
from parallel import apply_tensor_parallel  # noqa: E402

import composable  # noqa: E402

CFG = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=16)
SEQ, BATCH, STEPS, WARMUP = 16, 4, 6, 2
TP = 2


def _build(world: int, compiled: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cuda", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(CFG)
    if compiled:
        for block in model.layers:
            block.compile()
    apply_tensor_parallel(model, mesh["tp"])
    mp = composable.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (model.tok_embeddings, model.output, *model.layers, model):
        composable.fully_shard(module, mesh=mesh["dp"], mp_policy=mp)
    lr = torch.tensor(1e-2, device="cuda")
    return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)


def _train(rank: int, world: int, compiled: bool) -> None:
    dp_rank = rank // TP  # tp is the inner mesh dimension: a tp group reads the same rows
    results = {}
    for mode in ("eager", "graphed"):
        model, opt = _build(world, compiled)

        def step(tokens: torch.Tensor) -> torch.Tensor:
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        run = composable.graphed_step(step, warmup=WARMUP) if mode == "graphed" else step
        gen = torch.Generator(device="cuda").manual_seed(100 + dp_rank)
        losses = [
            run(torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), device="cuda", generator=gen)).item()
            for _ in range(STEPS)
        ]
        if mode == "graphed":
            assert run.graph is not None, "the 2D step was never captured"
        shards = {n: p.to_local().float().cpu() for n, p in model.named_parameters()}
        results[mode] = (losses, shards)
    (eager_losses, eager_shards), (graph_losses, graph_shards) = results["eager"], results["graphed"]
    assert eager_losses == graph_losses, f"losses eager {eager_losses} vs graphed {graph_losses}"
    for name, shard in eager_shards.items():
        assert torch.equal(shard, graph_shards[name]), f"{name}: the graphed step's shard differs after {STEPS} steps"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_blocks", "compiled_blocks"])
@pytest.mark.parametrize("world", gpu_worlds(2, 4))
def test_gpu_graphed_2d_step_trains_like_eager(world: int, compiled: bool) -> None:
    run_on_ranks(_train, world, compiled, backend="nccl", timeout=600)
