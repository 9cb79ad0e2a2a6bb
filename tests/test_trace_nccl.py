"""examples/trace_nccl.py (the ranks' NCCL kernels lined up: skew, transfer time, bandwidth,
compute overlap, launch gaps) on made-up 2-rank traces whose numbers are known; the
benchmark writing every rank's trace (2 gloo ranks on the CPU, which also checks the fields
of a real CPU trace the script relies on); and, on 2 GPUs, a real NCCL trace."""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path

import pytest
from _harness import requires_gpus, run_on_ranks, smoke_argv

from benchmarks import trace_nccl

BASE = 1_790_000_000_000_000_000


def _op(name: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _comms(ts: float, ext: int, coll: str, dtype: str, n_in: int, n_out: int, pg: str = "0") -> dict:
    meta = {"Collective name": coll, "dtype": dtype, "In msg nelems": n_in, "Out msg nelems": n_out}
    meta |= {"Group size": 2, "Process Group Name": pg, "External id": ext}
    return _op("record_param_comms", ts, 10, **meta)


def _launch(ts: float, corr: int) -> dict:
    event = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "pid": 1, "tid": 1}
    return event | {"args": {"correlation": corr}}


def _kernel(name: str, ts: float, dur: float, stream: int = 7, **args: object) -> dict:
    args |= {"device": 0, "stream": stream}
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream, "args": args}


def _trace(rank: int, events: list[dict], base: int = BASE) -> dict:
    return {"distributedInfo": {"rank": rank}, "baseTimeNanoseconds": base, "traceEvents": events}


# Rank 1's clock base is 1000 us later, so its timestamps are written 1000 us smaller.
# all-gather (pg 0): rank 0's kernel 100-150 (launched at 90, 20 us under a gemm), rank 1's
#   130-155 (launched at 128, after rank 0's began: late on the CPU, in aten::_foreach_add_).
# reduce-scatter (pg 0): rank 1's 300-345, rank 0's 305-345, launched at 250 (queued behind
#   `elementwise`); rank 1's has no launch call: its record_param_comms (288) stands in; a
#   gemm on rank 1 covers 15 us of it.
# all-reduce (pg 1, a generic kernel name: the kind comes from the collective name): 400-420;
#   rank 1's kernel has no External id: its record_param_comms is the op around its launch call.
AG_SIZE = {"Collective name": "_allgather_base", "In msg nelems": 1_000_000, "Out msg nelems": 2_000_000}
AG_SIZE |= {"Group size": 2, "dtype": "BFloat16"}
LINK_AG0 = {"External id": 11, "correlation": 101}
RANK0 = [
    _comms(85, 11, "_allgather_base", "BFloat16", 1_000_000, 2_000_000),
    _launch(90, 101),
    _kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 100, 50, 20, **LINK_AG0),
    _kernel("sm90_xmma_gemm", 80, 40),
    _comms(245, 12, "_reduce_scatter_base", "Float", 2_000_000, 1_000_000),
    _launch(250, 102),
    _kernel("elementwise", 260, 45),
    _op("aten::mul", 295, 15),
    _kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 305, 40, 20, **{"External id": 12, "correlation": 102}),
    _comms(390, 13, "allreduce", "Float", 500_000, 500_000, pg="1"),
    _kernel("ncclDevKernel_Generic_4", 400, 20, 21, **{"External id": 13}),
]
RANK1 = [
    _op("aten::_foreach_add_", 95, 25),
    _op("record_param_comms", 125, 10, **{"External id": 21, "Process Group Name": "0"}),
    _launch(128, 201),
    # Kineto copies the collective's size onto the kernel; the group comes from the CPU op.
    _kernel("ncclDevKernel_AllGather_RING_LL", 130, 25, 20, **{"External id": 21, "correlation": 201, **AG_SIZE}),
    _comms(288, 22, "_reduce_scatter_base", "Float", 2_000_000, 1_000_000),
    _kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 300, 45, 20, **{"External id": 22}),
    _kernel("sm90_xmma_gemm", 330, 30),
    _kernel("Memcpy DtoD", 135, 10) | {"cat": "gpu_memcpy"},  # the copy engine: not counted as compute
    _comms(390, 23, "allreduce", "Float", 500_000, 500_000, pg="1"),
    _launch(395, 203),  # no External id on the kernel: its comms op is the one around the launch call
    _kernel("ncclDevKernel_Generic_4", 400, 20, 21, correlation=203),
]


