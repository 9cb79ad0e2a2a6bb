"""The benchmark's DeepSpeed ZeRO-Offload contender (`--runs deepspeed_offload`,
examples/benchmarks/bench_deepspeed.py): refused in one line where deepspeed is missing or the
flags do not compose (these tests need no deepspeed), configured as ZeRO-Offload users run it
(ZeRO-3, the optimizer on the host, bf16) with the benchmark's clipping and batch, reported against
composable's offload runs; and, where deepspeed is installed, trained on the CPU (gloo) from
the same initial loss as the other contenders, its loss falling as data-parallel training's does,
its `DeepSpeedCPUAdam` with the other contenders' AdamW hyperparameters."""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import weakref
from pathlib import Path

import pytest
import torch
from _harness import run_on_ranks, smoke_argv
from test_benchmark_tools import _result  # the made-up run result the report reads

from benchmarks import bench_build, bench_deepspeed
from benchmarks import side_by_side as benchmark


@pytest.fixture
def deepspeed_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags parse as where deepspeed is installed, whether it is here or not."""
    monkeypatch.setattr(bench_deepspeed, "deepspeed_available", lambda: True)


def _error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        benchmark.parse_args(argv)
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_missing_deepspeed_is_one_line_at_parse_time(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a)
    )
    line = _error_line(["--runs", "fully_shard_offload,deepspeed_offload"], capsys)
    assert line.endswith(
        "error: --runs deepspeed_offload needs the deepspeed package, which is not installed: pip install deepspeed"
    ), line
    benchmark.parse_args(["--runs", "fully_shard_offload"])  # the other runs do not need it


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--compile"], "error: --runs deepspeed_offload runs eagerly: drop --compile"),
        (["--mesh", "hsdp"], "error: --runs deepspeed_offload runs with --model own, --mesh dp and --optimizer adamw"),
        (["--optimizer", "muon"], "error: --runs deepspeed_offload runs with --model own"),
        (["--float8"], "error: --runs deepspeed_offload runs with --model own"),
        (["--moe"], "error: --runs deepspeed_offload runs with --model own"),
        (["--model", "hf-llama"], "error: --runs deepspeed_offload runs with --model own"),
    ],
)
def test_deepspeed_run_refuses_what_does_not_compose(
    extra: list[str], expected: str, deepspeed_found: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error_line(["--runs", "fully_shard,deepspeed_offload", *extra], capsys)
    assert expected in line, line


def test_deepspeed_run_composes_with_checkpointing_clipping_and_the_chunked_loss(deepspeed_found: None) -> None:
    args = benchmark.parse_args(
        ["--runs", "deepspeed_offload", "--ac", "full", "--max-norm", "1.0", "--loss-chunk", "4096", "--no-compile"]
    )
    assert args.runs == "deepspeed_offload" and not args.compile


def test_config_is_zero3_with_the_optimizer_on_the_host() -> None:
    config = bench_deepspeed.deepspeed_config(batch_size=4, max_norm=1.0)
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert config["bf16"] == {"enabled": True} and config["communication_data_type"] == "fp32"
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 1
    assert config["gradient_clipping"] == 1.0 and bench_deepspeed.deepspeed_config(4, 0.0)["gradient_clipping"] == 0.0
    reference = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    assert bench_deepspeed.adamw_hyperparameters() == {k: reference[k] for k in ("betas", "eps", "weight_decay")}


def test_composable_offload_runs_are_held_against_deepspeeds(
    tmp_path: Path, deepspeed_found: None, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = {
        "fully_shard": [0.6, 0.6],
        "fully_shard_offload": [1.0, 1.0],
        "fully_shard_offload_step_in_backward": [0.8, 0.9],
        "fsdp2_offload": [1.2, 1.2],
        "deepspeed_offload": [1.6, 1.8],
    }
    rounds = [{run: _result(run, steps[run][r], 5.0) for run in steps} for r in range(2)]
    out = tmp_path / "b.json"
    benchmark.report(rounds, benchmark.parse_args(["--runs", ",".join(steps), "--out", str(out)]), 1, "GPU")
    ratios = json.loads(out.read_text())["ratios"]
    assert ratios["fully_shard_offload_step_in_backward/deepspeed_offload"]["throughput"] == pytest.approx(2.0)
    assert ratios["fully_shard_offload/deepspeed_offload"]["throughput"] == pytest.approx((1.6 + 1.8) / 2)
    assert ratios["deepspeed_offload/fully_shard"]["throughput"] == pytest.approx((0.6 / 1.6 + 0.6 / 1.8) / 2)
    assert "fsdp2_offload/deepspeed_offload" in ratios and "fully_shard_offload/fsdp2_offload" in ratios
    assert "host GiB" in capsys.readouterr().out


def _as_torchrun(rank: int) -> None:
    """The variable torchrun sets, which the benchmark runs under, and which DeepSpeed's engine
    requires (these workers are fresh: it goes with them)."""
    os.environ["LOCAL_RANK"] = str(rank)


def _first_losses(rank: int, world_size: int) -> dict:
    """Every contender's loss before its first step (no warm-up, one timed step)."""
    _as_torchrun(rank)
    runs = "floor,fully_shard,fsdp2_offload,deepspeed_offload"
    args = benchmark.parse_args(smoke_argv("--runs", runs, batch_size=2, warmup=0))
    return {run: res["loss"] for run, res in benchmark.run_rounds(args, torch.device("cpu"))[0].items()}


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_deepspeed_starts_from_the_same_loss_as_the_other_contenders() -> None:
    """One rank, where fully_shard's and FSDP2's shards are the whole weights: the same initial
    model and data give the same loss, up to bf16 compute."""
    pytest.importorskip("deepspeed")
    # fresh: DeepSpeed keeps the world group it clones for ZeRO past the group's destruction.
    losses = run_on_ranks(_first_losses, 1, timeout=600, fresh=True)[0]
    assert math.isfinite(losses["deepspeed_offload"]) and 4.0 < losses["deepspeed_offload"] < 7.0, losses
    for run in ("floor", "fully_shard", "fsdp2_offload"):
        assert losses["deepspeed_offload"] == pytest.approx(losses[run], rel=1e-3), losses


