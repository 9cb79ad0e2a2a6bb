#!/usr/bin/env python
"""QLoRA throughput and memory, composable's `fully_shard` against FSDP2: benchmarks/bench_qlora.py."""

from benchmarks.bench_qlora import main

if __name__ == "__main__":
    main()
