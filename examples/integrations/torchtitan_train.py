"""torchtitan's `train.py` entry point with composable's data parallelism selectable:
`--model.name llama3_composable` trains torchtitan's llama3 with `composable.fully_shard`
(`composable.integrations.torchtitan`), `--model.name llama3` with PyTorch FSDP2; every other flag
is torchtitan's.

    torchrun --nproc-per-node 2 examples/integrations/torchtitan_train.py \\
        --model.name llama3_composable --model.flavor debugmodel --training.steps 10
"""

import os
import sys

from torchtitan.train import Trainer, main

# A checkout that was not pip-installed still runs (the repository root holds the package).
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from composable.integrations.torchtitan import register_llama3  # noqa: E402

if __name__ == "__main__":
    register_llama3()  # the one line a torchtitan user adds
    main(Trainer)
