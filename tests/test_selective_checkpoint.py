"""Selective activation checkpointing: `checkpoint(module, context_fn=...)` and torch's keywords.

- Against torch's own composable checkpoint + FSDP2 with the same policy (`save_matmuls`), 2
  gloo ranks, dropout on: losses, gradients and parameters agree bit for bit, step by step.
- Under `save_matmuls` backward multiplies exactly as often as without checkpointing (aten
  mm/addmm/bmm counted by a TorchDispatchMode during backward), while full checkpointing
  multiplies again; the gradients of all three are equal.
- Composes with replicate and with module.compile(fullgraph=True) (same results as eager); compiled
  (aot_eager) with fully_shard it equals FSDP2 with torchtitan's compiled checkpoint_wrapper bit for
  bit; under inductor the compiled backward multiplies as often as without checkpointing.
- `determinism_check="none"` turns the check off; `debug=True` and `early_stop=False` run
  (and give the same gradients); each bad argument raises a clear error.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, requires_gpus, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError, CheckpointPolicy, create_selective_checkpoint_contexts

from composable import checkpoint, fully_shard, replicate
from composable.checkpoint import save_matmuls

STEPS = 3
MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func.overloadpacket in MATMULS
        return func(*args, **(kwargs or {}))


def _mlp_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)))


# ----------------------------------------------------------------------------- arguments


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="checkpoint: 'determinism_check' must be one of .*'sometimes'"):
        checkpoint(nn.Linear(2, 2), determinism_check="sometimes")
    with pytest.raises(TypeError, match="checkpoint: 'context_fn' must be a callable.*42"):
        checkpoint(nn.Linear(2, 2), context_fn=42)  # type: ignore[arg-type]
    for flag in ("debug", "early_stop", "preserve_rng_state"):
        with pytest.raises(TypeError, match=f"checkpoint.*{flag}"):
            checkpoint(nn.Linear(2, 2), **{flag: "yes"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint: debug=True does not combine with a context_fn"):
        checkpoint(nn.Linear(2, 2), context_fn=save_matmuls(), debug=True)
    m = nn.Linear(2, 2)
    policy = save_matmuls()
    checkpoint(m, context_fn=policy, determinism_check="none", early_stop=False)
    state = checkpoint.state(m)
    assert (state.context_fn, state.determinism_check, state.debug, state.early_stop) == (policy, "none", False, False)
    assert checkpoint.save_matmuls is save_matmuls


# ----------------------------------------------------------------------------- one process


def _backward_matmuls(model: nn.Module, x: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    loss = model(x).square().mean()
    with CountMatmuls() as counter:
        loss.backward()
    return counter.count, {n: p.grad for n, p in model.named_parameters()}


def test_save_matmuls_recomputes_no_matmul() -> None:
    x = torch.randn(4, 5, 8)  # 3D: the linears run aten.mm on a view, as in a transformer
    plain, full, selective = _mlp_blocks(), _mlp_blocks(), _mlp_blocks()
    for block_full, block_sel in zip(full, selective):
        checkpoint(block_full)
        checkpoint(block_sel, context_fn=save_matmuls())
    (n_plain, g_plain), (n_full, g_full), (n_sel, g_sel) = (_backward_matmuls(m, x) for m in (plain, full, selective))
    assert n_sel == n_plain, (n_sel, n_plain)
    assert n_full > n_plain, (n_full, n_plain)  # the count sees a recompute where there is one
    assert_close_tensors(g_sel, g_plain, exact=True, msg="selective vs plain")
    assert_close_tensors(g_full, g_plain, exact=True, msg="full vs plain")


def test_policy_that_saves_nothing_recomputes_like_full() -> None:
    def nothing(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(4, 8)
    full, selective = _mlp_blocks(), _mlp_blocks()
    for block_full, block_sel in zip(full, selective):
        checkpoint(block_full)
        checkpoint(block_sel, context_fn=functools.partial(create_selective_checkpoint_contexts, nothing))
    assert _backward_matmuls(selective, x)[0] == _backward_matmuls(full, x)[0]


class Flaky(nn.Module):
    """A forward whose recompute saves a tensor of another shape than the forward did."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        extra = torch.ones(self.calls, requires_grad=True)
        return y * (extra * extra).sum()


