"""FSDP2's methods that replace or reshape composable's collectives: custom all-gather and
reduce-scatter, the all-reduce hook, force-sum, a separate reduce-scatter group, buffers from
the process group's allocator, symmetric memory.

Every check trains against the single-process reference of test_fsdp2_module_methods.py
(loss, gradients and parameters each step) and counts what the method promises: the user's
collective called for every gather / reduction, the hook once per reduction with this rank's
reduced gradients, the reduce op, the process group used.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _harness import count_collectives, gpu_worlds, run_on_ranks
from _models import batch_for
from _training import sgd
from test_fsdp2_module_methods import EmbedNet, loss_of, sharded_pair, step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

import composable._engine.comm.collectives as collectives
from composable import ShardingStrategy, fully_shard
from composable._engine.comm import custom_comms
from composable.integrations.fsdp2_module import as_fsdp_modules


class CountingAllGather(AllGather):
    def __init__(self) -> None:
        self.allocs = self.calls = 0

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocs += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001, ANN204
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(ReduceScatter):
    """Records each call's op and group; ReduceOp.AVG (which gloo lacks) as a sum, then divided."""

    def __init__(self) -> None:
        self.allocs = 0
        self.ops: list[str] = []
        self.groups: list[dist.ProcessGroup] = []

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocs += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN204
        self.ops.append("AVG" if op == dist.ReduceOp.AVG else "SUM" if op == dist.ReduceOp.SUM else str(op))
        self.groups.append(group)
        if op == dist.ReduceOp.AVG:
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
            output_tensor.div_(group.size())
            return None
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _modules(model: EmbedNet) -> list:
    return [model, model.emb, model.body, model.body2]


# ----------------------------------------------------------------------------- custom all-gather / reduce-scatter


def _custom_comms(rank: int, world: int) -> None:
    model, ref = sharded_pair()
    gather, reduce = CountingAllGather(), CountingReduceScatter()
    with pytest.raises(TypeError, match="set_custom_all_gather: 'comm' must be an FSDP2 AllGather"):
        model.set_custom_all_gather(lambda *a: None)
    for m in _modules(model):
        m.set_custom_all_gather(gather)
        m.set_custom_reduce_scatter(reduce)
    opts = (sgd(model), sgd(ref))
    for s in range(2):
        with count_collectives() as c:
            step(model, ref, opts, s, rank, world)
        # Every gather and reduce-scatter of the step went through the user's objects
        # (the step's checks add their own full_tensor() gathers: count ours apart).
        assert gather.calls == 7 * (s + 1) and gather.allocs == gather.calls, (gather.calls, c.render())
        assert len(reduce.ops) == 4 * (s + 1) and reduce.allocs == 2 * len(reduce.ops)
        assert set(reduce.ops) == {"SUM"}  # gloo: sum, then divide by the world
    with count_collectives() as c:
        loss_of(model, batch_for(0, world, rank)).backward()
    # Forward gathers 4 groups, backward 3 (the root keeps its own); each one the user's.
    assert c.counts["all_gather"] == 7 == gather.calls - 14, c.render()
    assert c.counts["reduce_scatter"] == 4 == len(reduce.ops) - 8, c.render()


def test_custom_all_gather_and_reduce_scatter_replace_the_default() -> None:
    run_on_ranks(_custom_comms, 2)


# ----------------------------------------------------------------------------- force-sum


def _force_sum(rank: int, world: int) -> None:
    """On NCCL in fp32 the collectives average themselves (ReduceOp.AVG); force-sum makes them
    sum and divides after. gloo has no AVG: the test makes the engine believe it has one and
    gives it a reduce-scatter that does AVG as sum-then-divide, then looks at the op."""
    average = collectives.supports_average
    collectives.supports_average = lambda *a: True
    try:
        for forced in (False, True):
            model, ref = sharded_pair()
            reduce = CountingReduceScatter()
            for m in _modules(model):
                m.set_custom_reduce_scatter(reduce)
                m.set_force_sum_reduction_for_comms(forced)
            opts = (sgd(model), sgd(ref))
            for s in range(2):
                step(model, ref, opts, s, rank, world)
            assert reduce.ops == ["SUM" if forced else "AVG"] * 8, (forced, reduce.ops)
    finally:
        collectives.supports_average = average


def test_force_sum_reduction_uses_sum_and_divides_after() -> None:
    run_on_ranks(_force_sum, 2)


# ----------------------------------------------------------------------------- all-reduce hook


