"""The harness's report of workers that die: native and Python stacks, the dead worker replaced,
a crash between calls named by the next call, and one rerun in fresh workers for a crash."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import threading
import time
from pathlib import Path

import _harness
import pytest
import torch.distributed as dist
from _harness import RankError, WorkerCrashWarning, run_on_ranks
from test_harness import _all_reduce_ranks, _noop, _pid  # the plain rank functions

pytestmark = pytest.mark.once  # the same on every torch: CI runs it once (pyproject.toml)

# ----------------------------------------------------------------------------- rank functions
# Module level, so that the workers can unpickle them.


def _rank1_segfaults(rank: int, world_size: int) -> None:
    if rank == 1:
        faulthandler._sigsegv()


def _rank1_reads_address_zero(rank: int, world_size: int) -> None:
    if rank == 1:
        ctypes.string_at(0)  # a real SIGSEGV in native code, as a use-after-free would be


def _rank1_segfaults_after_returning(rank: int, world_size: int) -> None:
    """What a collective left in flight by a call would do: crash after the call returned."""
    if rank == 1:
        threading.Thread(target=lambda: (time.sleep(0.2), ctypes.string_at(0)), daemon=True).start()


def _rank1_aborts_once(rank: int, world_size: int, marker: str) -> int:
    """Rank 1 dies of SIGABRT (as on heap corruption) the first time only; the marker file
    remembers the first time across workers."""
    dist.barrier()
    if rank == 1 and not os.path.exists(marker):
        Path(marker).touch()
        os.abort()
    return rank


# ----------------------------------------------------------------------------- tests


def test_dead_worker_is_reported_with_its_stack_and_replaced() -> None:
    with pytest.raises(RankError, match=r"rank 1 failed: worker died \(exit code -11\)") as info:
        run_on_ranks(_rank1_segfaults, 2, retry_crash=False)
    assert "Segmentation fault" in info.value.errors[1]
    assert "_rank1_segfaults" in info.value.errors[1]  # faulthandler's Python stack
    assert run_on_ranks(_all_reduce_ranks, 2) == [3.0, 3.0]


def test_segfault_reports_native_and_python_stacks() -> None:
    """A crash in native code (gloo's threads have no Python frame) is reported with torch's
    native stacks of every thread, the crashing one first, and faulthandler's Python stacks."""
    with pytest.raises(RankError, match=r"rank 1 failed: worker died \(exit code -11\)") as info:
        run_on_ranks(_rank1_reads_address_zero, 2, retry_crash=False)
    note = info.value.errors[1]
    native = note.split("----- all threads -----")[0]
    assert native.startswith("----- native stack of the crashing thread -----\n"), note[:2000]
    assert "SIGSEGV(11)" in native and "fatalSignalHandler" in native and "frame #" in native, note[:2000]
    assert "Fatal Python error: Segmentation fault" in note, note[-3000:]
    assert "_rank1_reads_address_zero" in note  # faulthandler's Python stack
    assert "_rank1_reads_address_zero" in str(info.value)
    assert run_on_ranks(_all_reduce_ranks, 2) == [3.0, 3.0]


def test_worker_dying_between_calls_fails_the_next_call() -> None:
    """A crash after a call returned (something it left in flight) is reported by the next
    call, with its stacks, instead of the worker being replaced silently."""
    assert run_on_ranks(_rank1_segfaults_after_returning, 2) == [None, None]
    deadline = time.monotonic() + 30
    while _harness._pool.procs[1].is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RankError, match=r"(?s)rank 1 died after its previous call returned.*exit code -11") as info:
        run_on_ranks(_noop, 2)
    assert "fatalSignalHandler" in info.value.errors[1] and "<lambda>" in info.value.errors[1]
    assert run_on_ranks(_all_reduce_ranks, 2) == [3.0, 3.0]


def test_crash_is_rerun_in_fresh_workers_and_warned(tmp_path: Path) -> None:
    """A worker killed by a signal gets the call rerun once in fresh workers; when the rerun
    passes, the test passes with a WorkerCrashWarning that carries the crash's stacks."""
    before = run_on_ranks(_pid, 2)
    with pytest.warns(
        WorkerCrashWarning, match=r"(?s)_rank1_aborts_once.*rank\(s\) \[1\] died of a signal.*exit code -6"
    ):
        assert run_on_ranks(_rank1_aborts_once, 2, marker=str(tmp_path / "aborted")) == [0, 1]
    assert not set(run_on_ranks(_pid, 2)) & set(before)  # the rerun's workers are fresh ones


def test_crash_every_time_fails_after_the_rerun() -> None:
    with pytest.raises(RankError, match=r"rank 1 failed: worker died \(exit code -11\)"):
        run_on_ranks(_rank1_segfaults, 2)
    assert run_on_ranks(_all_reduce_ranks, 2) == [3.0, 3.0]


def test_python_failure_is_not_rerun(tmp_path: Path) -> None:
    with pytest.raises(RankError, match=r"rank 1 failed: RuntimeError: once"):
        run_on_ranks(_rank1_raises_once, 2, marker=str(tmp_path / "raised"))


def _rank1_raises_once(rank: int, world_size: int, marker: str) -> None:
    if rank == 1 and not os.path.exists(marker):
        Path(marker).touch()
        raise RuntimeError("once")
