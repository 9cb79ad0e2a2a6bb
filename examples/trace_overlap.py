#!/usr/bin/env python
"""Where the GPU's time goes in a benchmark's Chrome trace: benchmarks/trace_overlap.py."""

from benchmarks.trace_overlap import main

if __name__ == "__main__":
    main()
