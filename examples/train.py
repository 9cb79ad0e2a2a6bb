#!/usr/bin/env python
"""The main job: train a Llama-style byte-level language model with `composable`.

    python examples/train.py                       # CPU: spawns 2 gloo ranks, ~2 minutes
    torchrun --nproc-per-node 4 examples/train.py --preset 1b --mp bf16 --batch-size 4 --seq-len 2048

What it does, its flags and its outputs: trainer/main_job.py and trainer/options.py.
"""

import os
import sys

# A checkout that was not pip-installed still finds composable, one folder up.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.launch import exit_process  # noqa: E402
from trainer.main_job import main  # noqa: E402

if __name__ == "__main__":
    exit_process(main())  # a rank: after its bounded teardown (launch.py); the launching parent: sys.exit
