"""examples/train.py under faults and misuse (runs sharing an --out and what --resume accepts:
test_train_resume.py): a damaged checkpoint falls back to the newest intact one, a full disk says so, a rank
that dies or stalls ends the job naming it within --timeout, --out and every flag are checked
up front, metrics survive a crash, and each preset brings its own learning rate.

Training runs go through `train.train` on the harness's gloo ranks with a very small model;
the two tests about real signals run the command line (a rank must really die or stop).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _harness import assert_close_tensors, run_on_ranks
from test_train_example import SMALL, _losses, _reference, _run, command_line, register_command_line

from models.model import PRESET_LR, Transformer, get_config
from trainer import checkpointing, memory_check, options
from trainer import main_job as train_script
from trainer.checkpointing import CheckpointError
from trainer.parallel import UsageError
from trainer.watchdog import Watchdog

BASE = SMALL + ["--eval-every", "0"]


def _attempt(rank: int, world_size: int, argv: list[str]) -> dict:
    """train.train on this rank; a refusal or checkpoint error comes back as data, and what
    rank 0 printed to stderr (warnings) as "stderr"."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            result = train_script.train(train_script.parse_args(argv))
    except (UsageError, CheckpointError) as e:
        result = {"error": type(e).__name__, "message": str(e)}
    return {**result, "stderr": err.getvalue()}


def _try(argv: list[str], world_size: int = 2) -> dict:
    return run_on_ranks(_attempt, world_size, argv)[0]


# ----------------------------------------------------------------------------- 1: damaged checkpoints


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped byte in weights": (
        lambda d: _flip_byte(next(d.glob("__1_*.distcp"))),
        "checksum mismatch in __1_0.distcp",
    ),
    "truncated metadata": (lambda d: os.truncate(d / ".metadata", 10), ".metadata has 10 bytes"),
    "missing shard": (lambda d: os.remove(next(d.glob("__0_*.distcp"))), "__0_0.distcp is missing"),
    "garbled state file": (lambda d: (d / checkpointing.STATE_FILE).write_text('{"step": 6,'), "unreadable"),
    "edited state file": (
        lambda d: (d / checkpointing.STATE_FILE).write_text(
            (d / checkpointing.STATE_FILE).read_text().replace('"step": 6', '"step": 5', 1)
        ),
        "checksum mismatch in trainer_state",
    ),
}


def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path: Path) -> None:
    argv = BASE + ["--steps", "6", "--ckpt-every", "3", "--run-id", "r"]
    _run(argv + ["--out", str(tmp_path / "pristine")])
    expected = _reference(6, ("--ckpt-every", "3"))
    for name, (damage, reason) in DAMAGE.items():
        out = tmp_path / name.replace(" ", "-")
        shutil.copytree(tmp_path / "pristine", out)
        newest = out / "r" / "checkpoints" / "step_0000006"
        damage(newest)
        got = _try(argv + ["--out", str(out), "--resume"])
        assert got.get("resumed_from") == 3, (name, got)
        assert tuple(_losses(got)) == expected, name
        (line,) = [ln for ln in got["stderr"].splitlines() if "damaged" in ln]
        assert reason in line and "falling back to the previous one" in line, (name, line)
        assert (out / "r" / "checkpoints" / "step_0000006.damaged").is_dir()  # kept aside, not pruned into
    # The same step damaged again: set aside next to the first one, not over it.
    out = tmp_path / "flipped-byte-in-weights"
    _flip_byte(next((out / "r" / "checkpoints" / "step_0000006").glob("__1_*.distcp")))
    assert _try(argv + ["--out", str(out), "--resume"]).get("resumed_from") == 3
    assert (out / "r" / "checkpoints" / "step_0000006.damaged-2").is_dir()
    # Nothing intact at all: one line, no traceback.
    out = tmp_path / "all-damaged"
    shutil.copytree(tmp_path / "pristine", out)
    for step in ("step_0000003", "step_0000006"):
        _flip_byte(next((out / "r" / "checkpoints" / step).glob("__0_*.distcp")))
    got = _try(argv + ["--out", str(out), "--resume"])
    assert got.get("error") == "CheckpointError" and "no intact checkpoint" in got["message"], got


