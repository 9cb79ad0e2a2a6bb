"""Why NCCL kernels move fewer bytes per second in training than alone: the collectives of
every rank of one profiled run, lined up.

    torchrun --nproc-per-node 2 examples/benchmark.py ... --profile fully_shard --trace-dir DIR
    python examples/trace_nccl.py DIR/fully_shard_b1_rank*.json.gz [--top 10]

Each rank's trace gives its NCCL kernels (`ncclDevKernel_AllGather_RING_LL...`) in start
order; the k-th kernel of a process group is the same collective on every rank. Its size is
the profiler's collective metadata (`In msg nelems`, `Out msg nelems`, `dtype`, `Group size`,
`Process Group Name`), on the kernel or on the `record_param_comms` CPU op that launched it
(same `External id`); its CPU launch is the `cudaLaunchKernel`/`cuLaunchKernelEx` call with
the kernel's `correlation`. Processes of one host share its clock (microseconds). Per collective:

- skew: last start - first start over the ranks; the early ranks' kernels spin that long
  waiting for the late one. "waiting" is the sum over ranks of (last start - own start) as a
  share of the sum of the ranks' kernel durations.
- transfer: first end - last start, the time all ranks are in the kernel together.
- bus bandwidth (nccl-tests' busbw, comparable to measurements of NCCL alone): size / time x
  (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce, where size is the larger
  buffer (the gathered output, the scattered input); by mean kernel duration and by transfer.
- compute overlap: the share of the kernel's time that non-NCCL kernels ran on the same GPU
  (they share the SMs); launch gap: kernel start - its CPU launch call (large: queued behind
  other work on its stream; near zero: the GPU waited for the CPU).
- late launch: the late rank's CPU launched the kernel after the early rank's kernel began
  (the host made it late, not its GPU queue); the top list names the CPU op running on the
  late rank's launching thread, and the kernel running on its GPU, when the early one began.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from dataclasses import dataclass

from benchmarks.trace_overlap import Interval, union

KINDS = (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"))
KINDS += (("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("alltoall", "all_to_all"))
DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2}
DTYPE_BYTES |= {"Byte": 1, "Char": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "ComplexFloat": 8}
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def kind_of(name: str) -> str:
    """'all_gather' for `ncclDevKernel_AllGather_RING_LL(...)` or the collective name
    `_allgather_base`/`allgather_into_tensor_coalesced`; 'other' when unknown."""
    flat = name.lower().replace("_", "")
    return next((kind for key, kind in KINDS if key in flat), "other")


def _int(value: object) -> int | None:
    try:
        return int(str(value).strip('"'))
    except ValueError:
        return None


@dataclass
class Kernel:
    """One NCCL kernel on one rank."""

    kind: str
    pg: str
    start: float
    end: float
    nbytes: int | None
    group_size: int | None
    launch: float | None  # ts of its CPU launch call (or of its record_param_comms op)
    tid: int | None  # the CPU thread that launched it
    overlap: float  # microseconds of it during which compute kernels ran on the same GPU


class Timeline:
    """Complete events (`ph: X`) sorted by start, for "what was running at time t"."""

    def __init__(self, events: list[dict]) -> None:
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]

    def at(self, ts: float, name: str | None = None) -> dict | None:
        """The innermost (latest started) event running at `ts`, of that `name` if given."""
        for i in range(bisect.bisect_right(self.starts, ts) - 1, -1, -1):
            e = self.events[i]
            if e["ts"] + e["dur"] >= ts and name in (None, e["name"]):
                return e
        return None


@dataclass
class RankTrace:
    rank: int
    nccl: list[Kernel]
    ops: dict[int, Timeline]  # CPU ops per thread
    gpu: Timeline  # every GPU kernel, copy and set


@dataclass
class TracedCollective:
    """The k-th collective of one process group, on every rank (rank order)."""

    kind: str
    pg: str
    index: int
    nbytes: int | None
    on: list[Kernel]

    @property
    def skew(self) -> float:
        return max(k.start for k in self.on) - min(k.start for k in self.on)

    @property
    def transfer(self) -> float:
        return min(k.end for k in self.on) - max(k.start for k in self.on)

    @property
    def waiting(self) -> float:
        last = max(k.start for k in self.on)
        return sum(last - k.start for k in self.on)

    @property
    def mean_dur(self) -> float:
        return statistics.fmean(k.end - k.start for k in self.on)

    def busbw(self, time_us: float) -> float:
        """GB/s in nccl-tests' bus bandwidth; nan without a size or time."""
        n = self.on[0].group_size or len(self.on)
        factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
        if self.nbytes is None or time_us <= 0:
            return float("nan")
        return self.nbytes * factor.get(self.kind, 1.0) / time_us / 1e3


