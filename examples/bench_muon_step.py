#!/usr/bin/env python
"""The optimizer step alone on a sharded preset, Muon against fused AdamW: benchmarks/bench_muon_step.py."""

import os
import sys

sys.path.append(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # a checkout that was not pip-installed still runs

from benchmarks.bench_muon_step import main  # noqa: E402

if __name__ == "__main__":
    main()
