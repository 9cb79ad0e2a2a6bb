"""Gradient accumulation: `no_sync`, `set_requires_gradient_sync`, the state's
`set_requires_gradient_sync`, and HSDP's `set_requires_all_reduce`.

Sync and no-sync micro-steps interleave in any order (3 synced, 3 not, 3 synced; and 3 not,
3 synced, 3 not, 1 synced) under FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD (2x2
mesh of 4 ranks), with and without CPU offload. The reference is one process accumulating
every micro-batch of every rank (the concatenation of the ranks' rows, whose mean-loss
gradient is the average of the ranks' gradients): the accumulated gradients and the
parameters after the optimizer step must match it. A no-sync backward issues no gradient
collective (and, where parameters stay gathered, no collective at all).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, count_collectives, requires_gpus, run_on_ranks, step_and_match
from _models import TinyTransformer, batch_for, lm_loss
from _training import step_and_compare
from torch.distributed.device_mesh import init_device_mesh

from composable import (
    CPUOffloadPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
    no_sync,
    set_requires_gradient_sync,
)

FULL, GRAD_OP, NO_SHARD, HYBRID = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
    ShardingStrategy.HYBRID_SHARD,
)
PATTERNS = {  # True: a synced micro-step
    "sync3-nosync3-sync3": [True] * 3 + [False] * 3 + [True] * 3,
    "nosync3-sync3-nosync3-sync1": [False] * 3 + [True] * 3 + [False] * 3 + [True],
}
STEPS = 2  # optimizer steps, each over a whole pattern: zero_grad must reset everything
# SGD, not Adam: the reference sums in another order (1e-7 differences), and Adam would blow
# that noise on the exactly-zero key-bias gradients up to full-size steps.


def _build(strategy: ShardingStrategy, offload: bool, world_size: int, device: str = "cpu") -> TinyTransformer:
    mesh = init_device_mesh(device, (2, world_size // 2) if strategy is HYBRID else (world_size,))
    torch.manual_seed(0)
    model = TinyTransformer()
    kwargs = dict(mesh=mesh, strategy=strategy, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _micro_step(model: nn.Module, method: str, sync: bool, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Forward + backward with gradient sync `sync`, turned on/off through `method`; returns
    the loss and the collectives of the backward alone."""
    if method == "set_requires_gradient_sync":
        set_requires_gradient_sync(model, sync)
    elif method == "state":
        fully_shard.state(model).set_requires_gradient_sync(sync)
    loss = lm_loss(model, tokens)
    with count_collectives() as comm:
        if method == "no_sync" and not sync:
            with no_sync(model):
                loss.backward()
        else:
            loss.backward()
    return loss.detach(), dict(comm.counts)


def _accumulate(
    rank: int,
    world_size: int,
    strategy: ShardingStrategy,
    offload: bool,
    pattern: str,
    method: str,
    device: str = "cpu",
) -> None:
    model = _build(strategy, offload, world_size, device)
    torch.manual_seed(0)
    ref = TinyTransformer().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    # Parameters stay gathered from forward to backward except under FULL_SHARD/HSDP
    # (non-root groups), whose backward all-gathers again: that is not gradient traffic.
    regathers = strategy in (FULL, HYBRID)
    for step in range(STEPS):
        for i, sync in enumerate(PATTERNS[pattern]):
            # no_sync wraps only the backward: that is where communication would happen.
            loss, counts = _micro_step(model, method, sync, batch_for(100 * step + i, world_size, rank).to(device))
            ref_loss = lm_loss(ref, batch_for(100 * step + i, world_size, None).to(device))
            ref_loss.backward()
            where = f"step {step} micro-step {i} (sync={sync})"
            if sync:
                reduce_kind = "all_reduce" if strategy is NO_SHARD else "reduce_scatter"
                assert counts.get(reduce_kind, 0) == 3, (where, counts)  # one per group
                assert counts.get("all_reduce", 0) == (3 if strategy in (NO_SHARD, HYBRID) else 0), (where, counts)
            else:
                assert counts.get("reduce_scatter", 0) == counts.get("all_reduce", 0) == 0, (where, counts)
                if not regathers:
                    assert sum(counts.values()) == 0, (where, counts)
        set_requires_gradient_sync(model, True)  # whatever `method` left behind
        for name, p in model.named_parameters():
            home = "cpu" if offload else device
            assert p.grad.device.type == home and p.device.type == home, name
            assert_close_tensors(
                p.grad.full_tensor().to(device),
                ref.get_parameter(name).grad,
                msg=f"step {step} accumulated grad {name}",
            )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for name, p in model.named_parameters():
            assert_close_tensors(p.full_tensor().to(device), ref.get_parameter(name), msg=f"step {step} param {name}")
            assert p.grad is None, name


