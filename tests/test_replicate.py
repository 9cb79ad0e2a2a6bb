"""replicate: DDP semantics on the parameter-group engine.

Parity is checked step by step against `torch.nn.parallel.DistributedDataParallel` on a copy
of the same model fed the same (per-rank different) data: every rank's loss and every
parameter after each optimizer step. DDP divides each gradient by the world size before its
all-reduce, replicate after it; dividing by 2 is exact in binary floating point, so at world
size 2 the two agree bit for bit (`torch.equal`).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors, count_collectives, requires_gpus, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from composable import MixedPrecisionPolicy, fully_shard, no_sync, replicate
from composable._engine.grads.grad_dtype import default_reduce_dtype

STEPS = 4


# ----------------------------------------------------------------------------- models and data


class Chain(nn.Module):
    """Four linear layers of uneven widths; layer i's backward runs after layer i+1's."""

    def __init__(self, widths: tuple[int, ...] = (6, 9, 7, 5, 3)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class Tree(nn.Module):
    """A root with its own parameter, two children for fully_shard and one plain child."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.a = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
        self.b = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(self.a(x * self.scale))))


def data(step: int, rank: int, dim: int = 6, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input, target) for `rank` at `step`; different on every rank."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, dim, generator=g), torch.randn(rows, 3, generator=g)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- rank functions


def _placements_and_identity(rank: int, world_size: int) -> None:
    model = Chain()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    out = replicate(model)
    assert out is model and type(model) is Chain  # same object, no class swap
    assert [n for n, _ in model.named_parameters()] == names
    assert replicate.state(model).param_names == names
    assert replicate.state(model.layers[0]) is None and fully_shard.state(model) is None
    for p, shape in zip(model.parameters(), shapes):
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), type(p)
        assert p.placements == (Replicate(),) and p.shape == shape
        assert p.to_local().shape == shape
    assert set(model.state_dict()) == set(names)
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    # Still Replicate() DTensors after a training step, with Replicate() DTensor gradients.
    loss_fn(model, data(0, rank)).backward()
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(),), n
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Replicate(),), n


def _ddp_parity(rank: int, world_size: int, variant: str, opt: str, bucket_cap_mb: float, device: str = "cpu") -> None:
    torch.manual_seed(1)
    model = Chain().to(device)
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    if variant == "default":
        replicate(model, bucket_cap_mb=bucket_cap_mb)
    elif variant == "mesh":
        replicate(model, mesh=init_device_mesh(device, (world_size,)), bucket_cap_mb=bucket_cap_mb)
    elif variant == "process_group":
        pg = dist.new_group(list(range(world_size)))
        replicate(model, process_group=pg, bucket_cap_mb=bucket_cap_mb)
        assert replicate.state(model).mesh.get_group() is not None
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    }[opt]
    optim, ref_optim = make(model.parameters()), make(ref.parameters())
    for step in range(STEPS):
        batch = tuple(t.to(device) for t in data(step, rank))
        loss, ref_loss = loss_fn(model, batch), loss_fn(ref, batch)
        assert torch.equal(loss, ref_loss), (step, loss.item(), ref_loss.item())
        loss.backward()
        ref_loss.backward()
        for (n, p), q in zip(model.named_parameters(), ref.module.parameters()):
            assert_close_tensors(p.grad, q.grad, exact=True, msg=f"grad {n} step {step}")
        optim.step()
        ref_optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        ref_optim.zero_grad(set_to_none=step % 2 == 0)
        assert_close_tensors(params_of(model), dict(ref.module.named_parameters()), exact=True, msg=f"step {step}")
    # Gradients really were averaged: ranks saw different data but hold identical parameters.
    gathered = [torch.empty(0)] * world_size
    dist.all_gather_object(gathered, {n: t.cpu() for n, t in params_of(model).items()})
    assert_close_tensors(gathered[0], gathered[1], exact=True)


def _transformer_parity(rank: int, world_size: int) -> None:
    """Tied embeddings (one parameter in two slots), layer norms, small buckets, AdamW."""
    model = TinyTransformer()
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=1e-3)
    replicate(model, bucket_cap_mb=1e-3)
    assert model.head.weight is model.tok.weight  # still tied, one DTensor
    assert "head.weight" not in replicate.state(model).param_names
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(STEPS):
        tokens = batch_for(step, world_size, rank)
        loss, ref_loss = lm_loss(model, tokens), lm_loss(ref, tokens)
        assert torch.equal(loss, ref_loss), (step, loss.item(), ref_loss.item())
        loss.backward()
        ref_loss.backward()
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        assert_close_tensors(params_of(model), dict(ref.module.named_parameters()), exact=True, msg=f"step {step}")


