"""`MixedPrecisionPolicy` under `fully_shard`: which dtype is used where.

- dtypes: unsharded parameters have `param_dtype` during forward (cast once per all-gather,
  not per use); sharded parameters, sharded gradients and optimizer state keep the
  parameter's own dtype; the reduce-scatter runs in `reduce_dtype`, else `param_dtype`,
  else the parameter's dtype; `output_dtype`; `cast_forward_inputs` over nested inputs;
  nested modules with different policies each apply their own.
- bad policies raise at the call.

Numerical parity (with PyTorch FSDP2, and of fp16 models with a single-process reference)
is in test_mixed_precision_parity.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import count_collectives, run_on_ranks, trace_collectives
from _models import TinyTransformer, batch_for, lm_loss
from _training import shard_transformer
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from composable import MixedPrecisionPolicy, fully_shard
from composable._engine.grads.grad_dtype import FOLLOWS_GRAD_DTYPE

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


# ----------------------------------------------------------------------------- dtypes


class _CastCounter(TorchDispatchMode):
    """Counts ops that turn a floating tensor of another dtype into a `dtype` tensor (casts)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.casts = dtype, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if (
            isinstance(out, torch.Tensor)
            and out.dtype == self.dtype
            and any(t.is_floating_point() and t.dtype != self.dtype for t in ins)
        ):
            self.casts += 1
        return out


class _Reuse(nn.Module):
    """Applies one Linear `uses` times: a per-use cast would show as `uses` casts."""

    def __init__(self, uses: int) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.uses = uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.uses):
            x = torch.tanh(self.lin(x))
        return x


def _dtypes_in_forward(rank: int, world_size: int) -> None:
    mp = MixedPrecisionPolicy(param_dtype=bf16)
    torch.manual_seed(0)
    model = shard_transformer(TinyTransformer(), mp_policy=mp)
    seen: dict[str, set] = {}

    def record(module: nn.Module, args: tuple) -> None:
        for name, p in module.named_parameters(recurse=False):
            seen.setdefault(name, set()).add((type(p).__name__, isinstance(p, DTensor), p.dtype, tuple(p.shape)))

    for sub in model.modules():
        sub.register_forward_pre_hook(record)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    lm_loss(model, batch_for(0, world_size, rank)).backward()
    # During forward every parameter is a plain, full-size bf16 tensor.
    for name, kinds in seen.items():
        assert all(not is_dt and dt == bf16 for _, is_dt, dt, _ in kinds), (name, kinds)
    # Outside forward: fp32 sharded DTensors with fp32 sharded DTensor gradients.
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.dtype == fp32 and p.to_local().dtype == fp32, name
        assert isinstance(p.grad, DTensor) and p.grad.dtype == fp32 and p.grad.placements == p.placements, name
        assert p.grad.to_local().shape == p.to_local().shape, name
    opt.step()
    for p in model.parameters():
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.dtype == fp32 and isinstance(value, DTensor)
        assert p.dtype == fp32

    # Cast once per all-gather, not per use: the number of casts to bf16 in forward does not
    # grow with the number of uses, and equals one per all-gather plus one for the input.
    counts = []
    for uses in (1, 4):
        torch.manual_seed(0)
        m = fully_shard(_Reuse(uses), mp_policy=mp)
        x = torch.randn(3, 6, requires_grad=True)
        with count_collectives() as comm, _CastCounter(bf16) as casts:
            out = m(x)
        assert out.dtype == bf16
        assert comm.counts["all_gather"] == 1
        counts.append(casts.casts)
    assert counts == [2, 2], counts


def test_param_dtype_in_forward_and_own_dtype_outside() -> None:
    """Unsharded parameters are bf16 in forward; sharded params, grads and Adam state fp32;
    casts happen once per all-gather."""
    run_on_ranks(_dtypes_in_forward, 2)


