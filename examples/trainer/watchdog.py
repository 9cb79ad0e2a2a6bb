"""Heartbeats and the stall watchdog of train.py's ranks.

Every rank runs a daemon thread that writes a heartbeat to the job's store once a second:
its pid and host, and the step and phase its main thread last reported. When a collective
fails or times out (`--timeout`), `diagnose()` reads the other ranks' heartbeats and names
the culprit: a rank whose process is gone or stopped (same host: read from /proc), one that
stopped beating (another host), one that reported its own error, or one that is alive but
stuck at an earlier step. A SIGSTOPped process stops all its threads, so its heartbeat
stops too; a rank stuck in Python or I/O keeps beating but its step does not move.

The thread is also the backstop for waits that no process-group timeout covers (NCCL work
that a `.item()` blocks on, a hung file system): when its own main thread has reported no
progress for `--timeout` plus a margin, it prints the diagnosis and ends the process.

`ExitGuard` bounds the end of a rank (launch.py's teardown: meeting the other ranks, releasing
CUDA graphs and pending work, destroying the process group, exit handlers): past its bound it
prints which phase hung and the Python stacks of every thread, and ends the process with
`EXIT_TEARDOWN_HUNG`, so that a job never outlives its summary by more than the bound.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

INTERVAL_S = 1.0
EXIT_TEARDOWN_HUNG = 3  # exit status of a rank whose teardown did not finish within its bound
COMM_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "timed out",
    "Socket Timeout",
    "NCCL error",
    "ProcessGroupNCCL",
    "Connection refused",
)


def is_comm_failure(exc: BaseException) -> bool:
    """Whether `exc` comes from the process group (a peer died, stalled, or the network broke)
    rather than from this rank's own work: such errors are reported with `diagnose()`."""
    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
        return True
    return any(s in str(exc) for s in COMM_ERRORS)


def process_state(pid: int) -> str:
    """'gone', 'stopped', 'zombie' or 'running' for a process on this host ('' if unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return ""
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(state, "running")


class Watchdog:
    """Heartbeat writer, stall backstop and post-mortem for one rank. With `store=None` it only
    keeps the progress marks (train.train run under a test harness)."""

    def __init__(
        self, store: dist.Store | None, rank: int, world: int, timeout: float, interval: float = INTERVAL_S
    ) -> None:
        self.store, self.rank, self.world, self.timeout, self.interval = store, rank, world, timeout, interval
        self.step, self.phase = 0, "startup"
        self._since = time.monotonic()
        self._lock = threading.Lock()  # the store client is shared by the thread and diagnose()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.host = socket.gethostname()
        # A healthy rank beats every `interval`; a beat older than this means it stopped.
        self.stale_after = max(4 * interval, min(10.0, timeout / 2))
        self.backstop_after = timeout + max(10.0, 0.25 * timeout)

    def start(self) -> Watchdog:
        if self.store is not None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="train-watchdog", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)

    def progress(self, step: int, phase: str) -> None:
        """Called by the main thread at every phase boundary (cheap: the thread sends the beat)."""
        self.step, self.phase, self._since = step, phase, time.monotonic()
        self._wake.set()  # beat now, not up to a second later: the post-mortem names the phase

    def report_failure(self, message: str) -> None:
        """Tell the other ranks why this one is about to exit (they name it in their message)."""
        self._set(f"failed/{self.rank}", message)

    # ------------------------------------------------------------------------- thread

    def _set(self, key: str, value: str) -> None:
        if self.store is None:
            return
        with self._lock, contextlib.suppress(Exception):  # the store may be gone at teardown
            self.store.set(key, value)

    def _beat(self) -> None:
        self._set(
            f"hb/{self.rank}",
            json.dumps(
                {"time": time.time(), "pid": os.getpid(), "host": self.host, "step": self.step, "phase": self.phase}
            ),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._beat()
            stalled = time.monotonic() - self._since
            if stalled > self.backstop_after:
                print(
                    f"train.py: rank {self.rank}: no progress for {stalled:.0f} s at step {self.step} ({self.phase}), "
                    f"over --timeout {self.timeout:g}; {self.diagnose()}",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)  # the main thread is blocked where no exception can reach it

    # ------------------------------------------------------------------------- post-mortem

    def _peers(self) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        beats: dict[int, dict[str, Any]] = {}
        failures: dict[int, str] = {}
        if self.store is None:
            return beats, failures
        with self._lock:
            for r in range(self.world):
                if r == self.rank:
                    continue
                with contextlib.suppress(Exception):
                    if self.store.check([f"failed/{r}"]):
                        failures[r] = self.store.get(f"failed/{r}").decode()
                    if self.store.check([f"hb/{r}"]):
                        beats[r] = json.loads(self.store.get(f"hb/{r}"))
        return beats, failures

    def diagnose(self) -> str:
        """One clause per rank that looks at fault, e.g. `rank 1 (pid 4242) is stopped (SIGSTOP?)
        at step 3 (forward/backward)`; the lagging ranks if every rank still beats."""
        if self.store is None:
            return "no heartbeats to say which rank failed"
        beats, failures = self._peers()
        now, faults, behind = time.time(), [], []
        for r in range(self.world):
            if r == self.rank:
                continue
            if r in failures:
                faults.append(f"rank {r} failed: {failures[r]}")
                continue
            hb = beats.get(r)
            if hb is None:
                faults.append(f"rank {r} never reported (it died or hung while starting)")
                continue
            who = f"rank {r} (pid {hb['pid']}" + ("" if hb["host"] == self.host else f" on {hb['host']}") + ")"
            where = f"at step {hb['step']} ({hb['phase']})"
            state = process_state(hb["pid"]) if hb["host"] == self.host else ""
            age = now - hb["time"]
            if state in ("gone", "zombie"):
                faults.append(f"{who} is gone: it died {where}")
            elif state == "stopped":
                faults.append(f"{who} is stopped (SIGSTOP?) {where}, silent for {age:.0f} s")
            elif age > self.stale_after:
                faults.append(f"{who} has not responded for {age:.0f} s {where}: stopped or hung")
            elif (hb["step"], hb["phase"]) != (self.step, self.phase):
                behind.append(f"{who} is alive but {where}")
        if faults:
            return "; ".join(faults)
        if behind:
            return "; ".join(behind) + f", while this rank is at step {self.step} ({self.phase})"
        return "every other rank still responds"


class ExitGuard:
    """A daemon thread that ends this process if the teardown it watches does not finish
    within `bound` seconds: one line naming the rank and the phase it hung in, the stacks of
    all threads (faulthandler), exit status `EXIT_TEARDOWN_HUNG`. `phase(name)` says where the
    teardown is; the guard stays armed until the process exits (it is meant to end with
    `os._exit`), or `disarm()`."""

    def __init__(self, rank: int, bound: float) -> None:
        self.rank, self.bound, self.current = rank, bound, "start"
        self._disarmed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="train-exit-guard", daemon=True)

    def start(self) -> ExitGuard:
        self._thread.start()
        return self

    def phase(self, name: str) -> None:
        self.current = name

    def disarm(self) -> None:
        self._disarmed.set()

    def _run(self) -> None:
        if self._disarmed.wait(self.bound):
            return
        print(
            f"train.py: rank {self.rank}: teardown did not finish within {self.bound:g} s ({self.current}); "
            f"the stacks of its threads follow; exiting with status {EXIT_TEARDOWN_HUNG}",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(Exception):  # stderr without a file descriptor: no stacks, still the exit
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(EXIT_TEARDOWN_HUNG)
