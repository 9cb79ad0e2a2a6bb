"""Atomic, checksummed DCP checkpoints for train.py: save, verify, load the newest intact one.

A checkpoint is `<run>/checkpoints/step_N/`: the DCP shards of the model and optimizer, each
rank's RNG state, and `trainer_state.json` (step, history, scaler, flags, data position, the
run's identity, and the size and SHA-256 of every other file in the directory, plus a digest
of itself). Every rank writes into `step_N.tmp/`; rank 0 renames it once all are done, so a
crash mid-save leaves the previous checkpoints as they were. `trainer_state.json` is written
last: its presence in a `step_N/` directory marks a complete save.

Loading verifies before it reads (the ranks hash their share of the files): a checkpoint
with a flipped byte, a truncated or missing file or a garbled state file is skipped with one
line saying why, and the newest intact one is loaded instead; the damaged ones are renamed
`step_N.damaged` so that pruning and later resumes leave them alone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainer.watchdog import is_comm_failure

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
LOW_SPACE = 64 * 2**20  # after a failed write, less free space than this means the disk filled up
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or none could be read; the message says why in one line."""


# The optimizer's state keyed by parameter name, param groups included (`param_groups.<fqn>.lr`):
# ranks that hold different parameters (pipeline stages) each save and find their own groups,
# so a checkpoint loads into any other layout.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_dirs(run_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints under `run_dir`, oldest first. A `.tmp` directory is an unfinished save."""
    root = os.path.join(run_dir, CKPT_DIR)
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.startswith("step_") and name[5:].isdigit() and os.path.isfile(os.path.join(path, STATE_FILE)):
                found.append((int(name[5:]), path))
    return sorted(found)


def rank0_then_broadcast(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and give every rank its result, or raise its error on every
    rank (a UsageError or CheckpointError as such, anything else as RuntimeError): the ranks
    always take the same branch afterwards, so none is left waiting in a collective."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - carried to every rank below
            payload[0] = ("error", e)
    dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind == "error":
        if isinstance(value, (CheckpointError, ValueError)):  # UsageError is a ValueError
            raise value
        raise RuntimeError(f"rank 0: {type(value).__name__}: {value}")
    return value


def _dcp_save(state: dict[str, Any], path: str) -> None:
    """The collective write of one checkpoint (a seam for tests to simulate a crash)."""
    dcp.save(state, checkpoint_id=path)


def save_checkpoint(
    run_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
) -> str:
    """Write `checkpoints/step_N/` atomically and checksummed, then keep the newest `keep` of
    this run's checkpoints. Raises CheckpointError on every rank if the write fails (a full
    disk says so); the previous checkpoints are untouched then."""
    rank = dist.get_rank()
    root = os.path.join(run_dir, CKPT_DIR)
    final = os.path.join(root, f"step_{step:07d}")
    tmp = final + ".tmp"

    def prepare() -> None:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)

    rank0_then_broadcast(prepare)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    # RNG per rank (keyed by rank: DCP keeps one copy of same-named plain tensors).
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{rank}": torch.get_rng_state()}}
    try:
        _dcp_save(state, tmp)  # DCP gathers every rank's write result: all ranks raise alike
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a failed write, said in one line
        if is_comm_failure(e):
            raise  # a rank died or stalled mid-save: the rank's post-mortem names it
        message = describe_write_failure(e, tmp, step)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise CheckpointError(message) from None
    files = rank0_then_broadcast(lambda: sorted(os.listdir(tmp)))
    digests = _gather_digests(tmp, files)

    def finish() -> None:
        try:
            write_json(os.path.join(tmp, STATE_FILE), seal({**trainer_state, "files": digests}))
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(describe_write_failure(e, tmp, step)) from None
        old = final + ".old"
        if os.path.exists(final):  # saving the same step again (after a resume)
            shutil.rmtree(old, ignore_errors=True)  # a leftover of a crash right here
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        for _, path in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    rank0_then_broadcast(finish)  # also the barrier: every rank's shards are on disk before
    return final


def describe_write_failure(exc: BaseException, path: str, step: int) -> str:
    """One line for a failed write. DCP reports a full disk as `unexpected pos 704 vs 598`
    (torch's zip writer) with no errno, so the free space decides when the text does not."""
    causes: list[BaseException] = [exc]
    if isinstance(exc, CheckpointException):
        causes += [
            pair[0] for pair in exc.failures.values() if isinstance(pair, tuple) and isinstance(pair[0], BaseException)
        ]
    for c in list(causes):
        while c.__cause__ is not None or c.__context__ is not None:
            c = c.__cause__ or c.__context__
            causes.append(c)
    text = " ".join(str(c) for c in causes)
    free = _free_bytes(path)
    no_space = (
        any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes)
        or "No space left" in text
        or "quota exceeded" in text.lower()
        or ("unexpected pos" in text and free < LOW_SPACE)
    )
    if no_space:
        return (
            f"no space left on device while writing checkpoint step {step} to {path} ({free / 2**20:.0f} MiB free): "
            f"free some space or lower --keep-ckpts; the run's earlier checkpoints are intact"
        )
    inner = causes[-1] if len(causes) > 1 else exc
    first = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
    return f"could not write checkpoint step {step} to {path}: {type(inner).__name__}: {first}"


