"""torch 2.15's `FSDPModule` methods on `fully_shard.state(m)` (and through the FSDP2 adapter), on
every supported torch: manual backward finalization (`set_manual_backward_finalization`,
`finalize_backward`, its asynchronous handle) and `set_keep_unsharded_storage`.

Manual finalization over several microbatch backwards is compared with PyTorch FSDP2 (where
its torch has the methods) making the same calls: losses, gradients and parameters bit for
bit, and the same collectives per step; on an older torch with composable's automatic
finalization of the same accumulation, which other tests prove equal to FSDP2's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import count_collectives, run_on_ranks
from torch.distributed.fsdp import FSDPModule

from composable import fully_shard
from composable.integrations.fsdp2_module import as_fsdp_modules

FSDP2_FINALIZES = hasattr(FSDPModule, "finalize_backward")  # torch 2.15+
MICROBATCHES = 3
STEPS = 3
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _model(impl: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 8), nn.Tanh()), nn.Linear(8, 4)
    )
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for block in (model[0], model[1]):
            torch_fully_shard(block)
        torch_fully_shard(model)
        return model
    for block in (model[0], model[1]):
        fully_shard(block)
    fully_shard(model)
    return as_fsdp_modules(model) if impl == "adapter" else model


def _batch(step: int, mb: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * mb + rank))


def _train(impl: str, mode: str) -> dict[str, Any]:
    """STEPS steps of MICROBATCHES backwards each; `mode`: 'manual' (finalize_backward),
    'async' (finalize_backward(async_op=True) + wait) or 'auto' (the last backward syncs)."""
    rank = dist.get_rank()
    model = _model(impl)
    # The methods on the module (FSDP2, the adapter) or on composable's state.
    root: Any = fully_shard.state(model) if impl == "composable" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode != "auto":
        root.set_manual_backward_finalization(True)
    out: dict[str, Any] = {"losses": [], "grads": [], "counts": []}
    for step in range(STEPS):
        with count_collectives() as c:
            for mb in range(MICROBATCHES):
                last = mode == "auto" and mb == MICROBATCHES - 1
                root.set_requires_gradient_sync(last)
                root.set_reshard_after_backward(last)
                loss = model(_batch(step, mb, rank)).pow(2).mean()
                loss.backward()
                out["losses"].append(loss.detach())
            if mode != "auto":
                root.set_requires_gradient_sync(True)
                root.set_reshard_after_backward(True)
                handle = root.finalize_backward(async_op=mode == "async")
                assert (handle is None) == (mode == "manual")
                if handle is not None:
                    handle.wait()
                    handle.wait()  # a second wait does nothing
        out["counts"].append({k: c.counts.get(k, 0) for k in KINDS})
        out["grads"].append([p.grad.full_tensor() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    out["params"] = [p.full_tensor() for p in model.parameters()]
    return out


def _same(a: dict[str, Any], b: dict[str, Any], tag: str) -> None:
    for key in ("losses", "params"):
        for i, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
            assert torch.equal(x, y), f"{tag}: {key} {i}: {x} vs {y}"
    for s, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        for i, (x, y) in enumerate(zip(ga, gb, strict=True)):
            assert torch.equal(x, y), f"{tag}: step {s} grad {i}"
    assert a["counts"] == b["counts"], (tag, a["counts"], b["counts"])


def _manual_equals_reference(rank: int, world: int) -> list[dict[str, int]]:
    reference = _train("fsdp2", "manual") if FSDP2_FINALIZES else _train("composable", "auto")
    for impl in ("composable", "adapter"):
        for mode in ("manual", "async"):
            _same(_train(impl, mode), reference, f"{impl} {mode}")
    return reference["counts"]


def test_manual_finalization_over_microbatches_equals_fsdp2() -> None:
    counts = run_on_ranks(_manual_equals_reference, 2)[0]
    # One reduce-scatter per group (2 blocks + the root's head) per step, not per microbatch.
    assert all(c["reduce_scatter"] == 3 for c in counts), counts


def _async_handle_rules(rank: int, world: int) -> None:
    model = _model("composable")
    root = fully_shard.state(model)
    root.set_manual_backward_finalization(True)
    root.set_requires_gradient_sync(False)
    with count_collectives() as c:
        model(_batch(0, 0, rank)).sum().backward()
    assert c.counts.get("reduce_scatter", 0) == 0  # nothing reduced by the backward itself
    root.set_requires_gradient_sync(True)
    with count_collectives() as c:
        handle = root.finalize_backward(async_op=True)
    assert c.counts.get("reduce_scatter", 0) == 3  # launched: one per group
    with pytest.raises(RuntimeError, match=r"^finalize_backward: the previous gradient reduction must be waited on"):
        root.finalize_backward()
    with pytest.raises(
        RuntimeError, match=r"^fully_shard: the gradient reduction of finalize_backward.* before forward"
    ):
        model(_batch(0, 1, rank))
    handle.wait()
    assert all(p.grad is not None for p in model.parameters())
    # reset_iter_state discards a pending reduction: its handle's wait raises.
    model(_batch(0, 2, rank)).sum().backward()
    handle = root.finalize_backward(async_op=True)
    root.reset_iter_state()
    with pytest.raises(RuntimeError, match=r"^GradientReductionHandle.wait: this gradient reduction was invalidated"):
        handle.wait()
    model(_batch(0, 3, rank)).sum().backward()  # the next iteration runs normally
    root.finalize_backward()


def test_async_handle_must_be_waited_and_reset_invalidates_it() -> None:
    run_on_ranks(_async_handle_rules, 2)


def _errors(rank: int, world: int) -> None:
    model = _model("composable")
    root, block = fully_shard.state(model), fully_shard.state(model[0])
    with pytest.raises(TypeError, match=r"^set_manual_backward_finalization: 'enabled' must be a bool, got 1"):
        root.set_manual_backward_finalization(1)
    with pytest.raises(TypeError, match=r"^finalize_backward: 'async_op' must be a bool, got 'yes'"):
        root.finalize_backward(async_op="yes")
    assert root.finalize_backward() is None  # before the first forward: nothing to finalize
    block.set_manual_backward_finalization(True)  # before lazy init: refused at the first forward
    with pytest.raises(
        RuntimeError, match=r"^set_manual_backward_finalization: must be called on the root fully_shard"
    ):
        model(_batch(0, 0, rank))
    block.set_manual_backward_finalization(False)
    model(_batch(0, 0, rank)).sum().backward()  # automatic
    with pytest.raises(RuntimeError, match=r"^finalize_backward: requires manual backward finalization"):
        root.finalize_backward()
    with pytest.raises(RuntimeError, match=r"^set_manual_backward_finalization: must be called on the root"):
        block.set_manual_backward_finalization(True)
    with pytest.raises(RuntimeError, match=r"^finalize_backward: must be called on the root fully_shard module"):
        block.finalize_backward()
    root.set_manual_backward_finalization(True)
    out = model(_batch(0, 1, rank)).sum()

    def during_backward(grad: torch.Tensor) -> torch.Tensor:
        with pytest.raises(RuntimeError, match=r"^set_manual_backward_finalization: cannot change the mode .* during"):
            root.set_manual_backward_finalization(False)
        with pytest.raises(RuntimeError, match=r"^finalize_backward: must be called after backward completes"):
            root.finalize_backward()
        return grad

    out.register_hook(during_backward)
    out.backward()
    with pytest.raises(
        RuntimeError, match=r"^set_manual_backward_finalization: cannot change the mode .* after backward"
    ):
        root.set_manual_backward_finalization(False)
    root.finalize_backward()
    root.set_manual_backward_finalization(False)  # allowed again once finalized
    with pytest.raises(TypeError, match=r"^set_keep_unsharded_storage: 'keep' must be a bool, got None"):
        root.set_keep_unsharded_storage(None)
    with pytest.raises(TypeError, match=r"^set_keep_unsharded_storage: 'recurse' must be a bool, got 0"):
        root.set_keep_unsharded_storage(True, recurse=0)


def test_errors_name_the_method_and_the_value() -> None:
    run_on_ranks(_errors, 2)


def _hsdp_partial(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=mesh)
    state = fully_shard.state(model)
    state.set_manual_backward_finalization(True)
    state.set_requires_all_reduce(False)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"^finalize_backward: manual backward finalization does not support HSDP"):
        state.finalize_backward()


def test_hsdp_deferred_all_reduce_is_refused_under_manual_finalization() -> None:
    run_on_ranks(_hsdp_partial, 2)


def _keep_storage(rank: int, world: int) -> None:
    model = _model("adapter")
    blocks = [model[0], model[1]]

    def pointers() -> list[int]:
        return [b[0].weight.data_ptr() for b in blocks]  # the registered unsharded weights

    def unshard_all() -> None:
        for b in blocks:
            b.unshard()

    model.set_keep_unsharded_storage(True)  # recurse: every block
    unshard_all()
    kept = pointers()
    for _ in range(2):
        for b in blocks:
            b.reshard()
        unsharded = [fully_shard.state(b).groups[0].params[0].unsharded_param for b in blocks]
        assert all(u.untyped_storage().size() > 0 for u in unsharded)  # not freed
        model(_batch(0, 0, rank)).sum().backward()  # forward and backward reshard and gather again
        unshard_all()
        assert pointers() == kept
    model.set_keep_unsharded_storage(False, recurse=False)  # the root only: the blocks still keep
    model[0].set_keep_unsharded_storage(False)
    model[0].reshard()
    assert fully_shard.state(model[0]).groups[0].params[0].unsharded_param.untyped_storage().size() == 0
    model[1].reshard()
    assert fully_shard.state(model[1]).groups[0].params[0].unsharded_param.untyped_storage().size() > 0


def test_keep_unsharded_storage_keeps_data_pointers() -> None:
    run_on_ranks(_keep_storage, 2)
