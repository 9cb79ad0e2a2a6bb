"""`benchmark.py --cpu-overhead`: the CPU cost of the hooks, per step, on 64 tiny blocks + root.

Two settings: the fake process group (world 8, one process, nothing communicated: the pure
CPU cost of the hooks) and a real gloo group of 2 local ranks (gloo latency included).

Robustness. PyTorch's DDP contender on gloo used to abort the whole benchmark at teardown in
about 40% of runs ("terminate called without an active exception", SIGABRT): its Reducer
holds the process group and the gradient hooks, and the model was still alive (the last
contender) when `destroy_process_group` ran, so the reducer and gloo's worker threads were
torn down during interpreter exit instead. Now:
- every setting runs in processes of its own, and on gloo every contender does, so that a
  crash, a leaked model or a thread of one contender cannot touch another or this process;
- each contender tears down in order: barrier, DDP's reducer dropped, the model and optimizer
  dropped and collected, barrier, and only then `destroy_process_group`;
- results travel back before teardown: a rank that dies at teardown after reporting is named
  in a note and its result kept; one that dies (or hangs) before reporting is retried, and a
  contender that never reports is shown as failed instead of ending the run;
- faulthandler is on in every rank: an abort prints the Python stacks of all threads.
Each contender also reports whether its model was freed by the garbage collector after it
was dropped, and how many collectives were still registered as pending (work left behind).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import composable

OVERHEAD_RUNS = ("bare", "fully_shard", "fsdp2", "replicate", "ddp")
RETRIES = 2  # extra attempts for a contender whose ranks died or hung before reporting
TIMEOUT_S = 300.0


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


def _no_communication_hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for the fake process group (whose all-reduce futures carry no value):
    hands the bucket back untouched, so DDP's own CPU work is what is timed."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks the hook's annotations by identity; `from __future__ import annotations` made them strings.
_no_communication_hook.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


def build_tiny(run: str, fake: bool) -> nn.Module:
    """64 tiny blocks + root under `run`; `fully_shard`/FSDP2 wrap every block and the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*[TinyBlock() for _ in range(64)])
    if run in ("fully_shard", "fsdp2"):
        if run == "fully_shard":
            shard = composable.fully_shard
        else:
            from torch.distributed.fsdp import fully_shard as shard
        for block in model:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
    elif run == "replicate":
        composable.replicate(model, mesh=mesh)
    elif run == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        if fake:
            model.register_comm_hook(None, _no_communication_hook)
    elif run != "bare":
        raise ValueError(f"build_tiny: run must be one of {OVERHEAD_RUNS}, got {run!r}")
    return model


def _timed_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, warmup: int = 5) -> float:
    """Median time of `steps` steps (forward, backward, SGD step) after `warmup` untimed ones."""
    x = torch.randn(2, 8)
    times = []
    for step in range(steps + warmup):
        dist.barrier()
        start = time.perf_counter()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_contender(run: str, steps: int, fake: bool) -> dict[str, Any]:
    """Median step (forward, backward, SGD step) of `run`, then its teardown checks."""
    model = build_tiny(run, fake)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step_s = _timed_steps(model, opt, steps)
    owned = [model, opt]
    del model, opt
    return {"step_s": step_s, **_teardown(owned)}


