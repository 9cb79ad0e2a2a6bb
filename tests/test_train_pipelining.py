"""examples/train.py with pipeline parallelism (`--pp 2 --pp-schedule NAME --microbatches M`): a
pipelined run on (pp=2 x dp=2) gloo ranks trains the same model as the data-parallel run on the
same global batch (every schedule kind: single-stage, interleaved, V-shaped zero-bubble, with
fsdp, hsdp and tp inside the stages), and its checkpoints resume both pipelined and in another
layout."""

from __future__ import annotations

import shutil
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch
from _harness import assert_close_tensors
from test_train_example import SMALL, _losses, _run

from trainer import main_job as train_script
from trainer.pipeline import SCHEDULES

# Four layers: two stages per pipeline rank under the interleaved and V-shaped schedules.
BASE = [*SMALL, "--n-layers", "4", "--steps", "3", "--eval-every", "3", "--ckpt-every", "0"]
BASE[BASE.index("--batch-size") + 1] = "4"
TOL = dict(rtol=2e-5, atol=2e-5)


def _history(result: dict) -> tuple[list[float], list[float]]:
    return _losses(result), [h["val_loss"] for h in result["history"] if h["val_loss"] is not None]


@cache
def _reference(flags: tuple[str, ...]) -> tuple[list[float], list[float]]:
    """The 2-rank run without a pipeline (cached: several schedules compare with the same
    one), in a directory of its own."""
    with tempfile.TemporaryDirectory(prefix="train-pp-reference-") as out:
        return _history(_run([*BASE, *flags, "--out", out], world_size=2))


@pytest.mark.parametrize(
    "flags",
    [
        ["--pp-schedule", "1F1B"],
        ["--pp-schedule", "Interleaved1F1B", "--max-norm", "0.05"],  # clipping with the whole model's norm
        ["--pp-schedule", "ZBVZeroBubble", "--parallel", "hsdp", "--hsdp-shard-size", "1"],
        ["--pp-schedule", "1F1B", "--parallel", "tp", "--tp-size", "2", "--activation-checkpointing"],
    ],
    ids=lambda f: " ".join(f),
)
def test_pipelined_run_trains_the_data_parallel_model(tmp_path: Path, flags: list[str]) -> None:
    if "ZBVZeroBubble" in flags and "ZBVZeroBubble" not in SCHEDULES:
        pytest.skip("this torch has no ScheduleZBVZeroBubble")
    if "tp" not in flags:
        want = _reference(("--max-norm", "0.05") if "--max-norm" in flags else ())
    if "tp" in flags:  # (pp 2, dp 1, tp 2): the reference is (dp 1, tp 2)
        want = _reference(("--parallel", "tp", "--activation-checkpointing"))
    got = _history(_run(BASE + ["--pp", "2", "--microbatches", "2", "--out", str(tmp_path / "pp"), *flags], 4))
    for g, w in zip(got, want):
        assert_close_tensors(torch.tensor(g), torch.tensor(w), **TOL, msg=" ".join(flags))


def test_pipelined_checkpoints_resume_pipelined_and_in_another_layout(tmp_path: Path) -> None:
    """Stopped after step 2 (checkpoint at 2): resumed with the same pipeline it continues the
    loss curve bitwise; resumed by a plain data-parallel run (DCP reshards the stages' names
    into the whole model) it continues the uninterrupted pipelined run's curve."""
    pp = BASE + ["--pp", "2", "--pp-schedule", "Interleaved1F1B", "--ckpt-every", "2", "--run-id", "r"]
    full = _losses(_run(pp + ["--out", str(tmp_path / "full")], 4))
    _run(pp + ["--out", str(tmp_path / "split"), "--stop-after", "2"], 4)
    # The same stopped run, resumed the other way below (a copy: the run is deterministic).
    shutil.copytree(tmp_path / "split", tmp_path / "other")
    resumed = _run(pp + ["--out", str(tmp_path / "split"), "--resume"], 4)
    assert resumed["resumed_from"] == 2 and _losses(resumed) == full

    flat = BASE + ["--ckpt-every", "2", "--run-id", "r", "--out", str(tmp_path / "other"), "--resume"]
    moved = _run(flat, 2)
    assert moved["resumed_from"] == 2
    assert_close_tensors(torch.tensor(_losses(moved)), torch.tensor(full), **TOL)


def test_pipelining_flag_errors_say_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--pp", "2", "--pp-schedule", "NoSuch"], "--pp-schedule must be one of"),
        (["--pp", "2", "--batch-size", "4", "--microbatches", "3"], "--microbatches must divide --batch-size 4, got 3"),
        (["--pp", "2", "--grad-accum", "2"], "--grad-accum must be 1 with --pp"),
        (["--pp", "2", "--tie-embeddings"], "--tie-embeddings is not supported with --pp"),
    ):
        with pytest.raises(SystemExit):
            train_script.parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_estimate_pp_reports_a_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """estimate.py --pp: the stage's data-parallel collectives come from the engine once per
    step (the same for 1 or 4 microbatches), the bubble is the 1F1B bound, and memory grows
    with the microbatches in flight."""
    import json

    from estimator import estimate_cli as estimate

    common = ["--preset", "tiny", "--world-size", "4", "--batch-size", "4", "--seq-len", "64", "--pp", "2"]
    got = {}
    for m in (1, 4):
        assert estimate.main([*common, "--microbatches", str(m), "--json", str(tmp_path / f"{m}.json")]) == 0
        got[m] = json.loads((tmp_path / f"{m}.json").read_text())["pipeline"]
    assert got[1]["bubble_fraction"] == pytest.approx(1 / 2) and got[4]["bubble_fraction"] == pytest.approx(1 / 5)
    assert got[1]["data_parallel"] == got[4]["data_parallel"] and got[4]["data_parallel"]["collectives"] > 0
    assert got[4]["microbatches_in_flight"] == 2 and got[4]["layers_per_rank"] == 2  # tiny: 4 layers
    assert estimate.main([*common, "--microbatches", "3"]) == 2
    assert "--microbatches must divide --batch-size 4, got 3" in capsys.readouterr().err
