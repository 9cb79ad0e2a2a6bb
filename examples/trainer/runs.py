"""Run directories: every run of train.py owns `<out>/<run id>/`, so runs that share an `--out`
(the default `runs/train` is shared by every run) never prune, overwrite or resume each
other's checkpoints and metrics.

    <out>/<run id>/run.json          who the run is: model flags and seed (its identity), all flags
                   run.lock          held (flock) by rank 0 while a job runs in the directory
                   metrics.csv ...   see reporting.py
                   checkpoints/      see checkpointing.py; pruning looks only here

`--resume` continues `--run-id` if given, else the newest run in `--out` whose identity is the
current one and that no job is running in. A checkpoint of another model or seed is refused
with the differing flags named; another `--nproc`, `--parallel` or `--mp` is fine (the
checkpoint is resharded on load). Everything here runs on rank 0 only: no collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import secrets
import socket
from typing import Any

from models.model import ModelConfig
from trainer.checkpointing import checkpoint_dirs, write_json
from trainer.parallel import UsageError

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
# ModelConfig fields a user sets by flag; the others (norm_eps, rope_theta, init_std) come with
# --preset. max_seq_len is not identity: it follows --seq-len and no parameter depends on it.
MODEL_FLAGS = {
    "dim": "--dim",
    "n_layers": "--n-layers",
    "n_heads": "--n-heads",
    "ffn_dim": "--ffn-dim",
    "vocab_size": "--vocab-size",
    "tie_embeddings": "--tie-embeddings",
    "fused_projections": "--fused-projections",
    "moe_capacity_factor": "--moe-capacity-factor",
}
# Switches: how to ask for off (--tie-embeddings has no --no- form), and the checkpoint's in words.
SWITCH_WORDS = {
    "tie_embeddings": ("no --tie-embeddings", "tied", "untied"),
    "fused_projections": ("--no-fused-projections", "fused", "separate"),
}


def identity(args: argparse.Namespace, cfg: ModelConfig) -> dict[str, Any]:
    """What a checkpoint must share with the job that continues it: the model (every config
    field but max_seq_len) and the seed, which fixes the initial weights and the data order."""
    model = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "max_seq_len"}
    return {"preset": args.preset, "model": model, "seed": args.seed}


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The flags that differ, as `--flag now (checkpoint: then)`; [] when they agree."""
    diffs = []
    if saved.get("preset") != current["preset"]:
        diffs.append(f"--preset {current['preset']} (checkpoint: {saved.get('preset')})")
    # A field the checkpoint lacks was added to ModelConfig after it was saved: that run had
    # the field's default (e.g. separate q/k/v before fused projections existed).
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    old = {k: defaults.get(k) for k in current["model"]} | saved.get("model", {})
    new = current["model"]
    for key in sorted(set(old) | set(new), key=lambda k: (k not in MODEL_FLAGS, k)):
        if old.get(key) == new.get(key):
            continue
        if key in SWITCH_WORDS:
            off_flag, on, off = SWITCH_WORDS[key]
            flag = MODEL_FLAGS[key] if new.get(key) else off_flag
            diffs.append(f"{flag} (checkpoint: {on if old.get(key) else off})")
        elif key in MODEL_FLAGS:
            diffs.append(f"{MODEL_FLAGS[key]} {new.get(key)} (checkpoint: {old.get(key)})")
        elif saved.get("preset") == current["preset"]:  # same preset name, other defaults: a changed preset
            diffs.append(f"--preset {current['preset']}'s {key} {new.get(key)} (checkpoint: {old.get(key)})")
    if saved.get("seed") != current["seed"]:
        diffs.append(f"--seed {current['seed']} (checkpoint: {saved.get('seed')})")
    return diffs


def mismatch_message(where: str, diffs: list[str]) -> str:
    return (
        f"--resume: {where} was trained with other flags: {', '.join(diffs)}; pass the checkpoint's values to "
        f"continue it, or leave out --resume (or give a new --run-id) to start a new run"
    )


