"""PyTorch FSDP2's module interface on composable: every public `FSDPModule` method has its
counterpart on `fully_shard.state(m)` and, through the adapter, on the module; and the methods
that change when and what is gathered or reduced do what FSDP2's do.

Each training check compares against a single-process reference on all ranks' data (loss,
every gradient, every parameter, each step) or against PyTorch FSDP2 on the same model; each
promise of fewer or different collectives is counted. The collective-replacing methods live
in test_fsdp2_module_comms.py.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import count_collectives, gpu_worlds, run_on_ranks
from _models import batch_for
from _training import check_grads, check_params, rank_mean, sgd
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from composable import fully_shard
from composable._engine.groups.group import GroupState
from composable.fsdp._state import FSDPState
from composable.integrations.fsdp2_module import UNSUPPORTED_METHODS, ComposableFSDPModule, as_fsdp_modules

TOL = dict(rtol=1e-5, atol=1e-6)


class EmbedNet(nn.Module):
    """Embedding -> two small blocks -> head: an embedding whose backward needs no weights."""

    def __init__(self, vocab: int = 13, dim: int = 6, extra: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.body2 = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.head = nn.Linear(dim, vocab)
        self.use_extra = False
        if extra:  # `extra` runs only where `use_extra`; `unused` never runs
            self.extra = nn.Linear(dim, dim)
            self.unused = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.body2(self.body(self.emb(tokens)))
        if self.use_extra:
            x = x + self.extra(x)
        return self.head(x)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def sharded_pair(device: str = "cpu", **kw: bool) -> tuple[EmbedNet, EmbedNet]:
    """(composable model with FSDP2's interface, single-process reference), equal values."""
    ref = EmbedNet(**kw).to(device)
    model = copy.deepcopy(ref)
    for part in (model.emb, model.body, model.body2):
        fully_shard(part)
    fully_shard(model)
    return as_fsdp_modules(model), ref


def step(model: nn.Module, ref: nn.Module, opts: tuple, s: int, rank: int, world: int, device: str = "cpu") -> None:
    """One step of both on step `s`'s batch; loss, gradients, then parameters agree."""
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss = loss_of(model, batch_for(s, world, rank).to(device))
    loss.backward()
    ref_loss = loss_of(ref, batch_for(s, world, None).to(device))
    ref_loss.backward()
    torch.testing.assert_close(rank_mean(loss), ref_loss.detach(), **TOL)
    check_grads(model, ref, f"step {s}")
    for opt in opts:
        opt.step()
    check_params(model, ref, f"step {s}")


# ----------------------------------------------------------------------------- the interface


def _public(cls: type) -> list[str]:
    return sorted(n for n, v in vars(cls).items() if callable(v) and not n.startswith("_"))


# torch 2.13's FSDPModule: composable offers all of them on torch 2.11 and 2.12 too.
TORCH_2_13_METHODS = """reshard unshard reset_iter_state set_is_last_backward set_requires_gradient_sync
set_requires_all_reduce set_reshard_after_forward set_reshard_after_backward set_modules_to_forward_prefetch
set_modules_to_backward_prefetch set_custom_all_gather set_custom_reduce_scatter set_all_reduce_hook
set_post_optim_event set_reduce_scatter_divide_factor set_gradient_divide_factor set_force_sum_reduction_for_comms
set_reduce_scatter_unused_params set_reduce_scatter_max_input_buffers set_separate_reduce_scatter_group
set_unshard_in_backward set_allocate_memory_from_process_group_for_comm set_symm_mem_for_comm""".split()


def test_every_public_fsdp_module_method_has_a_counterpart() -> None:
    """A torch that adds a public FSDPModule method fails here until composable offers it."""
    assert len(TORCH_2_13_METHODS) == 23
    assert not [n for n in UNSUPPORTED_METHODS if not n.startswith("_")], UNSUPPORTED_METHODS
    for name in sorted(set(_public(FSDPModule)) | set(TORCH_2_13_METHODS)):
        ours = vars(ComposableFSDPModule).get(name)
        assert ours is not None, f"ComposableFSDPModule lacks {name}"
        mine = list(inspect.signature(ours).parameters)
        if hasattr(FSDPModule, name):  # same arguments as the installed torch's
            assert mine == list(inspect.signature(getattr(FSDPModule, name)).parameters), name
        if name != "set_reduce_scatter_divide_factor":  # FSDP2's deprecated alias: the adapter only
            assert list(inspect.signature(getattr(FSDPState, name)).parameters) == mine, name


def _via_adapter(rank: int, world: int) -> None:
    model, _ = sharded_pair()
    with pytest.raises(NotImplementedError, match="_get_fsdp_state"):
        model._get_fsdp_state()
    with pytest.raises(TypeError, match="set_unshard_in_backward: 'unshard_in_backward' must be"):
        model.emb.set_unshard_in_backward(1)
    with pytest.raises(TypeError, match="set_post_optim_event: 'event' must be a torch.Event"):
        model.set_post_optim_event(None)
    with pytest.raises(RuntimeError, match="reset_iter_state: module FSDPSequential is not the root"):
        model(batch_for(0, world, rank)).sum()  # lazy init decides the root
        model.body.reset_iter_state()


def test_adapter_errors() -> None:
    run_on_ranks(_via_adapter, 2)


# ----------------------------------------------------------------------------- set_unshard_in_backward


def _unshard_in_backward(rank: int, world: int) -> None:
    model, ref = sharded_pair()
    model.emb.set_unshard_in_backward(False)
    assert fully_shard.state(model.emb).unshard_in_backward is False
    opts = (sgd(model), sgd(ref))
    for s in range(3):
        tokens = batch_for(s, world, rank)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens)
        emb_group = fully_shard.state(model.emb).groups[0]
        with count_collectives() as c:
            loss.backward()
        # body2 and body are gathered again (the root keeps its own); the embedding is not.
        assert c.counts["all_gather"] == 2, c.render()
        assert c.counts["reduce_scatter"] == 4, c.render()  # its gradient is still reduced
        assert emb_group.state is GroupState.SHARDED
        ref_loss = loss_of(ref, batch_for(s, world, None))
        ref_loss.backward()
        torch.testing.assert_close(rank_mean(loss), ref_loss.detach(), **TOL)
        check_grads(model, ref, f"step {s}")
        for opt in opts:
            opt.step()
        check_params(model, ref, f"step {s}")
    model.emb.set_unshard_in_backward(True)  # back to gathering: 3 all-gathers in backward
    loss = loss_of(model, batch_for(0, world, rank))
    with count_collectives() as c:
        loss.backward()
    assert c.counts["all_gather"] == 3, c.render()


