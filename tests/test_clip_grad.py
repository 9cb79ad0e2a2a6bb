"""clip_grad_norm_: parity with a single-process reference on any meshes, collective counts,
error_if_nonfinite, foreach, argument errors, CPU cost; and torch's own clip on one mesh.

The reference is ``torch.nn.utils.clip_grad_norm_`` on the full (unsharded) gradients, which
every rank builds identically from the shared seed. A DTensor gradient is checked shard by
shard: its local tensor must equal the reference's clipped gradient distributed the same way.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from _harness import (
    assert_close_tensors,
    count_collectives,
    fake_process_group,
    requires_gpus,
    run_on_ranks,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

from composable.clip_grad import clip_grad_norm_

NORM_TYPES = (1.0, 2.0, 3.0, math.inf)
STRIDED = "strided"  # _StridedShard(0, split_factor=tp): dim 0 split by tp first, then by dp

# (shape, mesh, placements); meshes: "world" 1D, "2d" (dp, tp), "dp" its submesh, "ep" a
# second 1D mesh over the world, "plain" no mesh. Sizes are uneven on purpose; (1, 4) leaves
# some ranks with an empty shard.
_DP_TP = [
    ((7, 5), "2d", (Shard(0), Shard(1))),
    ((6, 4), "2d", (STRIDED, Shard(0))),
    ((7, 3), "2d", (STRIDED, Shard(0))),
    ((5, 2), "2d", (Shard(0), Replicate())),
    ((3,), "2d", (Replicate(), Shard(0))),
]
LAYOUTS = {
    "1d": [
        ((7, 5), "world", (Shard(0),)),
        ((3,), "world", (Shard(0),)),
        ((1, 4), "world", (Shard(0),)),
        ((4, 6), "world", (Shard(1),)),
        ((5,), "world", (Replicate(),)),
    ],
    "hsdp": [
        ((7, 5), "2d", (Replicate(), Shard(0))),
        ((3,), "2d", (Replicate(), Shard(0))),
        ((1, 4), "2d", (Replicate(), Shard(0))),
        ((2, 2), "2d", (Replicate(), Replicate())),
    ],
    "dp_tp": _DP_TP,
    # A TP x FSDP body, a head sharded over dp only, an expert sharded over its own mesh, a
    # replicated bias, and plain tensors.
    "mixed": _DP_TP
    + [
        ((9, 4), "dp", (Shard(0),)),
        ((4, 3, 2), "ep", (Shard(0),)),
        ((2,), "world", (Replicate(),)),
        ((3, 3), "plain", ()),
        ((4,), "plain", ()),
    ],
}
# Distinct process groups with a sharded, non-trivial mesh dim: the all_reduces expected.
# World 2 "mixed": the 2D mesh is (2, 1), and its dp group has the same ranks as "ep".
EXPECTED_ALL_REDUCES = {
    ("1d", 2): 1,
    ("1d", 4): 1,
    ("hsdp", 4): 1,
    ("dp_tp", 4): 2,
    ("mixed", 2): 1,
    ("mixed", 4): 3,
}


def _meshes(world_size: int) -> dict:
    m2 = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    return {
        "world": init_device_mesh("cpu", (world_size,), mesh_dim_names=("w",)),
        "2d": m2,
        "dp": m2["dp"],
        "ep": init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)),
        "plain": None,
    }


def _placements(mesh, placements: tuple) -> list:
    return [_StridedShard(0, split_factor=mesh.size(1)) if pl == STRIDED else pl for pl in placements]


def _build(fulls: list[torch.Tensor], specs: list, meshes: dict) -> list[torch.Tensor]:
    """Parameters whose gradients are ``fulls`` laid out as ``specs`` (no communication)."""
    params = []
    for full, (_, mesh_name, placements) in zip(fulls, specs):
        mesh = meshes[mesh_name]
        if mesh is None:
            p = torch.nn.Parameter(torch.zeros_like(full))
            p.grad = full.clone()
        else:
            pls = _placements(mesh, placements)
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, pls, src_data_rank=None))
            p.grad = distribute_tensor(full.clone(), mesh, pls, src_data_rank=None)
        params.append(p)
    return params


def _check_grads(params: list[torch.Tensor], ref: list[torch.Tensor], **tol: float) -> None:
    for i, (p, r) in enumerate(zip(params, ref)):
        if isinstance(p.grad, DTensor):
            expected = distribute_tensor(r.grad, p.grad.device_mesh, p.grad.placements, src_data_rank=None)
            assert_close_tensors(p.grad._local_tensor, expected._local_tensor, msg=f"grad {i}", **tol)
        else:
            assert_close_tensors(p.grad, r.grad, msg=f"grad {i}", **tol)


def _parity(rank: int, world_size: int, layout: str, foreach: bool | None) -> None:
    meshes = _meshes(world_size)
    specs = LAYOUTS[layout]
    for norm_type in NORM_TYPES:
        fulls = [torch.randn(shape) for shape, _, _ in specs]  # identical on every rank
        params = _build(fulls, specs, meshes)
        ref = [torch.nn.Parameter(torch.zeros_like(f)) for f in fulls]
        for r, f in zip(ref, fulls):
            r.grad = f.clone()
        # Clip to half the norm so that clipping really scales.
        max_norm = 0.5 * torch.linalg.vector_norm(torch.cat([f.flatten() for f in fulls]), norm_type).item()
        ref_total = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)

        with count_collectives() as comms:
            total = clip_grad_norm_(params, max_norm, norm_type, foreach=foreach)

        expected = EXPECTED_ALL_REDUCES[(layout, world_size)]
        assert comms.counts["all_reduce"] == comms.total == expected, (norm_type, comms.events)
        assert type(total) is torch.Tensor and total.dim() == 0
        assert_close_tensors(total, ref_total, msg=f"total norm, p={norm_type}")
        _check_grads(params, ref)


@pytest.mark.parametrize(
    "layout,world_size", [("1d", 2), ("1d", 4), ("hsdp", 4), ("dp_tp", 4), ("mixed", 2), ("mixed", 4)]
)
def test_parity_with_single_process_reference(layout: str, world_size: int) -> None:
    run_on_ranks(_parity, world_size, layout=layout, foreach=None)


@pytest.mark.parametrize("foreach", [True, False])
def test_parity_foreach_on_and_off(foreach: bool) -> None:
    run_on_ranks(_parity, 4, layout="mixed", foreach=foreach)


def _partial_grad(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(rank + 1)  # a Partial gradient differs per rank; the value is their sum
    g = DTensor.from_local(torch.randn(5, 3), mesh, [Partial()], run_check=False)
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 3), mesh, [Replicate()], src_data_rank=None))
    p.grad = g
    ref = torch.nn.Parameter(torch.zeros(5, 3))
    ref.grad = g.full_tensor()
    for norm_type in NORM_TYPES:
        ref_total = torch.nn.utils.clip_grad_norm_([ref], 1.0, norm_type)
        total = clip_grad_norm_([p], 1.0, norm_type)
        assert_close_tensors(total, ref_total)
        assert_close_tensors(p.grad.full_tensor(), ref.grad)


def test_partial_gradient_is_reduced_before_the_norm() -> None:
    run_on_ranks(_partial_grad, 2)


# Sharded layouts only: a rank without a gradient of a replicated or plain parameter cannot
# know its value without communicating, so only sharded gradients make totals comparable.
_SHARDED = [
    ((7, 5), "world", (Shard(0),)),
    ((1, 4), "world", (Shard(0),)),  # rank 1's shard is empty
    ((4, 6), "world", (Shard(1),)),
    ((4, 3, 2), "ep", (Shard(0),)),
]


def _missing_grads(rank: int, world_size: int, missing: str) -> tuple[float, float, dict]:
    """Rank 1 holds no gradients (``missing="all"``) or none on the "ep" mesh (``"ep"``)."""
    meshes = _meshes(world_size)
    out = {}
    for norm_type in (2.0, math.inf):
        params = _build([torch.randn(shape) for shape, _, _ in _SHARDED], _SHARDED, meshes)
        if rank == 1:
            for p, (_, mesh_name, _) in zip(params, _SHARDED):
                if missing == "all" or mesh_name == "ep":
                    p.grad = None
        held = [p.grad._local_tensor.flatten() for p in params if p.grad is not None]
        local = torch.linalg.vector_norm(torch.cat(held), norm_type) if held else torch.tensor(0.0)
        with count_collectives() as comms:
            total = clip_grad_norm_(params, 0.1, norm_type)  # used to hang: rank 1 skipped the all_reduce
        # The expected norm, from every rank's held pieces (outside the count).
        part = local.clone() if norm_type == math.inf else local.pow(2)
        torch.distributed.all_reduce(
            part, op=torch.distributed.ReduceOp.MAX if norm_type == math.inf else torch.distributed.ReduceOp.SUM
        )
        expected = part if norm_type == math.inf else part.sqrt()
        assert_close_tensors(total, expected, msg=f"rank {rank}, p={norm_type}")
        clipped = [p.grad._local_tensor.flatten() for p in params if p.grad is not None]
        if clipped:  # scaled to max_norm: this rank's share shrank by the common coefficient
            assert_close_tensors(
                torch.linalg.vector_norm(torch.cat(clipped), norm_type), local * 0.1 / (expected + 1e-6)
            )
        out[norm_type] = (total.item(), dict(comms.counts))
    return out


@pytest.mark.parametrize("missing", ["all", "ep"])
def test_rank_without_gradients_joins_the_same_collectives(missing: str) -> None:
    """A rank whose gradients are None must not skip the all_reduce."""
    results = run_on_ranks(_missing_grads, 2, missing=missing, timeout=30.0)
    assert results[0] == results[1]  # the same total and the same collectives on both ranks
    assert all(counts == {"all_reduce": 1} for _, counts in results[0].values()), results


def _nonfinite(rank: int, world_size: int, bad: float, norm_type: float) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 3), mesh, [Shard(0)], src_data_rank=None))
    p.grad = distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)], src_data_rank=None)
    q = torch.nn.Parameter(torch.zeros(4))
    q.grad = torch.randn(4)
    if rank == 1:  # only one rank's shard is bad: every rank must still see it
        p.grad._local_tensor[0, 0] = bad
    before = p.grad._local_tensor.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([p, q], 1.0, norm_type, error_if_nonfinite=True)
    assert torch.equal(p.grad._local_tensor.nan_to_num(), before.nan_to_num())  # untouched
    total = clip_grad_norm_([p, q], 1.0, norm_type)  # no error: scaled by the non-finite norm
    assert not torch.isfinite(total)
    if not math.isnan(bad):
        assert total.item() == math.inf


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_error_if_nonfinite_on_every_rank(bad: float, norm_type: float) -> None:
    run_on_ranks(_nonfinite, 2, bad=bad, norm_type=norm_type)


def _timing(rank: int, world_size: int, sizes: tuple[int, ...]) -> list[tuple[float, float]]:
    """(first call, second call) seconds of clip_grad_norm_ per number of gradients."""
    mesh = init_device_mesh("cpu", (world_size,))
    times = []
    for n in sizes:
        params = []
        for _ in range(n):
            p = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, [Shard(0)], run_check=False))
            p.grad = DTensor.from_local(torch.randn(4, 4), mesh, [Shard(0)], run_check=False)
            params.append(p)
        calls = []
        for _ in range(2):
            t0 = time.perf_counter()
            clip_grad_norm_(params, 1.0)
            calls.append(time.perf_counter() - t0)
        times.append((calls[0], calls[1]))
    return times


def test_cpu_cost_of_2000_dtensor_grads() -> None:
    """Linear in the number of gradients, first call included.

    For comparison (measured here, torch 2.13, 2 ranks): torch.nn.utils.clip_grad_norm_ takes
    2.0 s for 1,000 and 7.4 s for 2,000 DTensor gradients on its first call (DTensor's sharding
    propagation of a foreach op over that many inputs, quadratic), about 25 ms once cached.
    """
    sizes = (500, 1000, 2000)
    times = run_on_ranks(_timing, 2, sizes=sizes)[0]
    print(
        "\nclip_grad_norm_ on DTensor grads (first call / second call): "
        + ", ".join(f"{n}: {a * 1e3:.1f} / {b * 1e3:.1f} ms" for n, (a, b) in zip(sizes, times))
    )
    assert max(times[-1]) < 1.0


def test_collective_count_is_independent_of_parameter_count() -> None:
    """World 8 on the fake process group: 300 gradients on four meshes, three all_reduces."""
    with fake_process_group(8, rank=3):
        meshes = _meshes(8)
        specs = [spec for _ in range(30) for spec in LAYOUTS["mixed"]]
        params = _build([torch.randn(shape) for shape, _, _ in specs], specs, meshes)
        with count_collectives() as comms:
            clip_grad_norm_(params, 1.0)
        assert comms.counts["all_reduce"] == comms.total == 3, comms.events


def test_plain_tensors_match_torch() -> None:
    for norm_type in NORM_TYPES:
        for foreach in (None, True, False):
            grads = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, dtype=torch.float64)]
            ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for a, b, g in zip(ours, ref, grads):
                a.grad, b.grad = g.clone(), g.clone()
            total = clip_grad_norm_(ours, 0.5, norm_type, foreach=foreach)
            ref_total = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type, foreach=foreach)
            assert_close_tensors(total, ref_total.to(total.dtype))
            assert_close_tensors([p.grad for p in ours], [p.grad for p in ref])


def test_host_norms_on_threads_are_the_foreach_norms_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host gradients large enough for the pool of threads (CPU offload's case) get exactly the
    norms torch's foreach norm gives one tensor at a time, and clip_grad_norm_ the total it
    gives when every norm is taken on one thread."""
    from composable._engine.grads import host_norms as host_norms_module

    def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for q, g in zip(params, grads):
            q.grad = g.clone()
        return clip_grad_norm_(params, 1e9, norm_type)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        grads = [torch.randn(n) * (i + 1) for i, n in enumerate((1 << 21, 3 << 20, 12345, 1 << 20))]
        for norm_type in (1.0, 2.0, 3.0, math.inf):
            ours = host_norms_module.host_norms(grads, norm_type, torch.float32)
            theirs = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), norm_type
            pooled = total_norm(grads, norm_type)
            with monkeypatch.context() as m:  # every norm on this thread, one after the other
                m.setattr(host_norms_module, "_POOL_MIN_ELEMENTS", 1 << 62)
                assert torch.equal(pooled, total_norm(grads, norm_type)), norm_type
        assert host_norms_module._pool is not None  # the pool ran, not only the one-thread loop
    finally:
        torch.set_num_threads(threads)


