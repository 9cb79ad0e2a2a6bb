"""`graphed_step` over a 2D step: the examples' tensor-parallel recipe (examples/trainer/parallel.py's
`apply_tensor_parallel`: sequence-parallel norms, vocabulary-parallel embedding and head, the
vocabulary-parallel loss) x `fully_shard` over dp, bf16 compute / fp32 reduction, fused
capturable AdamW. The whole step (forward with its tp all-gathers and reduce-scatters,
backward, dp reduce-scatters, optimizer) is captured once and replayed, and trains exactly as
the same step run eagerly: losses and every local shard bit for bit, with the blocks eager,
compiled (`block.compile()`, as the examples run them on GPUs), and compiled with async TP
(`--async-tp`: fused projections, inductor's micro-pipelined all-gather + matmul and matmul +
reduce-scatter over symmetric memory, whose fused ops the eager run is checked to call). On 2
GPUs (dp 1 x tp 2) and 4 (dp 2 x tp 2); skipped with fewer (`pytest -m gpu` selects them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _harness import async_tp_restored, gpu_worlds, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import composable  # noqa: E402
from models.model import ModelConfig, Transformer, lm_loss
from trainer.parallel import apply_tensor_parallel, enable_async_tp

CFG = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=16)
SEQ, BATCH, STEPS, WARMUP = 16, 4, 6, 2
TP = 2
BLOCKS = ("eager", "compiled", "async_tp")
# The ops async TP's pass puts in the compiled blocks: without them the run tested plain TP.
FUSED_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")


def _build(world: int, blocks: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cuda", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    if blocks == "async_tp":
        enable_async_tp(mesh["tp"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(dataclasses.replace(CFG, fused_projections=blocks == "async_tp"))
    if blocks != "eager":
        for block in model.layers:
            block.compile()
    apply_tensor_parallel(model, mesh["tp"])
    mp = composable.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (model.tok_embeddings, model.output, *model.layers, model):
        composable.fully_shard(module, mesh=mesh["dp"], mp_policy=mp)
    lr = torch.tensor(1e-2, device="cuda")
    return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)


def _called_ops(run: Any, tokens: torch.Tensor) -> set[str]:
    """The names of the operators one call of `run` records on the host."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(tokens)
    return {event.name for event in prof.events()}


def _train(rank: int, world: int, blocks: str) -> None:
    # A fresh compile: a harness worker that ran other tests holds Block.forward's earlier
    # compiles (made without async TP), which guards alone may let these blocks reuse; without
    # the reset the 4-GPU async-TP case ran no fused op after the 2-GPU cases had run.
    torch.compiler.reset()
    with async_tp_restored():
        _compare(rank, world, blocks)


def _compare(rank: int, world: int, blocks: str) -> None:
    dp_rank = rank // TP  # tp is the inner mesh dimension: a tp group reads the same rows
    results = {}
    for mode in ("eager", "graphed"):
        model, opt = _build(world, blocks)

        def step(tokens: torch.Tensor) -> torch.Tensor:
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        run = composable.graphed_step(step, warmup=WARMUP) if mode == "graphed" else step
        gen = torch.Generator(device="cuda").manual_seed(100 + dp_rank)
        batches = [
            torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), device="cuda", generator=gen) for _ in range(STEPS)
        ]
        losses = [run(tokens).item() for tokens in batches]
        if mode == "graphed":
            assert run.graph is not None, "the 2D step was never captured"
        shards = {n: p.to_local().float().cpu() for n, p in model.named_parameters()}
        results[mode] = (losses, shards)
        if mode == "eager" and blocks == "async_tp":  # one more step, after the compared ones
            called = _called_ops(run, batches[-1])
            missing = [op for op in FUSED_OPS if not any(op in name for name in called)]
            assert not missing, f"async TP's fused ops never ran: {missing}"
    (eager_losses, eager_shards), (graph_losses, graph_shards) = results["eager"], results["graphed"]
    assert eager_losses == graph_losses, f"losses eager {eager_losses} vs graphed {graph_losses}"
    for name, shard in eager_shards.items():
        assert torch.equal(shard, graph_shards[name]), f"{name}: the graphed step's shard differs after {STEPS} steps"


@pytest.mark.parametrize("blocks", BLOCKS, ids=[f"{b}_blocks" for b in BLOCKS])
@pytest.mark.parametrize("world", gpu_worlds(2, 4))
def test_gpu_graphed_2d_step_trains_like_eager(world: int, blocks: str) -> None:
    run_on_ranks(_train, world, blocks, backend="nccl", timeout=600)