# A covering set of strategy x pattern x offload: every strategy with both patterns and with
# and without offload, and every pattern with and without offload.
_SYNC_FIRST, _NOSYNC_FIRST = PATTERNS
INTERLEAVED_CASES = [
    pytest.param(strategy, pattern, offload, id=f"{strategy.name}-{pattern}-{'offload' if offload else 'no-offload'}")
    for i, strategy in enumerate([FULL, GRAD_OP, NO_SHARD, HYBRID])
    for pattern, offload in ((_SYNC_FIRST, i % 2 == 1), (_NOSYNC_FIRST, i % 2 == 0))
]


@pytest.mark.parametrize("strategy,pattern,offload", INTERLEAVED_CASES)
def test_interleaved_accumulation_matches_reference(strategy: ShardingStrategy, pattern: str, offload: bool) -> None:
    """Any interleaving of synced and no-sync micro-steps equals accumulating them all."""
    world_size = 4 if strategy is HYBRID else 2
    # Both toggles across the matrix: the context manager and the top-level setter.
    method = "no_sync" if pattern.startswith("sync3") else "set_requires_gradient_sync"
    run_on_ranks(_accumulate, world_size, strategy, offload, pattern, method)


@requires_gpus(2)
@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "offload"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_interleaved_accumulation_gpu(pattern: str, offload: bool) -> None:
    """FULL_SHARD on 2 GPUs (NCCL), sharded parameters and gradients on the CPU with offload."""
    # A CPU backend next to NCCL for DTensor ops on the offloaded shards (full_tensor).
    run_on_ranks(
        _accumulate, 2, FULL, offload, pattern, "no_sync", "cuda", backend="cpu:gloo,cuda:nccl" if offload else "nccl"
    )


@pytest.mark.parametrize("method", ["no_sync", "set_requires_gradient_sync", "state"])
def test_every_toggle(method: str) -> None:
    """`no_sync`, `set_requires_gradient_sync` and `fully_shard.state(m).set_requires_gradient_sync`
    are interchangeable."""
    run_on_ranks(_accumulate, 2, FULL, False, "nosync3-sync3-nosync3-sync1", method)


def _toggle_scope(rank: int, world_size: int) -> None:
    model = _build(FULL, False, world_size)
    layer_states = [fully_shard.state(layer) for layer in model.layers]
    root = fully_shard.state(model)
    # recurse=False touches only that module's state.
    root.set_requires_gradient_sync(False, recurse=False)
    assert not root.requires_gradient_sync and all(s.requires_gradient_sync for s in layer_states)
    with count_collectives() as comm:
        lm_loss(model, batch_for(0, world_size, rank)).backward()
    assert comm.counts["reduce_scatter"] == 2, comm.render()  # the layers still reduce
    root.set_requires_gradient_sync(True)
    # no_sync restores each state's previous setting, even after an exception.
    fully_shard.state(model.layers[0]).set_requires_gradient_sync(False)
    with pytest.raises(KeyError):
        with no_sync(model):
            assert not any(s.requires_gradient_sync for s in [root, *layer_states])
            raise KeyError("inside")
    assert [s.requires_gradient_sync for s in [root, *layer_states]] == [True, False, True]
    # Bad arguments raise at the call.
    with pytest.raises(TypeError, match="set_requires_gradient_sync.*'requires_gradient_sync'"):
        set_requires_gradient_sync(model, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no_sync.*'module'"):
        no_sync(object())  # type: ignore[arg-type]


def test_toggle_scope_and_restore() -> None:
    """recurse=False, no_sync restoring previous flags, bad arguments."""
    run_on_ranks(_toggle_scope, 2)


# ----------------------------------------------------------------------------- HSDP: defer all-reduce


def _hsdp_defer_all_reduce(rank: int, world_size: int, offload: bool) -> None:
    model = _build(HYBRID, offload, world_size)
    torch.manual_seed(0)
    ref = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    state = fully_shard.state(model)
    micro = 4
    for step in range(STEPS):
        for i in range(micro):
            last = i == micro - 1
            # Reduce-scatter every micro-step (only sharded gradients are held); all-reduce
            # across replicas once, on the last.
            state.set_requires_all_reduce(last)
            with count_collectives() as comm:
                lm_loss(model, batch_for(100 * step + i, world_size, rank)).backward()
            lm_loss(ref, batch_for(100 * step + i, world_size, None)).backward()
            assert comm.counts["reduce_scatter"] == 3, comm.render()
            assert comm.counts["all_reduce"] == (3 if last else 0), comm.render()
            # The all-reduce runs over the replica group only (ranks r and r + 2).
            groups = {r.group for r in comm.records if r.kind == "all_reduce"}
            assert groups <= {f"g[{rank % 2},{rank % 2 + 2}]"}, groups
        step_and_compare(model, ref, opt, ref_opt, f"step {step} accumulated")
    with pytest.raises(TypeError, match="set_requires_all_reduce.*'requires_all_reduce'"):
        state.set_requires_all_reduce("no")  # type: ignore[arg-type]


@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "offload"])
def test_hsdp_defer_all_reduce(offload: bool) -> None:
    """HSDP `set_requires_all_reduce(False)`: reduce-scatter still runs every micro-step, the
    replica all-reduce once at the end; the result equals the reference."""
    run_on_ranks(_hsdp_defer_all_reduce, 4, offload)


