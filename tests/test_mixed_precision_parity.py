"""Numerical parity of mixed precision and pure fp16 under `fully_shard`.

- parity with PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) under the same policy,
  bf16 and fp16, on CPU gloo world 2: same losses and parameters over several Adam steps.
- pure fp16 (`model.half()` before or after `fully_shard`) and mixed policies on an fp16
  model, against a single-process reference that reduces exactly as the policy says.

Which dtype is used where, and bad policies, are in test_mixed_precision.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, requires_gpus, run_on_ranks, step_and_match, trace_collectives
from _models import TinyTransformer, batch_for, lm_loss
from _training import shard_transformer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from composable import CPUOffloadPolicy, MixedPrecisionPolicy
from composable._engine.grads.grad_dtype import FOLLOWS_GRAD_DTYPE, default_reduce_dtype

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
STEPS = 3


# ----------------------------------------------------------------------------- helpers


def _shard_torch(
    model: TinyTransformer, mp: MixedPrecisionPolicy, layer_mp: MixedPrecisionPolicy | None = None, **kwargs: Any
) -> TinyTransformer:
    """`shard_transformer(model, layer_mp, mp_policy=mp)` with PyTorch FSDP2 and its own
    MixedPrecisionPolicy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def conv(p: MixedPrecisionPolicy) -> TorchMP:
        return TorchMP(
            param_dtype=p.param_dtype,
            reduce_dtype=p.reduce_dtype,
            output_dtype=p.output_dtype,
            cast_forward_inputs=p.cast_forward_inputs,
        )

    for layer in model.layers:
        torch_fully_shard(layer, mp_policy=conv(layer_mp or mp), **kwargs)
    return torch_fully_shard(model, mp_policy=conv(mp), **kwargs)


# ----------------------------------------------------------------------------- parity with FSDP2


def _parity_with_fsdp2(
    rank: int, world_size: int, mp: MixedPrecisionPolicy, layer_mp: MixedPrecisionPolicy | None, device: str = "cpu"
) -> None:
    # An explicit mesh: FSDP2's default is a CUDA mesh wherever CUDA exists, even under gloo.
    mesh = init_device_mesh(device, (world_size,))
    torch.manual_seed(0)
    ours = shard_transformer(TinyTransformer().to(device), layer_mp, mp_policy=mp, mesh=mesh)
    torch.manual_seed(0)
    theirs = _shard_torch(TinyTransformer().to(device), mp, layer_mp, mesh=mesh)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(STEPS):
        tokens = batch_for(step, world_size, rank).to(device)
        losses = []
        for model, opt in zip((ours, theirs), opts):
            loss = lm_loss(model, tokens)
            loss.backward()
            losses.append(loss.detach())
        # Gradients first: they isolate the reduction from the optimizer.
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert p.grad.dtype == q.grad.dtype == p.dtype, name
            assert_close_tensors(p.grad, q.grad, exact=True, msg=f"step {step} grad {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_close_tensors(losses[0], losses[1], exact=True, msg=f"step {step} loss")
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert_close_tensors(p, q, exact=True, msg=f"step {step} param {name}")


@pytest.mark.parametrize(
    "mp, layer_mp",
    [
        (MixedPrecisionPolicy(param_dtype=bf16), None),
        (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), None),
        (MixedPrecisionPolicy(param_dtype=fp16), None),
        (MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32), None),
        (MixedPrecisionPolicy(reduce_dtype=bf16), None),  # fp32 compute, bf16 reduction
        # output_dtype on the root only (blocks feeding bf16 to a bf16 root norm).
        (
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32),
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
        ),
        # Nested: fp32 root (embeddings, norm, head) around fp16 blocks.
        (MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32, output_dtype=fp32)),
    ],
    ids=[
        "bf16",
        "bf16-reduce-fp32",
        "fp16",
        "fp16-reduce-fp32",
        "reduce-bf16-only",
        "bf16-output-fp32",
        "nested-fp16-in-fp32",
    ],
)
def test_parity_with_torch_fsdp2(mp: MixedPrecisionPolicy, layer_mp: MixedPrecisionPolicy | None) -> None:
    """Same losses, gradients and parameters as FSDP2 with the same policy, bit for bit."""
    run_on_ranks(_parity_with_fsdp2, 2, mp, layer_mp)