def test_half_precision_norm_does_not_overflow() -> None:
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    total = clip_grad_norm_([p], 1.0)
    assert total.dtype == torch.float32 and total.item() == pytest.approx(120000.0)
    assert_close_tensors(p.grad.float(), torch.full((4,), 0.5), atol=1e-3, rtol=1e-3)


def test_no_gradients_and_empty_generator() -> None:
    assert clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
    with pytest.warns(UserWarning, match="empty generator"):
        assert clip_grad_norm_((p for p in []), 1.0).item() == 0.0


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"max_norm": -1.0}, ValueError, r"clip_grad_norm_: max_norm .*-1\.0"),
        ({"max_norm": math.nan}, ValueError, r"clip_grad_norm_: max_norm .*nan"),
        ({"max_norm": None}, TypeError, r"clip_grad_norm_: max_norm .*None"),
        ({"norm_type": 0}, ValueError, r"clip_grad_norm_: norm_type .*0"),
        ({"norm_type": -2.0}, ValueError, r"clip_grad_norm_: norm_type .*-2\.0"),
        ({"norm_type": "two"}, TypeError, r"clip_grad_norm_: norm_type .*'two'"),
        ({"norm_type": True}, TypeError, r"clip_grad_norm_: norm_type .*True"),
        ({"foreach": "yes"}, TypeError, r"clip_grad_norm_: foreach .*'yes'"),
    ],
)
def test_bad_arguments(kwargs: dict, exc: type, match: str) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    args = {"max_norm": 1.0, **kwargs}
    with pytest.raises(exc, match=match):
        clip_grad_norm_([p], **args)