def _reduce_dtypes(rank: int, world_size: int, model_dtype: torch.dtype) -> list[tuple[str, str, str]]:
    """(policy, all-gather dtype, reduce-scatter dtype) for each policy, plus sharded-grad checks."""
    cases = [(None, None), (bf16, None), (bf16, fp32), (None, bf16), (fp16, bf16), (fp32, None), (fp16, fp32)]
    found = []
    for param_dtype, reduce_dtype in cases:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(model_dtype)
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
        with trace_collectives() as t:
            model(torch.randn(5, 4, dtype=model_dtype)).float().sum().backward()
        kinds = {r.kind: r.dtype for r in t.records}
        assert sorted(t.counts.items()) == [("all_gather", 1), ("reduce_scatter", 1)], t.render()
        for name, p in model.named_parameters():
            assert p.dtype == model_dtype and p.grad.dtype == model_dtype, (name, p.dtype, p.grad.dtype)
        found.append((f"{param_dtype}/{reduce_dtype}", str(kinds["all_gather"]), str(kinds["reduce_scatter"])))
    return found


@pytest.mark.parametrize("model_dtype", [fp32, fp16])
def test_reduce_dtype_semantics(model_dtype: torch.dtype) -> None:
    """reduce_dtype if set, else (as the installed FSDP2: torch < 2.15) param_dtype, else the
    parameter's own dtype; the sharded gradient always ends in the parameter's dtype."""
    found = run_on_ranks(_reduce_dtypes, 2, model_dtype)[0]
    own = str(model_dtype)
    unset = str(bf16) if not FOLLOWS_GRAD_DTYPE else own  # reduce dtype of param_dtype=bf16 alone
    expected = [
        ("None/None", own, own),
        ("torch.bfloat16/None", "torch.bfloat16", unset),
        ("torch.bfloat16/torch.float32", "torch.bfloat16", "torch.float32"),
        ("None/torch.bfloat16", own, "torch.bfloat16"),
        ("torch.float16/torch.bfloat16", "torch.float16", "torch.bfloat16"),
        ("torch.float32/None", "torch.float32", "torch.float32" if not FOLLOWS_GRAD_DTYPE else own),
        ("torch.float16/torch.float32", "torch.float16", "torch.float32"),
    ]
    assert found == expected


# ----------------------------------------------------------------------------- inputs / outputs


class _Recorder(nn.Module):
    """Records the dtype of every leaf of its (nested) inputs and of its parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[Any] = []

    def forward(self, x: torch.Tensor, nested: Any = None, **kwargs: Any) -> torch.Tensor:
        leaves = torch.utils._pytree.tree_leaves((x, nested, kwargs))
        self.seen.append([t.dtype if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves])
        self.param_dtype = self.lin.weight.dtype
        return self.lin(x.to(self.lin.weight.dtype))


def _inputs_and_outputs(rank: int, world_size: int) -> None:
    x = torch.randn(2, 4)
    nested = [torch.randn(2), (torch.randn(3, dtype=torch.float64), torch.arange(3)), {"d": torch.randn(1), "s": "str"}]
    kw = {"k": torch.randn(2), "i": torch.ones(2, dtype=torch.int32), "b": torch.ones(1, dtype=torch.bool), "f": 0.5}

    def run(mp: MixedPrecisionPolicy) -> tuple[list, torch.Tensor]:
        torch.manual_seed(0)
        m = fully_shard(_Recorder(), mp_policy=mp)
        out = m(x, nested, **kw)
        return m.seen[0], out

    f64, i64, i32, b = torch.float64, torch.int64, torch.int32, torch.bool
    # Cast on: every floating leaf (fp32 and fp64) becomes bf16; others are left alone.
    seen, out = run(MixedPrecisionPolicy(param_dtype=bf16))
    assert seen == [bf16, bf16, bf16, i64, bf16, "str", bf16, i32, b, "float"], seen
    assert out.dtype == bf16
    # Cast off: the module gets its inputs unchanged (it still computes with bf16 params).
    seen, out = run(MixedPrecisionPolicy(param_dtype=bf16, cast_forward_inputs=False))
    assert seen == [fp32, fp32, f64, i64, fp32, "str", fp32, i32, b, "float"], seen
    # output_dtype casts floating outputs, with or without param_dtype.
    _, out = run(MixedPrecisionPolicy(param_dtype=bf16, output_dtype=fp32))
    assert out.dtype == fp32
    _, out = run(MixedPrecisionPolicy(output_dtype=fp16))
    assert out.dtype == fp16
    # Without param_dtype nothing is cast.
    seen, out = run(MixedPrecisionPolicy(reduce_dtype=bf16))
    assert seen == [fp32, fp32, f64, i64, fp32, "str", fp32, i32, b, "float"] and out.dtype == fp32

    # Tuple, dict and non-tensor outputs: floating tensors cast, the rest left alone.
    class Multi(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            y = self.lin(x)
            return y, {"y": y, "n": torch.arange(2), "s": 1}

    torch.manual_seed(0)
    m = fully_shard(Multi(), mp_policy=MixedPrecisionPolicy(param_dtype=bf16, output_dtype=fp16))
    y, d = m(x)
    assert (y.dtype, d["y"].dtype, d["n"].dtype, d["s"]) == (fp16, fp16, i64, 1)
    (y.float().sum() + d["y"].float().sum()).backward()
    assert all(p.grad.dtype == fp32 for p in m.parameters())


def test_cast_forward_inputs_and_output_dtype() -> None:
    """cast_forward_inputs casts every floating leaf of nested args/kwargs (and only those);
    off, inputs are untouched; output_dtype casts floating outputs."""
    run_on_ranks(_inputs_and_outputs, 2)


class _Outer(nn.Module):
    """A root with its own Linear around an `inner` child that gets a different policy."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = _Recorder()
        self.post = nn.Linear(4, 4)
        self.seen: list[tuple] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, self.pre.weight.dtype, self.post.weight.dtype))
        h = self.pre(x)
        y = self.inner(h, [h])
        return self.post(y.to(self.post.weight.dtype))


