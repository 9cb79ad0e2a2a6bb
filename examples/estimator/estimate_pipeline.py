"""estimate.py --pp N: one pipeline stage on paper (train.py --pp's layout).

A stage holds ceil(n_layers / pp) blocks over world/pp data-parallel ranks and runs each
microbatch (local batch / --microbatches). Its data-parallel communication comes from the real
engine (estimate_comm on the stage's model, one step): a composable pipeline stage gathers and
reduces each group once per step whatever the number of microbatches. Its memory is
estimate_memory's for the stage, with the activations of every microbatch in flight on the
first stage (all of them under GPipe and LoopedBFS, at most pp under the 1F1B family). The
stage model keeps the embeddings and the head (the first and last stages' worst case).
Point-to-point traffic: each stage sends its output forward and its input gradient back once
per microbatch. Bubble: (pp - 1) / (v * M + pp - 1) with v stages per rank, the 1F1B bound
(zero-bubble schedules fill part of it).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from estimator.estimate_comm import estimate_comm
from estimator.estimate_memory import estimate_memory
from estimator.estimate_setup import Setup, UsageError
from trainer.pipeline import SCHEDULES

ALL_IN_FLIGHT = ("GPipe", "LoopedBFS")


def estimate_pipeline(s: Setup, pp: int, microbatches: int, schedule: str) -> dict[str, Any]:
    """Per-rank memory, bubble fraction and communication of one stage of `s` pipelined `pp`
    ways under torch's Schedule<`schedule`> with `microbatches`. UsageError for a bad value."""
    if schedule not in SCHEDULES:
        raise UsageError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    v = SCHEDULES[schedule]
    if pp < 2 or s.world_size % pp or s.cfg.n_layers < pp * v:
        raise UsageError(
            f"--pp must be >= 2, divide --world-size {s.world_size} and leave a layer per stage "
            f"({s.cfg.n_layers} layers, {v} stages per rank), got {pp}"
        )
    if microbatches < 1 or s.batch_size % microbatches:
        raise UsageError(f"--microbatches must divide --batch-size {s.batch_size}, got {microbatches}")
    layers = math.ceil(s.cfg.n_layers / pp)
    stage = replace(
        s,
        cfg=replace(s.cfg, n_layers=layers),
        world_size=s.world_size // pp,
        batch_size=s.batch_size // microbatches,
        hsdp_shard_size=None if s.hsdp_shard_size is None else min(s.hsdp_shard_size, s.world_size // pp),
        reshard_after_forward=False,  # train.py --pp: gathered once per step
    )
    mem, comm = estimate_memory(stage), estimate_comm(stage)
    in_flight = microbatches if schedule in ALL_IN_FLIGHT else min(microbatches, pp * v)
    peak = mem.peak + (in_flight - 1) * mem.activations
    p2p = 2 * v * s.batch_size * s.seq_len * s.cfg.dim * s.param_dtype.itemsize
    return {
        "pp": pp,
        "schedule": schedule,
        "microbatches": microbatches,
        "stages_per_rank": v,
        "layers_per_rank": layers,
        "bubble_fraction": (pp - 1) / (v * microbatches + pp - 1),
        "microbatches_in_flight": in_flight,
        "memory_peak_bytes": peak,
        "memory_activations_bytes": in_flight * mem.activations,
        "data_parallel": {"collectives": comm.total_count, "sent_bytes": comm.sent_bytes, "per_kind": comm.by_kind()},
        "p2p_sent_bytes": p2p,
    }


def print_pipeline(r: dict[str, Any]) -> None:
    GiB = 2**30
    print(
        f"pipeline  --pp {r['pp']} {r['schedule']} ({r['stages_per_rank']} stage(s) per rank, "
        f"{r['layers_per_rank']} layers per rank), {r['microbatches']} microbatches"
    )
    print(f"  bubble fraction          {r['bubble_fraction']:.3f}")
    print(
        f"  memory per rank at peak  {r['memory_peak_bytes'] / GiB:.2f} GiB "
        f"({r['microbatches_in_flight']} microbatches' activations in flight)"
    )
    dp = r["data_parallel"]
    print(f"  data-parallel per step   {dp['collectives']} collectives, {dp['sent_bytes'] / GiB:.3f} GiB sent")
    print(f"  point-to-point per step  {r['p2p_sent_bytes'] / GiB:.3f} GiB sent (activations and their gradients)")
