"""torchtitan's `train.py` entry point with composable's data parallelism
(`composable.integrations.torchtitan`); every flag is torchtitan's.

torchtitan 0.3: every model's own parallelize code shards with `composable.fully_shard`
(`use_composable_in_torchtitan()`), under each of torchtitan's SPMD backends (`--parallelism.spmd_backend`):
"spmd_types" (torchtitan's default), "partial_dtensor" or "full_dtensor":

    torchrun --nproc-per-node 2 examples/integrations/torchtitan_train.py \\
        --module llama3 --config llama3_debugmodel --parallelism.spmd_backend full_dtensor

torchtitan 0.2: `--model.name llama3_composable` trains llama3 with `composable.fully_shard`,
`--model.name llama3` with PyTorch FSDP2:

    torchrun --nproc-per-node 2 examples/integrations/torchtitan_train.py \\
        --model.name llama3_composable --model.flavor debugmodel --training.steps 10
"""

import os
import sys

# A checkout that was not pip-installed still runs (the repository root holds the package).
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from composable.integrations import torchtitan as adapter  # noqa: E402

if __name__ == "__main__":
    version = adapter.installed_torchtitan_version() or "0.3"
    if version.startswith("0.2"):
        from torchtitan.train import Trainer, main

        adapter.register_llama3()  # the one line a torchtitan 0.2 user adds
        main(Trainer)
    else:
        from torchtitan.train import main

        adapter.use_composable_in_torchtitan()  # the one line a torchtitan 0.3 user adds
        main()
