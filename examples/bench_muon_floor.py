#!/usr/bin/env python
"""Muon's floor on one GPU (`--preset 1b`): benchmarks/bench_muon_floor.py."""

import os
import sys

# A checkout that was not pip-installed still finds composable, one folder up.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_muon_floor import main  # noqa: E402

if __name__ == "__main__":
    main()
