"""Communication of one training step, counted on the real engine without any real tensor.

One process plays rank 0 of a world of any size on the fake process group; the model is built
on the meta device, laid out with the real `composable` APIs (exactly as `parallel.py` does for
train.py), materialised as fake tensors and run for one forward + backward under
`CommDebugMode`. So the collectives counted here are the ones the engine issues: which kind,
on which process group, how many elements, in which phase. Nothing is allocated.

Vocabulary: a collective's *payload* is the larger of its two sides (gathered output,
scattered input, the all-reduced buffer), in bytes; what one rank *sends* (and receives) is
the bandwidth-optimal (ring) volume: (g - 1) / g of the payload for all-gather and
reduce-scatter, 2 (g - 1) / g for all-reduce, over a group of g ranks.

Cost: fake tensors cost per operation, not per element, and an 80-layer model runs ~1,500
operations per layer through DTensor and the hooks. Identical blocks issue identical
collectives, so a model deeper than `exact_layers` is probed at 1 and 2 layers and the
per-block part extrapolated (`CommEstimate.extrapolated`); `replicate`'s bucket boundaries
depend on the whole model, so its all-reduce *count* is then approximate (bytes stay exact).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from estimator.estimate_setup import Setup
from models.model import Transformer, lm_loss

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


def _kind(op_name: str) -> str | None:
    """`c10d::_allgather_base_`, `_c10d_functional::all_gather_into_tensor` -> all_gather."""
    n = op_name.split("::")[-1].strip("_").replace("allgather", "all_gather").replace("allreduce", "all_reduce")
    n = n.replace("alltoall", "all_to_all")
    return next((k for k in KINDS if n.startswith(k)), None)


def ring_factor(kind: str, group_size: int) -> float:
    """Bytes one rank sends (= receives) per payload byte with a bandwidth-optimal ring."""
    if group_size <= 1:
        return 0.0
    frac = (group_size - 1) / group_size
    return {"all_reduce": 2 * frac, "broadcast": 1.0}.get(kind, frac)


@dataclass(frozen=True)
class PlannedCollective:
    """One collective as issued by rank 0."""

    kind: str
    phase: str  # forward | backward
    group_size: int
    group_ranks: tuple[int, ...]  # global ranks of the group (decides NVLink or inter-node)
    payload_bytes: int

    @property
    def sent_bytes(self) -> float:
        return self.payload_bytes * ring_factor(self.kind, self.group_size)


class SizedCommDebugMode(CommDebugMode):
    """CommDebugMode that also keeps each collective's size, group and phase: the counts stay
    CommDebugMode's own (`get_comm_counts()`), the sizes are what the byte totals need."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[PlannedCollective] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or not hasattr(func, "namespace"):
            return out
        kind = _kind(func.name()) if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") else None
        if kind is not None:
            self.records.append(self._describe(func, kind, args, kwargs or {}, out))
        return out

    def _describe(self, func, kind: str, args: tuple, kwargs: dict, out: object) -> PlannedCollective:  # type: ignore[no-untyped-def]
        bound = {**dict(zip([a.name for a in func._schema.arguments], args)), **kwargs}
        ranks: tuple[int, ...] = ()
        for key in ("process_group", "group_name", "group"):
            if key in bound and not ranks:
                ranks = _group_ranks(bound[key])

        def size(v: object) -> int:
            if isinstance(v, torch.Tensor):
                return v.numel() * v.element_size()
            return sum(size(x) for x in v) if isinstance(v, (list, tuple)) else 0

        payload = max([size(v) for v in bound.values()] + [size(out)])
        return PlannedCollective(kind, self.phase, len(ranks), ranks, payload)


def _group_ranks(value: object) -> tuple[int, ...]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = (
        value
        if isinstance(value, dist.ProcessGroup)
        else dist.ProcessGroup.unbox(value)
        if isinstance(value, torch.ScriptObject)
        else _resolve_process_group(value)
        if isinstance(value, str)
        else None
    )
    return tuple(dist.get_process_group_ranks(pg)) if pg is not None else ()


@dataclass
class CommEstimate:
    """Per-step communication of one rank: per kind, count / payload / sent bytes, and the
    ordered collectives (for the timing model)."""

    collectives: list[PlannedCollective] = field(default_factory=list)
    extrapolated: bool = False
    debug_mode_counts: dict[str, int] = field(default_factory=dict)  # CommDebugMode's own

    def by_kind(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "payload_bytes": 0, "sent_bytes": 0.0})
        for c in self.collectives:
            row = out[c.kind]
            row["count"] += 1
            row["payload_bytes"] += c.payload_bytes
            row["sent_bytes"] += c.sent_bytes
        return dict(out)

    @property
    def total_count(self) -> int:
        return len(self.collectives)

    @property
    def sent_bytes(self) -> float:
        return sum(c.sent_bytes for c in self.collectives)