def _all_reduce_hook(rank: int, world: int) -> None:
    """Own HSDP: shard over 2 ranks with fully_shard, all-reduce over the other 2 in the hook;
    it trains like the reference on all 4 ranks' data. Native HSDP calls the hook after its
    own all-reduce. Either way once per group per backward, with this rank's reduced shard."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicas = mesh.get_group("replicate")
    for native in (False, True):
        ref = EmbedNet()
        model = copy.deepcopy(ref)
        for part in (model.emb, model.body, model.body2, model):
            fully_shard(part, mesh=mesh if native else mesh["shard"])
        as_fsdp_modules(model)
        calls: dict[str, list[int]] = {}

        def hook_for(name: str):  # noqa: ANN202
            def hook(grads: torch.Tensor) -> None:
                calls.setdefault(name, []).append(grads.numel())
                if not native:
                    dist.all_reduce(grads, group=replicas)
                    grads.div_(replicas.size())  # the engine divides by the shard group's 2 after

            return hook

        for name, m in zip(("root", "emb", "body", "body2"), _modules(model)):
            m.set_all_reduce_hook(hook_for(name))
        if native:
            with pytest.raises(ValueError, match="set_all_reduce_hook: 'stream' cannot be set when using HSDP"):
                model.set_all_reduce_hook(hook_for("root"), stream=object())
        opts = (sgd(model), sgd(ref))
        for s in range(2):
            step(model, ref, opts, s, rank, world)
        names = ("root", "emb", "body", "body2")
        shards = [sum(mp.layout.region_numel for mp in fully_shard.state(m).groups[0].params) for m in _modules(model)]
        assert calls == {name: [n] * 2 for name, n in zip(names, shards)}, (calls, shards)


def test_all_reduce_hook_runs_once_per_reduction_on_the_reduced_shard() -> None:
    run_on_ranks(_all_reduce_hook, 4)


def _hook_errors(rank: int, world: int) -> None:
    model, _ = sharded_pair()
    with pytest.raises(TypeError, match="set_all_reduce_hook: 'hook' must be callable, got int"):
        model.set_all_reduce_hook(3)
    plain = EmbedNet()
    fully_shard(plain, strategy=ShardingStrategy.NO_SHARD)
    with pytest.raises(NotImplementedError, match="set_all_reduce_hook: a NO_SHARD module"):
        fully_shard.state(plain).set_all_reduce_hook(lambda g: None)
    with pytest.raises(NotImplementedError, match="set_symm_mem_for_comm: symmetric memory needs CUDA with NCCL"):
        model.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match="set_symm_mem_for_comm: 'backend' must be 'NCCL', got 'NVSHMEM'"):
        model.set_symm_mem_for_comm("NVSHMEM")


def test_hook_and_symmetric_memory_errors() -> None:
    run_on_ranks(_hook_errors, 2)


# ----------------------------------------------------------------------------- separate reduce-scatter group


def _separate_group(rank: int, world: int) -> None:
    model, ref = sharded_pair()
    reduce = CountingReduceScatter()
    for m in _modules(model):
        m.set_custom_reduce_scatter(reduce)
    model.set_separate_reduce_scatter_group()
    shared = fully_shard.state(model).groups[0].layout.shard_group
    own = {id(fully_shard.state(m).groups[0].reducer.options.reduce_scatter_group) for m in _modules(model)}
    assert len(own) == 1  # one new group for the one set of ranks
    opts = (sgd(model), sgd(ref))
    step(model, ref, opts, 0, rank, world)
    assert all(g is not shared and dist.get_process_group_ranks(g) == [0, 1] for g in reduce.groups)
    model.set_separate_reduce_scatter_group(False)
    step(model, ref, opts, 1, rank, world)
    assert all(g is shared for g in reduce.groups[4:]) and len(reduce.groups) == 8


def test_separate_reduce_scatter_group_reduces_on_its_own_group() -> None:
    run_on_ranks(_separate_group, 2)


# ----------------------------------------------------------------------------- process-group allocation


def _pg_alloc(rank: int, world: int) -> None:
    model, ref = sharded_pair()
    allocs = {"gather": 0, "reduce": 0}
    for m in _modules(model):
        m.set_allocate_memory_from_process_group_for_comm(True)
        group = fully_shard.state(m).groups[0]
        for kind, comm in (("gather", group.all_gather_comm), ("reduce", group.reducer.options.reduce_scatter_comm)):
            assert isinstance(
                comm, (custom_comms.ProcessGroupAllocAllGather, custom_comms.ProcessGroupAllocReduceScatter)
            )
            original = comm.allocate

            def allocate(*a: object, _kind: str = kind, _original: object = original, **kw: object) -> torch.Tensor:
                allocs[_kind] += 1
                return _original(*a, **kw)  # type: ignore[operator]

            comm.allocate = allocate
    opts = (sgd(model), sgd(ref))
    for s in range(2):
        step(model, ref, opts, s, rank, world)
    assert allocs == {"gather": 14, "reduce": 16}, allocs  # gloo has no allocator of its own: plain memory
    model.body.set_custom_all_gather(CountingAllGather())
    with pytest.raises(RuntimeError, match="cannot be used together with a custom collective .CountingAllGather"):
        model.body.set_allocate_memory_from_process_group_for_comm(True)
    model.set_allocate_memory_from_process_group_for_comm(False)
    assert fully_shard.state(model).groups[0].all_gather_comm is None


def test_allocate_memory_from_process_group_trains_through_it() -> None:
    run_on_ranks(_pg_alloc, 2)


# ----------------------------------------------------------------------------- symmetric memory (GPU)


def _symm_mem(rank: int, world: int) -> None:
    torch.cuda.set_device(rank)
    model, ref = sharded_pair("cuda")
    for m in _modules(model):
        m.set_force_sum_reduction_for_comms(True)  # NCCL's symmetric reduce-scatter only sums
        m.set_symm_mem_for_comm()
        group = fully_shard.state(m).groups[0]
        assert isinstance(group.all_gather_comm, custom_comms.SymmMemAllGather)
        assert isinstance(group.reducer.options.reduce_scatter_comm, custom_comms.SymmMemReduceScatter)
    opts = (sgd(model), sgd(ref))
    for s in range(3):
        step(model, ref, opts, s, rank, world, "cuda")


@pytest.mark.parametrize("world", gpu_worlds(1, 2))
def test_gpu_symm_mem_for_comm_trains_like_the_reference(world: int) -> None:
    # Fresh workers: the symmetric-memory pool of a worker that ran the world-1 form stays
    # registered to group "0", and that worker's rank would skip the registration (a hang).
    run_on_ranks(_symm_mem, world, backend="nccl", timeout=120, fresh=True)
