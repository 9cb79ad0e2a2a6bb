"""A replica group lost and started again under torchft, timed: what the loss costs the live group,
and how long the restarted group takes to heal and rejoin (examples/bench_ft_recovery.py).

Two launches of the main job (`examples/train.py --parallel hsdp --fault-tolerant`) train as two
replica groups. Group 0 serves the lighthouse, which needs one group for a quorum, so a group left
alone trains on. Group 1's rank 0 kills itself at `--fault-step` (the main job's `--fault`);
`--restart-after` seconds after that launch has ended, the same command is launched again, and it
heals from group 0 and rejoins; once it has committed `--steps-after-rejoin` steps, both launches
are stopped (their `--steps` is only the schedule's length, so the live group cannot finish
before the restarted one is back). Every line the launches print is timestamped as it arrives. From
the main job's line at the fault and torchft's Manager, which logs each vote to commit and a
healing group's recovery, it reports:

- the live group's step time before the fault (the median time between its commits);
- from the fault to the live group's next committed step: what losing a group costs the others
  (the step in flight fails and is taken again without the lost group);
- the steps the live group committed alone;
- the restarted group's time from its launch to its first quorum (start-up: the process, the
  model, the Manager), from there to its first committed step (the heal: the live group's state
  fetched and loaded, then one step), and its step time after;
- whether the live group logged every step once, from its first to its last (its metrics.csv).

Flags it does not know go to both launches (`--batch-size 4`, `--no-compile`, ...). With two or
more GPUs each group takes one (CUDA_VISIBLE_DEVICES); without one, both train on the CPU. One GPU
is refused: the groups' NCCL communicator takes no two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import IO, Any

import torch

TRAIN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")

# What the launches print that times the recovery: the main job at the fault, torchft's Manager
# at each vote to commit and when a joining group must heal.
FAULT_LINE = "train.py: --fault: rank"
COMMITTED = "should_commit completed should_commit=true"
NOT_COMMITTED = "should_commit completed should_commit=false"
QUORUM = "Finished quorum for group_rank"
HEAL = "healing is required"


class Launch:
    """One launch of the main job, every line it prints kept with the time it arrived."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: str) -> None:
        self.name, self.lines = name, []
        self.started = time.monotonic()
        # Its own process group (start_new_session): `stop` ends the launch with the ranks it spawned.
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.ended: float | None = None
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout, log_path), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str] | None, log_path: str) -> None:
        assert stream is not None  # stdout=PIPE
        with open(log_path, "w") as log:
            for line in stream:
                now = time.monotonic()
                self.lines.append((now, line.rstrip("\n")))
                log.write(f"{now - self.started:10.3f} {line}")
        self.ended = time.monotonic()

    def wait(self, deadline: float) -> int:
        """The launch's exit status; killed (and an error) if it outlasts `deadline` (monotonic)."""
        try:
            code = self.process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise RuntimeError(f"bench_ft_recovery: {self.name} did not end in time (--timeout-s); killed") from None
        self._reader.join()
        return code

    def stop(self) -> None:
        """End the launch and its ranks: SIGTERM, then SIGKILL if they linger."""
        for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 20.0)):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
        self._reader.join(timeout=grace)

    def times(self, marker: str) -> list[float]:
        """When each line holding `marker` arrived."""
        return [t for t, line in self.lines if marker in line]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the two groups, print the timings (seconds) and return them (also in OUT/ft_recovery.json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=1000, help="each launch's --steps (its schedule's length)")
    parser.add_argument("--fault-step", type=int, default=20, help="group 1's rank 0 kills itself at this step")
    parser.add_argument("--restart-after", type=float, default=2.0, help="seconds from group 1's end to its restart")
    parser.add_argument(
        "--steps-after-rejoin", type=int, default=10, help="the restarted group's committed steps before both stop"
    )
    parser.add_argument("--port", type=int, default=0, help="the lighthouse's port (0: a free one)")
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=None, help="seconds: group 0's lighthouse's (default: torchft's)"
    )
    parser.add_argument("--out", default="runs/ft_recovery")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="the whole measurement's limit")
    args, train_flags = parser.parse_known_args(argv)
    if args.fault_step < 2 or args.fault_step >= args.steps:
        parser.error(f"--fault-step must be in 2..{args.steps - 1} (below --steps), got {args.fault_step}")
    if args.steps_after_rejoin < 1:  # the restarted group's step time needs two commits
        parser.error(f"--steps-after-rejoin must be >= 1, got {args.steps_after_rejoin}")
    gpus = torch.cuda.device_count()
    if gpus == 1:
        parser.error(
            "needs a GPU per replica group, two, or none (NCCL takes no two ranks of one communicator on one GPU); "
            "CUDA_VISIBLE_DEVICES= runs both groups on the CPU"
        )
    os.makedirs(args.out, exist_ok=True)
    port = args.port or _free_port()
    deadline = time.monotonic() + args.timeout_s
    common = [sys.executable, TRAIN_PY, "--parallel", "hsdp", "--nproc", "1", "--preset", args.preset]
    common += ["--steps", str(args.steps), "--eval-every", "0", "--ckpt-every", "0", "--fault-tolerant", *train_flags]
    live_cmd = common + ["--lighthouse", f"start:{port}", "--min-replicas", "1", "--replica-group", "0"]
    if args.heartbeat_timeout is not None:
        live_cmd += ["--heartbeat-timeout", str(args.heartbeat_timeout)]
    lost_cmd = common + ["--lighthouse", f"localhost:{port}", "--replica-group", "1"]
    placement = "one GPU each" if gpus else "cpu"

    def launch(name: str, command: list[str], group: int) -> Launch:
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(group)
        return Launch(name, command + ["--out", os.path.join(args.out, f"g{group}")], env, f"{args.out}/{name}.log")

    live = launch("group0", live_cmd, 0)
    lost = launch("group1", lost_cmd + ["--fault", f"0:KILL:{args.fault_step}"], 1)
    try:
        code = lost.wait(deadline)
        faults = lost.times(FAULT_LINE)
        if not faults:
            raise RuntimeError(
                f"bench_ft_recovery: group 1 ended (exit status {code}) without its fault at step {args.fault_step} "
                f"(it may have healed past it): see {args.out}/group1.log"
            )
        time.sleep(args.restart_after)
        back = launch("group1_restarted", lost_cmd, 1)
        try:
            _wait_for_commits(back, live, args.steps_after_rejoin + 1, deadline, args.out)
        finally:
            back.stop()
    finally:
        live.stop()
    result = _timings(live, back, faults[0], args)
    result["placement"] = placement
    with open(os.path.join(args.out, "ft_recovery.json"), "w") as f:
        json.dump(result, f, indent=2)
    for key, value in result.items():
        print(f"{key:40s} {value:.3f}" if isinstance(value, float) else f"{key:40s} {value}")
    return result