def covered(cover: list[Interval], starts: list[float], s: float, e: float) -> float:
    """Length of [s, e] inside the disjoint sorted `cover` (`starts` its starts)."""
    i, out = max(bisect.bisect_right(starts, s) - 1, 0), 0.0
    while i < len(cover) and cover[i].start < e:
        out += max(0.0, min(e, cover[i].end) - max(s, cover[i].start))
        i += 1
    return out


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def parse_rank(trace: dict, default_rank: int, base_ns: int | None = None) -> RankTrace:
    """One rank's NCCL kernels from its Chrome trace, times moved onto the base `base_ns`
    (timestamps count from the trace's `baseTimeNanoseconds`, which may differ by rank)."""
    own = trace.get("baseTimeNanoseconds", 0)
    shift = (own - (own if base_ns is None else base_ns)) / 1e3
    rank = trace.get("distributedInfo", {}).get("rank", default_rank)
    events = [e | {"ts": float(e["ts"]) + shift} for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    threads: dict[int, list[dict]] = {}
    comms, launches = {}, {}
    for e in events:
        args = e.get("args", {})
        if e.get("cat") in ("cpu_op", "user_annotation"):
            threads.setdefault(e["tid"], []).append(e)
            if e["name"] == "record_param_comms" and "External id" in args:
                comms[args["External id"]] = e
        elif e.get("cat") in LAUNCH_CATS and "correlation" in args:
            launches[args["correlation"]] = e
    ops = {tid: Timeline(thread) for tid, thread in threads.items()}
    gpu = Timeline([e for e in events if e.get("cat") in GPU_CATS])
    # Kernels share the SMs with NCCL's; copies and sets run on the copy engines.
    is_compute = lambda e: e.get("cat") == "kernel" and "nccl" not in e["name"].lower()  # noqa: E731
    compute = union([Interval(e["ts"], e["ts"] + e["dur"]) for e in gpu.events if is_compute(e)])
    starts = [c.start for c in compute]
    nccl = []
    for e in gpu.events:
        if e.get("cat") != "kernel" or "nccl" not in e["name"].lower():
            continue
        args = e.get("args", {})
        call = launches.get(args.get("correlation"))
        op = comms.get(args.get("External id"))
        if op is None and call is not None and call["tid"] in ops:  # the op around the launch call
            op = ops[call["tid"]].at(call["ts"], "record_param_comms")
        meta = {**(op["args"] if op else {}), **args}
        kind = kind_of(e["name"])
        kind = kind if kind != "other" else kind_of(str(meta.get("Collective name", "")))
        nelems = [_int(meta[k]) for k in ("In msg nelems", "Out msg nelems") if k in meta]
        size = DTYPE_BYTES.get(str(meta.get("dtype", "")).strip('"'))
        nbytes = max(nelems) * size if nelems and None not in nelems and size else None
        origin = call or op
        nccl.append(
            Kernel(
                kind=kind,
                pg=str(meta.get("Process Group Name", "?")).strip('"'),
                start=e["ts"],
                end=e["ts"] + e["dur"],
                nbytes=nbytes,
                group_size=_int(meta.get("Group size", "")),
                launch=origin["ts"] if origin else None,
                tid=origin["tid"] if origin else None,
                overlap=covered(compute, starts, e["ts"], e["ts"] + e["dur"]),
            )
        )
    return RankTrace(rank, nccl, ops, gpu)


def match(ranks: list[RankTrace]) -> list[TracedCollective]:
    """Collectives by start, each with its kernel on every rank: the k-th kernel of a process
    group on each rank (NCCL runs a communicator's kernels in issue order, the same on every
    rank). A group whose counts differ across ranks is matched over the common prefix, said."""
    per: list[dict[str, list[Kernel]]] = []
    for r in ranks:
        groups: dict[str, list[Kernel]] = {}
        for k in r.nccl:
            groups.setdefault(k.pg, []).append(k)
        per.append(groups)
    out = []
    for pg in per[0]:
        lists = [groups.get(pg, []) for groups in per]
        if len({len(x) for x in lists}) > 1:
            print(f"process group {pg}: kernel counts differ by rank {[len(x) for x in lists]}; first ones matched")
        for i, on in enumerate(zip(*lists)):
            if len({k.kind for k in on}) > 1:
                print(f"process group {pg} collective {i}: kinds differ by rank {[k.kind for k in on]}")
            nbytes = next((k.nbytes for k in on if k.nbytes is not None), None)
            out.append(TracedCollective(on[0].kind, pg, i, nbytes, list(on)))
    return sorted(out, key=lambda c: min(k.start for k in c.on))


def late_launched(c: TracedCollective) -> bool:
    """Whether the late rank's CPU launched its kernel after the early rank's kernel began."""
    early, late = min(c.on, key=lambda k: k.start), max(c.on, key=lambda k: k.start)
    return late.launch is not None and late.launch > early.start


def summarize(colls: list[TracedCollective]) -> dict[str, dict[str, float]]:
    """Per collective kind: the numbers of the summary table (times in us, sizes in bytes)."""
    out = {}
    for kind in sorted({c.kind for c in colls}):
        cs = [c for c in colls if c.kind == kind]
        ks = [k for c in cs for k in c.on]
        sized = [c.nbytes for c in cs if c.nbytes is not None]
        skewed = [c for c in cs if c.skew > 0]
        gaps = [k.start - k.launch for k in ks if k.launch is not None]
        out[kind] = {
            "count": len(cs),
            "total_bytes": sum(sized),
            "median_bytes": statistics.median(sized) if sized else float("nan"),
            "median_dur": statistics.median(k.end - k.start for k in ks),
            "median_transfer": statistics.median(c.transfer for c in cs),
            "median_skew": statistics.median(c.skew for c in cs),
            "waiting_share": sum(c.waiting for c in cs) / sum(k.end - k.start for k in ks),
            "median_launch_gap": statistics.median(gaps) if gaps else float("nan"),
            "busbw_dur": _median([c.busbw(c.mean_dur) for c in cs]),
            "busbw_transfer": _median([c.busbw(c.transfer) for c in cs]),
            "overlap_share": sum(k.overlap for k in ks) / sum(k.end - k.start for k in ks),
            "late_launch_share": sum(c.skew for c in skewed if late_launched(c)) / sum(c.skew for c in skewed)
            if skewed
            else float("nan"),
        }
    return out


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop nans
    return statistics.median(values) if values else float("nan")


def report(ranks: list[RankTrace], top: int) -> list[TracedCollective]:
    colls = match(ranks)
    if not colls:
        print(f"no NCCL kernels in the traces of ranks {[r.rank for r in ranks]} (a CPU run has none)")
        return colls
    print(
        f"{len(colls)} collectives on ranks {[r.rank for r in ranks]}; times in us, busbw in GB/s (nccl-tests' "
        "bus bandwidth), waiting = kernel time before the last rank arrived, late launch = share of the skew "
        "where the late rank's CPU launched after the early rank's kernel began"
    )
    head = ("count", "total MB", "med MB", "med dur", "med xfer", "med skew", "waiting", "med gap")
    head += ("busbw dur", "busbw xfer", "compute", "late launch")
    print(f"{'kind':<14}" + "".join(f"{h:>12}" for h in head))
    for kind, s in summarize(colls).items():
        cells = [str(s["count"]), f"{s['total_bytes'] / 1e6:.1f}", f"{s['median_bytes'] / 1e6:.2f}"]
        cells += [f"{s[k]:.1f}" for k in ("median_dur", "median_transfer", "median_skew")]
        cells += [f"{s['waiting_share']:.1%}", f"{s['median_launch_gap']:.1f}"]
        cells += [f"{s['busbw_dur']:.1f}", f"{s['busbw_transfer']:.1f}"]
        cells += [f"{s['overlap_share']:.1%}", f"{s['late_launch_share']:.1%}"]
        print(f"{kind:<14}" + "".join(f"{c.replace('nan%', '-'):>12}" for c in cells))
    by_rank = {r.rank: r for r in ranks}
    order = [r.rank for r in ranks]
    print(
        f"top {top} by skew (us); when the early rank's kernel began: how long after it the late rank launched "
        "its own (negative: before, then queued on its GPU), the CPU op on its launching thread, its GPU kernel"
    )
    for c in sorted(colls, key=lambda c: -c.skew)[:top]:
        early = min(c.on, key=lambda k: k.start)
        i = max(range(len(c.on)), key=lambda j: c.on[j].start)
        late, trace = c.on[i], by_rank[order[i]]
        op = trace.ops[late.tid].at(early.start) if late.tid in trace.ops else None
        busy = trace.gpu.at(early.start)
        launched = "?" if late.launch is None else f"{late.launch - early.start:+.1f}"
        durs = "/".join(f"{k.end - k.start:.1f}" for k in c.on)
        print(
            f"  {c.kind:<14} pg {c.pg:<3} #{c.index:<4} {(c.nbytes or 0) / 1e6:8.2f} MB  skew {c.skew:8.1f}  "
            f"dur {durs}  late rank {order[i]} launched at {launched}  cpu: {op['name'] if op else '?'}  "
            f"gpu: {busy['name'][:60] if busy else 'idle'}"
        )
    return colls


def main(argv: list[str] | None = None) -> list[TracedCollective]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="one trace per rank of one profiled run")
    p.add_argument("--top", type=int, default=10, help="collectives with the largest skew to list")
    args = p.parse_args(argv)
    traces = [load(path) for path in args.traces]
    base = min(t.get("baseTimeNanoseconds", 0) for t in traces)
    ranks = sorted((parse_rank(t, i, base) for i, t in enumerate(traces)), key=lambda r: r.rank)
    return report(ranks, args.top)
