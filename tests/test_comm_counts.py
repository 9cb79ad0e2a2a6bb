"""fully_shard communication per training step, counted and traced with the fake process group.

One process plays rank 0 of a world of 8 (`fake_process_group`): local shapes and collectives are
real, numerics are not (the fake all-gather leaves its output uninitialised), so nothing here
looks at values.

- Counts: one all-gather and one reduce-scatter per parameter group per step, however many
  parameters a group holds (flat, batched communication); resharding after forward costs at most
  one extra all-gather per group, in backward; the optimizer step communicates nothing.
- The exact trace of one step of a small model (collective, process group, dtype, size, order)
  as inline expectations: any change to the communication shows up in review. Regenerate with
  `EXPECTTEST_ACCEPT=1 pytest tests/test_comm_counts.py` and explain the diff.
"""

from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn as nn
from _harness import CollectiveTracer, fake_process_group, trace_collectives
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from composable import MixedPrecisionPolicy, ShardingStrategy, fully_shard

WORLD = 8
N_BLOCKS = 3


class Net(nn.Module):
    """`N_BLOCKS` blocks of `per_block` Linear(8, 8) + a root-owned head."""

    def __init__(self, per_block: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(*[nn.Linear(8, 8) for _ in range(per_block)]) for _ in range(N_BLOCKS)
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, CollectiveTracer]:
    """One training step; the collectives of each phase."""
    phases: dict[str, CollectiveTracer] = {}
    with trace_collectives() as phases["forward"]:
        loss = model(x).sum()
    with trace_collectives() as phases["backward"]:
        loss.backward()
    with trace_collectives() as phases["optimizer"]:
        opt.step()
        opt.zero_grad()
    return phases


def _counts(phases: dict[str, CollectiveTracer]) -> dict[str, dict[str, int]]:
    return {name: dict(t.counts) for name, t in phases.items()}


# ----------------------------------------------------------------------------- counts


@pytest.mark.parametrize("per_block", [1, 2, 5])
@pytest.mark.parametrize(
    "options, extra_gathers",
    [
        # Parameters stay gathered from forward to backward: nothing is gathered twice.
        (dict(reshard_after_forward=False), 0),
        (dict(strategy=ShardingStrategy.SHARD_GRAD_OP), 0),
        # FULL_SHARD (the default): every block re-gathers once in backward; the root does not
        # reshard after forward (backward needs its parameters at once).
        (dict(), N_BLOCKS),
        (dict(strategy=ShardingStrategy.FULL_SHARD), N_BLOCKS),
        # Asked explicitly, the root reshards too: one extra gather for every group.
        (dict(reshard_after_forward=True), N_BLOCKS + 1),
    ],
    ids=["raf_false", "shard_grad_op", "default", "full_shard", "raf_true"],
)
def test_collectives_per_step(per_block: int, options: dict, extra_gathers: int) -> None:
    groups = N_BLOCKS + 1
    with fake_process_group(WORLD):
        model = Net(per_block)
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(4, 8)
        for step in range(3):  # the first step (lazy init) communicates like the others
            counts = _counts(_step(model, opt, x))
            assert counts == {
                "forward": {"all_gather": groups},
                "backward": {"all_gather": extra_gathers, "reduce_scatter": groups}
                if extra_gathers
                else {"reduce_scatter": groups},
                "optimizer": {},
            }, f"step {step}"


@pytest.mark.parametrize("mesh_shape", [(1, WORLD), (WORLD, 1)], ids=["replicate_1", "shard_1"])
def test_a_mesh_dim_of_one_rank_launches_no_collective(mesh_shape: tuple[int, int]) -> None:
    """HSDP whose replicate dimension has one rank (each torchft replica group's mesh) reduces
    with the reduce-scatter alone; one rank per shard group, with the all-reduce alone: a group
    of one rank has nothing to exchange, and `replicate` over one rank launches nothing either."""
    from composable import replicate

    with fake_process_group(WORLD):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        model = Net(2)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sharded = mesh_shape[1] > 1
        for step in range(2):
            counts = _counts(_step(model, opt, torch.randn(4, 8)))
            assert counts == {
                "forward": {"all_gather": N_BLOCKS + 1} if sharded else {},
                "backward": {"all_gather": N_BLOCKS, "reduce_scatter": N_BLOCKS + 1}
                if sharded
                else {"all_reduce": N_BLOCKS + 1},
                "optimizer": {},
            }, f"step {step}"
        one = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "one"))["one"]
        replicated = replicate(Net(1), mesh=one)
        with trace_collectives() as t:
            replicated(torch.randn(4, 8)).sum().backward()
        assert dict(t.counts) == {}


