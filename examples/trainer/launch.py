"""Starting and ending train.py's ranks, so that no failure is silent and no hang is endless.

Without a launcher, `spawn_local` starts `--nproc` ranks and supervises them: the job's store
lives in this parent process (a rank that dies or stops cannot take it down), and when one
rank fails the parent gives the others a moment to report, stops the rest, and ends the job
with one line naming each rank that was killed by a signal (SIGKILL: the OOM killer's) or
found stopped. Exit status: 128 + the signal's number, else the first failing rank's own.

On every rank (`run_rank`, under torchrun as well): the process group is made with
`--timeout`, a watchdog thread beats (watchdog.py), and the job's errors become one line:
exit status 2 for a refused request (UsageError), 1 for a failure; a failed collective is
reported with the diagnosis of which rank is at fault, and the rank exits at once, since a
broken gloo group can abort the process when it is torn down.

Otherwise the rank tears down in order, under a bound (`ExitGuard`, watchdog.py): it meets the
other ranks on the store (nobody destroys the process group while a peer still uses it; a peer
that does not come within half the bound is left behind, with a note), collects what the
training left (CUDA graphs that captured collectives, composable's states) and waits for the
GPU's pending work while the process group is still alive, destroys the process group, runs
the exit handlers and joins the remaining threads, then leaves with `os._exit` (`exit_process`):
the interpreter's own finalisation (CUDA and NCCL teardown in static destructors) is skipped.
A rank whose teardown exceeds the bound prints the phase and every thread's stack and exits
with status 3 (`EXIT_TEARDOWN_HUNG`), so a finished job always ends.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainer.checkpointing import CheckpointError
from trainer.options import FAULT
from trainer.parallel import UsageError
from trainer.watchdog import ExitGuard, Watchdog, is_comm_failure, process_state

STARTUP_TIMEOUT_S = 600.0  # spawning and importing torch on a loaded machine; the store's own timeout
GRACE_S = 3.0  # after one rank fails, how long the others get to say why before they are stopped
_GUARD: ExitGuard | None = None  # armed by a rank's teardown, until `exit_process`


def teardown_bound(args: argparse.Namespace) -> float:
    """Seconds a rank's teardown may take, from the end of its work to its exit."""
    return min(60.0, max(10.0, args.timeout))


# ----------------------------------------------------------------------------- parent side


def spawn_local(entry: Callable[..., None], args: argparse.Namespace) -> int:
    """Start `args.nproc` processes running `entry(rank, store_port, args)` and supervise them."""
    store = dist.TCPStore(
        "127.0.0.1", 0, args.nproc, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
    )
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=entry, args=(rank, store.port, args), name=f"rank{rank}") for rank in range(args.nproc)]
    for p in procs:
        p.start()
    try:
        return supervise(procs)
    except KeyboardInterrupt:
        _stop(procs)
        print("train.py: interrupted; stopped every rank", file=sys.stderr)
        return 130


def supervise(procs: list[Any], grace: float = GRACE_S) -> int:
    """Wait for the processes (rank i = procs[i]); after the first failure, give the others
    `grace` seconds, stop what is left, and report. Returns the job's exit status."""
    pending = {p.sentinel: p for p in procs}
    first_failure: Any = None
    deadline = None
    while pending:
        if deadline is not None:
            left = [p for p in pending.values()]
            if time.monotonic() >= deadline or all(process_state(p.pid) == "stopped" for p in left):
                break  # a stopped process never exits on its own: no point waiting for it
        ready = wait(list(pending), timeout=None if deadline is None else 0.2)
        for sentinel in ready:
            p = pending.pop(sentinel)
            p.join()
            if p.exitcode != 0 and first_failure is None:
                first_failure, deadline = p, time.monotonic() + grace
    killed = [(i, p) for i, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0]
    stopped = [(i, p) for i, p in enumerate(procs) if p.exitcode is None and process_state(p.pid) == "stopped"]
    _stop([p for p in procs if p.exitcode is None])
    for i, p in killed:
        name = (
            signal.Signals(-p.exitcode).name if -p.exitcode in signal.Signals._value2member_map_ else str(-p.exitcode)
        )
        hint = " (the kernel's OOM killer sends SIGKILL when memory runs out: see `dmesg`)" if name == "SIGKILL" else ""
        print(f"train.py: rank {i} (pid {p.pid}) was killed by {name}{hint}", file=sys.stderr, flush=True)
    for i, p in stopped:
        print(
            f"train.py: rank {i} (pid {p.pid}) was stopped (SIGSTOP or SIGTSTP) and no longer responded; ended it",
            file=sys.stderr,
            flush=True,
        )
    if killed:
        return 128 - killed[0][1].exitcode
    if first_failure is not None:
        return first_failure.exitcode or 1
    return 0


