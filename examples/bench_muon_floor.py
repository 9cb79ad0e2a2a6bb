#!/usr/bin/env python
"""Muon's floor on one GPU (`--preset 1b`): benchmarks/bench_muon_floor.py."""

import os
import sys

sys.path.append(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # a checkout that was not pip-installed still runs

from benchmarks.bench_muon_floor import main  # noqa: E402

if __name__ == "__main__":
    main()
