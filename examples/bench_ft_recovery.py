#!/usr/bin/env python
"""A torchft replica group lost and restarted, timed: benchmarks/bench_ft_recovery.py."""

import os
import sys

# A checkout that was not pip-installed still finds composable, one folder up.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_ft_recovery import main  # noqa: E402

if __name__ == "__main__":
    main()
