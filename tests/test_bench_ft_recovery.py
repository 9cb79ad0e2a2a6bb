"""examples/bench_ft_recovery.py: a torchft replica group of the main job is killed, the other
trains on, the killed one is started again, heals and rejoins, and each phase is timed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("torchft", exc_type=ImportError)  # also one installed that fails to import

from benchmarks import bench_ft_recovery  # noqa: E402


def test_a_lost_group_is_timed_from_its_fault_to_the_live_groups_commit_and_its_heal(tmp_path: Path) -> None:
    # Short steps; the tool stops both groups once the restarted one has committed 3 steps.
    result = bench_ft_recovery.main(
        ["--out", str(tmp_path), "--fault-step", "8", "--restart-after", "0", "--steps-after-rejoin", "3"]
        + ["--heartbeat-timeout", "1", "--batch-size", "1", "--seq-len", "64"]
    )
    assert result["restart: healed"] is True
    assert result["live group logged every step once"] is True
    assert result["live steps committed alone"] >= 1
    assert result["live steps that failed (taken again)"] == 1  # the step the fault broke
    # The death costs the live group the lighthouse's heartbeat timeout (1 s), not a collective's
    # timeout (60 s): a loose bound that a hang would break.
    assert 0 < result["fault to the live group's next commit"] < 30
    for key in ("restart: launch to first quorum", "restart: first quorum to first commit"):
        assert 0 < result[key] < math.inf, (key, result)


def test_refuses_a_fault_step_outside_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_ft_recovery.main(["--steps", "10", "--fault-step", "10"])
    assert "--fault-step must be in 2..9 (below --steps), got 10" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_ft_recovery.main(["--steps-after-rejoin", "0"])
    assert "--steps-after-rejoin must be >= 1, got 0" in capsys.readouterr().err


def test_refuses_one_gpu_for_two_groups(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_ft_recovery.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        bench_ft_recovery.main([])
    assert "needs a GPU per replica group, two, or none (NCCL takes no two ranks" in capsys.readouterr().err