def test_forward_without_grad_gathers_once_per_group() -> None:
    """Inference (no backward can follow) gathers each group once and frees it again."""
    with fake_process_group(WORLD):
        model = Net(2)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        with torch.no_grad(), trace_collectives() as t:
            model(torch.randn(4, 8))
        assert dict(t.counts) == {"all_gather": N_BLOCKS + 1}
        for block in model.blocks:  # resharded: the optimizer-facing DTensors are registered
            assert all(isinstance(p, DTensor) for p in block.parameters())


def test_sizes_are_padded_shards() -> None:
    """Each collective moves the padded group buffer, world * sum(ceil(rows / world) * row numel),
    and nothing else: the reduce-scatter's input is FSDP2's, element for element."""
    with fake_process_group(WORLD):
        model = Net(2)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        expected = [_padded_numel(model)] + [_padded_numel(b) for b in model.blocks]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        phases = _step(model, opt, torch.randn(4, 8))
        assert [r.numel for r in phases["forward"].records] == expected
        assert sorted(r.numel for r in phases["backward"].records if r.kind == "reduce_scatter") == sorted(expected)
        assert {r.dtype for t in phases.values() for r in t.records} == {torch.float32}


def _padded_numel(module: nn.Module) -> int:
    """What the engine must move for the parameters `module` itself manages, computed from shapes."""
    names = fully_shard.state(module).param_names
    params = dict(module.named_parameters())
    per_rank = sum(
        math.ceil(p.shape[0] / WORLD) * math.prod(p.shape[1:]) if p.dim() else 1 for p in (params[n] for n in names)
    )
    return WORLD * per_rank


# ----------------------------------------------------------------------------- exact trace


class TraceNet(nn.Module):
    """Three blocks and a root with different, uneven sizes, so each group's size is unique.

    Padded per-rank regions at world 8 (ceil(rows / 8) rows each):
      blocks.0 Linear(4, 10): weight 2*4 + bias 2            = 10 -> all-gather 80
      blocks.1 Linear(10, 3): weight 1*10 + bias 1           = 11 -> 88
      blocks.2 Linear(3, 9):  weight 2*3 + bias 2            =  8 -> 64
      root     head Linear(9, 17): weight 3*9 + bias 3, and the 0-d `scale` (a whole copy in
               every rank's region)                          = 31 -> 248
    """

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 10), nn.Linear(10, 3), nn.Linear(3, 9)])
        self.head = nn.Linear(9, 17)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x) * self.scale


def _trace_one_step(mesh_shape: tuple[int, ...] = (WORLD,), **options: object) -> str:
    with fake_process_group(WORLD):
        mesh = init_device_mesh("cpu", mesh_shape) if len(mesh_shape) > 1 else None
        model = TraceNet()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(2, 4)
        first = _step(model, opt, x)
        second = _step(model, opt, x)
        render = {name: t.render() for name, t in second.items()}
        assert render == {name: t.render() for name, t in first.items()}, "lazy init changed the trace"
        return "\n".join(f"{name}:\n" + "\n".join(f"  {e}" for e in t.events) for name, t in second.items())


