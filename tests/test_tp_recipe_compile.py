"""Compiled blocks under the tensor-parallel recipe and fully_shard (dp 2 x tp 2, 4 gloo ranks):
each block is one graph, compiled once, with no graph break and no recompile over the steps
that follow, and the compiled run trains as the eager one."""

from __future__ import annotations

import copy

import torch
from _harness import run_on_ranks
from test_tp_recipe import BATCH_PER_DP, CFG, STEPS, _parallelize, _step, _tokens
from torch.distributed.device_mesh import init_device_mesh


def _compiled(rank: int, world: int) -> None:
    from model import Transformer
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    base = Transformer(CFG)
    eager = _parallelize(copy.deepcopy(base), mesh, "composable", bf16=False)
    compiled = _parallelize(copy.deepcopy(base), mesh, "composable", bf16=False)
    counter = CompileCounterWithBackend("aot_eager")
    for block in compiled.layers:
        block.compile(backend=counter)
    frames = []
    for step in range(STEPS):
        rows = _tokens(step)[dp * BATCH_PER_DP : (dp + 1) * BATCH_PER_DP]
        torch.testing.assert_close(_step(compiled, rows), _step(eager, rows), msg=f"step {step}")
        for model in (eager, compiled):
            for p in model.parameters():
                p.grad = None
        frames.append(counter.frame_count)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One graph per block, made at the first step, never again.
    assert frames == [CFG.n_layers] * STEPS, frames


def test_compiled_recipe_blocks_have_no_graph_break_and_no_recompile() -> None:
    run_on_ranks(_compiled, 4)
