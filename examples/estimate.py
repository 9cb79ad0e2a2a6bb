#!/usr/bin/env python
"""Scale on paper: per-rank peak memory and per-step communication of a training setup, at any
world size, on one CPU process.

    python examples/estimate.py --preset 1b --world-size 2 --batch-size 4 --json

The flags and the report: estimator/estimate_cli.py; the arithmetic: the other estimator files.
"""

import os
import sys

# A checkout that was not pip-installed still finds composable, one folder up.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from estimator.estimate_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
