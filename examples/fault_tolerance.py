"""`--fault-tolerant`: this launch of the main job is one torchft replica group.

Each launch (its own `torchrun` or its own spawned ranks) is a group: HSDP over its ranks on a
`(1, world)` mesh, the replicate dimension extended across the groups by a torchft Manager
(`composable.integrations.torchft`). Steps are numbered by the Manager's committed steps, so a
step that is not committed (a group died during it) is taken again with the same batch, and a
group that heals takes the live groups' step. docs/fault-tolerance.md has the commands.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn


def problem(args: argparse.Namespace) -> str | None:
    """The first problem with the fault-tolerance flags as one line, or None."""
    ft = args.fault_tolerant
    for name, value in (("--lighthouse", args.lighthouse), ("--replica-group", args.replica_group)):
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
    if not (args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        return "--fault-tolerant needs --lighthouse HOST:PORT or TORCHFT_LIGHTHOUSE (start one: torchft_lighthouse --min_replicas 1)"
    if importlib.util.find_spec("torchft") is None:
        return "--fault-tolerant needs torchft (pip install 'composable[ft]')"
    return None


def replica_group(args: argparse.Namespace) -> int:
    """This launch's group index: --replica-group, else $REPLICA_GROUP_ID, else 0."""
    if args.replica_group is not None:
        return args.replica_group
    return int(os.environ.get("REPLICA_GROUP_ID", "0"))


def start(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace, step: int) -> tuple[Any, Any]:
    """(the optimizer the train step steps, the Manager): the group joins the lighthouse's
    quorums at committed step `step` (a resumed run's) and starts the first step's quorum."""
    from composable.integrations.torchft import create_manager, fault_tolerant

    manager = create_manager(
        replica_id=f"group_{replica_group(args)}",
        lighthouse=args.lighthouse,
        timeout=timedelta(seconds=args.timeout or 60),
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
