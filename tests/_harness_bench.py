"""The benchmark's (examples/benchmark.py) smoke command line, re-exported by `_harness`: the
tests that run the benchmark end to end on a tiny model share it."""

from __future__ import annotations

__all__ = ["smoke_argv"]


def smoke_argv(*extra: str, batch_size: int = 1, steps: int = 1, warmup: int | None = 1, rounds: int = 1) -> list[str]:
    """``--preset tiny --seq-len 16 --batch-size B --steps S [--warmup W] --rounds R`` followed by
    ``extra``: the smallest run that builds, trains, times and reports every contender.
    ``warmup=None`` leaves the benchmark's default."""
    argv = ["--preset", "tiny", "--seq-len", "16", "--batch-size", str(batch_size), "--steps", str(steps)]
    if warmup is not None:
        argv += ["--warmup", str(warmup)]
    return [*argv, "--rounds", str(rounds), *extra]
