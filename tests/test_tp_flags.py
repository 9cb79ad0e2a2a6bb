"""The tensor-parallel recipe's flags in the main job (train.py `--parallel tp`, `--async-tp`,
`--fused-projections`) and the benchmark (`--mesh tp`, `--async-tp`, `--fused-projections`,
compile on by default on GPUs): each bad value refused at parse time with one line naming the
flag and the value, `--async-tp` turning fused projections on unless told otherwise, and the
main job training dp 2 x tp 2 with the recipe as dp 2 does without it, fused or not, and on the
3D (replicate, shard, tp) mesh of `--parallel hsdp --tp-size`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _harness import assert_close_tensors
from test_train_example import SMALL, _losses, _run  # noqa: E402 (its ranks and its small model)

from benchmarks import side_by_side as benchmark
from benchmarks.bench_mesh import describe_mesh
from trainer import options

# SMALL's model: 2 heads, ffn 64, sequences of 32 tokens.
TRAIN_ERRORS = [
    (["--async-tp"], "--async-tp needs --parallel tp, got --parallel fsdp"),
    (["--parallel", "tp", "--async-tp", "--no-compile"], "--async-tp needs the blocks compiled by inductor"),
    (["--parallel", "tp", "--async-tp", "--compile-backend", "aot_eager"], "got --compile-backend aot_eager"),
    (["--parallel", "tp", "--async-tp", "--pp", "2"], "--async-tp with --pp 2: pipeline stages keep the textbook"),
    (["--parallel", "tp", "--tp-size", "4"], "--tp-size 4 must divide n_heads (2): the recipe splits it evenly"),
    (["--parallel", "tp", "--n-heads", "4", "--ffn-dim", "66", "--tp-size", "4"], "must divide ffn_dim (66)"),
    (["--parallel", "tp", "--seq-len", "31"], "--tp-size 2 must divide the sequence length (31)"),
    (["--tp-size", "2"], "--tp-size 2 needs --parallel tp or hsdp, got --parallel fsdp"),
    (["--parallel", "hsdp", "--tp-size", "4"], "--tp-size 4 must divide n_heads (2): the recipe splits it evenly"),
    (["--parallel", "hsdp", "--tp-size", "2", "--pp", "2"], "--parallel hsdp --tp-size 2 with --pp 2: pipeline"),
    (["--parallel", "hsdp", "--tp-size", "2", "--async-tp"], "--async-tp needs --parallel tp, got --parallel hsdp"),
    (
        ["--parallel", "tp", "--fused-projections", "--pp", "2"],
        "--fused-projections with --parallel tp --pp 2: pipeline stages keep the textbook TP plan",
    ),
]


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1], err
    return err[-1]


@pytest.mark.parametrize("argv,message", TRAIN_ERRORS, ids=[m.split(":")[0][:40] for _, m in TRAIN_ERRORS])
def test_train_refuses_tp_flags_that_do_not_fit(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        options.parse_args([*SMALL, "--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    line = _error_line(capsys)
    assert line.startswith("train.py: error: ") and message in line, line
    assert "Traceback" not in line


def test_async_tp_needs_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both jobs, with every other flag right: symmetric memory exists on CUDA only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        options.parse_args([*SMALL, "--out", str(tmp_path), "--parallel", "tp", "--async-tp"])
    assert "--async-tp needs CUDA (symmetric memory on the tp group)" in _error_line(capsys)
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--mesh", "tp", "--async-tp", "--compile"])
    assert "--async-tp needs CUDA (symmetric memory on the tp group)" in _error_line(capsys)


def test_benchmark_compiles_the_tp_mesh_by_default_on_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On GPUs `--mesh tp` runs compiled unless `--no-compile`; other meshes stay eager unless
    `--compile`, as before. Without a GPU nothing compiles by default, which `--async-tp` names."""
    assert benchmark.parse_args(["--mesh", "tp"]).compile is False  # this machine: no GPU
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--mesh", "tp", "--async-tp"])
    assert "got no --compile (off by default without a GPU)" in _error_line(capsys)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert benchmark.parse_args(["--mesh", "tp"]).compile is True
    assert benchmark.parse_args(["--mesh", "tp", "--no-compile"]).compile is False
    assert benchmark.parse_args(["--mesh", "dp"]).compile is False
    assert benchmark.parse_args(["--mesh", "tp", "--async-tp"]).async_tp is True
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--mesh", "tp", "--async-tp", "--no-compile"])
    assert "got --no-compile" in _error_line(capsys)


