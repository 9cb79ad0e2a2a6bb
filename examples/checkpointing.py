"""Atomic DCP checkpoints for train.py: save, load, find the complete ones.

A checkpoint is `<out>/checkpoints/step_N/`: the DCP shards of the model and optimizer, each
rank's RNG state, and `trainer_state.json` (step, history, scaler, args, data position). Every
rank writes into `step_N.tmp/`; rank 0 renames it once all are done, so a crash mid-save
leaves the previous checkpoints as they were. The presence of `trainer_state.json` in a
`step_N/` directory is what marks it complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"


def checkpoint_dirs(out: str) -> list[tuple[int, str]]:
    """Complete checkpoints under `out`, oldest first. A `.tmp` directory is an unfinished save."""
    root = os.path.join(out, CKPT_DIR)
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.startswith("step_") and name[5:].isdigit() and os.path.isfile(os.path.join(path, STATE_FILE)):
                found.append((int(name[5:]), path))
    return sorted(found)


def _dcp_save(state: dict[str, Any], path: str) -> None:
    """The collective write of one checkpoint (a seam for tests to simulate a crash)."""
    dcp.save(state, checkpoint_id=path)


def save_checkpoint(out: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any], keep: int) -> str:
    """Write `checkpoints/step_N/` atomically: every rank writes into `step_N.tmp/`; after a
    barrier rank 0 renames it. A crash before the rename leaves the previous checkpoints as
    they were (the `.tmp` leftover is ignored by resume and cleared by the next save)."""
    rank = dist.get_rank()
    root = os.path.join(out, CKPT_DIR)
    final = os.path.join(root, f"step_{step:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # RNG per rank (keyed by rank: DCP keeps one copy of same-named plain tensors).
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{rank}": torch.get_rng_state()}}
    _dcp_save(state, tmp)
    if rank == 0:
        write_json(os.path.join(tmp, STATE_FILE), trainer_state)  # its presence marks a complete save
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        old = final + ".old"
        if os.path.exists(final):  # saving the same step again (after a resume)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        for _, path in checkpoint_dirs(out)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` in place; returns its trainer state."""
    rank = dist.get_rank()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{rank}": torch.get_rng_state()}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"][f"rank{rank}"])
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def write_json(path: str, obj: Any) -> None:
    """Write `obj` as JSON atomically: a reader sees the old file or the whole new one."""
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (best effort: not every platform can open a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
