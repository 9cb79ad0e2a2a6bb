"""Tests of the test harness itself: the worker pool, the fake process group, the tracers."""

from __future__ import annotations

import os
import time
import warnings

import _harness
import pytest
import torch
import torch.distributed as dist
from _harness import (
    RankError,
    assert_close_tensors,
    count_collectives,
    fake_process_group,
    requires_gpus,
    run_on_ranks,
    trace_collectives,
)
from expecttest import assert_expected_inline

pytestmark = pytest.mark.once  # the same on every torch: CI runs it once (pyproject.toml)

# torch 2.13 renamed the tensor collectives to *_single; torch 2.11 only has the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------- rank functions
# Module level, so that the workers can unpickle them.


def _whoami(rank: int, world_size: int, tag: str = "", *, suffix: str = "") -> tuple:
    return rank, world_size, dist.get_rank(), dist.get_world_size(), tag + suffix


def _all_reduce_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _random_draw(rank: int, world_size: int) -> list[float]:
    return torch.randn(3).tolist()


def _noop(rank: int, world_size: int) -> None:
    return None


def _rank1_raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _all_raise(rank: int, world_size: int) -> None:
    raise KeyError(f"key{rank}")


def _rank1_raises_rank0_in_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # gloo fails it when rank 1 destroys its group


