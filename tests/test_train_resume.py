"""examples/train.py's run directories and resume: runs sharing an --out keep to their own
directories and resume their own, --resume skips a run in use and refuses a taken run id, refuses
a checkpoint of another model or seed and reshards one of another layout, and resumes checkpoints
written before a config field or the flattened optimizer state existed.

Training runs go through `train.train` on the harness's gloo ranks with a very small model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from _harness import assert_close_tensors, run_on_ranks
from test_train_example import _losses, _reference, _run
from test_train_faults import BASE, _attempt, _try

from models.model import get_config
from trainer import checkpointing, options, runs
from trainer.parallel import UsageError

# ----------------------------------------------------------------------------- 1: runs sharing --out


def test_runs_sharing_an_out_keep_their_own_checkpoints_and_resume_their_own(tmp_path: Path) -> None:
    """Run A (6 steps) and then run B (another seed, 2 steps) in one --out: B's pruning must not
    touch A's checkpoints nor its own, and `--resume` with B's flags continues B, not A."""
    common = BASE + ["--ckpt-every", "2", "--keep-ckpts", "2", "--out", str(tmp_path)]
    a = _run(common + ["--steps", "6"])
    b = _run(common + ["--steps", "4", "--seed", "1", "--stop-after", "2"])
    assert a["run_dir"] != b["run_dir"]
    assert [s for s, _ in checkpointing.checkpoint_dirs(a["run_dir"])] == [4, 6]
    assert [s for s, _ in checkpointing.checkpoint_dirs(b["run_dir"])] == [2]
    resumed = _try(common + ["--steps", "4", "--seed", "1", "--resume"])
    assert resumed["run_dir"] == b["run_dir"] and resumed["resumed_from"] == 2, resumed
    assert "continuing run" in resumed["stderr"]
    assert [s for s, _ in checkpointing.checkpoint_dirs(a["run_dir"])] == [4, 6]  # A untouched
    assert _losses(resumed)[:2] == _losses(b)


def test_resume_skips_a_run_in_use_and_refuses_a_taken_run_id(tmp_path: Path) -> None:
    """The run-choosing logic itself (rank 0 only, no ranks needed)."""
    args = options.parse_args(BASE + ["--out", str(tmp_path)])
    ident = runs.identity(args, options.model_config(args))
    first, lock = runs.open_run(args, ident)
    os.makedirs(os.path.join(first.path, checkpointing.CKPT_DIR, "step_0000002"))
    Path(first.path, checkpointing.CKPT_DIR, "step_0000002", checkpointing.STATE_FILE).write_text("{}")
    args.resume = True
    second, lock2 = runs.open_run(args, ident)  # `first` is locked: a job is running in it
    assert second.path != first.path and not second.resume
    assert any("skipping run" in n and "in use" in n for n in second.notes), second.notes
    lock.release()
    lock2.release()
    third, lock3 = runs.open_run(args, ident)  # now free: continued
    assert third.path == first.path and third.resume
    lock3.release()
    args.resume, args.run_id = False, first.run_id
    with pytest.raises(UsageError, match=f"--run-id {first.run_id}: .* already holds a run"):
        runs.open_run(args, ident)


# ----------------------------------------------------------------------------- 2: resume identity


def test_resume_refuses_another_model_or_seed_and_reshards_another_layout(tmp_path: Path) -> None:
    argv = BASE + ["--steps", "6", "--ckpt-every", "3", "--out", str(tmp_path), "--run-id", "r"]
    first = _run(argv + ["--stop-after", "3"])
    for flags, named in [
        (["--n-layers", "3"], "--n-layers 3 (checkpoint: 2)"),
        (["--n-heads", "4"], "--n-heads 4 (checkpoint: 2)"),
        (["--seed", "7"], "--seed 7 (checkpoint: 0)"),
        (["--fused-projections"], "--fused-projections (checkpoint: separate)"),
        (["--steps", "2"], "--steps 2 is below the step of checkpoint"),
    ]:
        got = _try(argv + ["--resume", *flags])
        assert got.get("error") == "UsageError" and named in got["message"], (flags, got)
        assert "\n" not in got["message"]
    # Another world size, parallelism or precision: the checkpoint is resharded on load.
    one_rank = _try(argv + ["--resume", "--stop-after", "4"], world_size=1)  # (1 rank: other data, no save)
    assert one_rank.get("resumed_from") is None and one_rank["stopped_at"] == 4 and len(one_rank["history"]) == 4
    resumed = _try(argv + ["--resume", "--parallel", "replicate"])
    assert resumed["resumed_from"] == 3 and "error" not in resumed
    full = _reference(6, ("--ckpt-every", "3"))
    assert_close_tensors(torch.tensor(_losses(resumed)), torch.tensor(full), rtol=1e-5, atol=1e-5)
    assert _losses(first) == list(full[:3])
    again = _try(argv + ["--resume", "--mp", "bf16"])  # at step 6 = --steps: nothing to do, said so
    assert again["resumed_from"] == 6 and "nothing to train" in again["stderr"]


def test_a_checkpoint_from_before_a_config_field_existed_resumes_with_its_default() -> None:
    """A checkpoint saved before ModelConfig had a field (none then: the run had its default)
    agrees with a job that keeps the default, and names the flag for one that does not."""
    cfg = get_config("tiny")
    current = runs.identity(argparse.Namespace(preset="tiny", seed=0), cfg)
    saved = {**current, "model": {k: v for k, v in current["model"].items() if k != "fused_projections"}}
    assert runs.identity_differences(saved, current) == []
    fused = runs.identity(argparse.Namespace(preset="tiny", seed=0), dataclasses.replace(cfg, fused_projections=True))
    assert runs.identity_differences(saved, fused) == ["--fused-projections (checkpoint: separate)"]


def _attempt_with_unflattened_optimizer_state(rank: int, world_size: int, argv: list[str]) -> dict:
    """As `_attempt`, saving the optimizer state as earlier checkpoints did (param groups as one list)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    flattened, checkpointing._OPTIONS = checkpointing._OPTIONS, StateDictOptions()
    try:
        return _attempt(rank, world_size, argv)
    finally:
        checkpointing._OPTIONS = flattened


def test_checkpoints_with_unflattened_optimizer_state_still_resume(tmp_path: Path) -> None:
    argv = BASE + ["--steps", "6", "--ckpt-every", "3", "--out", str(tmp_path), "--run-id", "r"]
    run_on_ranks(_attempt_with_unflattened_optimizer_state, 2, argv + ["--stop-after", "3"])
    resumed = _try(argv + ["--resume"])
    assert resumed.get("resumed_from") == 3 and "error" not in resumed, resumed
    full = _reference(6, ("--ckpt-every", "3"))
    assert_close_tensors(torch.tensor(_losses(resumed)), torch.tensor(full), rtol=1e-5, atol=1e-5)
