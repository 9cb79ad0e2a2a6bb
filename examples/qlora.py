#!/usr/bin/env python
"""QLoRA fine-tuning of a Llama-architecture model with `composable.fully_shard`: trainer/qlora.py.

python examples/qlora.py --steps 5                 # one CPU process, the tiny shape
"""

from trainer.qlora import main

if __name__ == "__main__":
    main()
