"""The harness's persistent workers: the worker loop (one spawned process per rank slot, a fresh
process group per call) and the parent's pool of them. `_harness.run_on_ranks` drives the pool;
nothing else uses this module. The workers keep DTensor's sharding answers and dynamo's trace
rules from call to call (``_harness_sharding.py``; about a fifth of the time of the tests that
run many calls), each call's answers naming its own meshes.

A worker that dies (segfault, abort) leaves the C++ stacks of all its threads (the crashing one
first) and its Python stacks in its fault file, which the pool reads into the `RankError`; a
worker's stderr goes to that file, not to the terminal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from _harness_errors import crashing_thread_first
from _harness_sharding import forget_sharding_cache, remember_sharding

STARTUP_TIMEOUT_S = 180.0  # spawning + importing torch; generous for a loaded 2-core machine
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
FAULT_TEXT_LIMIT = 200_000  # characters of a dead worker's fault file that go into the RankError


# ----------------------------------------------------------------------------- worker side


def _keep_trace_rules() -> None:
    """From now on, keep dynamo's trace rules (which objects it puts in graphs, skips, inlines)
    when a process group is made. init_process_group empties their caches for rules that may
    have been built while torch.distributed was half imported; a process that makes one group
    rebuilds them once, but a worker makes one per call, and composable's fully_shard asks
    dynamo about each module's forward: ~20 ms of rebuilding in every call. Called once this
    worker's first group is made, after that emptying."""
    from torch._dynamo import trace_rules

    trace_rules.clear_lru_cache = lambda: None


