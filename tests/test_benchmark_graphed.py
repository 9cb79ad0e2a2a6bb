"""The benchmark's CUDA-graphed contenders (`--runs ..._graphed`): opt-in, refused where they
cannot be measured, reported against both floors (the table aligned for their long names),
and on a GPU trained like their eager contenders. Their timings: BENCHMARKS.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness import requires_gpus, smoke_argv
from test_benchmark_tools import _result  # the made-up run result the report reads

from benchmarks import bench_args, bench_build
from benchmarks import side_by_side as benchmark


def test_graphed_contenders_are_held_against_both_floors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: True)  # graphed runs parse only with CUDA
    steps = {"floor": [1.0, 1.2], "floor_graphed": [0.8, 0.9], "fully_shard_graphed": [0.9, 1.0], "fsdp2": [1.8, 2.0]}
    steps |= {"replicate_graphed": [0.85, 1.0], "ddp": [1.5, 1.5]}
    rounds = [{run: _result(run, steps[run][r], 5.0) for run in steps} for r in range(2)]
    out = tmp_path / "b.json"
    benchmark.report(rounds, benchmark.parse_args(["--runs", ",".join(steps), "--out", str(out)]), 1, "GPU")
    ratios = json.loads(out.read_text())["ratios"]
    assert ratios["fully_shard_graphed/floor_graphed"]["throughput"] == pytest.approx((0.8 / 0.9 + 0.9 / 1.0) / 2)
    assert ratios["fully_shard_graphed/floor"]["throughput"] == pytest.approx((1.0 / 0.9 + 1.2 / 1.0) / 2)
    assert ratios["fully_shard_graphed/fsdp2"]["throughput"] == pytest.approx(2.0)
    assert ratios["replicate_graphed/ddp"]["throughput"] == pytest.approx((1.5 / 0.85 + 1.5) / 2)
    assert ratios["replicate_graphed/floor_graphed"]["throughput"] == pytest.approx((0.8 / 0.85 + 0.9) / 2)
    assert ratios["floor_graphed/floor"]["throughput"] == pytest.approx((1.0 / 0.8 + 1.2 / 0.9) / 2)
    assert "fully_shard/fsdp2" not in ratios and "replicate/ddp" not in ratios  # only pairs that ran
    table = [line for line in capsys.readouterr().out.splitlines() if line.split(" ")[0] in [*steps, "run"]]
    assert len(table) == 7 and len({len(line) for line in table}) == 1, table  # columns aligned for the long names


def test_graphed_runs_are_opt_in_and_graph_all_but_the_last_warmup_step() -> None:
    assert benchmark.parse_args([]).runs.split(",") == list(bench_build.RUNS)
    runs = bench_build.RUNS + bench_build.GRAPHED_RUNS + bench_build.OFFLOAD_RUNS + bench_build.STATE_OFFLOAD_RUNS
    runs += bench_build.DEEPSPEED_RUNS
    assert bench_build.ALL_RUNS == runs
    # `--warmup 3`: 2 eager steps, the capture in the third, replays from the first timed step
    step = benchmark.make_step(None, None, True, 3)  # type: ignore[arg-type]  # nothing runs before a call
    assert type(step).__name__ == "GraphedStep" and step.warmup == 2 and step.graph is None
    assert type(benchmark.make_step(None, None, False, 3)).__name__ == "function"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cuda,argv,message",
    [
        (
            False,
            ["--runs", "floor,fully_shard_graphed"],
            "error: --runs: fully_shard_graphed needs a GPU (CUDA graphs), and torch.cuda.is_available() is False",
        ),
        (True, ["--runs", "replicate_graphed", "--float8"], "error: --runs: replicate_graphed with --float8 is not"),
        (True, ["--runs", "floor_graphed,fully_shard_graphed", "--warmup", "1"], "error: --warmup must be >= 2"),
        (True, ["--runs", "floor_graphed", "--warmup", "1"], "error: --warmup must be >= 2 with --runs floor_graphed"),
    ],
)
def test_graphed_runs_are_refused_where_they_cannot_be_measured(
    cuda: bool, argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(bench_args, "float8_available", lambda: True)  # refused for being graphed, not for torchao
    with pytest.raises(SystemExit):
        benchmark.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: True)
    benchmark.parse_args([a for a in argv if a not in ("--float8", "--warmup", "1")])  # the same runs parse with CUDA


def test_graphed_runs_build_their_eager_contender() -> None:
    with pytest.raises(ValueError, match=r"build: run must be one of .*'floor_graphed'.*got 'ddp_graphed'"):
        bench_build.build("ddp_graphed", None, torch.device("cpu"))  # type: ignore[arg-type]


def _smoke_graphed(rank: int, world_size: int) -> dict:
    """The graphed runs beside their eager ones on the GPU, one profiled (its replays)."""
    import torch

    runs = "floor,floor_graphed,fully_shard,fully_shard_graphed,replicate,replicate_graphed"
    argv = smoke_argv("--runs", runs, "--profile", "fully_shard_graphed", batch_size=2, steps=3, warmup=None)
    args = benchmark.parse_args(argv)
    rounds = benchmark.run_rounds(args, torch.device("cuda", rank))
    return {run: res["loss"] for run, res in rounds[0].items()}


@requires_gpus(1)
@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_graphed_runs_train_like_their_eager_ones_on_a_gpu() -> None:
    from _harness import run_on_ranks

    losses = run_on_ranks(_smoke_graphed, 1, backend="nccl", timeout=600)[0]
    for run in ("floor", "fully_shard", "replicate"):  # same model, data and steps: the same last loss
        assert losses[f"{run}_graphed"] == pytest.approx(losses[run], rel=2e-2), losses


def test_float8_graphed_floor_and_fully_shard_are_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their after-step scale precompute is captured (composable's in-place one)."""
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_args, "float8_available", lambda: True)
    args = benchmark.parse_args(["--float8", "--runs", "floor_graphed,fully_shard_graphed,fsdp2"])
    assert args.float8 and args.runs == "floor_graphed,fully_shard_graphed,fsdp2"
