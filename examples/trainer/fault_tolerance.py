"""`--fault-tolerant`: this launch of the main job is one torchft replica group.

Each launch (its own `torchrun` or its own spawned ranks) is a group: HSDP over its ranks on a
`(1, world)` mesh, the replicate dimension extended across the groups by a torchft Manager
(`composable.integrations.torchft`). Steps are numbered by the Manager's committed steps, so a
step that is not committed (a group died during it) is taken again with the same batch, and a
group that heals takes the live groups' step. docs/fault-tolerance.md has the commands.

The lighthouse is one already running (`--lighthouse HOST:PORT` or `$TORCHFT_LIGHTHOUSE`), or
one this job starts: `--lighthouse start:PORT` on replica group 0 serves it from that launch's
rank 0 on PORT (every interface) for as long as group 0 runs; the other groups connect to
`HOST:PORT`, HOST being group 0's node (localhost on one host).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn

START = re.compile(r"start(?::(.*))?")  # --lighthouse start:PORT; a host named "start": http://start:PORT
LIGHTHOUSE_WAIT_S = 60.0  # how long a group waits for the lighthouse (group 0 may still be starting it)


def start_port(lighthouse: str | None) -> int | None:
    """The PORT of `--lighthouse start:PORT`, None for an address (or no value). Raises
    ValueError for `start` with a PORT that is not an integer in 1..65535."""
    match = START.fullmatch(lighthouse or "")
    if match is None:
        return None
    port = match[1] or ""
    if not (re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535):
        raise ValueError(port)
    return int(port)


def problem(args: argparse.Namespace) -> str | None:
    """The first problem with the fault-tolerance flags as one line, or None."""
    ft = args.fault_tolerant
    for name, value in (
        ("--lighthouse", args.lighthouse),
        ("--replica-group", args.replica_group),
        ("--min-replicas", args.min_replicas),
        ("--heartbeat-timeout", args.heartbeat_timeout),
    ):
        if value is not None and not ft:
            return f"{name} needs --fault-tolerant"
    if not ft:
        return None
    if args.parallel != "hsdp":
        return (
            f"--fault-tolerant needs --parallel hsdp (the groups are its replicate dim), got --parallel {args.parallel}"
        )
    for bad, why in (
        (args.pp > 1, f"--pp {args.pp}"),
        (args.tp_size is not None, f"--tp-size {args.tp_size}"),
        (args.cuda_graph == "on", "--cuda-graph on"),
        (args.mp == "fp16", "--mp fp16 (its scaler's state is not healed)"),
    ):
        if bad:
            return f"--fault-tolerant with {why}: not supported"
    if args.replica_group is not None and args.replica_group < 0:
        return f"--replica-group must be >= 0, got {args.replica_group}"
    env_group = os.environ.get("REPLICA_GROUP_ID")
    if args.replica_group is None and env_group is not None and not re.fullmatch(r"[0-9]+", env_group):
        return f"$REPLICA_GROUP_ID must be an integer >= 0, got {env_group!r} (or pass --replica-group)"
    if not (args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        return (
            "--fault-tolerant needs a lighthouse: --lighthouse HOST:PORT or TORCHFT_LIGHTHOUSE (one running), "
            "or --lighthouse start:PORT on replica group 0 (the job starts it)"
        )
    try:
        port = start_port(args.lighthouse)
    except ValueError:
        return f"--lighthouse {args.lighthouse}: start:PORT needs a PORT in 1..65535 (start:29510, say)"
    if port is None and args.min_replicas is not None:
        return (
            f"--min-replicas {args.min_replicas} needs --lighthouse start:PORT "
            "(a lighthouse started elsewhere has its own --min_replicas)"
        )
    if args.min_replicas is not None and args.min_replicas < 1:
        return f"--min-replicas must be >= 1, got {args.min_replicas}"
    if port is None and args.heartbeat_timeout is not None:
        return (
            f"--heartbeat-timeout {args.heartbeat_timeout:g} needs --lighthouse start:PORT "
            "(a lighthouse started elsewhere has its own --heartbeat_timeout_ms)"
        )
    if args.heartbeat_timeout is not None and not args.heartbeat_timeout > 0:
        return f"--heartbeat-timeout must be > 0 seconds, got {args.heartbeat_timeout:g}"
    if port is not None and (group := replica_group(args)) != 0:
        return (
            f"--lighthouse {args.lighthouse} on replica group {group}: only group 0 starts the lighthouse; "
            f"give this group --lighthouse HOST:{port} (HOST: group 0's node; localhost on one host)"
        )
    if importlib.util.find_spec("torchft") is None:
        return "--fault-tolerant needs torchft (pip install 'composable[ft]')"
    return None


def replica_group(args: argparse.Namespace) -> int:
    """This launch's group index: --replica-group, else $REPLICA_GROUP_ID, else 0."""
    if args.replica_group is not None:
        return args.replica_group
    return int(os.environ.get("REPLICA_GROUP_ID", "0"))


