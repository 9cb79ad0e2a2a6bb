"""The benchmark's `--mesh` (examples/benchmarks/bench_mesh.py): the flags and their refusals, the
contenders each mesh builds (fully_shard and FSDP2 with the same placements on the same 2D
mesh, the floors without one), the report's per-GPU token accounting and mesh naming, and a
4-rank gloo smoke run of each 2D mesh and of the 3D (replicate, shard, tp) one in which
fully_shard trains like FSDP2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness import fake_process_group, run_on_ranks, smoke_argv
from test_benchmark_tools import _result  # the made-up run result the report reads

from benchmarks import bench_args, bench_build, bench_mesh
from benchmarks import side_by_side as benchmark


def test_mesh_defaults() -> None:
    dp = benchmark.parse_args([])
    assert (dp.mesh, dp.dp_replicate, dp.tp_size) == ("dp", None, None)
    assert benchmark.parse_args(["--mesh", "hsdp"]).dp_replicate == 2
    assert benchmark.parse_args(["--mesh", "tp"]).tp_size == 2
    assert benchmark.parse_args(["--mesh", "tp", "--tp-size", "4"]).tp_size == 4


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["--tp-size", "2"], None, "--tp-size 2 needs --mesh tp, got --mesh dp"),
        (["--mesh", "tp", "--dp-replicate", "2"], None, "--dp-replicate 2 needs --mesh hsdp, got --mesh tp"),
        (["--mesh", "hsdp", "--dp-replicate", "0"], None, "--dp-replicate must be >= 1, got 0"),
        (["--mesh", "hsdp", "--dp-replicate", "3"], "4", "--dp-replicate 3 must divide the world size 4 (--mesh hsdp)"),
        (["--mesh", "tp", "--tp-size", "3"], None, "--tp-size 3 must divide n_heads (16): the recipe splits it"),
        (["--mesh", "tp", "--seq-len", "2047"], None, "--tp-size 2 must divide the sequence length (2047)"),
        (["--mesh", "tp", "--ffn-dim", "5631"], None, "--tp-size 2 must divide ffn_dim (5631)"),
        (["--async-tp", "--compile"], None, "--async-tp needs --mesh tp, got --mesh dp"),
        (["--mesh", "tp", "--async-tp", "--no-compile"], None, "--async-tp needs the blocks compiled by inductor"),
        (
            ["--mesh", "tp", "--async-tp", "--compile", "--compile-backend", "aot_eager"],
            None,
            "got --compile-backend aot_eager",
        ),
        (["--mesh", "tp", "--runs", "floor,replicate"], None, "--runs replicate with --mesh tp: only floor,"),
        (["--mesh", "hsdp", "--runs", "ddp"], None, "measure ddp with --mesh dp"),
        (["--mesh", "tp", "--model", "hf-llama"], None, "--model hf-llama with --mesh tp: the TP plan"),
        (["--mesh", "tp", "--float8"], None, "--float8 with --mesh tp: torchao's float8 needs its own TP styles"),
        (
            ["--mesh", "hsdp", "--dp-replicate", "2", "--tp-size", "4"],
            "4",
            "--dp-replicate 2 x --tp-size 4 must divide the world size 4 (--mesh hsdp with --tp-size)",
        ),
        (
            ["--mesh", "hsdp", "--tp-size", "2", "--runs", "floor,fully_shard,replicate"],
            None,
            "--runs replicate with --mesh hsdp --tp-size: only floor, fully_shard, fsdp2 run on a 3D mesh",
        ),
        (["--mesh", "hsdp", "--tp-size", "2", "--float8"], None, "--float8 with --mesh hsdp --tp-size: torchao"),
    ],
)
def test_mesh_flags_are_refused_where_they_do_not_fit(
    argv: list[str],
    env: str | None,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(bench_args, "hf_available", lambda: True)  # refused for the mesh, not the package
    monkeypatch.setattr(bench_args, "float8_available", lambda: True)
    if env is not None:
        monkeypatch.setenv("WORLD_SIZE", env)
    with pytest.raises(SystemExit):
        benchmark.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and ": error: " in err[-1], err


def test_graphed_fully_shard_runs_on_a_2d_mesh_and_graphed_replicate_does_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: True)  # graphed runs parse only with CUDA
    for mesh in ("hsdp", "tp"):
        runs = "floor_graphed,fully_shard_graphed,fsdp2"
        assert benchmark.parse_args(["--mesh", mesh, "--runs", runs]).runs == runs
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--mesh", "tp", "--runs", "fully_shard_graphed,replicate_graphed"])
    assert "--runs replicate_graphed with --mesh tp" in capsys.readouterr().err


def test_build_refuses_a_run_its_mesh_does_not_measure() -> None:
    mesh = bench_mesh.BenchMesh("tp", None, None)
    with pytest.raises(ValueError, match=r"build: run 'replicate' does not run on --mesh tp; runs there: "):
        bench_build.build("replicate", benchmark.get_config("tiny"), torch.device("cpu"), mesh=mesh)


def _placements(model: torch.nn.Module) -> dict[str, tuple]:
    return {
        name: (tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.placements)) for name, p in model.named_parameters()
    }


@pytest.mark.filterwarnings("ignore:DTensor random operators")
@pytest.mark.parametrize("kind", ["hsdp", "tp"])
def test_2d_meshes_shard_ours_and_fsdp2_alike(kind: str) -> None:
    """On 4 ranks: the same 2D mesh and the same placements for every parameter of fully_shard
    and FSDP2 (HSDP's (Replicate, Shard(0)); TP's plan on the blocks, then dp shards); the
    floor is plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    cfg = benchmark.get_config("tiny")
    args = benchmark.parse_args(["--preset", "tiny", "--mesh", kind])
    with fake_process_group(4):
        mesh = bench_mesh.build_mesh(args, "cpu")
        ours = bench_build.build("fully_shard", cfg, torch.device("cpu"), mesh=mesh).model
        theirs = bench_build.build("fsdp2", cfg, torch.device("cpu"), mesh=mesh).model
        floor = bench_build.build("floor", cfg, torch.device("cpu"), mesh=mesh).model
        assert not any(isinstance(p, DTensor) for p in floor.parameters())
        assert _placements(ours) == _placements(theirs)
        placements = _placements(ours)
    if kind == "hsdp":
        assert set(placements.values()) == {(("replicate", "shard"), (Replicate(), Shard(0)))}
        return
    assert {mesh for mesh, _ in placements.values()} == {("dp", "tp")}  # the recipe covers every parameter
    wq, wo, norm = (placements[f"layers.0.{n}.weight"] for n in ("attention.wq", "attention.wo", "attention_norm"))
    assert wq[1][1] == Shard(0) and wo[1] == (Shard(0), Shard(1))  # Colwise, Rowwise on tp
    assert norm[1] == placements["norm.weight"][1] == (Shard(0), Replicate())  # sequence-parallel norms
    assert placements["output.weight"][1][1] == placements["tok_embeddings.weight"][1][1] == Shard(0)  # by vocabulary


