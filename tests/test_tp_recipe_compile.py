"""Compiled blocks under the tensor-parallel recipe and fully_shard (dp 2 x tp 2, 4 gloo ranks):
each block is one graph, compiled once, with no graph break and no recompile over the steps
that follow, and the compiled run trains as the eager one; with separate and with fused
projections.

The compiled graphs also show what async TP (inductor's micro-pipeline pass, CUDA only) can
fuse: a reduce-scatter whose input is one matmul. Every forward one (wo, w2) is. In the
backward, the gradient of each sequence-parallel all-gather's output is reduce-scattered: with
separate projections it is a sum of the q/k/v (w1/w3) input gradients, which the pass cannot
split; with fused ones (wqkv, w13) it is a single matmul."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from _harness import run_on_ranks
from test_tp_recipe import BATCH_PER_DP, CFG, FUSED_CFG, STEPS, _parallelize, _step, _tokens
from torch.distributed.device_mesh import init_device_mesh

# Ops that only move or re-view a tensor between a matmul and its reduce-scatter: the split on
# the sequence dim and its concatenation, and the views around a 2D matmul.
LAYOUT_OPS = ("aten.cat.", "aten.split.", "aten.view.", "aten._unsafe_view.", "aten.reshape.", "getitem")


def reduce_scatter_producers(graph: torch.fx.Graph) -> list[set[str]]:
    """For each reduce-scatter of `graph`, the ops that compute its input, looking through
    layout ops (LAYOUT_OPS): {"aten.mm.default"} when it is one matmul's output."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or "reduce_scatter" not in str(node.target):
            continue
        producers, todo = set(), [node.args[0]]
        while todo:
            x = todo.pop()
            if any(op in str(x.target) for op in LAYOUT_OPS):
                args = x.args[0] if isinstance(x.args[0], (list, tuple)) else x.args[:1]
                todo.extend(a for a in args if isinstance(a, torch.fx.Node))
            else:
                producers.add(str(x.target))
        out.append(producers)
    return out


def _compiled(rank: int, world: int, fused: bool) -> None:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from models.model import Transformer

    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    base = Transformer(FUSED_CFG if fused else CFG)
    eager = _parallelize(copy.deepcopy(base), mesh, "composable", bf16=False)
    compiled = _parallelize(copy.deepcopy(base), mesh, "composable", bf16=False)
    aot_graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}

    def keeper(kind: str) -> Callable[..., Any]:  # aot_eager, keeping the graphs AOTAutograd made
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            aot_graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    counter = CompileCounterWithBackend(aot_autograd(fw_compiler=keeper("forward"), bw_compiler=keeper("backward")))
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
    assert len(aot_graphs["backward"]) == CFG.n_layers, len(aot_graphs["backward"])
    for kind, graphs in aot_graphs.items():
        for i, gm in enumerate(graphs):
            producers = reduce_scatter_producers(gm.graph)
            assert len(producers) == 2, (kind, i, producers)  # one per sub-layer
            if fused or kind == "forward":
                assert all(p == {"aten.mm.default"} for p in producers), (kind, i, producers)
            else:  # the sum of the q/k/v or w1/w3 input gradients
                assert all("aten.add.Tensor" in p for p in producers), (kind, i, producers)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_compiled_recipe_blocks_have_no_graph_break_and_no_recompile(fused: bool) -> None:
    """Also: every reduce-scatter is one matmul's output, but for the backward ones of separate
    projections, which sum the input gradients of q, k, v or w1, w3."""
    run_on_ranks(_compiled, 4, fused)
