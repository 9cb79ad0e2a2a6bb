#!/usr/bin/env python
"""The optimizer step alone on a sharded preset, Muon against fused AdamW: benchmarks/bench_muon_step.py."""

import os
import sys

# A checkout that was not pip-installed still finds composable, one folder up.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_muon_step import main  # noqa: E402

if __name__ == "__main__":
    main()
