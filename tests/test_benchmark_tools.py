"""The measuring tools of examples/: the benchmark's report (ratios over interleaved rounds)
and trace_overlap.py (compute / exposed communication / idle from a Chrome trace). Their
numbers go into BENCHMARKS.md, so their arithmetic is checked on made-up inputs."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import benchmark  # noqa: E402
import trace_overlap as overlap  # noqa: E402
from trace_overlap import Interval  # noqa: E402


def _result(run: str, step_s: float, peak: float) -> dict:
    return dict(run=run, step_s=step_s, tok_s_gpu=0.0, mfu_per_tok_s=1e-6, peak_alloc_gib=peak, peak_reserved_gib=peak + 1, left_before_gib=0.0, loss=1.0)


def test_report_ratios_are_medians_of_per_round_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Round 2 is slow for everyone (a drifting host): per-round ratios cancel it, a ratio of
    # medians over all runs would not.
    steps = {"fully_shard": [1.0, 2.0, 1.0], "fsdp2": [1.1, 2.2, 1.2], "floor": [0.9, 1.8, 0.95]}
    peaks = {"fully_shard": [5.0, 5.0, 5.5], "fsdp2": [6.0, 6.0, 6.0], "floor": [8.0, 8.0, 8.0]}
    rounds = [{run: _result(run, steps[run][r], peaks[run][r]) for run in steps} for r in range(3)]
    out = tmp_path / "b.json"
    args = benchmark.parse_args(["--batch-size", "2", "--seq-len", "8", "--rounds", "3", "--out", str(out)])
    benchmark.report(rounds, args, 2, "GPU")
    ratios = json.loads(out.read_text())["ratios"]
    fs = ratios["fully_shard/fsdp2"]
    assert fs["throughput"] == pytest.approx(1.1)  # per round: 1.1, 1.1, 1.2
    assert fs["throughput_range"] == pytest.approx([1.1, 1.2])
    assert fs["peak_alloc"] == pytest.approx(5.5 / 6.0)  # largest peaks
    assert ratios["fully_shard/floor"]["throughput"] == pytest.approx(0.9)
    assert "replicate/ddp" not in ratios  # only pairs that ran
    printed = capsys.readouterr().out
    assert "fully_shard/fsdp2: throughput 1.100x (rounds 1.100-1.200), peak allocated 0.917x" in printed


def test_interval_arithmetic() -> None:
    a = overlap.union([Interval(5, 7), Interval(0, 2), Interval(1, 3)])
    assert a == [Interval(0, 3), Interval(5, 7)]
    assert overlap.total(a) == 5
    assert overlap.subtract(a, [Interval(1, 2), Interval(6, 10)]) == [Interval(0, 1), Interval(2, 3), Interval(5, 6)]
    assert overlap.subtract(a, []) == a
    assert overlap.subtract([], a) == []


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def test_trace_overlap_splits_compute_exposed_and_idle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [
        _kernel("sm90_gemm", 0, 100),  # compute 0-100
        _kernel("ncclDevKernel_AllGather", 50, 100),  # comm 50-150: 50 exposed (100-150)
        _kernel("elementwise", 200, 50),  # idle 150-200, compute 200-250
        {"cat": "cpu_op", "name": "aten::_foreach_add_", "ts": 140, "dur": 30, "pid": 0, "tid": 1},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    overlap.analyse(str(path), top=2)
    printed = capsys.readouterr().out
    assert "span 0.2 ms; compute 0.1 ms (60.0%), exposed communication 0.1 ms (20.0%), idle 0.1 ms (20.0%)" in printed
    assert "idle                     0.050 ms at +    0.1 ms  cpu: aten::_foreach_add_" in printed


@pytest.mark.filterwarnings("ignore:DTensor random operators")  # init on a CPU mesh: expected
@pytest.mark.parametrize("wrap", benchmark.WRAPS)
def test_both_fsdp_implementations_get_the_same_groups(wrap: str) -> None:
    """`--wrap` must shard ours and FSDP2 alike, or the comparison is not like for like."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from _harness import fake_process_group
    from composable import fully_shard

    cfg = benchmark.get_config("tiny")
    with fake_process_group(2):
        ours, _ = benchmark.build("fully_shard", cfg, torch.device("cpu"), wrap)
        theirs, _ = benchmark.build("fsdp2", cfg, torch.device("cpu"), wrap)
        ours_units = [name for name, m in ours.named_modules() if fully_shard.state(m) is not None]
        theirs_units = [name for name, m in theirs.named_modules() if isinstance(m, FSDPModule)]
    assert ours_units == theirs_units
    ends = ["tok_embeddings", "output"] if wrap == "separate-ends" else []
    assert sorted(ours_units) == sorted(["", *ends, *(f"layers.{i}" for i in range(cfg.n_layers))])