def _rank1_raises_rank0_stuck(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    time.sleep(60)  # stuck somewhere no peer failure can reach


def _rank1_skips_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # gloo fails it when rank 1 destroys its group


def _rank1_skips_collective_and_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(60)


def _busy_for(rank: int, world_size: int, seconds: float) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return rank


def _thread_count(rank: int, world_size: int) -> int:
    return len(os.listdir("/proc/self/task"))


def _group_left_in_a_cycle(rank: int, world_size: int) -> None:
    """As a model does: its hooks (bound methods of its state) make a cycle that holds its
    mesh and process groups."""
    holder: dict = {"group": dist.new_group(backend="gloo")}
    holder["self"] = holder
    dist.barrier(group=holder["group"])


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


_KEPT_GROUPS: list = []  # what a leaking cache does: holds a call's group past the call


def _keeps_its_group_and_returns_a_tensor(rank: int, world_size: int) -> tuple[int, torch.Tensor]:
    _KEPT_GROUPS.append(dist.new_group(backend="gloo"))
    return os.getpid(), torch.full((1000,), float(rank))  # large enough to travel as shared memory


def _worker_footprint(rank: int, world_size: int) -> tuple[int, list[int]]:
    """(pid, [gloo threads, open descriptors] the worker's previous call left once torn down):
    counted between calls, where no group of a call is starting or stopping its threads."""
    from _harness_pool import LEFT_BY_LAST_CALL

    return os.getpid(), list(LEFT_BY_LAST_CALL)


def _train_on_meshes(rank: int, world_size: int) -> None:
    """What the suite's calls do with meshes: a 2D mesh and its submeshes, DTensor ops and
    redistributions on them (torch's planners and lru caches keep meshes), FSDP2 and composable
    training with an optimizer (composable keeps a spec per mesh for step counters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import composable

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "b"))
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0), Replicate()])
    (x * 2).redistribute(mesh, [Replicate(), Shard(1)]).full_tensor()
    for shard, sub in ((torch_fully_shard, mesh["a"]), (composable.fully_shard, mesh["b"])):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        shard(model[0], mesh=sub)
        shard(model, mesh=sub)
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()


def _unpicklable_result(rank: int, world_size: int) -> object:
    return lambda: None


def _counts_on_gloo(rank: int, world_size: int) -> tuple[dict, list[str]]:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(8.0).reshape(4, 2)
    with count_collectives() as c:
        dist.all_reduce(torch.ones(3))
        out = torch.empty(2 * world_size)
        all_gather_single(out, torch.full((2,), float(rank)))
        dt = distribute_tensor(full, mesh, [Shard(0)])  # a scatter
        assert torch.equal(dt.full_tensor(), full)  # an all-gather
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0]
    return dict(c.counts), c.events


def _compare_shards(rank: int, world_size: int) -> str:
    """A DTensor against a full tensor: shard by shard, no collective; a wrong element fails on
    the rank holding it, named by its global index."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(10.0).reshape(5, 2)  # 5 rows on 2 ranks: uneven shards
    dt, same, replicated = (distribute_tensor(full, mesh, [p]) for p in (Shard(0), Shard(0), Replicate()))
    with count_collectives() as c:
        assert_close_tensors(dt, full, exact=True)
        assert_close_tensors(full, dt)
        assert_close_tensors(dt, same, exact=True)
    assert c.total == 0, c.counts
    with count_collectives() as c:  # another layout: gathered, as before
        assert_close_tensors(dt, replicated, exact=True)
    assert c.counts["all_gather"] == 1, c.counts
    wrong = full.clone()
    wrong[4, 1] += 1  # on rank 1's shard (rows 3-4)
    try:
        assert_close_tensors(dt, wrong, exact=True, msg="w")
    except AssertionError as e:
        return str(e)
    return ""


def _op_on_2d_mesh(rank: int, world_size: int, groups_before: int) -> tuple[bool, float]:
    """A DTensor op on a 2D mesh of this call's subgroups, made after `groups_before` other
    groups (which shifts the subgroups' names): whether its result names this call's mesh, and
    the result's sum, gathered over the groups of the mesh it names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for _ in range(groups_before):
        dist.new_group(list(range(world_size)))
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "b"))
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0), Replicate()])
    y = x * 2
    return y.device_mesh is mesh, y.redistribute(y.device_mesh, [Replicate(), Shard(1)]).full_tensor().sum().item()


def _nccl_all_reduce(rank: int, world_size: int) -> float:
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    return t.item()


# ----------------------------------------------------------------------------- pool


def test_results_in_rank_order_with_args() -> None:
    assert run_on_ranks(_whoami, 2, "a", suffix="b") == [(0, 2, 0, 2, "ab"), (1, 2, 1, 2, "ab")]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_world_sizes(world_size: int) -> None:
    expected = world_size * (world_size + 1) / 2
    assert run_on_ranks(_all_reduce_ranks, world_size) == [expected] * world_size


def test_same_seed_on_every_rank_and_every_call() -> None:
    first = run_on_ranks(_random_draw, 2)
    assert first[0] == first[1] == run_on_ranks(_random_draw, 2)[0]


def test_failing_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(RankError, match=r"rank 1 failed: ValueError: boom on rank 1") as info:
        run_on_ranks(_rank1_raises, 2)
    assert set(info.value.errors) == {1}
    assert "_rank1_raises" in str(info.value)  # the remote traceback is in the message
    assert "rank 0 failed" not in str(info.value)


def test_all_failing_ranks_are_named() -> None:
    with pytest.raises(RankError, match=r"(?s)rank 0 failed: KeyError.*rank 1 failed: KeyError"):
        run_on_ranks(_all_raise, 2)


def test_root_cause_first_when_peer_fails_in_collective() -> None:
    with pytest.raises(
        RankError,
        match=r"^rank 1 failed: RuntimeError: rank 1 gives up\n"
        r"rank 0 failed: .*Connection (closed|reset) by peer",
    ):
        run_on_ranks(_rank1_raises_rank0_in_collective, 2)


def test_failure_while_peer_is_stuck(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "FAILURE_GRACE_S", 0.5)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 failed.*ranks \[0\] did not finish"):
        run_on_ranks(_rank1_raises_rank0_stuck, 2)
    assert time.monotonic() - start < 10
    assert run_on_ranks(_all_reduce_ranks, 2) == [3.0, 3.0]  # the restarted pool works


def test_rank_skipping_a_collective_is_named() -> None:
    with pytest.raises(RankError, match=r"(?s)rank 0 failed.*ranks \[1\] returned normally"):
        run_on_ranks(_rank1_skips_collective, 2)


def test_hang_times_out_and_pool_recovers() -> None:
    start = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=r"(?s)ranks \[0, 1\] of 2 did not finish within "
        r"1.0 s.*stack of hung rank 0.*in all_reduce",
    ) as info:
        run_on_ranks(_rank1_skips_collective_and_hangs, 2, timeout=1.0)
    assert "stack of hung rank 1" in str(info.value)
    assert time.monotonic() - start < 10
    assert run_on_ranks(_all_reduce_ranks, 2) == [3.0, 3.0]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the workers' CPU time in /proc")
def test_a_call_still_computing_past_its_timeout_is_slow_not_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine a call may outrun its timeout while its ranks compute: it runs on.
    Any CPU the ranks used counts as progress here, so that the test holds at any load."""
    monkeypatch.setattr(_harness, "PROGRESS_MIN_CPU_S", 0.0)
    assert run_on_ranks(_busy_for, 2, 2.5, timeout=1.0) == [0, 1]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the workers' CPU time in /proc")
def test_a_call_computing_forever_stops_at_its_loaded_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "PROGRESS_MIN_CPU_S", 0.0)
    with pytest.raises(TimeoutError, match=r"did not finish within 1.0 s \(killed after \d+ s\)") as info:
        run_on_ranks(_busy_for, 2, 60.0, timeout=1.0)
    waited = int(str(info.value).split("killed after ")[1].split(" s")[0])
    assert 4 <= waited < 30, waited  # LOADED_TIMEOUT_FACTOR x 1.0 s, and far from the 60 s the ranks wanted


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_process_groups_of_a_call_die_with_it() -> None:
    """Process groups a call left in reference cycles are torn down before it returns (each
    gloo group runs threads of its own): not at some collection during a later call, amid
    that call's collectives."""
    run_on_ranks(_group_left_in_a_cycle, 2)  # whatever a first use starts for good
    before = run_on_ranks(_thread_count, 2)
    run_on_ranks(_group_left_in_a_cycle, 2)
    assert run_on_ranks(_thread_count, 2) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts threads and descriptors in /proc")
