#!/usr/bin/env python
"""What an offloaded, clipped step costs on the host (`--preset 1b`): benchmarks/bench_host_step.py."""

import os
import sys

# A checkout that was not pip-installed still finds composable, one folder up.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_host_step import main  # noqa: E402

if __name__ == "__main__":
    main()