@requires_gpus(2)
@pytest.mark.parametrize("dtype", [bf16, fp16])
def test_parity_with_torch_fsdp2_gpu(dtype: torch.dtype) -> None:
    """The same on 2 GPUs with NCCL (which averages natively where gloo cannot)."""
    run_on_ranks(
        _parity_with_fsdp2, 2, MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32), None, "cuda", backend="nccl"
    )


# ----------------------------------------------------------------------------- pure fp16


def _reference_step(
    ref: nn.Module, step: int, world_size: int, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> list[torch.Tensor]:
    """One step of single-process data parallelism as the policy prescribes: per-rank forward/
    backward on `param_dtype` copies of `ref`'s parameters, gradients cast to the reduce dtype,
    averaged, cast back to `ref`'s dtype and set as `ref`'s gradients. Returns the losses."""
    own = next(ref.parameters()).dtype
    compute = copy.deepcopy(ref).to(param_dtype or own)
    reduce = reduce_dtype or default_reduce_dtype(param_dtype, own)
    if FOLLOWS_GRAD_DTYPE and reduce.itemsize < (param_dtype or own).itemsize:
        for p in compute.parameters():  # autograd casts each contribution (tied weights: two)
            p.grad_dtype = reduce
    # Half-precision reductions divide before summing (avoids overflow; PyTorch FSDP2 does the
    # same); this is exact except for subnormals, so the reference must do it too.
    pre, post = (world_size, 1) if reduce in (fp16, bf16) else (1, world_size)
    sums, losses = None, []
    for r in range(world_size):
        compute.zero_grad(set_to_none=True)
        loss = lm_loss(compute, batch_for(step, world_size, r))
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.to(reduce) / pre for p in compute.parameters()]
        sums = grads if sums is None else [s + g for s, g in zip(sums, grads)]
    for p, s in zip(ref.parameters(), sums):
        p.grad = (s / post).to(own)
    return losses


def _pure_fp16(
    rank: int,
    world_size: int,
    when: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    offload: bool,
) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    torch.manual_seed(0)
    ref = TinyTransformer().half()
    torch.manual_seed(0)
    model = TinyTransformer()
    if when == "before":
        model.half()
    kwargs = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    shard_transformer(model, mp_policy=mp, **kwargs)
    if when == "after":
        model.half()
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.dtype == fp16 and p.to_local().dtype == fp16, name
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gather_dtype = str(param_dtype or fp16)
    reduce_dtype_str = str(reduce_dtype or default_reduce_dtype(param_dtype, fp16))
    for step in range(STEPS):
        with trace_collectives() as t:
            loss = lm_loss(model, batch_for(step, world_size, rank))
            loss.backward()
        assert {str(r.dtype) for r in t.records if r.kind == "all_gather"} == {gather_dtype}, t.render()
        assert {str(r.dtype) for r in t.records if r.kind == "reduce_scatter"} == {reduce_dtype_str}, t.render()
        ref_losses = _reference_step(ref, step, world_size, param_dtype, reduce_dtype)
        for name, p in model.named_parameters():
            assert isinstance(p.grad, DTensor) and p.grad.dtype == fp16, name
        step_and_match(model, ref, (opt, ref_opt), f"step {step}", losses=(loss, ref_losses[rank]))


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(
    "param_dtype, reduce_dtype",
    [(None, None), (fp16, fp32), (fp32, None)],
    ids=["pure-fp16", "param-fp16-reduce-fp32", "param-fp32-on-fp16-model"],
)
def test_fp16_model(when: str, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
    """`model.half()` before or after fully_shard: fp16 DTensor params and grads, all-gather
    and reduce-scatter in the policy's dtypes, bit-identical to a single-process reference."""
    run_on_ranks(_pure_fp16, 2, when, param_dtype, reduce_dtype, False)


def test_fp16_model_with_cpu_offload() -> None:
    """The same with CPU offload (parameters and grads on the CPU, in fp16)."""
    run_on_ranks(_pure_fp16, 2, "after", fp16, fp32, True)