def test_norm_type_inf_as_string() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([3.0, -4.0])
    assert clip_grad_norm_([p], 10.0, "inf").item() == 4.0


def _gpu_mesh_with_offloaded_grads(rank: int, world_size: int) -> None:
    """A CUDA mesh whose gradients live partly on the GPU, partly on the CPU (offloaded)."""
    mesh = init_device_mesh("cuda", (world_size,))
    fulls = [torch.randn(7, 3), torch.randn(5), torch.randn(4, 2)]
    params = []
    for i, full in enumerate(fulls):
        local = full.chunk(world_size)[rank] if i < 2 else full
        local = local.cuda() if i == 0 else local.clone()  # grads 1 (DTensor) and 2 (plain) on CPU
        if i < 2:  # shape and stride given: the shards are uneven

            def as_dtensor(t: torch.Tensor, full: torch.Tensor = full) -> DTensor:
                return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())

            p = torch.nn.Parameter(as_dtensor(torch.zeros_like(local)))
            p.grad = as_dtensor(local)
        else:
            p = torch.nn.Parameter(torch.zeros_like(local))
            p.grad = local
        params.append(p)
    ref = [torch.nn.Parameter(torch.zeros_like(f)) for f in fulls]
    for r, f in zip(ref, fulls):
        r.grad = f.clone()
    for norm_type in NORM_TYPES:
        ref_total = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
        total = clip_grad_norm_(params, 1.0, norm_type)
        assert total.device.type == "cuda"  # the first gradient's device
        assert_close_tensors(total.cpu(), ref_total)
        for i, (p, r) in enumerate(zip(params, ref)):
            expected = r.grad.chunk(world_size)[rank] if i < 2 else r.grad
            got = p.grad._local_tensor if i < 2 else p.grad
            assert_close_tensors(got.cpu(), expected, msg=f"grad {i}")


