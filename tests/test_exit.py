"""The end of train.py's ranks: an ordered teardown under a bound, so a finished job always exits.

A rank whose teardown blocks (here: made to block where a hung NCCL teardown would, or a thread
that never ends at exit) is ended after the bound with one line naming the rank and the phase,
the stacks of its threads, and exit status 3; a normal teardown is prompt and exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

from _harness import env_without_launcher
from test_train_example import EXAMPLES, SMALL, command_line, register_command_line

from trainer import launch
from trainer.options import parse_args
from trainer.watchdog import EXIT_TEARDOWN_HUNG

# rank 1's teardown blocks in destroy_process_group; --timeout 10 makes the bound 10 s (the
# least there is) and gives the startup collectives 10 s on a loaded machine (4 s timed out once)
register_command_line(
    "teardown hangs", *SMALL, "--steps", "3", "--eval-every", "0", "--ckpt-every", "0", "--timeout", "10",
    "--fault", "1:EXITHANG:0",
)  # fmt: skip


def test_a_rank_whose_teardown_hangs_exits_naming_it_within_the_bound() -> None:
    out, proc, _ = command_line("teardown hangs")
    assert proc.returncode == EXIT_TEARDOWN_HUNG, proc.stderr
    lines = proc.stderr.splitlines()
    assert (
        "train.py: rank 1: teardown did not finish within 10 s (destroy_process_group); the stacks of its threads "
        "follow; exiting with status 3"
    ) in lines, proc.stderr
    assert any("in teardown" in ln for ln in lines), proc.stderr  # the main thread's stack, where it hung
    assert "rank 0" not in proc.stderr, proc.stderr  # rank 0 ended cleanly
    (run_dir,) = out.iterdir()
    assert (run_dir / "metrics.json").is_file()  # the job's work was done before the teardown
    # Without the bound the job never ends: the command line's own 240 s timeout fails the test.


def test_the_bound_follows_timeout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    flags = [*SMALL, "--out", str(tmp_path)]
    assert launch.teardown_bound(parse_args(flags)) == 60.0  # --timeout 600: a minute
    assert launch.teardown_bound(parse_args([*flags, "--timeout", "4"])) == 10.0
    assert launch.teardown_bound(parse_args([*flags, "--timeout", "30"])) == 30.0


# A rank's end on a gloo world of one, as `run_rank` ends: `teardown` then `exit_process`.
_RANK_END = """
import os, sys, tempfile, threading, time
import torch.distributed as dist
from trainer import launch
from trainer.watchdog import ExitGuard

dist.init_process_group("gloo", init_method=f"file://{{tempfile.mktemp()}}", rank=0, world_size=1)
threading.Thread(target={thread}, name="left-over").start()  # a non-daemon thread still running
start = time.monotonic()
launch._GUARD = launch.teardown(0, None, bound=5.0)
assert not dist.is_initialized()
print(f"teardown {{time.monotonic() - start:.3f}}", flush=True)
launch.exit_process(0)
"""


def _rank_end(thread: str) -> tuple[subprocess.CompletedProcess, float]:
    script = _RANK_END.format(thread=thread)
    # The child finds the examples' packages as pytest does (pyproject.toml's pythonpath).
    env = env_without_launcher()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES), env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    return proc, time.monotonic() - start


def test_teardown_is_prompt_and_a_thread_that_never_ends_is_bounded() -> None:
    with ThreadPoolExecutor(2) as pool:  # side by side: each is mostly Python importing torch
        normal = pool.submit(_rank_end, "lambda: time.sleep(0.3)")
        stuck = pool.submit(_rank_end, "threading.Event().wait")
        (proc, _), (stuck_proc, _) = normal.result(), stuck.result()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    (took,) = [float(ln.split()[1]) for ln in proc.stdout.splitlines() if ln.startswith("teardown ")]
    assert took < 3.0, took  # destroy_process_group of a world of one and a collection: well under a second alone
    assert stuck_proc.returncode == EXIT_TEARDOWN_HUNG, stuck_proc.stderr
    assert stuck_proc.stderr.startswith(
        "train.py: rank 0: teardown did not finish within 5 s (joining threads); the stacks of its threads follow"
    ), stuck_proc.stderr
    assert "Thread 0x" in stuck_proc.stderr and "in exit_process" in stuck_proc.stderr, stuck_proc.stderr