def serve_lighthouse(args: argparse.Namespace, stack: contextlib.ExitStack) -> str:
    """The lighthouse address this group's Manager connects to (call it on every rank).

    With `--lighthouse start:PORT` (replica group 0: `problem` refuses it on the others) rank 0
    first starts a torchft `LighthouseServer` bound to PORT on every interface, needing
    `--min-replicas` groups (default 1) for a quorum and counting a silent group alive for
    `--heartbeat-timeout` seconds (default torchft's), which `stack` shuts down when it closes
    (the end of the run); the address is then http://localhost:PORT, since only a group's rank 0
    talks to the lighthouse. Raises UsageError on every rank, in one line naming the flag and the
    port, when the port cannot be bound (another process holds it). Otherwise the address is
    `--lighthouse` or `$TORCHFT_LIGHTHOUSE`, and nothing is started."""
    port = start_port(args.lighthouse)
    if port is None:
        return args.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"]
    from trainer.checkpointing import rank0_then_broadcast
    from trainer.parallel import UsageError

    def serve() -> None:
        from torchft.coordination import LighthouseServer

        try:
            timeout_ms = None if args.heartbeat_timeout is None else max(1, round(args.heartbeat_timeout * 1000))
            server = LighthouseServer(
                bind=f"[::]:{port}", min_replicas=args.min_replicas or 1, heartbeat_timeout_ms=timeout_ms
            )
        except RuntimeError as e:  # torchft's bind error: "Address already in use (os error 98)"
            why = "is already in use on this host" if "in use" in str(e) else f"cannot be bound ({e})"
            raise UsageError(
                f"--lighthouse {args.lighthouse}: port {port} {why}; pick another PORT, or give "
                f"--lighthouse HOST:{port} if a lighthouse already serves there"
            ) from None
        stack.callback(server.shutdown)

    rank0_then_broadcast(serve)  # every rank raises the same UsageError, or none does
    return f"http://localhost:{port}"


def start(
    model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace, step: int, lighthouse: str
) -> tuple[Any, Any]:
    """(the optimizer the train step steps, the Manager): the group joins the quorums of the
    lighthouse at `lighthouse` (`serve_lighthouse`'s address) at committed step `step` (a
    resumed run's) and starts the first step's quorum."""
    from composable.integrations.torchft import create_manager, fault_tolerant

    manager = create_manager(
        replica_id=f"group_{replica_group(args)}",
        lighthouse=lighthouse,
        timeout=timedelta(seconds=args.timeout or 60),
        # The groups start side by side: a lighthouse that group 0 starts may come up later.
        connect_timeout=timedelta(seconds=LIGHTHOUSE_WAIT_S),
        init_sync=False,  # every group builds the same weights from --seed
    )
    if step:
        manager.load_state_dict({"step": step, "batches_committed": step})
    stepper = fault_tolerant(model, optimizer, manager)
    stepper.zero_grad()  # the train step zeroes after stepping, which starts the next quorum
    return stepper, manager


def next_step(manager: Any, done: int) -> int:
    """The step to take after committed step `done`: the Manager's (a healing group's jumps)."""
    if manager is None:
        return done + 1
    manager.wait_quorum()
    return manager.current_step() + 1


def committed(manager: Any, step: int) -> bool:
    """Whether `step` was committed (every live group reduced it; else it is taken again)."""
    return manager is None or manager.current_step() == step
