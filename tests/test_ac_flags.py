"""`--ac none|full|selective` of the main job (examples/train.py) and of the benchmark.

The main job: each mode trains the same model as no checkpointing (2 gloo ranks; checkpointing
changes what is kept, not the math), every block carries the checkpoint the mode asks for, and
`--activation-checkpointing` still means `--ac full`. The benchmark: every contender's blocks
are checkpointed by its own library's checkpoint with the mode's policy, and a 2-rank CPU run
of every contender with `--ac selective` trains.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _harness import assert_close_tensors, fake_process_group, run_on_ranks
from test_benchmark_tools import _smoke
from test_train_example import SMALL, _losses, _reference, _run

from benchmarks import bench_build
from benchmarks import side_by_side as benchmark
from composable import checkpoint
from models.model import Transformer, get_config
from trainer import main_job as train_script
from trainer import parallel


def test_ac_flag_parses_and_the_old_flag_is_full() -> None:
    assert train_script.parse_args(SMALL).ac == "none"
    assert train_script.parse_args(SMALL + ["--ac", "selective"]).ac == "selective"
    old = train_script.parse_args(SMALL + ["--activation-checkpointing"])
    assert old.ac == "full" and old.activation_checkpointing
    with pytest.raises(SystemExit):
        train_script.parse_args(SMALL + ["--ac", "some"])


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_checkpoint_blocks_applies_the_mode(ac: str) -> None:
    model = Transformer(get_config("tiny"))
    parallel.checkpoint_blocks(model.layers, ac)
    for block in model.layers:
        state = checkpoint.state(block)
        assert state is not None and (state.context_fn is not None) == (ac == "selective")
    parallel.checkpoint_blocks(Transformer(get_config("tiny")).layers, "none")  # nothing to check: no error


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_ac_modes_train_the_same_model(tmp_path: Path, ac: str) -> None:
    expected = _reference(4)
    argv = SMALL + ["--steps", "4", "--eval-every", "0", "--ckpt-every", "0", "--out", str(tmp_path / "run")]
    got = _losses(_run(argv + ["--ac", ac]))
    assert_close_tensors(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5, msg=ac)


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_benchmark_checkpoints_every_block_of_every_contender() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    assert benchmark.parse_args([]).ac == "none"
    assert benchmark.parse_args(["--ac", "selective"]).ac == "selective"
    cfg = benchmark.get_config("tiny")
    with fake_process_group(2):
        for run in ("floor", "fully_shard", "fsdp2", "replicate"):
            for ac in ("none", "full", "selective"):
                net = bench_build.build(run, cfg, torch.device("cpu"), ac=ac).model
                for block in bench_build.blocks(net):
                    if run == "fsdp2":  # torchtitan's way: torch's wrapper, sharded by FSDP2
                        assert isinstance(block, CheckpointWrapper) == (ac != "none"), (run, ac)
                        selective = ac != "none" and "context_fn" in block.checkpoint_fn.keywords
                    else:
                        state = checkpoint.state(block)
                        assert (state is not None) == (ac != "none"), (run, ac)
                        selective = state is not None and state.context_fn is not None
                    assert selective == (ac == "selective"), (run, ac)
    with pytest.raises(ValueError, match="build: ac must be one of"):
        bench_build.build("floor", cfg, torch.device("cpu"), ac="some")


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_benchmark_compiles_the_checkpointed_block() -> None:
    """With --compile the checkpoint is inside every contender's block graph: ours compiles the
    block (checkpoint traces itself in), FSDP2's compiles torch's wrapper, as torchtitan does."""
    cfg = benchmark.get_config("tiny")
    with fake_process_group(2):
        for run in ("fully_shard", "fsdp2"):
            net = bench_build.build(run, cfg, torch.device("cpu"), ac="selective", compile_backend="aot_eager").model
            for block in bench_build.blocks(net):
                assert block._compiled_call_impl is not None, run
                inner = getattr(block, "_checkpoint_wrapped_module", None)
                assert inner is None or inner._compiled_call_impl is None, run  # compiled once, outside


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_benchmark_smoke_run_with_compiled_selective_checkpointing() -> None:
    argv = ["--ac", "selective", "--compile", "--compile-backend", "aot_eager", "--runs", "fully_shard,fsdp2"]
    losses = run_on_ranks(_smoke, 2, argv, timeout=300)[0]
    assert list(losses) == ["fully_shard", "fsdp2"]
    assert all(math.isfinite(v) and 4.0 < v < 7.0 for v in losses.values()), losses


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_benchmark_smoke_run_with_selective_checkpointing() -> None:
    losses = run_on_ranks(_smoke, 2, ["--ac", "selective"], timeout=300)[0]
    assert list(losses) == list(bench_build.RUNS)
    assert all(math.isfinite(v) and 4.0 < v < 7.0 for v in losses.values()), losses
