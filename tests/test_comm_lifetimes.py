"""Lifetimes around asynchronous collectives (a gloo rank segfaulted in CI).

gloo runs an async collective on threads of its own, reading its input and writing its output
until the work is waited: a storage freed or resized under it (`untyped_storage().resize_(0)`,
the engine's way of freeing unsharded parameters) is memory the collective then writes into.
Every collective the engine issues is recorded here, and two invariants are checked across
the layouts, with no-sync micro-steps and explicit prefetching:
- no storage that an un-waited collective uses is shrunk;
- at the end of every backward every collective issued so far has been waited (nothing is left
  in flight into the optimizer step, the next test, or the process group's destruction).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import init_device_mesh

from composable import CPUOffloadPolicy, OffloadPolicy, ShardingStrategy, fully_shard, no_sync, replicate
from composable._engine.comm import collectives as comm


class _Tracked:
    """A work as the engine sees it, remembering whether it was waited."""

    def __init__(self, work: Any, kind: str, storages: set[int]) -> None:
        self.work, self.kind, self.storages, self.waited = work, kind, storages, False

    def wait(self, *args: Any) -> Any:
        self.waited = True
        return self.work.wait(*args)


def _storage_ids(*tensors: torch.Tensor) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().size() > 0}


@contextlib.contextmanager
def _recording() -> Iterator[tuple[list[_Tracked], list[str]]]:
    """Record the engine's async collectives (`comm.*`, looked up at each call) and every
    storage shrink that hits a storage one of them still uses (violations)."""
    works: list[_Tracked] = []
    violations: list[str] = []

    def track(fn: Callable[..., Any], kind: str, tensors: Callable[..., tuple]) -> Callable[..., Any]:
        def issue(*args: Any, **kwargs: Any) -> Any:
            work = fn(*args, **kwargs)
            if work is None:  # waited inside (synchronous)
                return None
            tracked = _Tracked(work, kind, _storage_ids(*tensors(*args)))
            works.append(tracked)
            return tracked

        return issue

    original_resize = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        if size < storage.size():
            ptr = storage.data_ptr()
            hit = [w.kind for w in works if not w.waited and ptr in w.storages]
            if hit:  # reported, and not done: the collective would write into freed memory
                violations.append(f"storage of an un-waited {hit[0]} resized to {size} bytes")
                return storage
        return original_resize(storage, size)

    patched = {
        "all_gather": track(comm.all_gather, "all_gather", lambda out, inp, *a, **k: (out, inp)),
        "reduce_scatter": track(comm.reduce_scatter, "reduce_scatter", lambda out, inp, *a, **k: (out, inp)),
        "all_reduce": track(comm.all_reduce, "all_reduce", lambda t, *a, **k: (t,)),
        "all_reduce_async": track(comm.all_reduce_async, "all_reduce", lambda t, *a, **k: (t,)),
    }
    saved = {name: getattr(comm, name) for name in patched}
    try:
        for name, fn in patched.items():
            setattr(comm, name, fn)
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        yield works, violations
    finally:  # the harness's workers persist: leave nothing patched behind
        torch.UntypedStorage.resize_ = original_resize  # type: ignore[method-assign]
        for name, fn in saved.items():
            setattr(comm, name, fn)


def _build(api: str, world_size: int) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer()
    if api == "replicate":
        for m in [*model.layers, model]:
            replicate(m)
        return model
    strategy, offload = {
        "FULL_SHARD": (ShardingStrategy.FULL_SHARD, False),
        "FULL_SHARD-offload": (ShardingStrategy.FULL_SHARD, True),
        "SHARD_GRAD_OP": (ShardingStrategy.SHARD_GRAD_OP, False),
        "NO_SHARD": (ShardingStrategy.NO_SHARD, False),
        "HYBRID_SHARD": (ShardingStrategy.HYBRID_SHARD, False),
    }[api]
    hybrid = strategy is ShardingStrategy.HYBRID_SHARD
    mesh = init_device_mesh("cpu", (2, world_size // 2) if hybrid else (world_size,))
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for m in [*model.layers, model]:
        fully_shard(m, mesh=mesh, strategy=strategy, offload_policy=policy)
    return model


def _lifetimes(rank: int, world_size: int, api: str) -> int:
    with _recording() as (works, violations):
        model = _build(api, world_size)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        issued = 0
        for step in range(2):
            for i, sync in enumerate([False, False, True]):
                if api != "replicate" and i == 1:  # an explicit prefetch, used by the forward
                    fully_shard.state(model.layers[0]).unshard(async_op=True)
                loss = lm_loss(model, batch_for(10 * step + i, world_size, rank))
                with contextlib.nullcontext() if sync else no_sync(model):
                    loss.backward()
                pending = [w.kind for w in works if not w.waited]
                assert not pending, f"step {step} micro-step {i}: un-waited after backward: {pending}"
            opt.step()
            opt.zero_grad()
            issued = len(works)
        assert not violations, violations
        assert all(w.waited for w in works)
    return issued


@pytest.mark.parametrize(
    "api, world_size",
    [
        ("FULL_SHARD", 2),
        ("FULL_SHARD-offload", 2),
        ("SHARD_GRAD_OP", 2),
        ("NO_SHARD", 2),
        ("HYBRID_SHARD", 4),
        ("replicate", 2),
    ],
)
def test_no_collective_outlives_its_buffers_or_its_backward(api: str, world_size: int) -> None:
    issued = run_on_ranks(_lifetimes, world_size, api)
    assert all(n > 0 for n in issued), issued  # the recording saw the engine's collectives


def _shrink_under_collective(rank: int, world_size: int) -> list[str]:
    """The recorder itself: a storage freed under an un-waited all-gather is caught."""
    with _recording() as (works, violations):
        out = torch.empty(2 * 4096)
        work = comm.all_gather(out, out.narrow(0, rank * 4096, 4096), dist.group.WORLD, async_op=True)
        out.untyped_storage().resize_(0)  # the hazard: refused and reported by the recorder
        work.wait()
    return violations


def test_recorder_catches_a_shrink_under_a_collective() -> None:
    """The check above can fail: a resize under an un-waited collective is reported."""
    for violations in run_on_ranks(_shrink_under_collective, 2):
        assert violations == ["storage of an un-waited all_gather resized to 0 bytes"], violations
