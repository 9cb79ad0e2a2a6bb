"""Where the GPU's time goes in a Chrome trace written by `benchmark.py --profile RUN --trace-dir DIR`.

    python examples/trace_overlap.py DIR/fully_shard_b4_rank0.json.gz [DIR/floor_b4_rank0.json.gz ...]

For each trace it prints, over the profiled window: the span from the first to the last
kernel, the time some compute kernel runs, the time only communication (NCCL) runs, i.e.
exposed communication, the time nothing runs on the GPU (idle, usually the CPU being late),
and the longest idle and exposed-communication gaps with the CPU op that was running when
each began, which is where to look first.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    start: float
    end: float


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint cover of `intervals`."""
    out: list[Interval] = []
    for iv in sorted(intervals, key=lambda i: i.start):
        if out and iv.start <= out[-1].end:
            out[-1] = Interval(out[-1].start, max(out[-1].end, iv.end))
        else:
            out.append(iv)
    return out


def total(intervals: list[Interval]) -> float:
    return sum(i.end - i.start for i in intervals)


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Parts of the disjoint sorted `a` not covered by the disjoint sorted `b`."""
    out: list[Interval] = []
    j = 0
    for iv in a:
        start = iv.start
        while j < len(b) and b[j].end <= start:
            j += 1
        k = j
        while k < len(b) and b[k].start < iv.end:
            if b[k].start > start:
                out.append(Interval(start, b[k].start))
            start = max(start, b[k].end)
            k += 1
        if start < iv.end:
            out.append(Interval(start, iv.end))
    return out


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def cpu_op_at(ops: list[dict], starts: list[float], ts: float) -> str:
    """The innermost CPU op running at `ts` (what the host was doing when the GPU went idle)."""
    i = bisect.bisect_right(starts, ts) - 1
    best = "?"
    while i >= 0 and ts - starts[i] < 5e5:  # ops started within the last 0.5 s
        op = ops[i]
        if op["ts"] + op.get("dur", 0) >= ts:
            return op["name"]
        i -= 1
    return best


def analyse(path: str, top: int) -> None:
    events = load(path)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    is_comm = lambda e: "nccl" in e["name"].lower()  # noqa: E731
    comm = union([Interval(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm(e)])
    compute = union([Interval(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_comm(e)])
    span = Interval(min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels))
    busy = union(comm + compute)
    exposed = subtract(comm, compute)
    idle = subtract([span], busy)
    ops = sorted(
        (e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e), key=lambda e: e["ts"]
    )
    starts = [e["ts"] for e in ops]
    width = span.end - span.start
    print(
        f"{path}: span {width / 1e3:.1f} ms; compute {total(compute) / 1e3:.1f} ms ({total(compute) / width:.1%}), "
        f"exposed communication {total(exposed) / 1e3:.1f} ms ({total(exposed) / width:.1%}), "
        f"idle {total(idle) / 1e3:.1f} ms ({total(idle) / width:.1%}); communication in all {total(comm) / 1e3:.1f} ms"
    )
    for label, gaps in (("idle", idle), ("exposed communication", exposed)):
        worst = sorted(gaps, key=lambda g: g.start - g.end)[:top]
        for g in worst:
            print(
                f"  {label:<22} {(g.end - g.start) / 1e3:7.3f} ms at +{(g.start - span.start) / 1e3:7.1f} ms  cpu: {cpu_op_at(ops, starts, g.start)}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=6, help="longest gaps to list per kind")
    args = p.parse_args()
    for path in args.traces:
        analyse(path, args.top)