def test_a_call_that_builds_meshes_leaves_its_worker_as_it_found_it() -> None:
    """The same worker (not a replacement) is left by calls that build meshes, shard and train on
    them with no gloo thread (three a group) and as many open descriptors (sockets) as a call that
    builds nothing leaves."""
    run_on_ranks(_train_on_meshes, 4)  # whatever a first use starts for good
    run_on_ranks(_noop, 4)
    before = run_on_ranks(_worker_footprint, 4)  # what the no-op call left
    assert all(left[0] == 0 for _, left in before), before
    for _ in range(2):
        run_on_ranks(_train_on_meshes, 4)
    assert run_on_ranks(_worker_footprint, 4) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_worker_still_holding_a_group_is_replaced_after_its_result_is_read() -> None:
    """A group held past its call (its gloo threads still running) retires the worker, so groups
    cannot pile up; the call's result, tensors included, still arrives (a worker that exited at
    once took the tensors' shared storage with it: FileNotFoundError in the parent)."""
    results = run_on_ranks(_keeps_its_group_and_returns_a_tensor, 2)
    assert [t.tolist() for _, t in results] == [[0.0] * 1000, [1.0] * 1000]
    after = run_on_ranks(_worker_footprint, 2)
    assert [pid for pid, _ in after] != [pid for pid, _ in results]  # fresh workers


def test_sharding_answers_of_an_earlier_call_name_this_calls_mesh() -> None:
    """The workers keep sharding propagation's answers from call to call: a later call's equal
    ops get them with its own mesh, not the earlier call's (whose groups are destroyed)."""
    for groups_before in (0, 1):
        assert run_on_ranks(_op_on_2d_mesh, 4, groups_before) == [(True, 56.0)] * 4


def test_failed_init_retires_the_workers() -> None:
    with pytest.raises(RankError, match="(?s)rank 0 failed.*bogus"):
        run_on_ranks(_noop, 2, backend="bogus")
    assert run_on_ranks(_all_reduce_ranks, 2) == [3.0, 3.0]


def test_fresh_workers_serve_one_call_alone() -> None:
    """fresh=True: workers no earlier call ran in, retired after it, so that no later call
    inherits what it left in the process (torch's symmetric-memory registrations)."""
    before = run_on_ranks(_pid, 2)
    assert run_on_ranks(_pid, 2) == before  # the pool's workers serve call after call
    fresh = run_on_ranks(_pid, 2, fresh=True)
    after = run_on_ranks(_pid, 2)
    assert len(set(before + fresh + after)) == 6, (before, fresh, after)


def test_unpicklable_result_and_fn() -> None:
    with pytest.raises(RankError, match="not picklable"):
        run_on_ranks(_unpicklable_result, 2)
    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(lambda rank, world_size: None, 2)


def test_overhead_per_call() -> None:
    run_on_ranks(_noop, 2)  # the pool is up
    n = 20
    start = time.perf_counter()
    for _ in range(n):
        run_on_ranks(_noop, 2)
    per_call = (time.perf_counter() - start) / n
    print(f"run_on_ranks overhead: {per_call * 1000:.1f} ms per call (2 ranks, gloo)")
    assert per_call < 1.0