def test_report_counts_tokens_per_gpu_and_names_the_mesh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under `--mesh tp` a floor GPU trains its whole batch, a TP GPU half of its group's: the
    ratio against the floor is per GPU-second, not per step."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    out = tmp_path / "b.json"
    args = benchmark.parse_args(["--mesh", "tp", "--batch-size", "2", "--seq-len", "8", "--out", str(out)])
    steps = {"floor": 1.0, "fully_shard": 0.8, "fsdp2": 1.0}
    rounds = [{run: _result(run, s, 5.0) | {"tokens_gpu": 16 if run == "floor" else 8} for run, s in steps.items()}]
    benchmark.report(rounds, args, 4, "GPU")
    data = json.loads(out.read_text())
    assert data["mesh"] == "dp 2 x tp 2" and data["args"]["tp_size"] == 2
    assert data["ratios"]["fully_shard/floor"]["throughput"] == pytest.approx(0.5 / 0.8)  # 10 vs 16 tok/s
    assert data["ratios"]["fully_shard/fsdp2"]["throughput"] == pytest.approx(1.25)  # same tokens: step ratio
    printed = capsys.readouterr().out
    assert "GPU x4, mesh dp 2 x tp 2, model own" in printed
    assert any(line.split()[:3] == ["fully_shard", "0.8000", "10"] for line in printed.splitlines()), printed


_SMOKE_MESHES = {
    "hsdp": ["--mesh", "hsdp"],
    "tp": ["--mesh", "tp"],
    "hsdp_tp": ["--mesh", "hsdp", "--dp-replicate", "2", "--tp-size", "2"],  # 2 x 1 x 2
}


def _smoke(rank: int, world_size: int) -> dict:
    out = {}
    for kind, mesh in _SMOKE_MESHES.items():
        args = benchmark.parse_args(smoke_argv(*mesh, "--runs", "floor,fully_shard,fsdp2", batch_size=2))
        rounds = benchmark.run_rounds(args, torch.device("cpu"))
        out[kind] = {run: (res["loss"], res["tokens_gpu"]) for run, res in rounds[0].items()}
    return out


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_smoke_run_of_each_2d_mesh_on_four_gloo_ranks() -> None:
    """The whole path (mesh, build, train, report) on 2 x 2 meshes: fully_shard's loss after a
    step is FSDP2's (same mesh, model, data and policy), every rank's finite; under tp the
    ranks of a tp group train on one batch (the same loss) and count half its tokens."""
    import math

    results = run_on_ranks(_smoke, 4, timeout=300)
    for kind in _SMOKE_MESHES:
        for res in (r[kind] for r in results):
            (floor, floor_tokens), (ours, tokens), (theirs, _) = res["floor"], res["fully_shard"], res["fsdp2"]
            assert all(math.isfinite(v) and 4.0 < v < 7.0 for v in (floor, ours, theirs)), res
            assert ours == theirs, (kind, res)
            assert floor_tokens == 32 and tokens == (32 if kind == "hsdp" else 16)
    for kind in ("tp", "hsdp_tp"):
        assert results[0][kind]["fully_shard"] == results[1][kind]["fully_shard"]  # ranks 0, 1: one tp group
        assert results[0][kind]["fully_shard"] != results[2][kind]["fully_shard"]  # another dp rank's batch