def _train(rank: int, world_size: int) -> dict:
    """DeepSpeed's contender stepped by hand (its losses, its optimizer's hyperparameters beside
    fused AdamW's, whether its engine is collected once closed), then DDP and it side by side
    through the benchmark, clipped."""
    _as_torchrun(rank)
    argv = smoke_argv("--runs", "ddp,deepspeed_offload", "--max-norm", "1.0", batch_size=2, warmup=3)
    args = benchmark.parse_args(argv)
    cfg = benchmark.model_config(args)
    torch.manual_seed(0)
    floor = bench_build.build("floor", cfg, torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (2, args.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    with floor.autocast(), torch.no_grad():
        floor_loss = float(benchmark.lm_loss(floor.model(tokens[:, :-1]), tokens[:, 1:]))
    fused = benchmark.build_optimizer(floor.model, "adamw", benchmark.LR, graphed=False).param_groups[0]
    torch.manual_seed(0)
    step = bench_deepspeed.DeepSpeedStep(
        bench_build.build("deepspeed_offload", cfg, torch.device("cpu")), benchmark.LR, 2, args.max_norm
    )
    keys = ("lr", "betas", "eps", "weight_decay")
    try:
        losses = [float(step(tokens)) for _ in range(4)]
        group = {k: step.optimizer.param_groups[0][k] for k in keys}
        engine = weakref.ref(step.engine)
    finally:
        step.close()
    del step
    gc.collect()
    rounds = benchmark.run_rounds(args, torch.device("cpu"))
    return {
        "losses": losses,
        "floor_loss": floor_loss,
        "engine_collected": engine() is None,
        "hyperparameters": (
            {**group, "betas": tuple(group["betas"])},
            {k: fused[k] for k in keys},
        ),
        "last": {run: res["loss"] for run, res in rounds[0].items()},
    }


def test_deepspeed_trains_as_data_parallel_training_does() -> None:
    """Two gloo ranks: the loss falls at every step from the floor's initial loss (the same
    model built the same way), the host optimizer is AdamW with the other contenders'
    hyperparameters, and after four steps on the same data it is where DDP's is (the same data
    parallelism; bf16 parameters against DDP's fp32 under autocast). Closed, the engine is
    collected, so the contenders after it are not charged with its memory."""
    pytest.importorskip("deepspeed")
    for res in run_on_ranks(_train, 2, timeout=600, fresh=True):
        losses = res["losses"]
        assert all(math.isfinite(v) for v in losses) and all(b < a for a, b in zip(losses, losses[1:])), res
        assert losses[0] == pytest.approx(res["floor_loss"], rel=1e-3), res
        ours, fused = res["hyperparameters"]
        assert ours == fused, res
        assert res["last"]["deepspeed_offload"] == pytest.approx(res["last"]["ddp"], rel=3e-3), res
        assert res["last"]["deepspeed_offload"] < losses[0]
        assert res["engine_collected"], (
            "the engine outlived close(): its model and buffers would be charged to later runs"
        )
