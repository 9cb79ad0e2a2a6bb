"""estimate.py --benchmark RESULTS.json: the estimate of a step that benchmark.py measured,
beside the measurement.

The setup is read from the benchmark's results file: the model shape (`--preset` and the
width flags), local batch and sequence length, `--wrap`, the world size and `--mesh` (dp:
`fsdp` over the world; hsdp: `--dp-replicate` replicas of world/replicas shards; tp: dp x
`--tp-size`), bf16 compute with fp32 reduction and AdamW, as the benchmark trains. Compute
time is calibrated on the measured floor when the file has one: its step gives the achieved
FLOP/s of one GPU running the whole model with no communication, so the estimate of a
sharded run is that compute plus the communication the timing model leaves exposed.
Compared per run (fully_shard and FSDP2 with the fully_shard layout, replicate and DDP with
the replicate one; graphed runs with their eager layout): step time and peak memory.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from typing import Any

from estimator.estimate_comm import estimate_comm
from estimator.estimate_memory import estimate_memory
from estimator.estimate_setup import Setup, UsageError
from estimator.estimate_time import Links, estimate_time
from models.model import PRESETS, get_config, model_flops_per_token, width_overrides

GiB = 2**30
LAYOUT = {"fully_shard": "sharded", "fsdp2": "sharded", "replicate": "replicate", "ddp": "replicate"}


# Measured fully_shard steps the estimate is checked against (tests/test_estimate.py):
# benchmark.py --preset 1b --seq-len 2048 --compile on 4 x H100 (torch 2.11, bf16 compute,
# fp32 reduction), the same global batch for both meshes. The estimate is the GPU's time; the
# eager 2D step is bound by the host (0.1735 s measured eagerly, 0.1345 s as one CUDA graph,
# `fully_shard_graphed`), so a 2D reference is the graphed step. The achieved FLOP/s comes from
# a separate measurement, the compiled no-communication floor of the same model: the hardware
# parameter, not fitted to these steps. For `1b` that is the floor at batch 4 on 2 x H100
# (BENCHMARKS.md, "Two GPUs"); an entry with a `floor_step_s` of its own (measured in the same
# run, at the entry's batch) uses that one.
H100_COMPILED_FLOOR_STEP_S = 0.1051  # 1b, batch 4 x 2048 tokens, one GPU's whole model
REFERENCE: dict[str, dict[str, Any]] = {
    "dp4": {"layout": {"parallel": "fsdp"}, "batch_size": 4, "step_s": 0.1100, "peak_gib": 13.92},
    "dp2xtp2": {"layout": {"parallel": "tp", "tp_size": 2}, "batch_size": 8, "step_s": 0.1345, "peak_gib": 16.93},
    # --dim 4096 --n-layers 8: the graphed 2D step and the floor of the same run.
    "dp2xtp2_w4096": {
        "layout": {"parallel": "tp", "tp_size": 2},
        "width": {"dim": 4096, "n_layers": 8},
        "batch_size": 8,
        "step_s": 0.1988,
        "peak_gib": 19.57,
        "floor_step_s": 0.3337,
    },
}


def reference_setup(name: str) -> Setup:
    """The Setup of a `REFERENCE` measurement (benchmark.py's default --wrap separate-ends)."""
    ref = REFERENCE[name]
    width = ref.get("width", {})  # benchmark.py's --dim / --n-layers: heads and ffn follow --dim as there
    cfg = get_config("1b", max_seq_len=2048, **(width | width_overrides("1b", width.get("dim"), None, None)))
    return Setup(cfg, 4, batch_size=ref["batch_size"], seq_len=2048, wrap="separate-ends", mp="bf16", **ref["layout"])


def reference_tflops(name: str) -> float:
    """Achieved TFLOP/s of the H100 compiled floor behind `REFERENCE[name]`: its own floor where
    it has one (at its batch), else the `1b` floor at batch 4."""
    ref = REFERENCE[name]
    floor_s, batch = (
        (ref["floor_step_s"], ref["batch_size"]) if "floor_step_s" in ref else (H100_COMPILED_FLOOR_STEP_S, 4)
    )
    return model_flops_per_token(reference_setup(name).cfg, 2048) * batch * 2048 / floor_s / 1e12


def load(path: str) -> dict[str, Any]:
    """The benchmark's results file; UsageError naming the flag and the path if unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
        data["args"], data["rounds"], data["world"]  # noqa: B018 - the keys this reads
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--benchmark {path}: not a benchmark.py results file ({type(e).__name__}: {e})") from None
    return data


def setup_from_benchmark(data: dict[str, Any]) -> Setup:
    """The estimate's Setup for the sharded contenders of a benchmark results file."""
    a, world = data["args"], int(data["world"])
    if a.get("float8"):
        raise UsageError("--benchmark: a --float8 run is not modelled (the estimate counts bf16 weights)")
    if a.get("preset") not in PRESETS:
        raise UsageError(f"--benchmark: unknown preset {a.get('preset')!r}")
    width = {k: a[k] for k in ("dim", "n_layers", "n_heads", "ffn_dim") if a.get(k) is not None}
    cfg = get_config(a["preset"], max_seq_len=a["seq_len"], **width)
    mesh = a.get("mesh", "dp")  # results from before --mesh: dp
    layout: dict[str, Any] = {"parallel": "fsdp"}
    if mesh == "hsdp":
        layout = {"parallel": "hsdp", "hsdp_shard_size": world // a["dp_replicate"]}
    elif mesh == "tp":
        layout = {"parallel": "tp", "tp_size": a["tp_size"]}
    return Setup(cfg, world, batch_size=a["batch_size"], seq_len=a["seq_len"], wrap=a["wrap"], mp="bf16", **layout)


def floor_tflops(data: dict[str, Any], s: Setup) -> float | None:
    """Achieved TFLOP/s of the measured floor (median step), or None without a floor run."""
    steps = [rd["floor"]["step_s"] for rd in data["rounds"] if "floor" in rd]
    if not steps:
        return None
    return model_flops_per_token(s.cfg, s.seq_len) * s.batch_size * s.seq_len / statistics.median(steps) / 1e12


def compare(data: dict[str, Any], s: Setup, links: Links, tflops: float) -> list[dict[str, Any]]:
    """Per measured run with a layout the estimate models: measured and estimated step time
    (compute + exposed communication) and peak memory, in seconds and bytes."""
    layouts = {"sharded": s}
    if s.parallel == "fsdp":  # replicate and DDP run on the dp mesh only
        layouts["replicate"] = replace(s, parallel="replicate", wrap="blocks")
    estimates = {}
    rows = []
    for run in data["rounds"][0]:
        layout = LAYOUT.get(run.removesuffix("_graphed"))
        if layout not in layouts:
            continue
        if layout not in estimates:
            setup = layouts[layout]
            tim = estimate_time(setup, estimate_comm(setup), links, tflops)
            estimates[layout] = (tim, estimate_memory(setup))
        tim, mem = estimates[layout]
        rows.append(
            {
                "run": run,
                "measured_step_s": statistics.median(rd[run]["step_s"] for rd in data["rounds"]),
                "estimated_step_s": tim.compute_s + tim.exposed_s,
                "estimated_compute_s": tim.compute_s,
                "measured_peak_bytes": max(rd[run]["peak_alloc_gib"] for rd in data["rounds"]) * GiB,
                "estimated_peak_bytes": mem.peak,
            }
        )
    return rows


def print_comparison(rows: list[dict[str, Any]], data: dict[str, Any], calibrated: bool) -> None:
    where = f"{data.get('device', '?')} x{data['world']}, mesh {data.get('mesh', 'dp ' + str(data['world']))}"
    rate = "compute at the measured floor's FLOP/s" if calibrated else "compute at --tflops (no floor measured)"
    print(f"\nmeasured ({where}) vs estimated ({rate}; + exposed communication)")
    print(f"  {'run':<20}{'s/step':>9}{'estimated':>11}{'ratio':>7}{'peak GiB':>10}{'estimated':>11}{'ratio':>7}")
    for r in rows:
        step, est = r["measured_step_s"], r["estimated_step_s"]
        peak, est_peak = r["measured_peak_bytes"] / GiB, r["estimated_peak_bytes"] / GiB
        print(
            f"  {r['run']:<20}{step:>9.4f}{est:>11.4f}{est / step:>7.2f}"
            f"{peak:>10.2f}{est_peak:>11.2f}{(est_peak / peak if peak else float('nan')):>7.2f}"
        )
