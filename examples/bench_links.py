#!/usr/bin/env python
"""Each group of a 2D (dp, tp) mesh timed alone: benchmarks/bench_links.py."""

from benchmarks.bench_links import main

if __name__ == "__main__":
    main()