def _hsdp_defer_mixed_with_no_sync(rank: int, world_size: int) -> None:
    """no_sync micro-steps, then deferred-all-reduce micro-steps, then a full one."""
    model = _build(HYBRID, False, world_size)
    torch.manual_seed(0)
    ref = TinyTransformer()
    state = fully_shard.state(model)
    plan = [("no_sync", 0, 0), ("defer", 3, 0), ("no_sync", 0, 0), ("defer", 3, 0), ("full", 3, 3)]
    for i, (mode, rs, ar) in enumerate(plan):
        state.set_requires_all_reduce(mode != "defer")
        loss = lm_loss(model, batch_for(i, world_size, rank))
        with count_collectives() as comm:
            if mode == "no_sync":
                with no_sync(model):
                    loss.backward()
            else:
                loss.backward()
        lm_loss(ref, batch_for(i, world_size, None)).backward()
        assert (comm.counts["reduce_scatter"], comm.counts["all_reduce"]) == (rs, ar), (mode, comm.render())
    for name, p in model.named_parameters():
        assert_close_tensors(p.grad, ref.get_parameter(name).grad, msg=f"accumulated grad {name}")


def test_hsdp_defer_all_reduce_with_no_sync() -> None:
    run_on_ranks(_hsdp_defer_mixed_with_no_sync, 4)


# ----------------------------------------------------------------------------- mixed precision