def _free_bytes(path: str) -> int:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return 0


# ----------------------------------------------------------------------------- integrity


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """`state` plus the SHA-256 of its own canonical JSON: flipped bytes that still parse show."""
    return {**state, "state_sha256": _json_digest(state)}


def _json_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _file_digest(path: str) -> dict[str, Any]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _gather_digests(directory: str, files: list[str]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of `files`, hashed by the ranks in turn (file i on rank i % world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: _file_digest(os.path.join(directory, name)) for name in files[rank::world]}
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {name: d for part in parts for name, d in sorted(part.items())}


def verify(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(trainer state, None) if the checkpoint at `path` is intact, else (None, what is wrong).
    Collective: rank 0 reads the state file, every rank checks its share of the files."""

    def read_state() -> tuple[dict[str, Any] | None, str | None]:
        try:
            with open(os.path.join(path, STATE_FILE)) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            return None, f"{STATE_FILE} unreadable: {e}"
        if not isinstance(state, dict) or "state_sha256" not in state or "files" not in state:
            return None, f"{STATE_FILE} has no checksums"
        if _json_digest({k: v for k, v in state.items() if k != "state_sha256"}) != state["state_sha256"]:
            return None, f"checksum mismatch in {STATE_FILE}"
        return state, None

    state, problem = rank0_then_broadcast(read_state)
    rank, world = dist.get_rank(), dist.get_world_size()
    local: list[str] = []
    if state is not None:
        names = sorted(state["files"])
        for name in names[rank::world]:
            expected, file = state["files"][name], os.path.join(path, name)
            try:
                got = _file_digest(file)
            except OSError:
                local.append(f"{name} is missing")
                continue
            if got["bytes"] != expected["bytes"]:
                local.append(f"{name} has {got['bytes']} bytes, {expected['bytes']} were written")
            elif got["sha256"] != expected["sha256"]:
                local.append(f"checksum mismatch in {name}")
    found: list[Any] = [None] * world
    dist.all_gather_object(found, local)  # every rank joins, whatever rank 0 found
    problems = [p for part in found for p in part]
    if problem or problems:
        return None, problem or ", ".join(problems[:3]) + (
            f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        )
    return state, None


def load_newest_intact(
    run_dir: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    accept: Callable[[dict[str, Any], str], None],
    warn: Callable[[str], Any],
) -> tuple[dict[str, Any], str] | None:
    """Load the newest intact checkpoint of the run in place; returns (trainer state, path), or
    None when the run has no checkpoint. `accept(state, path)` may refuse a checkpoint by
    raising (a different model). Raises CheckpointError when every checkpoint is damaged."""
    found = checkpoint_dirs(run_dir)
    damaged: list[str] = []
    for step, path in reversed(found):
        state, problem = verify(path)
        if state is not None:
            accept(state, path)
            try:
                load_checkpoint(path, model, optimizer)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank alike
                if is_comm_failure(e):
                    raise
                problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            else:
                if damaged:
                    rank0_then_broadcast(lambda: [os.replace(p, _unused(p + ".damaged")) for p in damaged])
                return state, path
        damaged.append(path)
        older = "falling back to the previous one" if step != found[0][0] else "no older checkpoint"
        warn(f"checkpoint {path} is damaged ({problem}); {older}")
    if damaged:
        raise CheckpointError(
            f"--resume: no intact checkpoint in {run_dir} (all {len(damaged)} damaged, see above); "
            f"start a new run without --resume"
        )
    return None


def _unused(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... whichever does not exist yet (a step damaged twice)."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def _options_written(path: str) -> StateDictOptions:
    """The state-dict options a checkpoint was written with: checkpoints from before the
    optimizer state was flattened keep its param groups as a list, each with the names of its
    parameters (`optim.param_groups.<i>.params`), and are read as written, so they still
    resume (without pipelining)."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    listed = any(key.startswith("optim.param_groups.") and key.endswith(".params") for key in keys)
    return StateDictOptions() if listed else _OPTIONS


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model, optimizer and this rank's RNG state of a checkpoint in place."""
    rank = dist.get_rank()
    options = _options_written(path)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{rank}": torch.get_rng_state()}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    torch.set_rng_state(state["rng"][f"rank{rank}"])


# ----------------------------------------------------------------------------- files


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