def _shifted(events: list[dict], by: float) -> list[dict]:
    return [e | {"ts": e["ts"] + by} for e in events]


def test_kinds_from_kernel_and_collective_names() -> None:
    assert trace_nccl.kind_of("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "all_gather"
    assert trace_nccl.kind_of("ncclKernel_ReduceScatter_RING_SIMPLE_Sum_bf16") == "reduce_scatter"
    assert trace_nccl.kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all_reduce"
    assert trace_nccl.kind_of("allgather_into_tensor_coalesced") == "all_gather"
    assert trace_nccl.kind_of("_reduce_scatter_base") == "reduce_scatter"
    assert trace_nccl.kind_of("ncclDevKernel_Generic_4") == "other"


def _write(tmp_path: Path, rank: int, trace: dict) -> str:
    path = tmp_path / f"run_b1_rank{rank}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return str(path)


def test_numbers_of_made_up_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [
        _write(tmp_path, 1, _trace(1, _shifted(RANK1, -1000), BASE + 1_000_000)),  # rank order from the trace
        _write(tmp_path, 0, _trace(0, RANK0)),
    ]
    colls = trace_nccl.main([*paths, "--top", "2"])
    assert [(c.kind, c.pg, c.index, c.nbytes) for c in colls] == [
        ("all_gather", "0", 0, 4_000_000),
        ("reduce_scatter", "0", 1, 8_000_000),
        ("all_reduce", "1", 0, 2_000_000),
    ]
    ag, rs, ar = colls
    assert [(k.start, k.end, k.launch, k.nbytes) for k in ag.on] == [(100, 150, 90, 4e6), (130, 155, 128, 4e6)]
    assert (ag.skew, ag.transfer, ag.waiting, ag.mean_dur) == (30, 20, 30, 37.5)
    assert [k.overlap for k in ag.on] == [20, 0]
    assert [(k.launch, k.overlap) for k in rs.on] == [(250, 0), (288, 15)]
    s = trace_nccl.summarize(colls)
    assert s["all_gather"] == {
        "count": 1,
        "total_bytes": 4_000_000,
        "median_bytes": 4_000_000,
        "median_dur": 37.5,
        "median_transfer": 20,
        "median_skew": 30,
        "waiting_share": 30 / 75,
        "median_launch_gap": 6,  # (10 + 2) / 2
        "busbw_dur": pytest.approx(4e6 / 2 / 37.5 / 1e3),
        "busbw_transfer": pytest.approx(100.0),
        "overlap_share": 20 / 75,
        "late_launch_share": 1.0,
    }
    assert s["reduce_scatter"]["waiting_share"] == 5 / 85
    assert s["reduce_scatter"]["median_launch_gap"] == (55 + 12) / 2
    assert s["reduce_scatter"]["busbw_transfer"] == pytest.approx(8e6 / 2 / 40 / 1e3)
    assert s["reduce_scatter"]["overlap_share"] == 15 / 85
    assert s["reduce_scatter"]["late_launch_share"] == 0.0  # rank 0 launched early, queued on its GPU
    assert s["all_reduce"]["busbw_dur"] == pytest.approx(2e6 * 1.0 / 20 / 1e3)  # 2(n-1)/n = 1
    assert s["all_reduce"]["median_launch_gap"] == (10 + 5) / 2
    assert s["all_reduce"]["median_skew"] == 0 and math.isnan(s["all_reduce"]["late_launch_share"])
    out = capsys.readouterr().out
    assert "3 collectives on ranks [0, 1]" in out
    top = out.split("top 2 by skew")[1].splitlines()[1:]
    assert len(top) == 2
    assert "all_gather" in top[0] and "skew     30.0" in top[0] and "dur 50.0/25.0" in top[0]
    assert "late rank 1 launched at +28.0  cpu: aten::_foreach_add_  gpu: idle" in top[0]
    assert "late rank 0 launched at -50.0  cpu: aten::mul  gpu: elementwise" in top[1]


def test_unequal_counts_are_said_and_the_common_prefix_matched(capsys: pytest.CaptureFixture[str]) -> None:
    extra = [
        _comms(490, 14, "_allgather_base", "BFloat16", 1_000_000, 2_000_000),
        _kernel("ncclDevKernel_AllGather_RING_LL", 500, 10, 20, **{"External id": 14}),
    ]
    ranks = [trace_nccl.parse_rank(_trace(0, RANK0 + extra), 0), trace_nccl.parse_rank(_trace(1, RANK1), 1)]
    colls = trace_nccl.match(ranks)
    matched = [(c.kind, c.pg, c.index, [k.start for k in c.on]) for c in colls]
    assert matched == [
        ("all_gather", "0", 0, [100, 130]),
        ("reduce_scatter", "0", 1, [305, 300]),
        ("all_reduce", "1", 0, [400, 400]),
    ]
    assert "process group 0: kernel counts differ by rank [3, 2]" in capsys.readouterr().out


def _profiled_floor(rank: int, world_size: int, trace_dir: str) -> None:
    import torch

    from benchmarks import side_by_side as benchmark

    argv = smoke_argv("--runs", "floor", "--profile", "floor", "--trace-dir", trace_dir)
    benchmark.run_rounds(benchmark.parse_args(argv), torch.device("cpu"))


def test_benchmark_writes_every_ranks_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real torch.profiler trace: the fields the script relies on exist (gloo launches no
    kernels and records no `record_param_comms`, so those are checked on GPUs below)."""
    run_on_ranks(_profiled_floor, 2, str(tmp_path), timeout=300)
    paths = [str(tmp_path / f"floor_b1_rank{r}.json.gz") for r in range(2)]
    for r, path in enumerate(paths):
        trace = trace_nccl.load(path)
        assert trace["distributedInfo"]["rank"] == r and trace["baseTimeNanoseconds"] > 0
        ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
        assert ops and all({"ts", "dur", "tid"} <= e.keys() and "External id" in e["args"] for e in ops)
    capsys.readouterr()
    assert trace_nccl.main(paths) == []
    assert "no NCCL kernels in the traces of ranks [0, 1]" in capsys.readouterr().out


def _nccl_trace(rank: int, world_size: int, trace_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16)
    dist.all_reduce(torch.ones(1, device="cuda"))  # NCCL's communicator set up before the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.all_gather_into_tensor(torch.empty(2 << 20, device="cuda", dtype=torch.bfloat16), x)
        dist.reduce_scatter_tensor(torch.empty(1 << 19, device="cuda"), torch.ones(1 << 20, device="cuda"))
        dist.all_reduce(torch.ones(1 << 18, device="cuda"))
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(trace_dir, f"nccl_rank{rank}.json"))


@requires_gpus(2)
def test_real_nccl_traces_give_sizes_groups_and_launches(tmp_path: Path) -> None:
    run_on_ranks(_nccl_trace, 2, str(tmp_path), backend="nccl")
    colls = trace_nccl.main([str(tmp_path / f"nccl_rank{r}.json") for r in range(2)])
    assert [(c.kind, c.nbytes) for c in colls] == [
        ("all_gather", 4 << 20),  # the gathered bf16 output
        ("reduce_scatter", 4 << 20),  # the fp32 input
        ("all_reduce", 1 << 20),
    ], colls
    assert all(k.pg != "?" and k.launch is not None and k.launch < k.start for c in colls for k in c.on), colls
    for r in range(2):  # the fields relied on: each kernel's launch call and record_param_comms op
        events = trace_nccl.load(str(tmp_path / f"nccl_rank{r}.json"))["traceEvents"]
        calls = {e["args"].get("correlation") for e in events if e.get("cat") in trace_nccl.LAUNCH_CATS}
        comms = {e["args"]["External id"] for e in events if e.get("name") == "record_param_comms"}
        kernels = [e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
        assert kernels and all(k["args"]["correlation"] in calls for k in kernels), kernels
        assert all(k["args"]["External id"] in comms for k in kernels), kernels
