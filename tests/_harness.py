"""Test harness: the one place for multi-process machinery and for every use of torch's private
modules (here and in the ``_harness_*.py`` modules it re-exports, one concern each). Tests import
it as ``from _harness import ...``.

``run_on_ranks`` uses a persistent pool of spawned workers (``_harness_pool.py``; a few
hundredths of a second per call, where spawning per test costs 3.5-9 s on 2 cores);
``fake_process_group`` makes this process one rank of any world;
``count_collectives``/``trace_collectives`` record collectives.

A worker that dies (segfault, abort) is reported in a ``RankError`` with the C++ stacks of all
its threads (the crashing one first) and its Python stacks; a worker's stderr goes to the file
they are read from, not to the terminal. A worker killed by a signal gets its call rerun once in
fresh workers (``run_on_ranks``'s ``retry_crash``).
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

# Counting collectives is part of the harness's offer; the code lives in _comm_trace.py.
from _comm_trace import Collective, CollectiveTracer, count_collectives, trace_collectives  # noqa: E402,F401

# The benchmark's smoke command line: its own module.
from _harness_bench import smoke_argv  # noqa: F401

# Comparing tensors and DTensors, shard by shard: its own module.
from _harness_compare import assert_close_tensors  # noqa: F401

# What a failed call raises, torch's fake process group and the GPU marks: modules of their own.
from _harness_errors import RankError, crashing_thread_first, rank_error  # noqa: F401
from _harness_fake import fake_process_group, register_fake_backend  # noqa: F401
from _harness_gpu import async_tp_restored, gpu_worlds, on_gpus, requires_gpus  # noqa: F401

# Stepping two models side by side and matching them: its own module.
from _harness_parity import step_and_match  # noqa: F401
from _harness_pool import Pool, no_silent_eager_fallback

# One module object whichever way it is imported (`_harness` or `tests._harness`): two copies
# would mean two worker pools and two distinct `RankError` classes.
sys.modules.setdefault("_harness", sys.modules[__name__])
sys.modules.setdefault("tests._harness", sys.modules[__name__])
no_silent_eager_fallback()  # in pytest's process too: its tests compile in it as well

__all__ = [
    "RankError",
    "WorkerCrashWarning",
    "run_on_ranks",
    "shutdown_pool",
    "fake_process_group",
    "count_collectives",
    "trace_collectives",
    "CollectiveTracer",
    "Collective",
    "requires_gpus",
    "on_gpus",
    "assert_close_tensors",
    "step_and_match",
    "smoke_argv",
    "register_fake_backend",
]

FAILURE_GRACE_S = 5.0  # after one rank fails, how long the others get to finish or fail
# A gloo call past its timeout whose ranks still use CPU is slow (a loaded machine: CI runs two
# suites side by side, among other tenants' jobs), not hung: hung gloo ranks wait in a collective
# or a sleep, using none. It gets PROGRESS_WINDOW_S more at a time while its ranks used
# PROGRESS_MIN_CPU_S of CPU in the last window, up to LOADED_TIMEOUT_FACTOR times its timeout.
# Not on GPUs: a rank waiting there spins its host thread in the CUDA driver.
PROGRESS_WINDOW_S = 30.0
PROGRESS_MIN_CPU_S = 0.05
LOADED_TIMEOUT_FACTOR = 4.0


_pool: Pool | None = None


def shutdown_pool() -> None:
    """Stop the workers (called at exit; safe to call any time, the pool restarts lazily)."""
    global _pool
    if _pool is not None:
        _pool.shutdown()
        _pool = None


atexit.register(shutdown_pool)


class WorkerCrashWarning(UserWarning):
    """A harness worker died of a signal during a call that then passed in fresh workers."""


@dataclass
class _Outcome:
    """What one call of ``fn`` on the pool's workers gave."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    stuck: list[int] = field(default_factory=list)
    stacks: str = ""
    crashed: list[int] = field(default_factory=list)  # ranks whose worker died of a signal
    waited: float = 0.0  # seconds the call ran before it finished or was stopped


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    fresh: bool = False,
    retry_crash: bool = True,
    **kwargs: Any,
) -> list:
    """Run module-level ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    Each call gets a fresh default process group (``backend``) and the same seeds on every
    rank (``torch.manual_seed(0)``, ``random.seed(0)``). Returns the ranks' (picklable)
    return values in rank order. Raises ``RankError`` naming the failing ranks with their
    tracebacks, or ``TimeoutError`` naming the ranks that did not finish in ``timeout`` s;
    stuck or dead workers are killed and replaced. Past ``timeout``, a gloo call whose ranks
    still use CPU runs on, up to ``LOADED_TIMEOUT_FACTOR`` times ``timeout`` (slow, not hung).
    ``fresh=True`` runs ``fn`` in workers started for this call alone, for state a process keeps
    past its destroyed groups: torch's symmetric memory keeps its pool's buffers registered to a
    group *name*, and every call's default group is named "0", so a worker that ran an earlier
    call skips the collective registration its fresh peers wait in (a hang).

    A worker killed by a signal (a native crash: segfault, abort on heap corruption) is one
    of a process that served many earlier calls, so the crash may be a leftover of any of them
    or of torch's own native code. With ``retry_crash`` (the default) the call runs once more in
    fresh workers: if that passes, the crash is reported as a ``WorkerCrashWarning`` carrying
    its stacks (pytest lists it in the warnings summary) instead of failing the test; if it
    fails again, that failure is raised. ``retry_crash=False`` raises the first crash.
    """
    __tracebackhide__ = True  # pytest: show the test and the remote traceback, not this
    if world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be >= 1, got {world_size}")
    filters: list | None = list(warnings.filters)
    try:
        pickle.dumps(filters)
    except Exception:  # a filter on a locally defined category: workers keep their own
        filters = None
    try:
        blob = pickle.dumps((list(sys.path), filters, fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"run_on_ranks: fn {fn!r} and its arguments must be picklable (fn must be a module-level function): {e}"
        ) from e
    name = getattr(fn, "__name__", repr(fn))
    outcome = _call(blob, world_size, backend, timeout, fresh)
    if outcome.crashed and retry_crash:
        first = rank_error(outcome.errors, outcome.results, outcome.stuck, outcome.stacks, FAILURE_GRACE_S)
        outcome = _call(blob, world_size, backend, timeout, fresh=True)
        if not outcome.errors and not outcome.stuck:
            warnings.warn(
                WorkerCrashWarning(
                    f"run_on_ranks({name}): the worker of rank(s) {sorted(first.errors)} died of a signal; "
                    f"the call passed when run again in fresh workers. The crash:\n{first}"
                ),
                stacklevel=2,
            )
    if outcome.errors:
        raise rank_error(outcome.errors, outcome.results, outcome.stuck, outcome.stacks, FAILURE_GRACE_S)
    if outcome.stuck:
        raise TimeoutError(
            f"run_on_ranks({name}): ranks {outcome.stuck} of {world_size} did not finish within "
            f"{timeout} s (killed after {outcome.waited:.0f} s){outcome.stacks}"
        )
    return [outcome.results[r] for r in range(world_size)]


def _call(blob: bytes, world_size: int, backend: str, timeout: float, fresh: bool) -> _Outcome:
    """Run the pickled call once on the pool's first ``world_size`` workers."""
    __tracebackhide__ = True
    global _pool
    if _pool is None:  # lazily: spawn copies sys.path, which pytest has set up by now
        _pool = Pool()
    pool = _pool
    died_idle: dict[int, str] = {}
    for slot in range(world_size):  # grow the pool; replace workers that died meanwhile
        if fresh and slot < len(pool.procs) and pool.procs[slot].is_alive():
            pool.start(slot)
        elif slot >= len(pool.procs) or not pool.procs[slot].is_alive():
            if slot < len(pool.procs) and pool.procs[slot].exitcode:
                died_idle[slot] = pool.death_note(slot)
            pool.start(slot)
    if died_idle:  # a crash after a call returned (a collective or a group outliving it) must not pass unseen
        raise RankError(
            "".join(
                f"harness worker of rank {r} died after its previous call returned:\n{note}\n"
                for r, note in died_idle.items()
            ),
            died_idle,
        )
    pool.wait_ready(world_size)
    pool.call_id += 1
    for rank in range(world_size):
        pool.marks[rank] = pool.fault_size(rank)
        pool.conns[rank].send((pool.call_id, rank, world_size, pool.store.port, backend, blob))

    out = _Outcome()
    pending = {pool.conns[r]: r for r in range(world_size)}
    retire: list[int] = list(range(world_size)) if fresh else []  # dead, failed outside fn, or fresh: replace them
    ranks = list(range(world_size))
    start = time.monotonic()
    deadline, last_deadline = start + timeout, start + LOADED_TIMEOUT_FACTOR * timeout
    window = min(timeout, PROGRESS_WINDOW_S)
    cpu_seen = pool.cpu_seconds(ranks) if backend == "gloo" else None  # None: no running on past timeout
    failed = False
    try:
        while pending:
            now = time.monotonic()
            if now >= deadline:  # past the timeout: a call still computing is slow, not hung
                if failed or cpu_seen is None or now >= last_deadline:
                    break
                cpu = pool.cpu_seconds(ranks)
                if cpu is None or cpu - cpu_seen < PROGRESS_MIN_CPU_S:
                    break
                cpu_seen, deadline = cpu, min(last_deadline, now + window)
                continue
            for conn in wait(list(pending), timeout=deadline - now):
                rank = pending.pop(conn)
                try:
                    call_id, ok, payload, healthy = conn.recv()
                    assert call_id == pool.call_id, "stale message from a harness worker"
                except EOFError:
                    ok, payload, healthy = False, pool.death_note(rank), False
                    if (pool.procs[rank].exitcode or 0) < 0:
                        out.crashed.append(rank)
                if not healthy:
                    retire.append(rank)
                (out.results if ok else out.errors)[rank] = payload
                if not ok:  # the others may wait forever in a collective it never joins
                    deadline, failed = min(deadline, time.monotonic() + FAILURE_GRACE_S), True
    finally:  # also on KeyboardInterrupt: a worker still busy would answer the next call
        out.waited = time.monotonic() - start
        out.stuck = sorted(pending.values())
        out.stacks = pool.stacks(out.stuck) if out.stuck else ""
        for slot in sorted(set(out.stuck + retire)):  # a wedged process group cannot be reused: fresh workers
            pool.start(slot)
    return out


# ----------------------------------------------------------------------------- misc


def env_without_launcher() -> dict[str, str]:
    """This process's environment minus what a launcher (torchrun) sets: a script started with
    it runs as if started by hand (the main job then spawns its own ranks)."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in launcher}


def torchrun_argv(nproc: int, script: str) -> list[str]:
    """The command that starts ``script`` on ``nproc`` local ranks under torchrun, standalone: its
    rendezvous takes a free port, so launches running side by side (the GPU suite's shards, two
    test runs on one machine) never meet on torchrun's default port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script]