# -- building the real layout ---------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(world: int):  # type: ignore[no-untyped-def]
    """This process as rank 0 of a `world`-rank fake process group (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_initialized():
        raise RuntimeError("estimate: a default process group already exists")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_layout(setup: Setup, device: str = "cpu") -> Transformer:
    """The meta-device model with `setup`'s layout applied through the public APIs, mirroring
    examples/trainer/parallel.py (checkpoint, then TP, then fully_shard per block + root, or replicate)."""
    from torch.distributed.device_mesh import init_device_mesh

    from composable import checkpoint, fully_shard, replicate
    from trainer.parallel import offload_policy_for

    with torch.device("meta"):
        model = Transformer(replace(setup.cfg, max_seq_len=max(setup.cfg.max_seq_len, setup.seq_len)))
    world = dist.get_world_size()
    if setup.parallel == "tp":
        mesh = init_device_mesh(device, (world // setup.tp_size, setup.tp_size), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    elif setup.parallel == "hsdp":
        dp_mesh = init_device_mesh(
            device, (world // setup.shard_size, setup.shard_size), mesh_dim_names=("replicate", "shard")
        )
    else:
        dp_mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    mp_policy = setup.mp_policy()
    if setup.activation_checkpointing:
        for block in model.layers:
            checkpoint(block)
    if setup.parallel == "tp":  # torchtitan's recipe, as train.py and benchmark.py --mesh tp run it
        from trainer.parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    if setup.parallel == "replicate":
        replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
        return model
    kw = {"mesh": dp_mesh, "mp_policy": mp_policy, "offload_policy": offload_policy_for(setup.offload)}
    if setup.wrap == "separate-ends":  # as benchmark.py --wrap separate-ends
        for end in (model.tok_embeddings, model.output):
            fully_shard(end, **kw)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=setup.reshard_after_forward, **kw)
    # The root keeps its default (None): it does not reshard after forward, as train.py runs it.
    fully_shard(model, **kw)
    return model


def probe(setup: Setup) -> CommEstimate:
    """One forward + backward of `setup` on the fake process group (the optimizer step
    communicates nothing: tests/test_comm_counts.py). Must run inside `fake_world`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_layout(setup)
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        # CommDebugMode's module tracker registers full backward hooks on every module.
        warnings.simplefilter("ignore")
        model.to_empty(device="cpu")
        tokens = torch.zeros(setup.batch_size, setup.seq_len + 1, dtype=torch.long)
        with SizedCommDebugMode() as mode:
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            mode.phase = "backward"
            loss.backward()
    counts = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    return CommEstimate(mode.records, False, counts)


def estimate_comm(setup: Setup, exact_layers: int = 4) -> CommEstimate:
    """`probe` of the full model when it has at most `exact_layers` blocks, else the 2-layer
    probe plus (n_layers - 2) times the per-block difference between the 2- and 1-layer probes."""
    n = setup.cfg.n_layers
    with fake_world(setup.world_size):
        if n <= exact_layers:
            return probe(setup)
        one = probe(replace(setup, cfg=replace(setup.cfg, n_layers=1)))
        two = probe(replace(setup, cfg=replace(setup.cfg, n_layers=2)))
    return extrapolate(one, two, n)


def extrapolate(one: CommEstimate, two: CommEstimate, n_layers: int) -> CommEstimate:
    """Blocks are identical: the 2-layer probe's collectives with those of its second block
    (what the 2-layer probe issues beyond the 1-layer one, per phase and kind) repeated.
    Counts follow CommDebugMode's own counts extrapolated the same way."""
    n_extra = n_layers - 2
    phases: list[PlannedCollective] = []
    for phase in ("forward", "backward"):
        own = [c for c in two.collectives if c.phase == phase]
        extra: list[PlannedCollective] = []
        for kind in KINDS:
            a = [c for c in one.collectives if c.phase == phase and c.kind == kind]
            b = [c for c in two.collectives if c.phase == phase and c.kind == kind]
            pool = list(b)
            for c in a:  # what is common to both is the root's and the first block's
                for i, d in enumerate(pool):
                    if (d.group_size, d.payload_bytes) == (c.group_size, c.payload_bytes):
                        del pool[i]
                        break
                else:  # replicate's buckets: boundaries shift with the model size
                    pool = []
                    extra += _bucket_growth(a, b, n_extra, own)
                    break
            extra += pool * n_extra
        # Keep the root's first forward and last backward collective at the ends: the timing
        # model treats those two as never hidden behind compute.
        cut = 1 if phase == "forward" else max(len(own) - 1, 0)
        phases += own[:cut] + extra + own[cut:]
    counts = {
        k: two.debug_mode_counts.get(k, 0)
        + n_extra * (two.debug_mode_counts.get(k, 0) - one.debug_mode_counts.get(k, 0))
        for k in two.debug_mode_counts
    }
    return CommEstimate(phases, True, counts)


def _bucket_growth(
    a: list[PlannedCollective], b: list[PlannedCollective], n_extra: int, own: list[PlannedCollective]
) -> list[PlannedCollective]:
    """Buckets whose boundaries moved: the extra blocks add (len(b) - len(a)) buckets each and
    exactly their bytes; with no extra bucket per block, the last bucket of `own` (in place)
    grows instead. Bytes are exact, the bucket count approximate."""
    per_block, added = len(b) - len(a), sum(c.payload_bytes for c in b) - sum(c.payload_bytes for c in a)
    if per_block > 0:
        return [replace(b[-1], payload_bytes=added // per_block)] * (per_block * n_extra)
    i = max(j for j, c in enumerate(own) if c.kind == b[-1].kind)
    own[i] = replace(own[i], payload_bytes=own[i].payload_bytes + added * n_extra)
    return []
