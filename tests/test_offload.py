"""CPU offload (`CPUOffloadPolicy`): sharded parameters and gradients live on the CPU, the
optimizer steps there, training is identical to training without offload and, bit for bit, to
PyTorch FSDP2's `CPUOffloadPolicy`; a DCP checkpoint resumes bit for bit.

On this CPU-only machine the compute device is the CPU as well, so the copies are no-ops, but
the offload code paths (storage placement, pinning decisions, gradient copy-back) still run;
in particular the default `pin_memory=True` must not fail without an accelerator (PyTorch
FSDP2 does). The GPU variants (1 and 2 GPUs, NCCL) check parameters and gradients on the CPU
(pinned: copied there as they are reduced) with compute on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, count_collectives, requires_gpus, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from composable import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    clip_grad_norm_,
    fully_shard,
)

STEPS = 3


def _wrap(model: TinyTransformer, **kwargs: object) -> TinyTransformer:
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _train_pair(
    rank: int,
    world_size: int,
    device: str,
    mp: MixedPrecisionPolicy,
    strategy: ShardingStrategy,
    pin_memory: bool = True,
    compute_shard_on_device: bool = False,
) -> None:
    """The same model with and without offload: identical losses, gradients and parameters
    over several SGD steps; with offload everything the optimizer touches is on the CPU."""
    mesh = init_device_mesh(device, (world_size,))
    models = []
    policy = CPUOffloadPolicy(pin_memory=pin_memory, compute_shard_on_device=compute_shard_on_device)
    for offload in (OffloadPolicy(), policy):
        torch.manual_seed(0)
        models.append(_wrap(TinyTransformer(), mesh=mesh, mp_policy=mp, strategy=strategy, offload_policy=offload))
    plain, offloaded = models
    assert fully_shard.state(offloaded).offload_policy == policy
    for name, p in offloaded.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu" and p.to_local().device.type == "cpu", name
        if not torch.cuda.is_available():  # pinning needs an accelerator: skipped, no failure
            assert not p.to_local().is_pinned(), name
        elif device == "cuda":  # pinned for asynchronous host-to-device copies
            assert p.to_local().is_pinned() == pin_memory, name
    for name, p in plain.named_parameters():
        assert p.device.type == device, name
    compute_dtype = mp.param_dtype or torch.float32
    seen: list[tuple[str, torch.dtype]] = []
    offloaded.layers[0].qkv.register_forward_pre_hook(lambda m, a: seen.append((m.weight.device.type, m.weight.dtype)))
    # SGD with momentum (its state must live on the CPU too). Not Adam: on CUDA the offloaded
    # optimizer steps on the CPU and the other on the GPU, 1-ulp apart, and Adam would blow that
    # up on the exactly-zero key-bias gradients. On the CPU the kernels are the same: identical.
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in models]
    tol = (
        {"exact": True}
        if device == "cpu"
        else {"rtol": 1e-4, "atol": 1e-5}
        if mp.param_dtype is None
        else {"rtol": 2e-2, "atol": 2e-3}
    )
    for step in range(STEPS):
        tokens = batch_for(step, world_size, rank).to(device)
        losses = []
        for model in models:
            with count_collectives() as comm:
                loss = lm_loss(model, tokens)
                loss.backward()
            losses.append(loss.detach().cpu())
            if world_size > 1:  # one rank reduces with no collective
                assert comm.counts["reduce_scatter" if strategy is not ShardingStrategy.NO_SHARD else "all_reduce"] == 3
        # Computation happened on the compute device, in the compute dtype.
        assert seen[-1] == (device, compute_dtype), seen
        assert_close_tensors(losses[0], losses[1], **(tol if step else {"exact": True}), msg=f"step {step} loss")
        for (name, p), q in zip(offloaded.named_parameters(), plain.parameters()):
            assert p.grad.device.type == "cpu" and p.grad.dtype == p.dtype, name
            if device == "cuda":  # pinned: copied to the host as they were reduced, overlapping backward
                assert p.grad.to_local().is_pinned() == pin_memory, name
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            assert_close_tensors(
                p.grad.full_tensor().to(device),
                q.grad,
                **(tol if step else {"exact": True}),
                msg=f"step {step} grad {name}",
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(offloaded.named_parameters(), plain.parameters()):
            assert p.device.type == "cpu", name
            assert_close_tensors(p.full_tensor().to(device), q, **tol, msg=f"step {step} param {name}")
    # The optimizer state lives where the sharded parameters do: on the CPU.
    for p in offloaded.parameters():
        for value in opts[1].state[p].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device.type == "cpu" and isinstance(value, DTensor)


@pytest.mark.parametrize(
    "strategy",
    [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
    ids=lambda s: s.name,
)
@pytest.mark.parametrize(
    "mp",
    [MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)],
    ids=["fp32", "bf16"],
)
def test_offload_parity_cpu(mp: MixedPrecisionPolicy, strategy: ShardingStrategy) -> None:
    """CPU offload with the default pin_memory=True on a machine without an accelerator:
    no failure, no pinning, parameters/grads/optimizer state on the CPU, identical training."""
    run_on_ranks(_train_pair, 2, "cpu", mp, strategy)


def test_offload_without_pinning_cpu() -> None:
    run_on_ranks(_train_pair, 2, "cpu", MixedPrecisionPolicy(), ShardingStrategy.FULL_SHARD, False)


def _offload_hsdp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    model = _wrap(TinyTransformer(), mesh=mesh, offload_policy=CPUOffloadPolicy())
    torch.manual_seed(0)
    ref = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(STEPS):
        lm_loss(model, batch_for(step, world_size, rank)).backward()
        lm_loss(ref, batch_for(step, world_size, None)).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for name, p in model.named_parameters():
            assert p.device.type == "cpu"
            assert_close_tensors(p, ref.get_parameter(name), msg=f"step {step} param {name}")


def test_offload_hsdp_cpu() -> None:
    """Offload composes with HSDP (2x2 mesh): equal to the single-process reference."""
    run_on_ranks(_offload_hsdp, 4)


def _checkpoint_resume(rank: int, world_size: int, path: str) -> None:
    """A DCP checkpoint of an offloaded run (parameters and AdamW state on the host) resumes bit
    for bit as the run that never stopped, and loads into a run without offload too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = init_device_mesh("cpu", (world_size,))

    def build(offload: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        model = _wrap(TinyTransformer(), mesh=mesh, offload_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        lm_loss(model, batch_for(step, world_size, rank)).backward()
        clip_grad_norm_(model.parameters(), max_norm=0.05)
        opt.step()
        opt.zero_grad()

    model, opt = build(offload=True)
    for step in range(2):
        train(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = [p.full_tensor().clone() for p in model.parameters()]
    train(model, opt, 2)
    for offload in (True, False):
        resumed, resumed_opt = build(offload)
        msd, osd = get_state_dict(resumed, resumed_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for p, q in zip(resumed.parameters(), saved):
            assert p.to_local().device.type == "cpu" and torch.equal(p.full_tensor(), q)
        if offload:  # the same step on the same host kernels: the same bits
            train(resumed, resumed_opt, 2)
            for (name, p), q in zip(resumed.named_parameters(), model.parameters()):
                assert torch.equal(p.to_local(), q.to_local()), f"resumed: {name}"


def test_checkpoint_resumes_bit_for_bit(tmp_path: Path) -> None:
    run_on_ranks(_checkpoint_resume, 2, str(tmp_path))


def _against_fsdp2(rank: int, world_size: int, compute_shard_on_device: bool) -> None:
    """composable's and PyTorch FSDP2's CPUOffloadPolicy on the same model, AdamW and clipping:
    the same losses, parameters and optimizer state, bit for bit, every step (also with
    composable's compute-dtype shard kept on the device, bf16 compute)."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if compute_shard_on_device else {}
    torch.manual_seed(0)
    ours = _wrap(
        TinyTransformer(),
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(**dtypes),
        offload_policy=CPUOffloadPolicy(compute_shard_on_device=compute_shard_on_device),
    )
    torch.manual_seed(0)
    theirs = TinyTransformer()
    their_mp = TorchMixedPrecisionPolicy(**dtypes)
    for layer in theirs.layers:  # FSDP2 pins the host shards, which needs an accelerator
        torch_fully_shard(layer, mesh=mesh, mp_policy=their_mp, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    torch_fully_shard(theirs, mesh=mesh, mp_policy=their_mp, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    models = [ours, theirs]
    # Fused in the on-device variant: its writes bump no version counter, and the device copy
    # must follow them all the same.
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=compute_shard_on_device) for m in models]
    for step in range(STEPS):
        losses = []
        for model, opt in zip(models, opts):
            loss = lm_loss(model, batch_for(step, world_size, rank))
            loss.backward()
            clip_grad_norm_(model.parameters(), max_norm=0.05)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step} loss"
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), f"step {step} parameter {name}"
            for key, value in opts[0].state[p].items():
                other = opts[1].state[q][key]
                local = value.to_local() if isinstance(value, DTensor) else value
                assert torch.equal(local, other.to_local() if isinstance(other, DTensor) else other), (name, key)


@pytest.mark.parametrize("compute_shard_on_device", [False, True], ids=["host", "on_device"])
def test_offload_equals_fsdp2_offload_bit_for_bit(compute_shard_on_device: bool) -> None:
    run_on_ranks(_against_fsdp2, 2, compute_shard_on_device)


def _host_copies(rank: int, world_size: int, strategy: ShardingStrategy) -> None:
    """`compute_shard_on_device=True`: each group's shard is copied from the host once per
    step (not again for backward's all-gather), and not at all in a forward after no change; any
    in-place write to a parameter (here outside the optimizer) reaches the next forward."""
    from composable._engine.hooks.contract import param_states

    mesh = init_device_mesh("cpu", (world_size,))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for policy in (OffloadPolicy(), CPUOffloadPolicy(compute_shard_on_device=True)):
        torch.manual_seed(0)
        models.append(_wrap(TinyTransformer(), mesh=mesh, mp_policy=bf16, strategy=strategy, offload_policy=policy))
    plain, offloaded = models
    groups = [g for state in param_states(offloaded) for g in state.groups]
    assert len(groups) == len(offloaded.layers) + 1

    def copies() -> int:
        return sum(g._device_copy.copies for g in groups)

    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    for step in range(STEPS):
        tokens = batch_for(step, world_size, rank)
        before = copies()
        losses = []
        for model, opt in zip(models, opts):
            loss = lm_loss(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step} loss"
        assert copies() - before == len(groups), f"step {step}: {copies() - before} copies from the host"
    with torch.no_grad():  # no step between two forwards: the second copies nothing
        lm_loss(offloaded, batch_for(0, world_size, rank))
        before = copies()
        lm_loss(offloaded, batch_for(0, world_size, rank))
        assert copies() == before
        for model in models:  # an in-place write outside the optimizer
            model.layers[0].qkv.weight.mul_(0.5)
        out = [lm_loss(model, batch_for(1, world_size, rank)) for model in models]
        assert copies() == before + 1 and torch.equal(out[0], out[1]), copies() - before


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
def test_compute_shard_on_device_copies_only_changed_shards(strategy: ShardingStrategy) -> None:
    run_on_ranks(_host_copies, 2, strategy)


def _bad_offload(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

    fully_shard(nn.Linear(2, 2), offload_policy=TorchCPUOffloadPolicy())  # FSDP2's policy is accepted
    for bad in ("cpu", True, CPUOffloadPolicy):
        with pytest.raises(TypeError, match=r"fully_shard: 'offload_policy' must be a composable.OffloadPolicy"):
            fully_shard(nn.Linear(2, 2), offload_policy=bad)  # type: ignore[arg-type]
    # The policies compare by value, so states can be inspected with ==.
    assert CPUOffloadPolicy() == CPUOffloadPolicy(pin_memory=True) != CPUOffloadPolicy(pin_memory=False)
    assert OffloadPolicy() == OffloadPolicy() != CPUOffloadPolicy()


def test_wrong_offload_policy_type_raises() -> None:
    """An offload policy of the wrong type (PyTorch's own, a string, the class) is a TypeError."""
    run_on_ranks(_bad_offload, 2)


# ----------------------------------------------------------------------------- GPU


@requires_gpus(2)
@pytest.mark.parametrize(
    "mp",
    [MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)],
    ids=["fp32", "bf16"],
)
def test_offload_parity_gpu(mp: MixedPrecisionPolicy) -> None:
    """Parameters and gradients pinned on the CPU, compute on CUDA; identical to no offload.
    The process group has a CPU backend too (as with PyTorch FSDP2's offload), so that DTensor
    ops on the CPU-resident shards (full_tensor, clip_grad_norm_) can communicate."""
    run_on_ranks(_train_pair, 2, "cuda", mp, ShardingStrategy.FULL_SHARD, backend="cpu:gloo,cuda:nccl")


@requires_gpus(1)
@pytest.mark.parametrize(
    ("pin_memory", "on_device"), [(True, False), (False, False), (True, True)], ids=["pinned", "pageable", "on_device"]
)
def test_offload_parity_one_gpu(pin_memory: bool, on_device: bool) -> None:
    """One GPU (where offload lets a model fit at all): bf16 compute, the gradients copied to
    pinned host memory as they are reduced (or, unpinned, at the end of backward), or the bf16
    shard kept on the GPU between steps; identical to no offload."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    run_on_ranks(
        _train_pair, 1, "cuda", bf16, ShardingStrategy.FULL_SHARD, pin_memory, on_device, backend="cpu:gloo,cuda:nccl"
    )


def _default_mesh_gpu(rank: int, world_size: int) -> None:
    # A model built on the CPU (as one does for offload) with a mixed CPU/CUDA process group:
    # the default mesh must still be a CUDA mesh, so compute runs on the GPU.
    model = fully_shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy())
    assert fully_shard.state(model).mesh.device_type == "cuda"
    assert model.weight.to_local().device.type == "cpu"
    out = model(torch.randn(2, 4, device="cuda"))
    assert out.device.type == "cuda"
    out.sum().backward()
    assert model.weight.grad.to_local().device.type == "cpu"


@requires_gpus(2)
def test_offload_default_mesh_gpu() -> None:
    run_on_ranks(_default_mesh_gpu, 2, backend="cpu:gloo,cuda:nccl")


def _init_on_host(rank: int, world_size: int) -> None:
    """The main job's model built on meta, sharded with and without offload, materialised (the
    offloaded one on the host) and initialised from the same seed: the same weights, and no two
    layers alike (DTensor's RNG region would otherwise repeat host draws: model.init_random)."""
    from models.model import Transformer, get_config

    cfg = get_config("tiny")
    models = []
    for policy in (OffloadPolicy(), CPUOffloadPolicy()):
        with torch.device("meta"):
            model = Transformer(cfg)
        for block in model.layers:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        model.to_empty(device="cpu" if isinstance(policy, CPUOffloadPolicy) else "cuda")
        torch.manual_seed(0)
        model.init_weights(buffer_device="cuda")
        models.append(model)
    plain, offloaded = models
    for (name, p), q in zip(offloaded.named_parameters(), plain.parameters()):
        assert p.to_local().device.type == "cpu", name
        assert torch.equal(p.full_tensor().cpu(), q.full_tensor().cpu()), name
    first, second = (block.attention.wo.weight.full_tensor() for block in offloaded.layers[:2])
    assert not torch.equal(first, second), "two layers initialised alike"


@requires_gpus(1)
def test_offloaded_weights_initialise_as_without_offload() -> None:
    run_on_ranks(_init_on_host, 1, backend="cpu:gloo,cuda:nccl")


def _backward_peak(rank: int, world_size: int, n_layers: int) -> int:
    """The peak GPU memory of one backward above what the device held before its forward, for
    a stack of `n_layers` 1024 x 1024 layers, each its own pinned-offload fully_shard group."""
    mesh = init_device_mesh("cuda", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(n_layers)]).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    x = torch.randn(16, 1024, device="cuda")
    model(x).sum().backward()  # the lazy init's allocations first
    model.zero_grad()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model(x).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@requires_gpus(1)
def test_pinned_offload_frees_each_reduced_gradient_on_the_device_once_copied() -> None:
    """With pinned offload each group's reduced gradients go to the host as they are reduced; the
    GPU's copy is freed then, not at the end of backward, so backward's peak does not grow with
    the number of groups (it grew by 4 MiB, a layer's fp32 gradient, per layer)."""
    small, large = (run_on_ranks(_backward_peak, 1, n, backend="cpu:gloo,cuda:nccl")[0] for n in (4, 12))
    assert large - small < 16 * 2**20, f"backward's peak grew by {(large - small) / 2**20:.1f} MiB for 8 more layers"