def test_determinism_check_none_turns_the_check_off() -> None:
    x = torch.randn(2, 4)
    checked = checkpoint(Flaky())
    with pytest.raises(CheckpointError):
        checked(x).sum().backward()
    unchecked = checkpoint(Flaky(), determinism_check="none")
    unchecked(x).sum().backward()
    assert unchecked.lin.weight.grad is not None


@pytest.mark.parametrize(
    "options", [{"debug": True}, {"early_stop": False}, {"early_stop": False, "context_fn": save_matmuls()}]
)
def test_debug_and_early_stop_run(options: dict[str, Any]) -> None:
    x = torch.randn(4, 8)
    plain, model = _mlp_blocks(), _mlp_blocks()
    for block in model:
        checkpoint(block, **options)
    assert_close_tensors(_backward_matmuls(model, x)[1], _backward_matmuls(plain, x)[1], exact=True, msg=str(options))


def test_early_stop_is_passed_through() -> None:
    """Each block's second linear is not needed by backward's recompute (GELU saved its input,
    the linear its own input): early_stop skips it, early_stop=False runs it too."""
    x = torch.randn(4, 8)
    counts = []
    for early_stop in (True, False):
        model = _mlp_blocks()
        for block in model:
            checkpoint(block, early_stop=early_stop)
        counts.append(_backward_matmuls(model, x)[0])
    assert counts[1] == counts[0] + len(model), counts


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_blocks_under_selective_checkpointing_train_like_eager(backend: str) -> None:
    """Inductor's matmuls write into buffers its code reuses (`out=`): save_matmuls must not keep
    those, or backward finds them overwritten."""
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    eager, compiled = _mlp_blocks(), _mlp_blocks()
    for i, (block_eager, block_compiled) in enumerate(zip(eager, compiled)):
        if i == 0:
            block_compiled.compile(backend=backend, fullgraph=True)  # before
        checkpoint(block_eager, context_fn=save_matmuls())
        checkpoint(block_compiled, context_fn=save_matmuls())
        if i > 0:
            block_compiled.compile(backend=backend, fullgraph=True)  # after
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for step in range(STEPS):
        for model, opt in zip((eager, compiled), opts):
            model(x + step).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert_close_tensors(dict(compiled.named_parameters()), dict(eager.named_parameters()), rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"]


class _Mlp(nn.Module):  # a forward of user code: dynamo compiles it as is on every torch
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_inductor_compiled_blocks_keep_their_matmuls() -> None:
    """With `module.compile()` the checkpoint is traced into the graph: the partitioner keeps
    the matmuls save_matmuls names and recomputes the rest inside the compiled backward, so
    backward multiplies as often as without checkpointing (full checkpointing more), with the
    same gradients. Ten blocks of one class: more than dynamo's per-code cache would hold if
    each block compiled a graph of its own."""
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    counts, grads = {}, {}
    for ac in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = nn.Sequential(*(_Mlp() for _ in range(10)))
        for block in model:
            if ac != "none":
                checkpoint(block, context_fn=save_matmuls() if ac == "selective" else None)
            block.compile(backend="inductor", fullgraph=True)
        loss = model(x).square().mean()
        with CountMatmuls() as mode:  # inductor's code calls its matmuls through the dispatcher
            loss.backward()
        counts[ac], grads[ac] = mode.count, {n: p.grad for n, p in model.named_parameters()}
    assert counts["selective"] == counts["none"] < counts["full"], counts
    for ac in ("selective", "full"):
        assert_close_tensors(grads[ac], grads["none"], exact=True, msg=ac)
    assert not torch._dynamo.utils.counters["graph_break"]


# ----------------------------------------------------------------------------- two ranks


def _parity_with_torch(rank: int, world: int, compiled: bool = False) -> None:
    """Eager: torch's composable checkpoint on FSDP2's blocks. Compiled (aot_eager): torch's
    `checkpoint_wrapper` compiled after wrapping, torchtitan's order, so both checkpoints are
    traced into the block graphs and partitioned by the same policy."""
    from torch.distributed._composable import checkpoint as torch_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    theirs = TinyTransformer(dropout=0.0 if compiled else 0.1)
    ours = copy.deepcopy(theirs)
    mesh = init_device_mesh("cpu", (world,))
    for i, block in enumerate(list(theirs.layers)):
        if compiled:
            block = checkpoint_wrapper(block, context_fn=save_matmuls())
            block.compile(backend="aot_eager")
            theirs.layers[i] = block
        else:
            torch_checkpoint(block, context_fn=save_matmuls())
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    for block in ours.layers:
        checkpoint(block, context_fn=save_matmuls())
        if compiled:
            block.compile(backend="aot_eager")
        fully_shard(block, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(STEPS):
        tokens = batch_for(step, world, rank)
        losses = []
        for model, opt in zip((ours, theirs), opts):
            torch.manual_seed(100 + step)  # the same dropout masks
            loss = lm_loss(model, tokens)
            loss.backward()
            losses.append(loss.detach())
        assert_close_tensors(losses[0], losses[1], exact=True, msg=f"step {step}: loss")
        for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert_close_tensors(a.grad.to_local(), b.grad.to_local(), exact=True, msg=f"step {step}: grad {name}")
        for opt in opts:  # (the wrapper's names carry its prefix: zipped in order, not by name)
            opt.step()
            opt.zero_grad()
        for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert_close_tensors(a.to_local(), b.to_local(), exact=True, msg=f"step {step}: {name}")


def test_selective_with_fully_shard_matches_torch() -> None:
    run_on_ranks(_parity_with_torch, 2)


def test_compiled_selective_with_fully_shard_matches_torch() -> None:
    run_on_ranks(_parity_with_torch, 2, True, timeout=300)


def _replicate_matches_plain(rank: int, world: int) -> None:
    plain, selective = TinyTransformer(), TinyTransformer()
    selective.load_state_dict(plain.state_dict())
    for block in selective.layers:
        checkpoint(block, context_fn=save_matmuls())
    for model in (plain, selective):
        replicate(model, mesh=init_device_mesh("cpu", (world,)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, selective)]
    for step in range(STEPS):
        tokens = batch_for(step, world, rank)
        losses = []
        for model, opt in zip((plain, selective), opts):
            loss = lm_loss(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert_close_tensors(losses[1], losses[0], exact=True, msg=f"step {step}: loss")
        assert_close_tensors(
            {n: p.to_local() for n, p in selective.named_parameters()},
            {n: p.to_local() for n, p in plain.named_parameters()},
            exact=True,
            msg=f"step {step}: params",
        )


def test_selective_with_replicate_matches_no_checkpointing() -> None:
    run_on_ranks(_replicate_matches_plain, 2)


# ----------------------------------------------------------------------------- CUDA graphs


def _graphed_selective(rank: int, world: int) -> None:
    from composable import graphed_step

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    mesh = init_device_mesh("cuda", (world,))
    models = []
    for selective in (False, True):
        torch.manual_seed(0)
        model = TinyTransformer().to(dev)
        for block in model.layers:
            if selective:
                checkpoint(block, context_fn=save_matmuls())
            fully_shard(block, mesh=mesh)
        models.append(fully_shard(model, mesh=mesh))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]

    def step_of(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(tokens: torch.Tensor) -> torch.Tensor:
            loss = lm_loss(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return step

    eager, graphed = step_of(models[0], opts[0]), graphed_step(step_of(models[1], opts[1]))
    for step in range(5):
        tokens = batch_for(step, world, rank).to(dev)
        assert_close_tensors(graphed(tokens).clone(), eager(tokens), exact=True, msg=f"step {step}: loss")


@requires_gpus(2)
def test_gpu_selective_checkpointing_under_graphed_step() -> None:
    run_on_ranks(_graphed_selective, 2, backend="nccl", timeout=300)