def test_unshard_in_backward_false_keeps_the_embedding_sharded_in_backward() -> None:
    run_on_ranks(_unshard_in_backward, 2)


# ----------------------------------------------------------------------------- reset_iter_state


class _Boom(Exception):
    pass


def _reset_iter_state(rank: int, world: int) -> None:
    model, ref = sharded_pair()
    opts = (sgd(model), sgd(ref))
    fail = {"forward": False, "backward": False}

    def forward_pre(module: nn.Module, args: tuple) -> None:
        if fail["forward"]:  # body2 gathered, emb/body done: the forward stops half way
            raise _Boom("forward")

    def backward_in_emb(grad: torch.Tensor) -> torch.Tensor:
        if fail["backward"]:  # body's reduce-scatter is in flight, root's final callback queued
            raise _Boom("backward")
        return grad

    model.body2.register_forward_pre_hook(forward_pre)

    def hook_emb_output(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(backward_in_emb)

    model.emb.register_forward_hook(hook_emb_output)
    sharded = {n: p for n, p in model.named_parameters()}
    s = 0
    for phase in ("forward", "backward", None, None):
        if phase is not None:
            fail[phase] = True
            with pytest.raises(_Boom):
                loss_of(model, batch_for(s, world, rank)).backward()
            fail[phase] = False
            model.reset_iter_state()
            for name, p in model.named_parameters():  # every group resharded
                assert p is sharded[name] and isinstance(p, DTensor), name
            for m in (model, model.emb, model.body, model.body2):
                assert fully_shard.state(m).groups[0].state is GroupState.SHARDED
        step(model, ref, opts, s, rank, world)  # the failed iteration left nothing behind
        s += 1


def test_reset_iter_state_recovers_from_exceptions_in_forward_and_backward() -> None:
    run_on_ranks(_reset_iter_state, 2)


# ----------------------------------------------------------------------------- set_reduce_scatter_unused_params


def _unused_params(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard as fsdp2

    base = EmbedNet(extra=True)
    theirs, mine, default = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for model, api in ((theirs, fsdp2), (mine, fully_shard), (default, fully_shard)):
        api(model.body)
        api(model)
        model.use_extra = rank == 0  # `extra` gets a gradient on rank 0 only; `unused` nowhere
    theirs.set_reduce_scatter_unused_params(True)  # FSDP2 needs it: ranks reduce the same parameters
    fully_shard.state(mine).set_reduce_scatter_unused_params(True)
    assert fully_shard.state(mine.body).groups[0].reducer.options.reduce_unused  # recurse=True
    opts = [sgd(m) for m in (theirs, mine, default)]
    for s in range(2):
        losses = [loss_of(m, batch_for(s, world, rank)) for m in (theirs, mine, default)]
        for loss in losses:
            loss.backward()
        for name, p in theirs.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(mine.get_parameter(name).grad.full_tensor(), p.grad.full_tensor(), **TOL)
            other = default.get_parameter(name).grad
            if name.startswith("unused."):
                assert other is None, name  # composable's default: no rank had one, so none
                assert not p.grad.full_tensor().any(), name
            else:  # ranks using different parameters need no flag in composable
                torch.testing.assert_close(other.full_tensor(), p.grad.full_tensor(), **TOL)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    fully_shard.state(mine).set_reduce_scatter_unused_params(False, recurse=False)
    assert not fully_shard.state(mine).groups[0].reducer.options.reduce_unused
    assert fully_shard.state(mine.body).groups[0].reducer.options.reduce_unused


@pytest.mark.skipif(
    not hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
    reason="this torch's FSDP2 has no set_reduce_scatter_unused_params to compare with (torch < 2.13)",
)
def test_reduce_scatter_unused_params_matches_fsdp2() -> None:
    run_on_ranks(_unused_params, 2)


# ----------------------------------------------------------------------------- set_reduce_scatter_max_input_buffers


def _max_input_buffers(rank: int, world: int, device: str = "cpu", cap: int = 3) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    model, ref = sharded_pair(device)
    with pytest.raises(TypeError, match="'max_input_buffers' must be an int, got bool"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="'max_input_buffers' must be >= 1, got 0"):
        model.set_reduce_scatter_max_input_buffers(0)
    model.body.set_reduce_scatter_max_input_buffers(2, recurse=False)
    assert fully_shard.state(model).groups[0].reducer.options.max_input_buffers == 1
    model.set_reduce_scatter_max_input_buffers(cap)
    reducers = [fully_shard.state(m).groups[0].reducer for m in (model, model.emb, model.body, model.body2)]
    assert [r.options.max_input_buffers for r in reducers] == [cap] * 4
    streams = reducers[0].streams
    in_flight: list[int] = []
    if streams is not None:  # CUDA: how many reduce-scatter inputs are alive after each one
        for r in reducers:
            original = r._launch_reduce_scatter

            def launch(*a: object, _original: object = original) -> None:
                _original(*a)  # type: ignore[operator]
                in_flight.append(streams.reduces_in_flight)

            r._launch_reduce_scatter = launch
    opts = (sgd(model), sgd(ref))
    for s in range(2):
        step(model, ref, opts, s, rank, world, device)
    if streams is not None:
        assert max(in_flight) == cap, in_flight


def test_reduce_scatter_max_input_buffers_checks_and_trains() -> None:
    run_on_ranks(_max_input_buffers, 2)


@pytest.mark.parametrize("world", gpu_worlds(1, 2))
@pytest.mark.parametrize("cap", [1, 3])
def test_gpu_reduce_scatter_max_input_buffers_keeps_that_many_inputs(cap: int, world: int) -> None:
    run_on_ranks(_max_input_buffers, world, "cuda", cap, backend="nccl", timeout=300)


# ----------------------------------------------------------------------------- set_post_optim_event


def _post_optim_event(rank: int, world: int) -> None:
    torch.cuda.set_device(rank)
    model, ref = sharded_pair("cuda")
    opts = (sgd(model), sgd(ref))
    streams = fully_shard.state(model).groups[0].streams
    for s in range(3):
        event = torch.cuda.current_stream().record_event()  # after the previous step's optimizer
        model.set_post_optim_event(event)
        assert streams.post_optim_event is event
        step(model, ref, opts, s, rank, world, "cuda")
        assert streams.post_optim_event is None  # waited on once, then dropped
    dist.barrier()


@pytest.mark.parametrize("world", gpu_worlds(1, 2))
def test_gpu_post_optim_event_orders_the_next_gathers(world: int) -> None:
    run_on_ranks(_post_optim_event, world, backend="nccl", timeout=300)
