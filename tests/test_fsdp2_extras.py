"""What FSDP2 users reach for beyond the basics: an int `reshard_after_forward`, async
`unshard`, the state's setters and `register_forward_method`.

Every numeric check compares against a twin trained the plain way (same data, same
collectives' arithmetic, so bit for bit) or against a single-process reference; the
collective checks count what the tracer records and over which ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, count_collectives, run_on_ranks, step_and_match, trace_collectives
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from composable import MixedPrecisionPolicy, fully_shard, register_forward_method, replicate

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _shard(model: TinyTransformer, **options: object) -> TinyTransformer:
    for block in model.layers:
        fully_shard(block, **options)
    fully_shard(model, **{k: v for k, v in options.items() if k != "reshard_after_forward"})
    return model


def _steps(models: list[nn.Module], rank: int, world: int, steps: int = 3, fused: bool = False) -> None:
    """Train both models on the same data; losses, gradients and parameters agree each step,
    bit for bit."""
    first, second = models
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused) for m in models]
    for step in range(steps):
        tokens = batch_for(step, world, rank)
        losses = [lm_loss(m, tokens) for m in models]
        for loss in losses:
            loss.backward()
        step_and_match(second, first, opts, f"step {step}", same_placements=True, losses=(losses[1], losses[0]))


# ----------------------------------------------------------------------------- int reshard_after_forward


def _int_reshard(rank: int, world: int, mesh_shape: tuple[int, ...], mp: bool) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    options = {"mesh": mesh, "mp_policy": BF16 if mp else MixedPrecisionPolicy()}
    base = TinyTransformer()
    full, partial = (
        _shard(copy.deepcopy(base), reshard_after_forward=True, **options),
        _shard(copy.deepcopy(base), reshard_after_forward=2, **options),
    )
    assert fully_shard.state(partial.layers[0]).reshard_after_forward == 2
    # Backward gathers every block within its pair of ranks; forward over the whole shard dim.
    shard_ranks = [
        str(r) for r in mesh.mesh.reshape(-1, mesh.size(mesh.ndim - 1)).tolist()[rank // mesh.size(mesh.ndim - 1)]
    ]
    tokens = batch_for(0, world, rank)
    loss = lm_loss(partial, tokens)
    with trace_collectives() as t:
        loss.backward()
    gathers = [r for r in t.records if r.kind == "all_gather"]
    assert len(gathers) == len(partial.layers), t.render()
    pair = rank % mesh.size(mesh.ndim - 1) // 2
    expected = "g[" + ",".join(shard_ranks[2 * pair : 2 * pair + 2]) + "]"
    assert all(g.group == expected for g in gathers), (expected, t.render())
    for model in (partial,):
        model.zero_grad()
    _steps([full, partial], rank, world)


@pytest.mark.parametrize(
    "mesh_shape, mp", [((4,), False), ((4,), True), ((1, 4), True)], ids=["fsdp", "fsdp-bf16", "hsdp-bf16"]
)
def test_int_reshard_after_forward_gathers_within_n_ranks_and_trains_the_same(
    mesh_shape: tuple[int, ...], mp: bool
) -> None:
    run_on_ranks(_int_reshard, 4, mesh_shape, mp)


def _int_reshard_errors(rank: int, world: int) -> None:
    with pytest.raises(
        ValueError, match=r"fully_shard: 'reshard_after_forward' must be .* divides the shard world size 4, got 3"
    ):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=3)
    with pytest.raises(ValueError, match=r"got 0"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=0)
    with pytest.raises(TypeError, match=r"fully_shard: 'reshard_after_forward' must be a bool or an int, got 2.0"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=2.0)
    one = fully_shard(nn.Linear(4, 4), reshard_after_forward=1)
    assert fully_shard.state(one).reshard_after_forward is False  # 1 keeps them unsharded
    four = fully_shard(nn.Linear(4, 4), reshard_after_forward=4)
    assert fully_shard.state(four).reshard_after_forward is True


def test_int_reshard_after_forward_errors() -> None:
    run_on_ranks(_int_reshard_errors, 4)


# ----------------------------------------------------------------------------- async unshard


def _async_unshard(rank: int, world: int) -> None:
    base = TinyTransformer()
    model, twin = _shard(copy.deepcopy(base)), _shard(copy.deepcopy(base))
    state = fully_shard.state(model.layers[0])
    assert state.unshard() is None
    state.reshard()
    with count_collectives() as c:
        handle = state.unshard(async_op=True)
        handle.wait()
    assert c.counts["all_gather"] == 1
    weight = model.layers[0].qkv.weight
    assert not isinstance(weight, DTensor) and weight.shape == (30, 10)  # unsharded, registered
    state.reshard()
    # Async unshard, then the forward: the forward reuses the gather, one all-gather in all.
    handle = state.unshard(async_op=True)
    with count_collectives() as c:
        model.layers[0](torch.randn(2, 7, 10))
    handle.wait()  # after the forward used it: nothing left to do
    assert c.counts["all_gather"] == 0, c.render()
    # Started before the first step's forward, which waits for it (the optimizer, made
    # first, sees the sharded parameters: nothing is registered until the wait).
    fully_shard.state(model).unshard(async_op=True)
    _steps([twin, model], rank, world, steps=2)
    with pytest.raises(TypeError, match="unshard: 'async_op' must be a bool, got 1"):
        state.unshard(async_op=1)


@pytest.mark.parametrize("world", [2, 4])
def test_async_unshard_returns_a_handle_and_the_forward_reuses_it(world: int) -> None:
    run_on_ranks(_async_unshard, world)


# ----------------------------------------------------------------------------- setters


def _setters(rank: int, world: int) -> None:
    base = TinyTransformer()
    plain, tuned = _shard(copy.deepcopy(base)), _shard(copy.deepcopy(base))
    root = fully_shard.state(tuned)
    root.set_reshard_after_forward(False)
    assert all(fully_shard.state(b).reshard_after_forward is False for b in tuned.layers)
    tokens = batch_for(0, world, rank)
    loss = lm_loss(tuned, tokens)
    with count_collectives() as c:
        loss.backward()
    assert c.counts["all_gather"] == 0, "kept unsharded from forward to backward"
    tuned.zero_grad()
    root.set_reshard_after_forward(True, recurse=True)
    # Kept unsharded after backward: the next forward gathers nothing; after an optimizer step
    # it notices the changed shards and gathers them again, also after a fused AdamW's step,
    # which writes the parameters without bumping their version counters.
    root.set_reshard_after_backward(False)
    lm_loss(tuned, tokens).backward()
    with count_collectives() as c:
        lm_loss(tuned, tokens)
    assert c.counts["all_gather"] == 0, c.render()
    tuned.zero_grad()
    _steps([plain, tuned], rank, world, steps=3, fused=True)
    with pytest.raises(
        TypeError, match="set_reshard_after_backward: 'reshard_after_backward' must be a bool, got 'no'"
    ):
        root.set_reshard_after_backward("no")
    with pytest.raises(ValueError, match="set_reshard_after_forward: 'reshard_after_forward' must be .* got 3"):
        root.set_reshard_after_forward(3)


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_setters(world: int) -> None:
    run_on_ranks(_setters, world)


def _divide_factor(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    model = copy.deepcopy(ref)
    fully_shard(model[0])
    fully_shard(model)
    for state in (fully_shard.state(model[0]), fully_shard.state(model)):
        state.set_gradient_divide_factor(3.0)
    x = torch.arange(world * 4 * 6, dtype=torch.float32).reshape(world * 4, 6) / 50
    model(x[rank * 4 : (rank + 1) * 4]).square().sum().backward()
    ref(x).square().sum().backward()  # the sum over every rank's rows
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close_tensors(p.grad.full_tensor(), r.grad / 3.0, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="set_gradient_divide_factor: 'factor' must be a finite number > 0, got 0"):
        fully_shard.state(model).set_gradient_divide_factor(0)


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_divide_factor_sums_then_divides(world: int) -> None:
    run_on_ranks(_divide_factor, world)


def _last_backward(rank: int, world: int) -> None:
    base = TinyTransformer()
    plain, micro = _shard(copy.deepcopy(base)), _shard(copy.deepcopy(base))
    for step in range(2):
        tokens = [batch_for(2 * step + i, world, rank) for i in range(2)]
        for i, t in enumerate(tokens):
            lm_loss(plain, t).backward()
            fully_shard.state(micro).set_is_last_backward(i == len(tokens) - 1)
            lm_loss(micro, t).backward()
        for (name, a), (_, b) in zip(micro.named_parameters(), plain.named_parameters()):
            assert_close_tensors(a.grad.to_local(), b.grad.to_local(), exact=True, msg=f"{step} {name}")
        for m in (plain, micro):
            m.zero_grad()


@pytest.mark.parametrize("world", [2, 4])
def test_is_last_backward_false_leaves_reductions_for_later(world: int) -> None:
    run_on_ranks(_last_backward, world)


# ----------------------------------------------------------------------------- register_forward_method


class Generator(TinyTransformer):
    def generate(self, tokens: torch.Tensor, new: int) -> torch.Tensor:
        """Greedy decoding that reads `self.head.weight` directly (not through forward)."""
        for _ in range(new):
            hidden = self.norm(self.layers[1](self.layers[0](self.tok(tokens[:, -7:]))))
            nxt = (hidden[:, -1] @ self.head.weight.t()).argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens


def _forward_method(rank: int, world: int, api: str) -> None:
    torch.manual_seed(0)
    ref = Generator()
    model = copy.deepcopy(ref)
    if api == "fully_shard":
        _shard(model, mp_policy=MixedPrecisionPolicy())
    else:
        replicate(model)
    register_forward_method(model, "generate")
    prompt = torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model.generate(prompt, new=3), ref.generate(prompt, new=3)
    assert torch.equal(got, want)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "sharded parameters shown again after the call"
    with pytest.raises(RuntimeError, match="register_forward_method: Generator.generate is already registered"):
        register_forward_method(model, "generate")
    with pytest.raises(ValueError, match="register_forward_method: Generator has no method 'sample'"):
        register_forward_method(model, "sample")
    with pytest.raises(ValueError, match="neither fully_shard nor replicate"):
        register_forward_method(nn.Linear(2, 2), "forward")
    with pytest.raises(TypeError, match="register_forward_method: 'method_name' must be a str, got 3"):
        register_forward_method(model, 3)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_register_forward_method_runs_the_hooks(api: str, world: int) -> None:
    run_on_ranks(_forward_method, world, api)