def _wait_for_commits(back: Launch, live: Launch, commits: int, deadline: float, out: str) -> None:
    """Until `back` has committed `commits` steps; an error if either launch ends first or time runs out."""
    while len(back.times(COMMITTED)) < commits:
        for each in (back, live):
            if each.process.poll() is not None:
                raise RuntimeError(
                    f"bench_ft_recovery: {each.name} ended (exit status {each.process.returncode}) before the "
                    f"restarted group committed {commits} steps: see {out}/{each.name}.log"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench_ft_recovery: no {commits} committed steps of the restarted group in time")
        time.sleep(0.2)


def _timings(live: Launch, back: Launch, fault: float, args: argparse.Namespace) -> dict[str, Any]:
    """The report's numbers from the launches' timestamped lines (see the module doc)."""
    commits = live.times(COMMITTED)
    before = [t for t in commits if t < fault]
    after = [t for t in commits if t > fault]
    back_quorum = back.times(QUORUM)
    back_commits = back.times(COMMITTED)
    if not after or not back_quorum:
        raise RuntimeError(
            f"bench_ft_recovery: the live group did not commit after the fault, or the restarted group never joined: "
            f"see {args.out}/*.log"
        )
    joined = back_quorum[0]
    return {
        "live step before the fault (median)": statistics.median(b - a for a, b in zip(before, before[1:])),
        "fault to the live group's next commit": after[0] - fault,
        "live steps that failed (taken again)": sum(1 for t in live.times(NOT_COMMITTED) if fault < t < after[0]),
        "live steps committed alone": sum(1 for t in after if t < joined),
        "restart: launch to first quorum": joined - back.started,
        "restart: healed": bool(back.times(HEAL)),
        "restart: first quorum to first commit": back_commits[0] - joined,
        "restart: launch to first commit": back_commits[0] - back.started,
        "restarted step after (median)": statistics.median(b - a for a, b in zip(back_commits, back_commits[1:])),
        "live group logged every step once": _every_step_once(os.path.join(args.out, "g0")),
    }


def _every_step_once(out: str) -> bool:
    """Whether the live group's metrics.csv (its run's, under `out`; a line per step, flushed) has
    every step from its first to its last once (the first may be past 1: a group that joins a step
    late heals to it)."""
    (path,) = glob.glob(os.path.join(out, "*", "metrics.csv"))
    with open(path) as f:
        logged = [int(row["step"]) for row in csv.DictReader(f)]
    return bool(logged) and logged == list(range(logged[0], logged[-1] + 1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
