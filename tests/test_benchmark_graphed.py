"""The benchmark's CUDA-graphed contenders (`--runs ..._graphed`): refused where they cannot
run, reported against both floors. Their timing needs a GPU (BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import bench_build
import benchmark


def _result(run: str, step_s: float, peak: float) -> dict:
    return {
        "run": run,
        "step_s": step_s,
        "tok_s_gpu": 0.0,
        "mfu_per_tok_s": 1e-6,
        "peak_alloc_gib": peak,
        "peak_reserved_gib": peak + 1,
        "left_before_gib": 0.0,
        "loss": 1.0,
    }


def test_graphed_runs_are_opt_in() -> None:
    args = benchmark.parse_args([])
    assert args.runs.split(",") == list(bench_build.RUNS)
    assert not set(bench_build.GRAPHED_RUNS) & set(bench_build.RUNS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_a_graphed_run_without_a_gpu_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--runs", "floor,fully_shard_graphed"])
    err = capsys.readouterr().err
    assert "--runs: fully_shard_graphed needs a GPU (CUDA graphs), and torch.cuda.is_available() is False" in err


def test_a_graphed_run_with_float8_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(benchmark, "float8_available", lambda: True)
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--runs", "replicate_graphed", "--float8"])
    assert "--runs: replicate_graphed with --float8 is not supported" in capsys.readouterr().err


def test_graphed_runs_build_their_eager_contender() -> None:
    with pytest.raises(ValueError, match=r"build: run must be one of .*'floor_graphed'.*got 'ddp_graphed'"):
        bench_build.build("ddp_graphed", None, torch.device("cpu"))  # type: ignore[arg-type]


def test_graphed_contenders_are_reported_against_both_floors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    steps = {
        "floor": [1.0, 1.2],
        "floor_graphed": [0.8, 0.9],
        "fully_shard_graphed": [0.9, 1.0],
        "fsdp2": [1.8, 2.0],
        "replicate_graphed": [0.85, 1.0],
        "ddp": [1.5, 1.5],
    }
    rounds = [{run: _result(run, steps[run][r], 5.0) for run in steps} for r in range(2)]
    out = tmp_path / "b.json"
    args = benchmark.parse_args(["--runs", ",".join(steps), "--rounds", "2", "--out", str(out)])
    benchmark.report(rounds, args, 1, "GPU")
    ratios = json.loads(out.read_text())["ratios"]
    assert ratios["fully_shard_graphed/floor_graphed"]["throughput"] == pytest.approx((0.8 / 0.9 + 0.9 / 1.0) / 2)
    assert ratios["fully_shard_graphed/floor"]["throughput"] == pytest.approx((1.0 / 0.9 + 1.2 / 1.0) / 2)
    assert ratios["fully_shard_graphed/fsdp2"]["throughput"] == pytest.approx(2.0)
    assert ratios["replicate_graphed/ddp"]["throughput"] == pytest.approx((1.5 / 0.85 + 1.5) / 2)
    assert ratios["floor_graphed/floor"]["throughput"] == pytest.approx((1.0 / 0.8 + 1.2 / 0.9) / 2)
    assert "fully_shard/fsdp2" not in ratios