def _teardown(owned: list[Any]) -> dict[str, Any]:
    """Drop the model and optimizer in `owned` (the only references left: emptied here) and
    report whether the model was freed and how many works were left pending."""
    model, opt = owned
    owned.clear()
    # Teardown, in the order DDP needs: every rank past its last collective, then the reducer
    # (which holds the process group and the gradient hooks) dropped while the group lives.
    dist.barrier()
    freed = weakref.ref(model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        del model.reducer, model.logger
    del model, opt
    gc.collect()
    dist.barrier()
    return {"model_freed": freed() is None, "pending_works": torch._C._distributed_c10d._get_work_registry_size()}


def _rank_entry(fn: Callable[..., Any], rank: int, world: int, port: int, queue: Any, args: tuple) -> None:
    """One rank: a process group (gloo, or fake when `port` is 0), `fn(*args)`, result to the
    parent (rank 0) *before* teardown, then an orderly teardown."""
    faulthandler.enable(all_threads=True)  # an abort shows every thread's Python stack
    torch.set_num_threads(1)  # 2 cores shared by the ranks: oversubscription is the killer
    if port:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    result = fn(*args)
    if rank == 0:
        queue.put(result)
    dist.barrier()  # nobody destroys the group while a peer still uses it
    dist.destroy_process_group()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "hung (killed)"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_isolated(
    fn: Callable[..., Any], args: tuple, world: int, fake: bool, what: str, retries: int = RETRIES
) -> tuple[Any, list[str]]:
    """`fn(*args)` on `world` fresh ranks (gloo, or one process of a fake world); retried up to
    `retries` times if no result comes back. Returns (rank 0's result or None, notes)."""
    ctx = mp.get_context("spawn")
    notes: list[str] = []
    for attempt in range(1 + retries):
        port = 0
        if not fake:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        queue = ctx.SimpleQueue()  # synchronous put: the result is out before any teardown
        procs = [
            ctx.Process(target=_rank_entry, args=(fn, rank, world, port, queue, args))
            for rank in range(1 if fake else world)
        ]
        for p in procs:
            p.start()
        result, deadline = None, time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if not queue.empty():
                result = queue.get()
                break
            if not any(p.is_alive() for p in procs):
                break
            time.sleep(0.02)
        for p in procs:
            p.join(timeout=30 if result is not None else 1)
            if p.is_alive():
                p.kill()
                p.join()
        if result is None and not queue.empty():  # reported just before the last rank exited
            result = queue.get()
        codes = {rank: None if p.exitcode == -signal.SIGKILL else p.exitcode for rank, p in enumerate(procs)}
        failed = ", ".join(f"rank {r} {_exit_text(c)}" for r, c in codes.items() if c != 0)
        if result is not None:
            if failed:
                notes.append(f"{what}: {failed} at teardown, after reporting (result kept)")
            return result, notes
        notes.append(f"{what}, attempt {attempt + 1}: no result ({failed or 'no rank reported'})")
    return None, notes


FAKE_ROUNDS = 5


def _fake_all(steps: int) -> dict[str, Any]:
    """Every contender in one process (nothing is communicated), timed in `FAKE_ROUNDS`
    interleaved rounds so that a drifting host (this 2-core machine drifts by tens of percent
    within a minute) hits all of them alike; a contender's step is its fastest round's median
    (the least disturbed), then the teardown checks."""
    built = {run: build_tiny(run, fake=True) for run in OVERHEAD_RUNS}
    opts = {run: torch.optim.SGD(model.parameters(), lr=1e-3) for run, model in built.items()}
    rounds: dict[str, list[float]] = {run: [] for run in OVERHEAD_RUNS}
    for _ in range(FAKE_ROUNDS):
        for run in OVERHEAD_RUNS:
            rounds[run].append(_timed_steps(built[run], opts[run], steps))
    out = {}
    for run in OVERHEAD_RUNS:
        out[run] = {"step_s": min(rounds[run]), **_teardown([built.pop(run), opts.pop(run)])}
    return out


def optimizer_dispatch_cost(steps: int) -> dict[str, float]:
    """The SGD step alone over the bare model's parameters: plain, and the same parameters as
    replicated DTensors (what `replicate` must give the optimizer) with DTensor gradients
    sharing their spec, no hook of ours anywhere: DTensor's own per-op dispatch cost, which
    bounds how close replicate's step can come to DDP's (fastest of `FAKE_ROUNDS` medians)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    opts = {}
    for kind in ("plain", "dtensor"):
        params = [p.detach().clone() for p in build_tiny("bare", fake=True).parameters()]
        if kind == "dtensor":
            params = [distribute_tensor(p, mesh, [Replicate()]) for p in params]
        params = [nn.Parameter(p) for p in params]
        for p in params:
            grad = torch.ones_like(p)
            p.grad = (
                DTensor.__new__(DTensor, grad._local_tensor, p._spec, requires_grad=False)
                if kind == "dtensor"
                else grad
            )
        opts[kind] = torch.optim.SGD(params, lr=1e-3)
    best = dict.fromkeys(opts, float("inf"))
    for _ in range(FAKE_ROUNDS):
        for kind, opt in opts.items():
            times = []
            for step in range(steps + 5):
                start = time.perf_counter()
                opt.step()
                if step >= 5:
                    times.append(time.perf_counter() - start)
            best[kind] = min(best[kind], statistics.median(times))
    return {**best, "params": float(len(opts["plain"].param_groups[0]["params"]))}


def overhead(steps: int = 30) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(fake-group results, gloo results, notes); a contender that never reported is None."""
    fake, notes = run_isolated(_fake_all, (steps,), world=8, fake=True, what="fake process group")
    fake = fake or dict.fromkeys(OVERHEAD_RUNS)
    gloo = {}
    for run in OVERHEAD_RUNS:
        gloo[run], more = run_isolated(time_contender, (run, steps, False), world=2, fake=False, what=f"gloo {run}")
        notes += more
    return fake, gloo, notes


def print_overhead(title: str, out: dict[str, Any]) -> None:
    print(title)
    for run, r in out.items():
        if r is None:
            print(f"  {run:<12} failed (see the notes)")
            continue
        teardown = "model freed" if r["model_freed"] else "model NOT freed by gc"
        print(f"  {run:<12} {r['step_s'] * 1e3:8.2f} ms   teardown: {teardown}, {r['pending_works']} pending works")
    t = {run: r["step_s"] for run, r in out.items() if r is not None}
    for ours, theirs in (("fully_shard", "fsdp2"), ("replicate", "ddp")):
        if {ours, theirs, "bare"} <= set(t):
            print(
                f"  overhead over the bare model: {ours} {1e3 * (t[ours] - t['bare']):.2f} ms vs {theirs} "
                f"{1e3 * (t[theirs] - t['bare']):.2f} ms (step time ratio {ours}/{theirs} {t[ours] / t[theirs]:.3f}x)"
            )


def cpu_overhead_main(steps: int = 30) -> int:
    """Print both tables and the notes; exit status 1 only if some contender never reported."""
    fake, gloo, notes = overhead(steps)
    print_overhead(
        f"fake process group, world 8, 64 tiny blocks + root, one process ({FAKE_ROUNDS} interleaved rounds of {steps} "
        "steps; fastest round's median):",
        fake,
    )
    print_overhead(
        f"gloo, world 2, 64 tiny blocks + root, each contender in its own processes (median of {steps} "
        "steps; includes gloo latency):",
        gloo,
    )
    optim, more = run_isolated(optimizer_dispatch_cost, (steps,), world=8, fake=True, what="optimizer alone")
    if optim is not None:
        print(
            f"SGD step alone over the same {int(optim['params'])} parameters "
            f"(fake group): plain {optim['plain'] * 1e3:.2f} ms, as replicated DTensors {optim['dtensor'] * 1e3:.2f} ms "
            "(DTensor's dispatch; replicate's parameters must be DTensors)"
        )
    for note in notes + more:
        print(f"  note: {note}")
    return int(any(r is None for r in [*fake.values(), *gloo.values()]))