def _no_sync_mixed_precision(
    rank: int,
    world_size: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype | None,
    pattern: str,
    api: str = "fully_shard",
) -> None:
    """Against PyTorch FSDP2 with the same policy and the same sync pattern, bit for bit.
    With bf16 compute and fp32 reduction, no-sync gradients must accumulate in fp32 (as
    FSDP2 does), not be rounded to bf16 every micro-step. NO_SHARD and `replicate` are
    compared with FSDP2's HSDP on a (world, 1) mesh: replicated over every rank, and the same
    mixed-precision semantics."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from composable import MixedPrecisionPolicy, replicate

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    torch.manual_seed(0)
    ours = TinyTransformer()
    for m in [*ours.layers, ours]:
        if api == "replicate":
            replicate(m, mp_policy=mp)
        else:
            fully_shard(m, mp_policy=mp, strategy=NO_SHARD if api == "NO_SHARD" else None)
    mesh = init_device_mesh(
        "cpu",
        (world_size,) if api == "fully_shard" else (world_size, 1),
        mesh_dim_names=("dp",) if api == "fully_shard" else ("replicate", "shard"),
    )
    torch.manual_seed(0)
    theirs = TinyTransformer()
    for m in [*theirs.layers, theirs]:
        torch_fully_shard(m, mesh=mesh, mp_policy=TorchMP(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(STEPS):
        for i, sync in enumerate(PATTERNS[pattern]):
            tokens = batch_for(100 * step + i, world_size, rank)
            _micro_step(ours, "no_sync", sync, tokens)
            theirs.set_requires_gradient_sync(sync)
            lm_loss(theirs, tokens).backward()
        # Replicated groups follow DDP: a no-sync sum on top of an already reduced, not yet
        # zeroed gradient is reduced together with it (avg(prev + new), not prev + avg(new)):
        # the same value up to one rounding, so those compare with a tolerance of an ulp or so.
        step_and_match(
            ours,
            theirs,
            opts,
            f"step {step}",
            exact=api == "fully_shard",
            grad_tol={"rtol": 1e-6, "atol": 1e-7},
            param_tol={"rtol": 1e-5, "atol": 1e-6},
            grad_word="accumulated grad",
        )


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize(
    "param_dtype, reduce_dtype",
    [(torch.bfloat16, torch.float32), (torch.bfloat16, None), (torch.float16, torch.float32)],
    ids=["bf16-reduce-fp32", "bf16", "fp16-reduce-fp32"],
)
def test_no_sync_mixed_precision_matches_torch_fsdp2(
    param_dtype: torch.dtype, reduce_dtype: torch.dtype | None, pattern: str
) -> None:
    run_on_ranks(_no_sync_mixed_precision, 2, param_dtype, reduce_dtype, pattern)


@pytest.mark.parametrize("api", ["NO_SHARD", "replicate"])
def test_no_sync_mixed_precision_replicated_matches_torch_fsdp2(api: str) -> None:
    run_on_ranks(_no_sync_mixed_precision, 2, torch.bfloat16, torch.float32, "nosync3-sync3-nosync3-sync1", api)


# ----------------------------------------------------------------------------- zero_grad after no_sync

ZERO_PLANS = {  # (kind, micro-batch): "nosync"/"sync" backward, "zero" optimizer.zero_grad()
    "nosync-zero-sync": [("nosync", 0), ("zero", None), ("sync", 1)],
    "nosync-zero-nosync-sync": [("nosync", 0), ("nosync", 1), ("zero", None), ("nosync", 2), ("sync", 3)],
    "sync-nosync-zero-sync": [("sync", 0), ("nosync", 1), ("zero", None), ("sync", 2)],
    "nosync-sync-kept": [("nosync", 0), ("sync", 1)],  # no zero_grad: both micro-batches count
    "zero-between-forward-and-backward": [("nosync", 0), ("fwd-zero-sync", 1)],
}


def _zero_grad_after_no_sync(
    rank: int,
    world_size: int,
    plan: str,
    set_to_none: bool,
    strategy: ShardingStrategy,
    param_dtype: torch.dtype | None,
) -> None:
    """The model runs `plan`; a twin of it runs only what follows the last zero_grad and must
    end bit for bit equal; a single-process fp32 reference runs `plan` too (fp32 only)."""
    from composable import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = TinyTransformer()
        for m in [*model.layers, model]:
            fully_shard(m, mesh=mesh, strategy=strategy, mp_policy=mp)
        models.append(model)
    model, twin = models
    torch.manual_seed(0)
    ref = TinyTransformer()
    opt, twin_opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin, ref))
    steps = ZERO_PLANS[plan]
    last_zero = max([i for i, (kind, _) in enumerate(steps) if "zero" in kind], default=-1)
    for n, (kind, i) in enumerate(steps):
        if kind == "zero":
            opt.zero_grad(set_to_none=set_to_none)
            ref_opt.zero_grad(set_to_none=set_to_none)
            continue
        loss = lm_loss(model, batch_for(i, world_size, rank))
        if kind == "fwd-zero-sync":  # `loss = model(x); opt.zero_grad(); loss.backward()`
            opt.zero_grad(set_to_none=set_to_none)
            ref_opt.zero_grad(set_to_none=set_to_none)
        with no_sync(model) if kind == "nosync" else contextlib.nullcontext():
            loss.backward()
        lm_loss(ref, batch_for(i, world_size, None)).backward()
        if n >= last_zero:
            twin_loss = lm_loss(twin, batch_for(i, world_size, rank))
            with no_sync(twin) if kind == "nosync" else contextlib.nullcontext():
                twin_loss.backward()
    for name, p in model.named_parameters():
        assert_close_tensors(p.grad, twin.get_parameter(name).grad, exact=True, msg=f"{plan}: grad {name} vs twin")
        if param_dtype is None:
            assert_close_tensors(p.grad.full_tensor(), ref.get_parameter(name).grad, msg=f"{plan}: grad {name}")
    for o in (opt, twin_opt, ref_opt):
        o.step()
    for name, p in model.named_parameters():
        assert_close_tensors(p, twin.get_parameter(name), exact=True, msg=f"{plan}: param {name} vs twin")
        if param_dtype is None:
            assert_close_tensors(p.full_tensor(), ref.get_parameter(name), msg=f"{plan}: param {name}")


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("plan", list(ZERO_PLANS))
def test_zero_grad_after_no_sync_drops_the_accumulated_sums(plan: str, set_to_none: bool) -> None:
    """optimizer.zero_grad() (either kind) after a no_sync backward discards what no_sync
    accumulated, as in DDP; without zero_grad the sums are kept."""
    run_on_ranks(_zero_grad_after_no_sync, 2, plan, set_to_none, FULL, None)


@pytest.mark.parametrize(
    "strategy, param_dtype",
    [(GRAD_OP, None), (FULL, torch.bfloat16), (NO_SHARD, None)],
    ids=["SHARD_GRAD_OP", "bf16-reduce-fp32", "NO_SHARD"],
)
def test_zero_grad_after_no_sync_other_layouts(strategy: ShardingStrategy, param_dtype: torch.dtype | None) -> None:
    """The same with stashed (widened) sums and with replicated groups."""
    for set_to_none in (True, False):
        run_on_ranks(_zero_grad_after_no_sync, 2, "nosync-zero-nosync-sync", set_to_none, strategy, param_dtype)