def test_disk_full_is_reported_as_no_space_left(tmp_path: Path) -> None:
    """DCP reports a full disk as `unexpected pos 704 vs 598` without an errno (seen on a 1 MiB tmpfs)."""
    pos = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    full = checkpointing.CheckpointException("write failed", {1: (pos, None)})
    old = checkpointing._free_bytes
    try:
        checkpointing._free_bytes = lambda path: 4096
        message = checkpointing.describe_write_failure(full, str(tmp_path / "step_0000003.tmp"), 3)
    finally:
        checkpointing._free_bytes = old
    assert message.startswith("no space left on device while writing checkpoint step 3"), message
    assert "no space left" in checkpointing.describe_write_failure(
        OSError(errno.ENOSPC, "No space left on device"), str(tmp_path), 3
    )
    assert checkpointing.describe_write_failure(pos, str(tmp_path), 3).startswith(
        "could not write checkpoint step 3"
    )  # disk not full


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0, reason="mounting a tiny tmpfs needs root"
)
def test_disk_full_for_real_on_a_tiny_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)], capture_output=True, check=False
    ).returncode:
        pytest.skip("mount not permitted here")
    try:
        got = _try(BASE + ["--steps", "2", "--ckpt-every", "2", "--out", str(mnt)])
        assert got.get("error") == "CheckpointError", got
        assert got["message"].startswith("no space left on device while writing checkpoint step 2"), got["message"]
        assert not list(mnt.glob("*/checkpoints/step_*")), "the partial save is removed (its space given back)"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ----------------------------------------------------------------------------- 2: dead and stalled ranks


# Both run the command line (a rank must really die or stop), side by side with the other
# registered command lines (test_train_example.command_line).
register_command_line(
    "killed rank", *BASE, "--steps", "6", "--ckpt-every", "0", "--fault", "1:KILL:3", "--timeout", "30"
)
register_command_line(
    "stopped rank", *BASE, "--steps", "6", "--ckpt-every", "0", "--fault", "1:STOP:2", "--timeout", "4"
)


def test_a_killed_rank_ends_the_job_naming_the_rank_and_signal() -> None:
    out, proc, _ = command_line("killed rank")
    assert proc.returncode == 128 + 9, proc.stderr
    assert "rank 1 (pid" in proc.stderr and "was killed by SIGKILL" in proc.stderr, proc.stderr
    assert "rank 0: lost the connection to another rank" in proc.stderr and "rank 1 (pid" in proc.stderr
    assert "Traceback" not in proc.stderr and "leaked semaphore" not in proc.stderr, proc.stderr
    (run_dir,) = out.iterdir()  # 5: the steps done before the crash are in metrics.csv
    assert (run_dir / "metrics.csv").read_text().count("\n") == 1 + 2


def test_a_stopped_rank_surfaces_within_the_timeout_naming_it() -> None:
    _, proc, elapsed = command_line("stopped rank")
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert any(
        ln.startswith("train.py: rank 0: a collective timed out after --timeout 4 s")
        and "rank 1 (pid" in ln
        and "is stopped" in ln
        for ln in lines
    ), proc.stderr
    assert any("rank 1 (pid" in ln and "was stopped" in ln for ln in lines), proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 600  # not torch's 30 minutes (startup on a loaded 2-core machine is most of it)


