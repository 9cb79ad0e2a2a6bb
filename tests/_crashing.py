"""Rank functions that crash, for `bench_overhead.run_isolated`'s tests: a module of their own,
importing nothing heavy, since each attempt's fresh process imports it (the test module would
bring transformers and torchao with it)."""

from __future__ import annotations

import atexit
import os


def abort_at_exit() -> str:
    atexit.register(os.abort)  # what DDP on gloo did: SIGABRT while the process tears down
    return "measured"


def abort_now() -> str:
    os.abort()