def no_silent_eager_fallback() -> None:
    """Make dynamo raise where it would give up compiling a frame at its recompile limit. A test
    process (pytest's, and each pool worker) outlives its tests, and dynamo's caches with it:
    once a code object (the examples' Block.forward) has been compiled for other tests up to
    the limit, dynamo would run it eagerly without a word, and a test of compiled blocks would
    pass having compiled nothing."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True


# What the worker's last successful call left once torn down: [gloo threads, open descriptors].
LEFT_BY_LAST_CALL: list[int] = []


def gloo_threads() -> int:
    """How many of this process's threads are gloo's (each gloo group runs three: two work
    loops and one for its sockets); 0 where /proc is not there to tell."""
    count = 0
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
                count += "gloo" in comm.read()
    return count


def worker_main(conn: Connection, fault_path: str) -> None:
    """Worker loop: receive a task, run it on a fresh process group, send back the outcome."""
    # A segfault or abort leaves no traceback: faulthandler writes the Python stacks to a file
    # that the parent puts into the RankError; on SIGUSR1 it dumps the stacks of a hung worker.
    # The crash may be in a native thread with no Python frame (gloo runs async collectives on
    # threads of its own): torch's fatal-signal handler prints every thread's C++ stack to
    # stderr, then chains to faulthandler. So stderr goes to the same file (fd 2 itself, for
    # native writers); the parent reads what each call added to it.
    fault_file = open(fault_path, "w")  # noqa: SIM115 - open for the life of the worker
    os.dup2(fault_file.fileno(), 2)
    faulthandler.enable(fault_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, fault_file, all_threads=True)
    native_stacks = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if native_stacks is not None:  # installed after faulthandler's handler, so it chains to it
        native_stacks(True)
    # Ctrl-C is for the parent; it tears the pool down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # die with the parent even if it is SIGKILLed
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # no DNS, single host
    torch.set_num_threads(1)  # 2 cores shared by all ranks: oversubscription is the killer
    no_silent_eager_fallback()
    with contextlib.suppress(Exception):
        importlib.import_module("torch.distributed.tensor")  # warm it once, not per test
        # Answers of sharding propagation outlive the call that computed them, rebound to each
        # later call's meshes (DTensor's own caches are emptied after every call, below).
        remember_sharding()
    # What startup made (torch's modules: ~300k objects) is never garbage: out of every
    # collection, so that the collection after each call costs milliseconds, not ~0.3 s.
    gc.collect()
    gc.freeze()
    stores: dict[int, dist.TCPStore] = {}
    trace_rules_kept = False
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone
            return
        call_id, rank, world_size, port, backend, blob = task
        ok, payload, in_fn = True, None, False
        try:
            sys_path, filters, fn, args, kwargs = pickle.loads(blob)
            sys.path.extend(p for p in sys_path if p not in sys.path)
            if port not in stores:
                stores[port] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
            # A fresh key space per call: the default group is always named "0", so keys
            # from an earlier call would otherwise be found by this one's rendezvous.
            store = dist.PrefixStore(f"call{call_id}/", stores[port])
            if "nccl" in backend:
                torch.cuda.set_device(rank)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
            if not trace_rules_kept and "torch._dynamo" in sys.modules:
                _keep_trace_rules()
                trace_rules_kept = True
            # gloo's init is no barrier: a rank that finishes fn and destroys its group early
            # would break a slow peer's connection handshake. Wait until all are connected.
            if store.add("initialised", 1) == world_size:
                store.set("all_initialised", "1")
            store.wait(["all_initialised"])
            torch.manual_seed(0)
            random.seed(0)
            torch.set_default_dtype(torch.float32)
            with warnings.catch_warnings(), torch.enable_grad():
                # The parent's filters (pytest's ini filters, -W error) apply here too.
                if filters is not None:
                    warnings.filters[:] = filters
                    getattr(warnings, "_filters_mutated", lambda: None)()
                in_fn = True
                payload = fn(rank, world_size, *args, **kwargs)
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            ok, payload = False, traceback.format_exc()
        healthy = in_fn  # a failed init/rendezvous may leave c10d state half made
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            forget_sharding_cache()
            if ok:
                # A model's hooks are bound methods of its state, so the model, its meshes and
                # their process groups form reference cycles that outlive fn: a group's gloo
                # threads and sockets then lived on until some collection inside a later call,
                # which tore them down (joins, closed connections to peers) amid that call's
                # own collectives. Torn down here instead, within the call that made them. Not
                # after a failure: a peer may still be blocked in a collective of those groups.
                gc.collect()
                # What survives is what the call left for good (modules it imported: dynamo,
                # inductor, transformers; caches): out of later collections, as startup's is,
                # or each later call's collection costs ~0.1 s per worker instead of milliseconds.
                gc.freeze()
                # Every group of the call is gone now, and with it every gloo thread: one left
                # means something outside the call still holds a group (a cache of meshes). Such
                # a worker is replaced rather than let groups pile up call after call (hundreds
                # of threads and sockets in an hour); tests/test_harness.py pins that mesh-building
                # calls leave none.
                LEFT_BY_LAST_CALL[:] = [gloo_threads(), len(os.listdir("/proc/self/fd"))]
                if LEFT_BY_LAST_CALL[0] > 0:
                    healthy = False
        except Exception:  # noqa: BLE001
            healthy = False
        try:
            conn.send((call_id, ok, payload, healthy))
        except Exception:  # noqa: BLE001 - an unpicklable return value
            conn.send(
                (call_id, False, f"return value of rank {rank} is not picklable:\n" + traceback.format_exc(), healthy)
            )
        if not healthy:
            # The parent kills and replaces this worker once it has read every rank's result. Not
            # gone before then: a result holding tensors is read through this process's resource
            # sharer (their storage passes as file descriptors), which dies with it.
            with contextlib.suppress(EOFError, OSError):
                conn.recv()
            return


# ----------------------------------------------------------------------------- parent side


class Pool:
    """Spawned workers (slot i runs rank i) plus a TCPStore server that lives in the parent."""

    def __init__(self) -> None:
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.ready: list[bool] = []
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.call_id = 0
        self.tmpdir = tempfile.mkdtemp(prefix="harness-")
        self.fault_paths: list[str] = []
        self.marks: list[int] = []  # size of each fault file when the slot's current call began

    def start(self, slot: int) -> None:
        """(Re)start the worker of ``slot`` without waiting: it imports torch meanwhile.
        Not daemonic, so that a test may start processes of its own (DataLoader workers)."""
        if slot < len(self.procs):  # stuck or dead: the others keep running
            self.procs[slot].kill()
            self.procs[slot].join(5)
            self.conns[slot].close()
        ctx = mp.get_context("spawn")  # fork deadlocks once OpenMP has run in the parent
        parent, child = ctx.Pipe()
        fault_path = os.path.join(self.tmpdir, f"worker{slot}-{time.monotonic_ns()}.txt")
        p = ctx.Process(target=worker_main, args=(child, fault_path), name=f"harness-worker-{slot}")
        p.start()
        child.close()
        if slot == len(self.procs):
            self.procs.append(p), self.conns.append(parent), self.ready.append(False)
            self.fault_paths.append(fault_path)
            self.marks.append(0)
        else:
            self.procs[slot], self.conns[slot], self.ready[slot] = p, parent, False
            self.fault_paths[slot] = fault_path
            self.marks[slot] = 0

    def fault_size(self, slot: int) -> int:
        with contextlib.suppress(OSError):
            return os.path.getsize(self.fault_paths[slot])
        return 0

    def fault_text(self, slot: int, since: int = 0) -> str:
        """What the worker of ``slot`` wrote to its fault file (faulthandler, stderr) from byte
        ``since`` on."""
        with contextlib.suppress(OSError), open(self.fault_paths[slot], "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace").strip()
        return ""

    def death_note(self, slot: int) -> str:
        """Why the worker of ``slot`` died: what it wrote since its current (or last) call
        began, native stacks (the crashing thread's first) and Python stacks, and the exit code."""
        self.procs[slot].join(1.0)
        text = crashing_thread_first(self.fault_text(slot, self.marks[slot]))
        if len(text) > FAULT_TEXT_LIMIT:  # the head names the crash, the tail holds the Python stacks
            half = FAULT_TEXT_LIMIT // 2
            text = f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"
        return f"{text}\nworker died (exit code {self.procs[slot].exitcode})"

    def stacks(self, slots: list[int]) -> str:
        """The Python stacks of hung workers, dumped by faulthandler on SIGUSR1."""
        sizes = {i: self.fault_size(i) for i in slots}
        for i in slots:
            with contextlib.suppress(Exception):
                os.kill(self.procs[i].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not all(self.fault_size(i) > sizes[i] for i in slots):
            time.sleep(0.05)
        time.sleep(0.05)  # let a dump in progress finish
        return "".join(f"\n----- stack of hung rank {i} -----\n{self.fault_text(i, sizes[i])}" for i in slots)

    def cpu_seconds(self, slots: list[int]) -> float | None:
        """CPU time (user + system) the workers of ``slots`` have used so far; None where the
        platform has no /proc to read it from."""
        total = 0.0
        for i in slots:
            try:
                with open(f"/proc/{self.procs[i].pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            except (OSError, IndexError):
                return None
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        return total

    def wait_ready(self, n: int) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for i in range(n):
            if not self.ready[i]:
                try:
                    if not self.conns[i].poll(max(0.0, deadline - time.monotonic())):
                        raise TimeoutError(f"harness worker {i} did not start")
                    self.conns[i].recv()
                except EOFError:
                    raise RuntimeError(
                        f"harness worker {i} failed to start; see its stderr\n" + self.death_note(i)
                    ) from None
                self.ready[i] = True

    def shutdown(self) -> None:
        for p, c in zip(self.procs, self.conns):  # idle workers hold nothing worth flushing
            p.kill()
            p.join(2.0)
            c.close()
        self.procs, self.conns, self.ready = [], [], []
        shutil.rmtree(self.tmpdir, ignore_errors=True)