def test_watchdog_names_a_silent_rank_on_another_host() -> None:
    """The post-mortem from heartbeats alone (a rank elsewhere: no /proc to look at)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    now = time.time()
    store.set(
        "hb/1", json.dumps({"time": now - 30, "pid": 4242, "host": "elsewhere", "step": 3, "phase": "evaluation"})
    )
    store.set(
        "hb/2", json.dumps({"time": now, "pid": 4243, "host": "elsewhere", "step": 5, "phase": "forward/backward"})
    )
    store.set("failed/3", "ValueError: bad batch")
    dog = Watchdog(store, rank=0, world=4, timeout=10)
    dog.progress(5, "forward/backward")
    text = dog.diagnose()
    assert "rank 1 (pid 4242 on elsewhere) has not responded for 30 s at step 3 (evaluation)" in text, text
    assert "rank 3 failed: ValueError: bad batch" in text and "rank 2" not in text


# ----------------------------------------------------------------------------- 3: --out, metrics


def test_out_that_is_a_file_or_unwritable_is_refused_up_front(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, expected in [(afile, "is a file, not a directory"), (afile / "sub", "is not writable")]:
        with pytest.raises(SystemExit) as e:
            options.parse_args(BASE + ["--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and expected in err and str(out) in err and err.count("\n") == 1, err


def test_metrics_are_written_as_the_run_goes(tmp_path: Path) -> None:
    got = _run(BASE + ["--steps", "6", "--ckpt-every", "0", "--out", str(tmp_path), "--stop-after", "3"])  # "killed"
    lines = (Path(got["run_dir"]) / "metrics.csv").read_text().splitlines()
    assert len(lines) == 4 and lines[0].startswith("step,loss") and lines[3].startswith("3,")


# ----------------------------------------------------------------------------- 4: nonsense flags


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--ckpt-every", "-1"),
        ("--eval-every", "-1"),
        ("--max-norm", "-1"),
        ("--max-norm", "nan"),
        ("--seq-len", "0"),
        ("--seq-len", "-4"),
        ("--seq-len", "2000000"),
        ("--warmup-steps", "-10"),
        ("--ffn-dim", "0"),
        ("--hsdp-shard-size", "0"),
        ("--hsdp-shard-size", "-1"),
        ("--dim", "0"),
        ("--n-layers", "0"),
        ("--n-layers", "-2"),
        ("--n-heads", "0"),
        ("--lr", "nan"),
        ("--lr", "-1"),
        ("--lr", "inf"),
        ("--weight-decay", "-0.1"),
        ("--timeout", "0"),
        ("--run-id", "../x"),
        ("--steps", "0"),
    ],
)
def test_nonsense_flag_values_are_refused_with_one_line(
    flag: str, value: str, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as e:
        options.parse_args(["--out", str(tmp_path), flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and flag in err and value.lstrip("./") in err, err


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--cpu-offload", "--parallel", "replicate"],
            "--cpu-offload needs --parallel fsdp, hsdp or tp (replicate has no offload policy)",
        ),
        (
            ["--cpu-offload", "optimizer-state", "--optimizer", "muon"],
            "--cpu-offload optimizer-state steps in buckets, and Muon's step communicates: pass --cpu-offload host",
        ),
        (
            ["--step-in-backward", "--max-norm", "0"],
            "--step-in-backward steps CPUOffloadPolicy's host parameters: pass --cpu-offload host",
        ),
        (
            ["--cpu-offload", "--step-in-backward", "--mp", "fp16"],
            "--step-in-backward takes AdamW, without --mp fp16 (a GradScaler), --pp (pipeline stages) "
            "or --fault-tolerant (its vote to commit comes after backward)",
        ),
    ],
)
def test_offload_combinations_refused_with_one_line(
    flags: list[str], line: str, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit):
        options.parse_args(["--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith(line), err


def test_every_flag_has_help_that_states_its_default_once() -> None:
    parser = options.build_parser()
    # One line per flag: wide enough that no help wraps or starts on a line of its own.
    parser.formatter_class = functools.partial(parser.formatter_class, width=100_000, max_help_position=100_000)
    lines = [line.strip() for line in parser.format_help().splitlines() if line.startswith("  -")]
    assert len(lines) > 40, lines
    for line in lines:
        invocation, _, text = line.partition("  ")  # an invocation has single spaces only
        text = text.strip()
        assert text, f"{invocation} has no help"
        assert len(re.findall(r"\(default:", text)) <= 1 and "(default: None)" not in text, line
        # An alias (--activation-checkpointing is --ac full) has no default of its own.
        assert "default" in text or invocation in ("-h, --help", "--activation-checkpointing"), line


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_training(tmp_path: Path) -> None:
    args = options.parse_args(["--seq-len", "1000000", "--batch-size", "64", "--out", str(tmp_path)])
    cfg = options.model_config(args)
    with pytest.raises(UsageError, match=r"--seq-len 1000000 with --batch-size 64 needs at least \d+"):
        memory_check.check_memory(args, cfg, 1_000_000, 2, 64 * 2**30, "this host has per rank (2 ranks)")
    tiny = options.parse_args(["--out", str(tmp_path)])
    memory_check.check_memory(tiny, options.model_config(tiny), 256, 2, 2**30, "")  # the default run fits in 1 GiB


# ----------------------------------------------------------------------------- 5: presets


def test_each_preset_brings_its_learning_rate_and_scaled_init(tmp_path: Path) -> None:
    lrs = {p: options.parse_args(["--preset", p, "--out", str(tmp_path)]).lr for p in ("tiny", "small", "1b")}
    assert lrs == PRESET_LR and lrs["tiny"] == 3e-3  # tiny's CPU run is unchanged
    dims = {p: get_config(p).dim for p in lrs}
    # Adam moves every weight by about lr per step: wider layers need a smaller rate (~1/width).
    assert lrs["1b"] * dims["1b"] <= 2 * lrs["tiny"] * dims["tiny"] and lrs["1b"] <= 5e-4
    assert options.parse_args(["--preset", "1b", "--lr", "1e-3", "--out", str(tmp_path)]).lr == 1e-3
    torch.manual_seed(0)
    model = Transformer(get_config("small", vocab_size=256))
    cfg = model.cfg
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # residual outputs scaled down by depth (GPT-2 / Llama)
    for block in model.layers:
        assert abs(block.attention.wo.weight.std().item() - out_std) < 0.15 * out_std
        assert abs(block.feed_forward.w2.weight.std().item() - out_std) < 0.15 * out_std
        assert abs(block.attention.wq.weight.std().item() - cfg.init_std) < 0.15 * cfg.init_std


# ----------------------------------------------------------------------------- compile and wrapping


def _units_and_compile(rank: int, world_size: int, argv: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from composable import fully_shard
    from trainer.parallel import parallelize

    args = options.parse_args(argv)
    args.mp = "fp32"
    model = Transformer(options.model_config(args))
    mesh = init_device_mesh("cpu", (world_size,))
    parallelize(model, args, mesh, mesh)
    return {
        "sharded": sorted(name for name, m in model.named_modules() if fully_shard.state(m) is not None),
        "compiled": [block._compiled_call_impl is not None for block in model.layers],
    }


@pytest.mark.parametrize("tie", [False, True])
def test_embeddings_and_head_are_their_own_fully_shard_groups(tie: bool, tmp_path: Path) -> None:
    argv = (
        BASE
        + ["--out", str(tmp_path), "--compile", "--compile-backend", "aot_eager"]
        + (["--tie-embeddings"] if tie else [])
    )
    got = run_on_ranks(_units_and_compile, 2, argv)[0]
    ends = [] if tie else ["output", "tok_embeddings"]  # tied: one parameter at both ends stays with the root
    assert got["sharded"] == sorted(["", "layers.0", "layers.1", *ends]), got
    assert got["compiled"] == [True, True]  # --compile: every block, before the APIs


def test_compile_flag_compiles_the_blocks_and_trains_like_eager(tmp_path: Path) -> None:
    """--compile with --parallel replicate (fully_shard + compile is being fixed separately)."""
    argv = BASE + ["--steps", "3", "--ckpt-every", "0", "--parallel", "replicate"]
    eager = _run(argv + ["--out", str(tmp_path / "eager")])
    assert eager["compile"] is False  # the default on CPU
    compiled = _run(argv + ["--out", str(tmp_path / "compiled"), "--compile", "--compile-backend", "aot_eager"])
    assert compiled["compile"] is True
    assert_close_tensors(torch.tensor(_losses(compiled)), torch.tensor(_losses(eager)), rtol=1e-5, atol=1e-5)
    assert options.parse_args(["--no-compile", "--out", str(tmp_path)]).compile is False
