"""Communication time of a step, and whether it can hide behind compute.

Assumptions (none of these was measured by the project; override them with flags):
- `--bandwidth nvlink=360,inter=45`: GB/s each GPU sends at, in NCCL's bus-bandwidth sense,
  inside one node (NVLink/NVSwitch of an 8 x H100/H200 node, ~75% of its 450 GB/s per
  direction) and between nodes (one 400 Gb/s InfiniBand NIC per GPU, ~90%);
  `latency_us=10` per collective. A collective whose group spans two or more nodes
  (`--gpus-per-node`, consecutive ranks per node) runs at the inter-node rate.
- `--tflops 334`: achieved dense bf16 TFLOP/s per GPU, derived from BENCHMARKS.md's measured
  no-communication floor (1b preset, batch 4: 58,313 tok/s/GPU x 5.73 GFLOP/token on H200).
  Compute time = model FLOPs (examples/models/model.py's `model_flops_per_token`, +1/3 for
  checkpointing's recomputed forward) / achieved FLOP/s; 1/3 of it forward. Under tensor
  parallelism (torchtitan's recipe, parallel.py's `apply_tensor_parallel`) every term is
  split over the tp ranks: the sharded GEMMs by heads / hidden features / vocabulary (the head
  is vocabulary-parallel, the loss reduced shard by shard), the norms, residual adds
  and elementwise work by sequence (each rank keeps T/tp tokens between the GEMMs). So a tp
  rank with tp times the local batch computes what a data-parallel rank does.

Overlap model (what examples/trace_overlap.py measures on real traces): the step's first
collective (the root's all-gather: nothing to compute before it) and its last (the root's
reduce-scatter: nothing left after it) are exposed, and so is every collective on the tensor-
parallel group: the recipe's sequence-parallel all-gathers (before attention and feed-forward,
of the normed sequence shards) and reduce-scatters (after wo and w2, of their partial sums),
their mirrors in backward, the vocabulary-parallel embedding's reduce-scatter and the head's
all-gather, the vocabulary-parallel loss's two all-reduces and the norm weights' gradient all-reduces: the next
GEMM needs each one's result, so it sits on the critical path between two GEMMs. The rest
(FSDP's all-gathers and reduce-scatters on the data-parallel group) overlaps with compute of
the same phase, and only what exceeds it is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.estimate_comm import CommEstimate, PlannedCollective
from estimator.estimate_setup import Setup, UsageError
from models.model import model_flops_per_token

DEFAULT_TFLOPS = 334.0


@dataclass(frozen=True)
class Links:
    nvlink_gbps: float = 360.0
    inter_gbps: float = 45.0
    latency_us: float = 10.0
    gpus_per_node: int = 8

    def seconds(self, c: PlannedCollective) -> float:
        nodes = {r // self.gpus_per_node for r in c.group_ranks} or {0}
        bw = self.inter_gbps if len(nodes) > 1 else self.nvlink_gbps
        return (self.latency_us * 1e-6 if c.group_size > 1 else 0.0) + c.sent_bytes / (bw * 1e9)


def parse_bandwidth(text: str, gpus_per_node: int) -> Links:
    """`nvlink=360,inter=45,latency_us=10` (any subset) -> Links."""
    keys = {"nvlink": "nvlink_gbps", "inter": "inter_gbps", "latency_us": "latency_us"}
    values: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            values[keys[key.strip()]] = float(value)
        except (KeyError, ValueError):
            raise UsageError(
                f"--bandwidth {text!r}: expected nvlink=GB/s,inter=GB/s,latency_us=us, got {item!r}"
            ) from None
        if values[keys[key.strip()]] <= 0 and key.strip() != "latency_us":
            raise UsageError(f"--bandwidth {text!r}: {key} must be > 0")
    if gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    return Links(**values, gpus_per_node=gpus_per_node)


@dataclass(frozen=True)
class TimeEstimate:
    compute_s: float
    comm_s: float  # all collectives back to back
    exposed_s: float  # lower bound of communication not hidden behind compute
    per_kind_s: dict[str, float]

    @property
    def hides(self) -> bool:
        """Communication hides when what must stay exposed is under 5% of compute."""
        return self.exposed_s <= 0.05 * self.compute_s

    def verdict(self) -> str:
        if self.hides:
            return "hides behind compute"
        share = self.exposed_s / self.compute_s
        return f"does not hide: >= {self.exposed_s * 1e3:.1f} ms exposed ({share:.0%} of compute)"


def compute_seconds(s: Setup, tflops: float) -> float:
    """One rank's step at `tflops`. With tensor parallelism the recipe splits all of the
    model's FLOPs over the tp ranks (the blocks' GEMMs and attention by heads and features,
    the head's by vocabulary rows) while each rank sees the whole local batch."""
    flops = model_flops_per_token(s.cfg, s.seq_len) / s.tp * s.batch_size * s.seq_len
    if s.activation_checkpointing:
        flops *= 4 / 3  # the forward runs twice
    return flops / (tflops * 1e12)


def tp_group(s: Setup) -> tuple[int, ...]:
    """Rank 0's tensor-parallel group: tp is the inner mesh dimension, so consecutive ranks
    (the data-parallel group of rank 0 is every tp-th rank, and may have the same size)."""
    return tuple(range(s.tp)) if s.tp > 1 else ()


def estimate_time(s: Setup, comm: CommEstimate, links: Links, tflops: float = DEFAULT_TFLOPS) -> TimeEstimate:
    if tflops <= 0:
        raise UsageError(f"--tflops must be > 0, got {tflops}")
    compute = compute_seconds(s, tflops)
    fwd_compute = compute / (4 if s.activation_checkpointing else 3)
    cols = comm.collectives
    per_kind: dict[str, float] = {}
    for c in cols:
        per_kind[c.kind] = per_kind.get(c.kind, 0.0) + links.seconds(c)
    # By position, not equality: identical blocks issue equal collectives.
    # The tp group's collectives feed the next GEMM: on the critical path, never hidden.
    blocking = {i for i, c in enumerate(cols) if c.group_ranks and c.group_ranks == tp_group(s)}
    ends = {0, len(cols) - 1} - blocking if cols else set()
    exposed = sum(links.seconds(cols[i]) for i in blocking | ends)
    for phase, budget in (("forward", fwd_compute), ("backward", compute - fwd_compute)):
        rest = [c for i, c in enumerate(cols) if c.phase == phase and i not in blocking | ends]
        exposed += max(0.0, sum(links.seconds(c) for c in rest) - budget)
    return TimeEstimate(compute, sum(per_kind.values()), exposed, per_kind)
