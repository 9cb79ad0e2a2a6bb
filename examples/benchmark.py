#!/usr/bin/env python
"""Side-by-side benchmark: composable vs PyTorch's FSDP2 and DDP, one run, same GPUs.

    torchrun --nproc_per_node 2 examples/benchmark.py --preset 1b --batch-size 4
    python examples/benchmark.py --cpu-overhead        # CPU cost of the hooks, no GPU needed

The runs, the flags and the report: benchmarks/side_by_side.py and the files it names.
"""

import os
import sys

# A checkout that was not pip-installed still finds composable, one folder up.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.side_by_side import command_line_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(command_line_main())
