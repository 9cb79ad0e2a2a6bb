"""examples/train.py with `--moe`: `--cuda-graph` resolves for it (expert parallelism over more
than one rank reads the all-to-all's split sizes on the host: `auto` runs without a graph and
says why, `on` is refused at once naming the reason), and on GPUs the main job's defaults
(compiled, CUDA graphs where the step can be captured) train on 1, 2 and 4 GPUs."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from pathlib import Path

import pytest
import torch
from _harness import gpu_worlds, run_on_ranks

from models.moe import NOT_CAPTURABLE
from trainer import main_job as train_script
from trainer.options import cuda_graph_mode, parse_args
from trainer.parallel import UsageError

SMALL = (
    "--preset tiny --dim 64 --n-layers 2 --n-heads 2 --ffn-dim 128 --seq-len 64 --batch-size 4 --lr 1e-2 "
    "--warmup-steps 2 --eval-batches 1 --eval-every 0 --ckpt-every 0 --moe"
).split()


def _args(world: str, *flags: str) -> argparse.Namespace:
    settings = {"cuda_graph": "auto", "parallel": "fsdp", "cpu_offload": False, "mp": "bf16", "moe": True}
    return argparse.Namespace(**settings | {"nproc": int(world)} | dict(f.split("=", 1) for f in flags))


@pytest.mark.parametrize(
    ("world", "flags", "expected"),
    [
        ("1", (), (True, "auto")),  # no expert parallelism: nothing read on the host
        ("2", (), (False, NOT_CAPTURABLE)),
        ("4", (), (False, NOT_CAPTURABLE)),
        ("4", ("cuda_graph=off",), (False, "--cuda-graph off")),
    ],
)
def test_auto_runs_without_a_graph_with_expert_parallelism(
    monkeypatch: pytest.MonkeyPatch, world: str, flags: tuple[str, ...], expected: tuple[bool, str]
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cuda_graph_mode(_args(world, *flags), "cuda") == expected


def test_on_with_expert_parallelism_is_refused_naming_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it: known before any rank starts
    with pytest.raises(SystemExit):
        parse_args([*SMALL, "--cuda-graph", "on", "--out", str(tmp_path)])
    assert capsys.readouterr().err == f"train.py: error: --cuda-graph on: {NOT_CAPTURABLE}\n"
    with pytest.raises(UsageError, match=f"^--cuda-graph on: {NOT_CAPTURABLE}$"):
        cuda_graph_mode(_args("4", "cuda_graph=on"), "cuda")


def _train_on_gpus(rank: int, world: int, out: str) -> dict:
    torch.cuda.set_device(rank)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = train_script.train(parse_args([*SMALL, "--steps", "6", "--out", out]))
    assert result["compile"] is True
    assert result["cuda_graph"] is (world == 1), result["cuda_graph"]
    losses = [h["loss"] for h in result["history"]]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    if rank == 0:
        why = "auto" if world == 1 else NOT_CAPTURABLE
        assert f"cuda graph: {'on' if world == 1 else 'off'} ({why})" in printed.getvalue(), printed.getvalue()
    return result


@pytest.mark.parametrize("world", gpu_worlds(1, 2, 4))
def test_gpu_moe_trains_with_the_defaults(world: int, tmp_path: Path) -> None:
    """Compiled (the default on CUDA), bf16, --cuda-graph auto: graphed on one GPU, eager
    dispatch without a graph on 2 and 4. Fresh workers, as a job starts: a worker that had run
    the graphed one-GPU form hung in the two-rank form's first all-to-all (rank 0 in NCCL's
    connection setup, rank 1 queued behind it), which the two-rank form alone never did."""
    run_on_ranks(_train_on_gpus, world, str(tmp_path), backend="nccl", timeout=600, fresh=True)