class RunLock:
    """An exclusive flock on `<run>/run.lock`, held by rank 0 for the life of the job. The
    kernel drops it when the process dies, however it dies, so a lock is never stale."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError), open(self.path) as f:
            return f.read().strip() or "another job"
        return "another job"

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


@dataclasses.dataclass
class Run:
    """The directory this job writes into, and whether it continues a checkpoint there."""

    run_id: str
    path: str
    resume: bool  # load the newest intact checkpoint under `path`
    notes: list[str]  # lines for the user (which run, what was skipped)


def new_run_id() -> str:
    """Sortable by start time, unique without coordination: date-time plus 16 random bits."""
    return f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def _read_run(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, RUN_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _last_activity(path: str) -> float:
    """When the run last wrote a checkpoint (or started): the order --resume tries runs in."""
    times = [os.path.getmtime(p) for _, p in checkpoint_dirs(path)[-1:]]
    with contextlib.suppress(OSError):
        times.append(os.path.getmtime(os.path.join(path, RUN_FILE)))
    return max(times, default=0.0)


def open_run(args: argparse.Namespace, ident: dict[str, Any]) -> tuple[Run, RunLock]:
    """Pick (or create) this job's run directory and lock it. Rank 0 only; raises UsageError
    when the request cannot be honoured (a mismatched resume, a run in use, a taken id)."""
    out = args.out
    if args.resume and args.run_id:
        path = os.path.join(out, args.run_id)
        saved = _read_run(path)
        if saved is None:
            return _create(
                args, ident, args.run_id, [f"--resume: no run {args.run_id} under {out}; starting it from scratch"]
            )
        diffs = identity_differences(saved.get("identity", {}), ident)
        if diffs:
            raise UsageError(mismatch_message(f"run {args.run_id}", diffs))
        lock = RunLock(path)
        if not lock.acquire():
            raise UsageError(
                f"--resume --run-id {args.run_id}: the run is in use by {lock.holder()}; stop that job first"
            )
        return Run(args.run_id, path, bool(checkpoint_dirs(path)), []), lock
    if args.resume:
        notes: list[str] = []
        runs = []
        if os.path.isdir(out):
            for name in os.listdir(out):
                saved = _read_run(os.path.join(out, name))
                if saved is not None:
                    runs.append((_last_activity(os.path.join(out, name)), name, saved))
        runs.sort(reverse=True)
        same = [(name, saved) for _, name, saved in runs if not identity_differences(saved.get("identity", {}), ident)]
        if runs and not same:
            _, name, saved = runs[0]
            raise UsageError(
                mismatch_message(
                    f"the newest run in {out} ({name})", identity_differences(saved.get("identity", {}), ident)
                )
            )
        for name, _ in same:
            path = os.path.join(out, name)
            if not checkpoint_dirs(path):
                continue
            lock = RunLock(path)
            if lock.acquire():
                return Run(name, path, True, notes + [f"--resume: continuing run {name}"]), lock
            notes.append(f"--resume: skipping run {name}: in use by {lock.holder()}")
        notes.append(f"--resume: no run in {out} to continue; starting a new one")
        return _create(args, ident, None, notes)
    if args.run_id and _read_run(os.path.join(out, args.run_id)) is not None:
        raise UsageError(
            f"--run-id {args.run_id}: {os.path.join(out, args.run_id)} already holds a run; "
            f"add --resume to continue it, or choose another --run-id"
        )
    return _create(args, ident, args.run_id, [])


def _create(
    args: argparse.Namespace, ident: dict[str, Any], run_id: str | None, notes: list[str]
) -> tuple[Run, RunLock]:
    """A new run directory (exclusive: two jobs starting together get different ones)."""
    for _ in range(100):
        name = run_id or new_run_id()
        path = os.path.join(args.out, name)
        try:
            os.makedirs(path, exist_ok=run_id is not None)
        except FileExistsError:
            continue  # the same second and the same 16 random bits: draw again
        lock = RunLock(path)
        if not lock.acquire():
            raise UsageError(f"--run-id {name}: the run is in use by {lock.holder()}")
        write_json(
            os.path.join(path, RUN_FILE),
            {
                "identity": ident,
                "args": vars(args),
                "host": socket.gethostname(),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
            },
        )
        return Run(name, path, False, notes), lock
    raise RuntimeError(f"could not create a new run directory under {args.out}")