def _stop(procs: list[Any]) -> None:
    """SIGTERM, then SIGKILL what is still there after 2 s (at once for a stopped process:
    it cannot act on SIGTERM until continued)."""
    for p in procs:
        if p.exitcode is None:
            if process_state(p.pid) == "stopped":
                p.kill()
            else:
                p.terminate()
    end = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


# ----------------------------------------------------------------------------- rank side


def host_threads_for_offload() -> None:
    """CPU offload steps the optimizer on the host: give each local rank its share of the
    host's cores. torchrun sets OMP_NUM_THREADS=1 when it starts several processes, which leaves a
    1b model's host AdamW step on one core (1.8 s on an H200 host against 0.25 s on 16)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def init_torchrun_rank() -> torch.device:
    """The benchmarks' join, under torchrun: the default process group on this rank's device,
    NCCL on the local GPU or gloo on the CPU where there is none; returns the device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def init_rank(args: argparse.Namespace, external_store_port: int | None = None) -> tuple[torch.device, Watchdog]:
    """Join the job: store, arrival barrier, process group with `--timeout`, watchdog."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= min(
        world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    )
    if use_cuda:
        torch.cuda.set_device(local_rank)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = external_store_port or int(os.environ["MASTER_PORT"])
    # The store outlives any one rank when our parent or torchrun's agent hosts it; a bare
    # RANK/WORLD_SIZE launch (srun, by hand) has rank 0 host it, as env:// would.
    is_master = external_store_port is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    startup = timedelta(seconds=max(STARTUP_TIMEOUT_S, args.timeout))
    base = dist.TCPStore(host, port, world, is_master=is_master, timeout=startup, wait_for_workers=False)
    store = dist.PrefixStore(f"train/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", base)
    # Ranks start seconds apart (imports on a busy machine): meet on the store, whose timeout
    # is long, so that a short --timeout only ever measures the work itself.
    if store.add("arrived", 1) == world:
        store.set("all_arrived", "1")
    store.wait(["all_arrived"])
    # NCCL ends a timed-out process itself (its own watchdog): give it a margin over ours, so
    # that our watchdog speaks first and names the rank at fault.
    pg_timeout = args.timeout if not use_cuda else args.timeout + 60.0
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        store=dist.PrefixStore("pg/", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=pg_timeout),
        device_id=torch.device("cuda", local_rank) if use_cuda else None,
    )
    beat_store = dist.PrefixStore(
        f"train/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
        dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10)),
    )
    watchdog = Watchdog(beat_store, rank, world, args.timeout).start()
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"), watchdog


def run_rank(
    args: argparse.Namespace,
    train: Callable[[argparse.Namespace, Watchdog], Any],
    external_store_port: int | None = None,
) -> int:
    """Initialise, train, tear down; every way out is one line and an exit status."""
    watchdog = None
    try:
        _, watchdog = init_rank(args, external_store_port)
        train(args, watchdog)
    except UsageError as e:  # every rank raises it alike; one says it
        if int(os.environ["RANK"]) == 0:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return _end(2, watchdog, clean=True, args=args)
    except NotImplementedError as e:  # a combination the library does not support yet
        if int(os.environ["RANK"]) == 0:
            print(f"train.py: NotImplementedError: {e}", file=sys.stderr, flush=True)
        return _end(2, watchdog, clean=True, args=args)
    except CheckpointError as e:
        if int(os.environ["RANK"]) == 0:
            print(f"train.py: {e}", file=sys.stderr, flush=True)
        return _end(1, watchdog, clean=True, args=args)
    except KeyboardInterrupt:
        return _end(130, watchdog, clean=False)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        if isinstance(e, SystemExit):
            raise
        rank = int(os.environ["RANK"])
        if watchdog is not None and is_comm_failure(e):
            first = _gist(e)
            what = (
                f"a collective timed out after --timeout {args.timeout:g} s"
                if "imed out" in first
                else f"lost the connection to another rank ({first})"
            )
            print(
                f"train.py: rank {rank}: {what} at step {watchdog.step} ({watchdog.phase}); {watchdog.diagnose()}",
                file=sys.stderr,
                flush=True,
            )
            return _end(1, watchdog, clean=False)
        if watchdog is not None:
            watchdog.report_failure(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        print(f"train.py: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return _end(1, watchdog, clean=False)
    return _end(0, watchdog, clean=True, args=args)


def _gist(exc: BaseException) -> str:
    """The first sentence of an error, without gloo's `[source/file.cc:553] ` prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". ")[0][:200]


