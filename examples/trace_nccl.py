#!/usr/bin/env python
"""The NCCL kernels of every rank of one profiled run, lined up: benchmarks/trace_nccl.py."""

from benchmarks.trace_nccl import main

if __name__ == "__main__":
    main()