class TestTrace(expecttest.TestCase):
    """The exact communication of one training step (the second: the first must match it).

    Reading guide (update it with the expectations). Forward: the root is gathered first (its
    pre-forward runs first), then each block in order. Backward: the root stays gathered
    (default FULL_SHARD keeps the root's parameters, backward needs them at once); each block
    was freed after forward and is gathered again one module ahead (implicit backward prefetch
    in reverse forward order: the root's pre-backward gathers blocks.2, blocks.2's gathers
    blocks.1, ...); a block is reduce-scattered once its input gradients exist; blocks.0 (whose
    input needs no gradient) and the root are reduced by the end-of-backward callback, root
    first. A reduce-scatter moves its group's all-gather size, FSDP2's buffer (a rank without a
    gradient sends -0.0s in its place: see reduce.py). The optimizer step on sharded DTensors
    communicates nothing.
    """

    def test_full_shard_fp32(self) -> None:
        self.assertExpectedInline(
            _trace_one_step(),
            """\
forward:
  all_gather(g[0,1,2,3,4,5,6,7], float32, 248)
  all_gather(g[0,1,2,3,4,5,6,7], float32, 80)
  all_gather(g[0,1,2,3,4,5,6,7], float32, 88)
  all_gather(g[0,1,2,3,4,5,6,7], float32, 64)
backward:
  all_gather(g[0,1,2,3,4,5,6,7], float32, 64)
  all_gather(g[0,1,2,3,4,5,6,7], float32, 88)
  reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 64)
  all_gather(g[0,1,2,3,4,5,6,7], float32, 80)
  reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 88)
  reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 248)
  reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 80)
optimizer:
""",
        )

    def test_shard_grad_op_bf16_params_fp32_reduce(self) -> None:
        # Gathers move bf16 (half the bytes); gradients are reduced in fp32; nothing re-gathers.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.assertExpectedInline(
            _trace_one_step(strategy=ShardingStrategy.SHARD_GRAD_OP, mp_policy=mp),
            """\
forward:
  all_gather(g[0,1,2,3,4,5,6,7], bfloat16, 248)
  all_gather(g[0,1,2,3,4,5,6,7], bfloat16, 80)
  all_gather(g[0,1,2,3,4,5,6,7], bfloat16, 88)
  all_gather(g[0,1,2,3,4,5,6,7], bfloat16, 64)
backward:
  reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 64)
  reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 88)
  reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 248)
  reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 80)
optimizer:
""",
        )

    def test_hsdp_2x4(self) -> None:
        # HSDP on a (replicate 2, shard 4) mesh: gathers and reduce-scatters within the shard
        # group of rank 0 (ranks 0-3), then one all-reduce per group across replicas (0 and 4).
        self.assertExpectedInline(
            _trace_one_step((2, 4)),
            """\
forward:
  all_gather(g[0,1,2,3], float32, 204)
  all_gather(g[0,1,2,3], float32, 60)
  all_gather(g[0,1,2,3], float32, 44)
  all_gather(g[0,1,2,3], float32, 48)
backward:
  all_gather(g[0,1,2,3], float32, 48)
  all_gather(g[0,1,2,3], float32, 44)
  reduce_scatter(g[0,1,2,3], float32, 48)
  all_reduce(g[0,4], float32, 12)
  all_gather(g[0,1,2,3], float32, 60)
  reduce_scatter(g[0,1,2,3], float32, 44)
  all_reduce(g[0,4], float32, 11)
  reduce_scatter(g[0,1,2,3], float32, 204)
  all_reduce(g[0,4], float32, 51)
  reduce_scatter(g[0,1,2,3], float32, 60)
  all_reduce(g[0,4], float32, 15)
optimizer:
""",
        )


@pytest.mark.parametrize(
    "backend, device, dtype, expected",
    [
        ("nccl", "cuda", torch.float32, True),  # NCCL averages fp32 itself: no division kernel
        ("cpu:gloo,cuda:nccl", "cuda", torch.float32, True),  # offload's two-backend group
        ("nccl", "cuda", torch.bfloat16, False),  # half precision: pre/post-factor division
        ("nccl", "cuda", torch.float16, False),
        ("gloo", "cpu", torch.float32, False),  # gloo has no AVG
        ("fake", "cpu", torch.float32, False),
    ],
)
def test_when_collectives_average(
    monkeypatch: pytest.MonkeyPatch, backend: str, device: str, dtype: torch.dtype, expected: bool
) -> None:
    """Which reductions use ReduceOp.AVG instead of SUM and a division (only the decision:
    CI has no NCCL; the GPU suite checks the numbers against references)."""
    from composable._engine.comm import collectives as _collectives

    monkeypatch.setattr(_collectives.dist, "get_backend", lambda group=None: backend)
    assert _collectives.supports_average(object(), torch.device(device), dtype) is expected
