"""examples/models/moe.py at fixed capacity (`ModelConfig.moe_capacity_factor`): each rank sends each
expert at most `expert_capacity` of its routed rows, in token order, and the rest are dropped.

One process: the slots are placed and dropped as promised; a capacity no expert reaches computes
what the dropless layer computes, bit for bit; a small one computes the dropless layer with the
dropped rows' gates set to zero. Expert parallelism on 2 and 4 gloo ranks: each rank's outputs
and router gradients are those of the unsplit layer on that rank's tokens, the local experts'
gradients the ranks' mean of the unsplit layer's; the forward issues two all-to-alls (the rows
out and back, equal splits) and no exchange of counts, so nothing is read on the host.

The main job's `--moe-capacity-factor`: refused without `--moe` or at a value not above 0, one
line; trains on 2 gloo ranks; `--cuda-graph auto` graphs the expert-parallel step (dropless
expert parallelism stays eager); on GPUs `--cuda-graph on` captures and trains.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import count_collectives, gpu_worlds, run_on_ranks
from test_moe_train import SMALL as MOE_SMALL
from test_moe_train import _args as moe_args
from test_train_example import SMALL, _losses, _run
from torch.distributed.device_mesh import init_device_mesh

from models import moe
from models.model import get_config
from trainer import main_job as train_script
from trainer.options import cuda_graph_mode, parse_args

CFG = get_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=48, n_experts=4)


def _layer(factor: float, seed: int = 0) -> moe.MoEFeedForward:
    torch.manual_seed(seed)
    layer = moe.MoEFeedForward(replace(CFG, moe_capacity_factor=factor))
    for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
        torch.nn.init.normal_(w, std=0.1)
    return layer


def test_slots_keep_rows_in_token_order_up_to_the_capacity() -> None:
    ids = torch.tensor([0, 1, 0, 0, 2, 1, 0])
    # Capacity 2 of 3 experts: expert 0's third and fourth rows are dropped (slot 6, past the end).
    assert moe.capacity_slots(ids, 3, 2).tolist() == [0, 2, 1, 6, 4, 3, 6]
    assert moe.expert_capacity(routed_rows=16, n_experts=4, factor=1.25) == 5
    assert moe.expert_capacity(routed_rows=1, n_experts=8, factor=1.0) == 1


def test_a_capacity_no_expert_reaches_computes_the_dropless_layer() -> None:
    x = torch.randn(2, 8, CFG.dim)
    outs = [_layer(factor)(x) for factor in (0.0, float(CFG.n_experts))]  # capacity = every routed row
    assert torch.equal(outs[0], outs[1])


def test_a_small_capacity_drops_rows_as_zero_gates() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 8, CFG.dim)
    capped, dropless = _layer(0.5), _layer(0.0)
    tokens = x.reshape(-1, CFG.dim)
    scores = dropless.router(tokens).float().softmax(-1)
    top, experts = scores.topk(CFG.top_k, dim=-1)
    capacity = moe.expert_capacity(experts.numel(), CFG.n_experts, 0.5)
    kept = (moe.capacity_slots(experts.flatten(), CFG.n_experts, capacity) < CFG.n_experts * capacity).view_as(top)
    assert 0 < kept.sum() < kept.numel(), "the capacity drops some rows, not all"
    expected = dropless.experts(tokens, top / top.sum(-1, keepdim=True) * kept, experts).view_as(x)
    torch.testing.assert_close(capped(x), expected, rtol=0, atol=0)


def _expert_parallel(rank: int, world: int, factor: float) -> None:
    ref = _layer(factor)
    ep = copy.deepcopy(ref)
    ep.experts.split(init_device_mesh("cpu", (world,)))
    torch.manual_seed(100 + rank)
    x = torch.randn(2, 8, CFG.dim)
    with count_collectives() as comm:
        out = ep(x)
    # The rows out and back: two all-to-alls of equal splits, no exchange of counts to read.
    assert comm.counts["all_to_all"] == 2 and comm.total == 2, comm.events
    expected = ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(ep.router.weight.grad, ref.router.weight.grad, rtol=1e-5, atol=1e-6)
    local = slice(rank * CFG.n_experts // world, (rank + 1) * CFG.n_experts // world)
    for name in ("w1", "w3", "w2"):
        mean = getattr(ref.experts, name).grad.clone()
        dist.all_reduce(mean)
        got = getattr(ep.experts, name).grad.to_local()
        torch.testing.assert_close(got, (mean / world)[local], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("factor", [0.5, 1.25])
def test_expert_parallel_at_fixed_capacity_is_the_layer_on_each_ranks_tokens(world: int, factor: float) -> None:
    run_on_ranks(_expert_parallel, world, factor)


def test_a_negative_capacity_or_one_without_experts_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"^ModelConfig: moe_capacity_factor -1.0 must be 0, or > 0 with n_experts > 0$"
    ):
        get_config("tiny", n_experts=4, moe_capacity_factor=-1.0)
    with pytest.raises(ValueError, match="moe_capacity_factor 1.0 must be"):
        get_config("tiny", moe_capacity_factor=1.0)


# ----------------------------------------------------------------------------- the main job's flag


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--moe-capacity-factor", "1.25"], "--moe-capacity-factor 1.25 needs --moe"),
        (["--moe", "--moe-capacity-factor", "0"], "--moe-capacity-factor must be a finite number > 0, got 0.0"),
        (["--moe", "--moe-capacity-factor", "nan"], "--moe-capacity-factor must be a finite number > 0, got nan"),
    ],
)
def test_the_flag_is_refused_with_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit):
        parse_args([*SMALL, *flags, "--out", str(tmp_path)])
    assert capsys.readouterr().err == f"train.py: error: {message}\n"


def test_the_main_job_trains_at_fixed_capacity(tmp_path: Path) -> None:
    result = _run([*SMALL, "--moe", "--moe-capacity-factor", "1.25", "--steps", "3", "--out", str(tmp_path)])
    losses = _losses(result)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses


def test_auto_graphs_the_expert_parallel_step_at_fixed_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixed capacity makes the all-to-all's splits known without the host: the step is one
    graph under `auto`; dropless expert parallelism reads its splits on the host and stays eager."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    capped = "moe_capacity_factor=1.25"
    assert cuda_graph_mode(moe_args("4", capped), "cuda") == (True, "auto")
    assert cuda_graph_mode(moe_args("4", capped, "cuda_graph=on"), "cuda") == (True, "--cuda-graph on")
    assert cuda_graph_mode(moe_args("1", capped), "cuda") == (True, "auto")  # no expert parallelism
    assert cuda_graph_mode(moe_args("4"), "cuda")[0] is False


def _graphed_on_gpus(rank: int, world: int, out: str) -> dict:
    torch.cuda.set_device(rank)
    flags = [*MOE_SMALL, "--moe-capacity-factor", "1.25", "--cuda-graph", "on"]
    with contextlib.redirect_stdout(io.StringIO()):
        result = train_script.train(parse_args([*flags, "--steps", "6", "--out", out]))
    assert result["cuda_graph"] is True, result["cuda_graph"]
    losses = [h["loss"] for h in result["history"]]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    return result


@pytest.mark.parametrize("world", gpu_worlds(2, 4))
def test_gpu_expert_parallel_step_at_fixed_capacity_is_captured(world: int, tmp_path: Path) -> None:
    """Compiled blocks, bf16, expert parallelism over every GPU, the whole step one CUDA graph."""
    run_on_ranks(_graphed_on_gpus, world, str(tmp_path), backend="nccl", timeout=600, fresh=True)


def test_the_benchmark_takes_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import side_by_side as benchmark

    args = benchmark.parse_args(["--moe", "--moe-capacity-factor", "1.25", "--preset", "tiny"])
    assert benchmark.model_config(args).moe_capacity_factor == 1.25
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--moe-capacity-factor", "1.25"])
    assert "--moe-capacity-factor 1.25 needs --moe and a value > 0" in capsys.readouterr().err
