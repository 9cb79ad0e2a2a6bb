"""`MixedPrecisionPolicy(param_dtype_override_fn=...)`: some parameters of a group keep their
own dtype (norms in fp32 among bf16 weights) while the rest compute in `param_dtype`.

- on every torch: against a single-process reference that computes each parameter in the
  dtype the override gives it and reduces as the policy says, bit for bit;
- where the installed PyTorch FSDP2 has the field (torch >= 2.15): against FSDP2 with the
  same policy, bit for bit;
- bad answers of the override raise at the call.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, run_on_ranks, step_and_match, trace_collectives
from _models import TinyTransformer, batch_for, lm_loss
from _training import shard_transformer
from torch.distributed.device_mesh import init_device_mesh

from composable import MixedPrecisionPolicy, fully_shard, replicate
from composable._engine.grads.grad_dtype import FOLLOWS_GRAD_DTYPE, default_reduce_dtype

bf16, fp32 = torch.bfloat16, torch.float32
STEPS = 3


class _Fp32Norm(nn.LayerNorm):
    """LayerNorm computing in its parameters' dtype and answering in its input's (the usual
    shape of norms kept in fp32 among bf16 weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


def _model() -> TinyTransformer:
    """TinyTransformer whose norms are `_Fp32Norm`s with their parameters marked `keep`."""
    model = TinyTransformer()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.LayerNorm:
                norm = _Fp32Norm(child.normalized_shape)
                norm.load_state_dict(child.state_dict())
                for p in norm.parameters():
                    p.keep = True  # type: ignore[attr-defined]
                setattr(parent, name, norm)
    return model


def _keep_norms(param: nn.Parameter) -> torch.dtype | None:
    """The norms' parameters keep their own dtype (fp32); the rest use param_dtype."""
    return param.dtype if getattr(param, "keep", False) else None


def _torch_has_override() -> bool:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    return "param_dtype_override_fn" in getattr(TorchMP, "__dataclass_fields__", {})


# ----------------------------------------------------------------------------- reference


def _reference_step(ref: nn.Module, step: int, world_size: int, reduce: torch.dtype) -> list[torch.Tensor]:
    """Single-process data parallelism: per rank, a copy of `ref` whose parameters compute in
    the override's dtype (norms in fp32, the rest in bf16), gradients cast to `reduce`,
    averaged (fp32: sum then divide; bf16: halve then sum) and cast back to fp32."""
    sums, losses = None, []
    for r in range(world_size):
        compute = copy.deepcopy(ref)
        for name, p in compute.named_parameters():  # (a deep copy loses the marks: by name)
            if "norm" not in name:
                p.data = p.data.to(bf16)
            if FOLLOWS_GRAD_DTYPE and reduce.itemsize < p.dtype.itemsize:
                p.grad_dtype = reduce  # as FSDP2 >= 2.15: autograd casts each contribution
        loss = lm_loss(compute, batch_for(step, world_size, r))
        loss.backward()
        losses.append(loss.detach())
        pre = world_size if reduce == bf16 else 1
        grads = [p.grad.to(reduce) / pre for p in compute.parameters()]
        sums = grads if sums is None else [s + g for s, g in zip(sums, grads)]
    for p, s in zip(ref.parameters(), sums):
        p.grad = (s / (1 if reduce == bf16 else world_size)).to(fp32)
    return losses


def _against_reference(rank: int, world_size: int, reduce_dtype: torch.dtype | None) -> None:
    mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=reduce_dtype, param_dtype_override_fn=_keep_norms)
    torch.manual_seed(0)
    ref = _model()
    torch.manual_seed(0)
    model = shard_transformer(_model(), mp_policy=mp)  # (a deep copy would lose the marks)
    seen: dict[str, torch.dtype] = {}
    block = model.layers[0]
    block.norm1.register_forward_pre_hook(lambda m, a: seen.update(norm=m.weight.dtype, inp=a[0].dtype))
    block.qkv.register_forward_pre_hook(lambda m, a: seen.update(qkv=m.weight.dtype, qkv_bias=m.bias.dtype))
    block.norm1.register_forward_hook(lambda m, a, out: seen.update(out=out.dtype))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    reduce = reduce_dtype or default_reduce_dtype(bf16, fp32)
    for step in range(STEPS):
        with trace_collectives() as t:
            loss = lm_loss(model, batch_for(step, world_size, rank))
            loss.backward()
        # As without the override: one all-gather per group, again in backward for the blocks
        # (in fp32: the parameters' own dtype), one reduce-scatter per group.
        assert {str(r.dtype) for r in t.records if r.kind == "all_gather"} == {str(fp32)}, t.render()
        assert {str(r.dtype) for r in t.records if r.kind == "reduce_scatter"} == {str(reduce)}, t.render()
        assert (t.counts["all_gather"], t.counts["reduce_scatter"]) == (5, 3), t.render()
        # Inputs are still cast to param_dtype (bf16); the norms' parameters are fp32.
        assert seen == {"norm": fp32, "inp": bf16, "out": bf16, "qkv": bf16, "qkv_bias": bf16}, seen
        ref_losses = _reference_step(ref, step, world_size, reduce)
        assert_close_tensors(loss.detach(), ref_losses[rank], exact=True, msg=f"step {step} loss")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.dtype == p.grad.dtype == fp32, name
            assert_close_tensors(p.grad, q.grad, exact=True, msg=f"step {step} grad {name}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("reduce_dtype", [None, fp32, bf16], ids=["reduce-default", "reduce-fp32", "reduce-bf16"])
def test_override_matches_reference(reduce_dtype: torch.dtype | None) -> None:
    """Kept parameters compute in fp32, the others in bf16, inputs cast to bf16; losses and
    gradients equal a single-process reference doing the same arithmetic."""
    run_on_ranks(_against_reference, 2, reduce_dtype)


# ----------------------------------------------------------------------------- FSDP2 parity


def _against_fsdp2(rank: int, world_size: int, reduce_dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ours = shard_transformer(
        _model(),
        mp_policy=MixedPrecisionPolicy(
            param_dtype=bf16, reduce_dtype=reduce_dtype, param_dtype_override_fn=_keep_norms
        ),
        mesh=mesh,
    )
    torch.manual_seed(0)
    theirs = _model()
    policy = TorchMP(param_dtype=bf16, reduce_dtype=reduce_dtype, param_dtype_override_fn=_keep_norms)
    for m in [*theirs.layers, theirs]:
        torch_fully_shard(m, mesh=mesh, mp_policy=policy)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(STEPS):
        tokens = batch_for(step, world_size, rank)
        losses = []
        for model in (ours, theirs):
            loss = lm_loss(model, tokens)
            loss.backward()
            losses.append(loss.detach())
        assert_close_tensors(losses[0], losses[1], exact=True, msg=f"step {step} loss")
        step_and_match(ours, theirs, opts, f"step {step}")


@pytest.mark.skipif(not _torch_has_override(), reason="the installed FSDP2 has no param_dtype_override_fn")
@pytest.mark.parametrize("reduce_dtype", [None, fp32, bf16], ids=["reduce-default", "reduce-fp32", "reduce-bf16"])
def test_override_matches_torch_fsdp2(reduce_dtype: torch.dtype | None) -> None:
    """Same losses, gradients and parameters as FSDP2 with the same override, bit for bit."""
    run_on_ranks(_against_fsdp2, 2, reduce_dtype)


# ----------------------------------------------------------------------------- uniform answers, errors


def _uniform(rank: int, world_size: int) -> None:
    # Every parameter kept: the group gathers and computes in fp32, as without param_dtype.
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    keep_all = MixedPrecisionPolicy(
        param_dtype=bf16, cast_forward_inputs=False, param_dtype_override_fn=lambda p: p.dtype
    )
    fully_shard(model, mp_policy=keep_all)
    seen = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    with trace_collectives() as t:
        model(torch.randn(2, 4)).sum().backward()
    assert seen == [fp32] and {str(r.dtype) for r in t.records} == {str(fp32)}, (seen, t.render())
    # Bad answers raise at the call, naming the API, the argument and the parameter.
    for fn, exc, match in [
        (
            lambda p: torch.float16,
            ValueError,
            r"fully_shard: 'param_dtype_override_fn' must return None, .*float16.*'0.weight'",
        ),
        (
            lambda p: "bf16",
            TypeError,
            r"fully_shard: 'param_dtype_override_fn' must return a torch.dtype or None, got 'bf16'",
        ),
    ]:
        with pytest.raises(exc, match=match):
            fully_shard(
                nn.Sequential(nn.Linear(2, 2)),
                mp_policy=MixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn=fn),
            )
    # A group of parameters in different dtypes is not supported by replicate (yet).
    with pytest.raises(NotImplementedError, match=r"replicate: parameters of one group in different dtypes"):
        replicate(_model(), mp_policy=MixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn=_keep_norms))


def test_uniform_override_and_errors() -> None:
    run_on_ranks(_uniform, 2)


def test_override_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"MixedPrecisionPolicy: 'param_dtype_override_fn' must be a callable"):
        MixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn=bf16)  # type: ignore[arg-type]