def _nested_policies(rank: int, world_size: int) -> None:
    x = torch.randn(3, 4)
    cases = [  # (root param dtype, child param dtype)
        (None, fp16),  # fp16 child inside an fp32 root
        (bf16, None),  # plain child inside a bf16 root: it computes in bf16 (root's gather)
        (bf16, fp32),  # fp32 child inside a bf16 root
        (bf16, fp16),
    ]
    for root_dtype, child_dtype in cases:
        torch.manual_seed(0)
        m = _Outer()
        if child_dtype is not None:
            fully_shard(m.inner, mp_policy=MixedPrecisionPolicy(param_dtype=child_dtype))
        fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=root_dtype))
        out = m(x)
        root = root_dtype or fp32
        child = child_dtype or root
        assert m.seen == [(root, root, root)], (root_dtype, child_dtype, m.seen)
        # The child's inputs are cast to its param_dtype; without one they pass as they come.
        assert m.inner.seen == [[child, child]], (root_dtype, child_dtype, m.inner.seen)
        assert m.inner.param_dtype == child
        assert out.dtype == root
        out.float().sum().backward()
        assert all(p.grad.dtype == fp32 for p in m.parameters())


def test_nested_policies_apply_to_their_own_module() -> None:
    """An fp16 child inside an fp32 root sees fp16 inputs and params; the root's own modules
    see fp32; and the other combinations likewise."""
    run_on_ranks(_nested_policies, 2)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("arg", ["param_dtype", "reduce_dtype", "output_dtype"])
@pytest.mark.parametrize("value", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_non_floating_dtype_raises(arg: str, value: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"MixedPrecisionPolicy.*'{arg}'.*{value}"):
        MixedPrecisionPolicy(**{arg: value})


@pytest.mark.parametrize("value", ["bf16", torch.ones(1), 16])
def test_non_dtype_raises(value: object) -> None:
    with pytest.raises(TypeError, match=r"MixedPrecisionPolicy.*'param_dtype'.*must be a torch.dtype"):
        MixedPrecisionPolicy(param_dtype=value)  # type: ignore[arg-type]


def _wrong_policy_type(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    fully_shard(nn.Linear(2, 2), mp_policy=TorchMP(param_dtype=bf16))  # FSDP2's policy is accepted
    for bad in ({"param_dtype": bf16}, bf16):
        with pytest.raises(TypeError, match=r"fully_shard: 'mp_policy' must be a composable.MixedPrecisionPolicy"):
            fully_shard(nn.Linear(2, 2), mp_policy=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'cast_forward_inputs' must be a bool"):
        MixedPrecisionPolicy(cast_forward_inputs=1)  # type: ignore[arg-type]


def test_wrong_policy_type_raises() -> None:
    run_on_ranks(_wrong_policy_type, 2)
