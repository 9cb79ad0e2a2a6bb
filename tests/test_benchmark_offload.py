"""The benchmark's CPU-offload contenders (`--runs fully_shard_offload,fsdp2_offload`): fully_shard
and FSDP2 with `CPUOffloadPolicy` (shards, gradients and the optimizer step on the host), measured
beside the same contenders without it. Their shards live on the host, the loss after a step is the
one without offload (the same math), the report holds them against FSDP2's and against no offload,
with the host's memory beside the GPU's, and the combinations not measured are refused in one line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from _harness import run_on_ranks, smoke_argv

from benchmarks import bench_args, bench_build
from benchmarks import side_by_side as benchmark

RUNS = (
    "fully_shard,fully_shard_offload,fully_shard_offload_on_device,fully_shard_state_offload,"
    "fully_shard_state_offload_prefetch,fsdp2_offload"
)


def _smoke(rank: int, world_size: int, out: str) -> dict:
    args = benchmark.parse_args(smoke_argv("--runs", RUNS, "--out", out))
    rounds = benchmark.run_rounds(args, torch.device("cpu"))
    if rank == 0:
        benchmark.report(rounds, args, world_size, "cpu")
    return {run: (res["loss"], res["host_rss_gib"]) for run, res in rounds[0].items()}


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_offload_contenders_train_as_without_offload_and_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "offload.json"
    results = run_on_ranks(_smoke, 2, str(out), timeout=300)
    for res in results:
        (plain, _), (ours, host), (theirs, _) = res["fully_shard"], res["fully_shard_offload"], res["fsdp2_offload"]
        on_device, state_offload = res["fully_shard_offload_on_device"][0], res["fully_shard_state_offload"][0]
        prefetched = res["fully_shard_state_offload_prefetch"][0]
        assert math.isfinite(plain) and 4.0 < plain < 7.0, res
        assert ours == on_device == state_offload == prefetched == plain == theirs, (
            res
        )  # offload moves the state, not the math
        assert host > 0
    ratios = json.loads(out.read_text())["ratios"]
    assert {
        "fully_shard_offload/fsdp2_offload",
        "fully_shard_offload/fully_shard",
        "fully_shard_offload_on_device/fully_shard_offload",
        "fully_shard_state_offload/fully_shard",
        "fully_shard_state_offload_prefetch/fully_shard_state_offload",
    } <= set(ratios)


def _shard_devices(rank: int, world_size: int) -> dict:
    """Each contender built for a compute device other than the host ('meta' stands in for the
    GPU here): where its shards live."""
    cfg = bench_args.model_config(benchmark.parse_args(smoke_argv()))
    devices = {}
    for run in ("fully_shard", *bench_build.OFFLOAD_RUNS, *bench_build.STATE_OFFLOAD_RUNS):
        contender = bench_build.build(run, cfg, torch.device("meta"), "separate-ends", "own")
        devices[run] = sorted({p.to_local().device.type for p in contender.model.parameters()})
    return devices


def _clipped_smoke(rank: int, world_size: int) -> dict:
    runs = (
        "fully_shard,fully_shard_offload,fully_shard_offload_step_in_backward,"
        "fully_shard_offload_step_in_backward_speculative,fsdp2_offload"
    )
    args = benchmark.parse_args(smoke_argv("--runs", runs, "--max-norm", "0.5"))
    rounds = benchmark.run_rounds(args, torch.device("cpu"))
    return {run: res["loss"] for run, res in rounds[0].items()}


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_clipped_contenders_train_the_same_model() -> None:
    """--max-norm clips every contender alike: composable.clip_grad_norm_ between backward and the
    step, and the step in backward's own clipping, speculating or not."""
    for res in run_on_ranks(_clipped_smoke, 2, timeout=300):
        assert len(set(res.values())) == 1 and math.isfinite(res["fully_shard"]), res


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_max_norm_must_be_finite_and_not_negative(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--max-norm", value])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith(f"error: --max-norm must be a finite number >= 0 (0: no clipping), got {float(value)}"), line


def test_offload_shards_live_on_the_host() -> None:
    """Materialised on the host (to_empty on the CPU), as the offload policies keep them; the
    contenders without them (only the optimizer state on the host) on their compute device."""
    got = run_on_ranks(_shard_devices, 2)[0]
    offloaded = {run: ["cpu"] for run in bench_build.OFFLOAD_RUNS}
    on_gpu = {run: ["meta"] for run in ("fully_shard", *bench_build.STATE_OFFLOAD_RUNS)}
    assert got == {**on_gpu, **offloaded}, got


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--optimizer", "muon"], "--optimizer muon"),
        (["--moe"], "--moe"),
        (["--mesh", "hsdp"], "--mesh hsdp"),
    ],
)
def test_offload_runs_refuse_what_is_not_measured(
    extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--runs", "fully_shard_offload", *extra])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: --runs fully_shard_offload runs with --model own, --mesh dp" in line and named in line, line


def test_offloaded_ranks_share_the_host_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun starts several processes with OMP_NUM_THREADS=1; the host's optimizer step of an
    offloaded run gets each local rank's share of the cores instead."""
    from trainer import launch

    before = torch.get_num_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    try:
        launch.host_threads_for_offload()
        assert torch.get_num_threads() == 16
    finally:
        torch.set_num_threads(before)