def _end(code: int, watchdog: Watchdog | None, clean: bool, args: argparse.Namespace | None = None) -> int:
    """Tear down; after a failed collective skip it and leave at once (see module docstring)."""
    if not clean:
        if watchdog is not None:
            watchdog.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    assert args is not None, "a clean end tears down under the bound of its arguments"
    global _GUARD
    rank = int(os.environ["RANK"])
    fault = FAULT.fullmatch(args.fault) if args.fault else None
    hang = fault is not None and fault[2] == "EXITHANG" and int(fault[1]) == rank
    _GUARD = teardown(rank, watchdog, teardown_bound(args), hang)
    return code


def teardown(rank: int, watchdog: Watchdog | None, bound: float, hang: bool = False) -> ExitGuard:
    """The ordered end of a rank (module docstring), under an `ExitGuard` of `bound` seconds,
    which it returns armed: `exit_process` ends the process. `hang` (tests) blocks where a
    hung NCCL teardown would."""
    guard = ExitGuard(rank, bound).start()
    if watchdog is not None:
        guard.phase("waiting for the other ranks")
        watchdog.close()
        _meet(rank, watchdog, bound / 2)
    guard.phase("releasing CUDA graphs and pending GPU work")
    gc.collect()  # graphs that captured collectives, states holding the process group: gone before it
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    guard.phase("destroy_process_group")
    if hang:
        threading.Event().wait()
    if dist.is_initialized():
        dist.destroy_process_group()
    guard.phase("exit")
    return guard


def _meet(rank: int, watchdog: Watchdog, wait_s: float) -> None:
    """Wait on the store until every rank has ended its work, at most `wait_s` seconds."""
    store, world = watchdog.store, watchdog.world
    if store is None or world == 1:
        return
    try:
        if store.add("teardown/arrived", 1) == world:
            store.set("teardown/all", "1")
        store.wait(["teardown/all"], timedelta(seconds=wait_s))
    except Exception as e:  # noqa: BLE001 - a peer gone or late: tear down without it
        print(
            f"train.py: rank {rank}: not every rank ended its work within {wait_s:g} s ({_gist(e)}); tearing down without them",
            file=sys.stderr,
            flush=True,
        )


def exit_process(code: int) -> NoReturn:
    """End the process with `code`. After a rank's teardown: its exit handlers and remaining
    threads still under the teardown's bound, then `os._exit` (no interpreter finalisation,
    whose CUDA/NCCL destructors can block). Elsewhere (the launching parent) `sys.exit`."""
    guard = _GUARD
    if guard is None:
        sys.exit(code)
    guard.phase("exit handlers")
    atexit._run_exitfuncs()
    guard.phase("joining threads")
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