@requires_gpus(1)
def test_gpu_mesh_with_cpu_offloaded_grads() -> None:
    run_on_ranks(_gpu_mesh_with_offloaded_grads, 2)


# --- torch.nn.utils.clip_grad_norm_ itself on DTensors that all live on one mesh ---------

TORCH_LAYOUTS = {  # no empty shards: torch's foreach inf-norm raises on an empty tensor
    "1d": ((2,), (Shard(0),)),
    "hsdp": ((2, 2), (Replicate(), Shard(0))),
    "2d": ((2, 2), (Shard(0), Shard(1))),
}


def _torch_clip_one_mesh(rank: int, world_size: int, layout: str) -> None:
    mesh_shape, placements = TORCH_LAYOUTS[layout]
    mesh = init_device_mesh("cpu", mesh_shape)
    shapes = [(7, 5), (4, 6), (6, 3)]
    sharded_dims = sum(1 for pl in placements if pl.is_shard())
    for norm_type in NORM_TYPES:
        fulls = [torch.randn(s) for s in shapes]
        params = _build(fulls, [(s, "m", placements) for s in shapes], {"m": mesh})
        ref = [torch.nn.Parameter(torch.zeros_like(f)) for f in fulls]
        for r, f in zip(ref, fulls):
            r.grad = f.clone()
        ref_total = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
        # CommDebugMode, not count_collectives: DTensor's sharding propagation runs on fake
        # tensors, which the harness tracer does not let through.
        with CommDebugMode() as comm:
            total = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type)
        n_all_reduce = sum(v for k, v in comm.get_comm_counts().items() if "all_reduce" in str(k))
        assert n_all_reduce == comm.get_total_counts() <= sharded_dims, comm.get_comm_counts()
        assert isinstance(total, DTensor)  # torch returns a DTensor here (API.md)
        assert_close_tensors(total.full_tensor(), ref_total)
        _check_grads(params, ref)


@pytest.mark.parametrize("layout,world_size", [("1d", 2), ("hsdp", 4), ("2d", 4)])
def test_torch_clip_grad_norm_on_one_mesh(layout: str, world_size: int) -> None:
    run_on_ranks(_torch_clip_one_mesh, world_size, layout=layout)