def test_fused_projections_follow_async_tp_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Off by default; on by flag; on with --async-tp unless --no-fused-projections; in the
    model config both jobs build, and in the benchmark's mesh line. Refused for HF's model."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what --async-tp needs
    train = [*SMALL, "--out", str(tmp_path), "--parallel", "tp"]
    for extra, fused in (([], False), (["--fused-projections"], True), (["--async-tp"], True)):
        args = options.parse_args([*train, *extra])
        assert args.fused_projections is fused and options.model_config(args).fused_projections is fused, extra
    assert options.parse_args([*train, "--async-tp", "--no-fused-projections"]).fused_projections is False
    bench = ["--mesh", "tp", "--preset", "tiny"]
    for extra, fused in (([], False), (["--fused-projections"], True), (["--async-tp"], True)):
        args = benchmark.parse_args([*bench, *extra])
        assert args.fused_projections is fused and benchmark.model_config(args).fused_projections is fused, extra
        assert describe_mesh(args, 4) == "dp 2 x tp 2" + (", fused projections" if fused else "")
    assert benchmark.parse_args([*bench, "--async-tp", "--no-fused-projections"]).fused_projections is False
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--model", "hf-llama", "--fused-projections"])
    assert "--fused-projections with --model hf-llama: the fused layout is examples/models/model.py's" in _error_line(
        capsys
    )


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_train_dp2_tp2_recipe_trains_as_dp2(fused: bool, tmp_path: Path) -> None:
    """train.py --parallel tp on 4 ranks (dp 2 x tp 2, the recipe) against --parallel fsdp on
    2 (the same two data-parallel batches per step): the same losses to fp32 rounding; with
    --fused-projections in both (the fused model draws other initial weights)."""
    argv = [*SMALL, "--steps", "3", "--eval-every", "0", "--ckpt-every", "0", *(["--fused-projections"] * fused)]
    got = _losses(_run([*argv, "--parallel", "tp", "--out", str(tmp_path / "tp")], world_size=4))
    expected = _losses(_run([*argv, "--out", str(tmp_path / "dp")], world_size=2))
    assert_close_tensors(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_train_hsdp_tp_3d_mesh_trains_as_dp2(tmp_path: Path) -> None:
    """train.py --parallel hsdp --tp-size 2 on 4 ranks (2 replicas x shard groups of 1 x tp 2:
    the recipe, then HSDP) against --parallel fsdp on 2 (the same two data-parallel batches per
    step): the same losses to fp32 rounding. Not captured as a CUDA graph (one line)."""
    argv = [*SMALL, "--steps", "3", "--eval-every", "0", "--ckpt-every", "0"]
    got = _losses(_run([*argv, "--parallel", "hsdp", "--tp-size", "2", "--out", str(tmp_path / "3d")], world_size=4))
    expected = _losses(_run([*argv, "--out", str(tmp_path / "dp")], world_size=2))
    assert_close_tensors(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    args = options.parse_args([*argv, "--parallel", "hsdp", "--tp-size", "2", "--out", str(tmp_path / "g")])
    assert (
        options.cuda_graph_unsupported(args, "cuda") == "--parallel hsdp --tp-size: the 3D mesh's step is not captured"
    )
    assert options.parse_args([*argv, "--parallel", "tp", "--out", str(tmp_path / "t")]).tp_size == 2