def _mixed_precision(rank: int, world_size: int) -> None:
    """bf16 compute, bf16 reduction, fp32 sharded parameters and gradients, against a
    single-process emulation doing the same arithmetic on both ranks' data."""
    torch.manual_seed(2)
    model = Chain()
    ref = copy.deepcopy(model)  # fp32 master copy of the reference
    seen: list[torch.dtype] = []
    model.layers[1].register_forward_pre_hook(lambda m, args: seen.extend([args[0].dtype, m.weight.dtype]))
    replicate(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        loss = loss_fn(model, data(step, rank))
        loss.backward()
        assert seen[-2:] == [torch.bfloat16, torch.bfloat16], seen  # computes in bf16
        # Reference: each rank's bf16 gradient, halved and summed in the default reduce dtype
        # (as the installed FSDP2: bf16, param_dtype, before torch 2.15; fp32, the parameters'
        # own dtype, from 2.15 on), then cast to the fp32 parameters.
        reduce = default_reduce_dtype(torch.bfloat16, torch.float32)
        grads, losses = [], []
        for r in range(world_size):
            low = copy.deepcopy(ref).to(torch.bfloat16)
            x, y = data(step, r)
            ref_loss = F.mse_loss(low(x.to(torch.bfloat16)).float(), y)
            ref_loss.backward()
            losses.append(ref_loss)
            grads.append([p.grad for p in low.parameters()])
        assert torch.equal(loss, losses[rank]), (step, loss.item(), losses[rank].item())
        for (n, p), q, *gs in zip(model.named_parameters(), ref.parameters(), *grads):
            q.grad = sum(g.to(reduce) / world_size for g in gs).float()
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
            assert_close_tensors(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=f"grad {n} step {step}")
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        assert_close_tensors(params_of(model), dict(ref.named_parameters()), atol=1e-6, rtol=1e-5, msg=f"step {step}")
        assert all(p.dtype == torch.float32 for p in model.parameters())


def _mixed_precision_vs_autocast(rank: int, world_size: int) -> None:
    """Loosely: bf16 replicate tracks DDP + CPU autocast(bf16) on the same data."""
    torch.manual_seed(3)
    model = Chain()
    ref = DDP(copy.deepcopy(model))
    replicate(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        batch = data(step, rank)
        loss = loss_fn(model, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = loss_fn(ref, batch)
        torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
        loss.backward()
        ref_loss.backward()
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        assert_close_tensors(params_of(model), dict(ref.module.named_parameters()), atol=2e-2, rtol=2e-2)


def _no_sync(rank: int, world_size: int) -> None:
    """Two micro-batches under no_sync, one synced: equal to DDP doing the same, and the
    no-sync backwards communicate nothing."""
    torch.manual_seed(4)
    model = Chain()
    ref = DDP(copy.deepcopy(model))
    replicate(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        for micro in range(3):
            batch = data(10 * step + micro, rank)
            if micro < 2:
                with no_sync(model), count_collectives() as comm:
                    loss_fn(model, batch).backward()
                assert comm.total == 0, comm.events
                with ref.no_sync():
                    loss_fn(ref, batch).backward()
            else:
                with count_collectives() as comm:
                    loss_fn(model, batch).backward()
                assert comm.counts["all_reduce"] >= 1, comm.events
                loss_fn(ref, batch).backward()
        for (n, p), q in zip(model.named_parameters(), ref.module.parameters()):
            assert_close_tensors(p.grad, q.grad, exact=True, msg=f"grad {n} step {step}")
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        assert_close_tensors(params_of(model), dict(ref.module.named_parameters()), exact=True, msg=f"step {step}")


def _count_all_reduces(rank: int, world_size: int, bucket_cap_mb: float) -> int:
    model = replicate(Chain(), bucket_cap_mb=bucket_cap_mb)
    loss_fn(model, data(0, rank)).backward()  # warm-up (lazy init, buckets built)
    with count_collectives() as comm:
        loss_fn(model, data(1, rank)).backward()
    assert set(comm.counts) <= {"all_reduce"}, comm.events
    return comm.counts["all_reduce"]


def _overlap(rank: int, world_size: int, bucket_cap_mb: float) -> list[list[int]]:
    """Per backward (three of them): how many all-reduces had been issued when each layer's
    backward began, in layer order, then the total after backward returned."""
    model = Chain()
    replicate(model, bucket_cap_mb=bucket_cap_mb)
    tracer = count_collectives()
    issued_before: dict[int, int] = {}
    for i, layer in enumerate(model.layers):
        # Runs (on the thread running backward) right before this layer's backward computes
        # anything, i.e. once the gradient of its output is known.
        layer.register_full_backward_pre_hook(lambda m, g, i=i: issued_before.__setitem__(i, tracer.total))
    runs = []
    with warnings.catch_warnings():
        # Layer 0's input does not require grad (on purpose: then no post-backward hook of
        # the root runs, and only the gradient hooks can launch buckets); torch warns.
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        for step in range(3):
            issued_before.clear()
            with tracer:
                loss_fn(model, data(step, rank)).backward()
            runs.append([issued_before[i] for i in range(len(model.layers))] + [tracer.total])
            tracer.records.clear()
    return runs


def _root_over_sharded_children(rank: int, world_size: int) -> None:
    model = Tree()
    fully_shard(model.a)
    fully_shard(model.b)
    replicate(model)
    assert fully_shard.state(model.a).param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert fully_shard.state(model.b).param_names == ["weight", "bias"]
    assert replicate.state(model).param_names == ["scale", "head.weight", "head.bias"]
    for name, p in model.named_parameters():
        expected = (Replicate(),) if name in ("scale", "head.weight", "head.bias") else None
        assert isinstance(p, DTensor), name
        if expected:
            assert p.placements == expected, (name, p.placements)
        else:
            assert p.placements[0].is_shard(0), (name, p.placements)


# ----------------------------------------------------------------------------- tests


def test_parameters_are_replicate_dtensors_and_fqns_unchanged() -> None:
    run_on_ranks(_placements_and_identity, 2)


@pytest.mark.parametrize("variant", ["default", "mesh", "process_group"])
def test_parity_with_ddp(variant: str) -> None:
    run_on_ranks(_ddp_parity, 2, variant=variant, opt="sgd", bucket_cap_mb=25.0)


@requires_gpus(2)
@pytest.mark.parametrize("variant", ["default", "mesh"])
def test_parity_with_ddp_on_gpus_nccl(variant: str) -> None:
    run_on_ranks(_ddp_parity, 2, variant=variant, opt="adam", bucket_cap_mb=1e-4, device="cuda", backend="nccl")


def test_parity_with_ddp_adam_small_buckets() -> None:
    # Buckets of ~100 bytes: several per backward, on both sides.
    run_on_ranks(_ddp_parity, 2, variant="default", opt="adam", bucket_cap_mb=1e-4)


def test_parity_with_ddp_tied_transformer() -> None:
    run_on_ranks(_transformer_parity, 2)


def test_mixed_precision_bf16_matches_same_precision_reference() -> None:
    run_on_ranks(_mixed_precision, 2)


def test_mixed_precision_bf16_tracks_ddp_with_autocast() -> None:
    run_on_ranks(_mixed_precision_vs_autocast, 2)


def test_no_sync_matches_ddp_no_sync_and_communicates_nothing() -> None:
    run_on_ranks(_no_sync, 2)


def test_small_buckets_mean_more_all_reduces() -> None:
    tiny = run_on_ranks(_count_all_reduces, 2, bucket_cap_mb=1e-9)[0]
    huge = run_on_ranks(_count_all_reduces, 2, bucket_cap_mb=1e4)[0]
    assert huge == 1, huge
    assert tiny == 8, tiny  # one bucket per parameter (4 weights + 4 biases)


def test_all_reduces_are_launched_during_backward() -> None:
    # With one bucket per parameter, each layer's two buckets are launched as soon as its
    # backward has produced their gradients: before the backward of the layers below it
    # begins (layer 3's backward runs first). With one huge bucket nothing is issued until
    # every gradient is in.
    # Every backward, not only the first (a stale bucket bookkeeping once deferred all
    # buckets of later backwards to the end).
    per_param = run_on_ranks(_overlap, 2, bucket_cap_mb=1e-9)[0]
    assert per_param == [[6, 4, 2, 0, 8]] * 3, per_param
    one_bucket = run_on_ranks(_overlap, 2, bucket_cap_mb=1e4)[0]
    assert one_bucket == [[0, 0, 0, 0, 1]] * 3, one_bucket


def test_root_over_sharded_children_manages_exactly_the_rest() -> None:
    run_on_ranks(_root_over_sharded_children, 2)