@requires_gpus(2)
def test_nccl() -> None:
    assert run_on_ranks(_nccl_all_reduce, 2, backend="nccl") == [2.0, 2.0]


# ----------------------------------------------------------------------------- collectives


def test_count_collectives_on_gloo() -> None:
    for counts, events in run_on_ranks(_counts_on_gloo, 2):
        assert counts == {"all_reduce": 1, "all_gather": 2, "scatter": 1}
        assert events[:2] == ["all_reduce(g[0,1], float32, 3)", "all_gather(g[0,1], float32, 4)"]


def test_dtensors_compare_shard_by_shard() -> None:
    r0, r1 = run_on_ranks(_compare_shards, 2)
    assert r0 == ""
    assert r1.startswith("w (shard at (3, 0)): not equal; 1 of 4 elements differ") and "first at (4, 1)" in r1, r1


def test_fake_pg_counts_and_trace_world_8() -> None:
    with fake_process_group(8, rank=3):
        assert (dist.get_rank(), dist.get_world_size()) == (3, 8)
        with count_collectives() as c, trace_collectives() as t:
            all_gather_single(torch.empty(24), torch.ones(3))
            reduce_scatter_single(torch.empty(3, dtype=torch.bfloat16), torch.ones(24, dtype=torch.bfloat16))
        assert c.counts == {"all_gather": 1, "reduce_scatter": 1} and c.total == 2
        assert c.counts["all_reduce"] == 0
        assert_expected_inline(
            t.render(),
            """\
all_gather(g[0,1,2,3,4,5,6,7], float32, 24)
reduce_scatter(g[0,1,2,3,4,5,6,7], bfloat16, 24)""",
        )
    assert not dist.is_initialized()


def test_trace_merges_eager_functional_and_dtensor_collectives() -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    with fake_process_group(8, rank=5):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        world = dist.group.WORLD
        x = distribute_tensor(torch.zeros(8, 4), mesh, [Replicate(), Shard(0)])
        with trace_collectives() as t, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old names, on purpose
            dist.all_gather_into_tensor(torch.empty(16), torch.ones(2))  # c10d
            dist.reduce_scatter_tensor(torch.empty(2), torch.ones(16))
            funcol.all_gather_tensor(torch.ones(2), 0, world).wait()  # functional
            funcol.reduce_scatter_tensor(torch.ones(16), "sum", 0, world).wait()
            funcol.all_reduce(torch.ones(5), "avg", mesh.get_group("dp")).wait()
            x.redistribute(mesh, [Replicate(), Replicate()])  # DTensor, tp group
            dist.broadcast(torch.ones(2, dtype=torch.int64), src=0)
        assert_expected_inline(
            t.render(),
            """\
all_gather(g[0,1,2,3,4,5,6,7], float32, 16)
reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 16)
all_gather(g[0,1,2,3,4,5,6,7], float32, 16)
reduce_scatter(g[0,1,2,3,4,5,6,7], float32, 16)
all_reduce(g[1,5], float32, 5)
all_gather(g[4,5,6,7], float32, 32)
broadcast(g[0,1,2,3,4,5,6,7], int64, 2)""",
        )


def test_fake_process_group_refuses_nesting() -> None:
    with fake_process_group(2):
        with pytest.raises(RuntimeError, match="already exists"):
            with fake_process_group(2):
                pass


# ----------------------------------------------------------------------------- assertions


def test_assert_close_tensors() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    assert_close_tensors(a, a.clone(), exact=True)
    assert_close_tensors(a, a + 1e-7)
    assert_close_tensors({"w": [a]}, {"w": [a + 0.01]}, rtol=0, atol=0.02)
    with pytest.raises(AssertionError, match=r"step 3 at \['w'\]\[0\]: not equal; 1 of 3"):
        assert_close_tensors({"w": [a]}, {"w": [a + torch.tensor([0, 0, 1e-6])]}, exact=True, msg="step 3")
    with pytest.raises(AssertionError, match="torch.float32.*torch.float64"):
        assert_close_tensors(a, a.double(), exact=True)
    with pytest.raises(AssertionError):
        assert_close_tensors(a, a + 0.1)
