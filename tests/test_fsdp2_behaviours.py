"""What a user moving from PyTorch FSDP2 meets, side by side with FSDP2 where it has the feature.

- `Shard(1)` from `shard_placement_fn`: local shards and their gradients are contiguous, as FSDP2's
  (also for uneven sizes, which FSDP2 refuses on dims > 0);
- a shard group of one rank runs no all-gather and no reduce-scatter, as FSDP2 (mixed precision,
  gradient accumulation, clipping, state dicts; HSDP whose shard dim has one rank all-reduces only);
- torch's `register_fsdp_forward_method` works on composable's modules, core and FSDP2 adapter;
- the adapter shows the unsharded parameters after a forward that keeps them, as FSDP2;
- what composable accepts that FSDP2 refuses (a 2D mesh without names, 0-d and channels_last
  parameters), each trained against a reference, and its errors for what both refuse.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, count_collectives, fake_process_group, run_on_ranks, step_and_match
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import composable
from composable import MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from composable.integrations.fsdp2_module import fsdp2_fully_shard


class Net(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(2))
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        """Computes with the parameters without calling forward (as HF's generate)."""
        return self.out(torch.tanh(self.inp(x)))


def _shard(shard: object, model: Net, **options: object) -> Net:
    for block in model.blocks:
        shard(block, **options)  # type: ignore[operator]
    shard(model, **options)  # type: ignore[operator]
    return model


def _data(step: int, rank: int, dim: int = 8) -> torch.Tensor:
    return torch.randn(4, dim, generator=torch.Generator().manual_seed(100 * step + rank))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------- Shard(1)


def on_dim1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.dim() >= 2 else None


def _shard1_contiguous(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Net()
    ours = _shard(fully_shard, copy.deepcopy(ref), shard_placement_fn=on_dim1)
    models = [ours]
    if world == 2:  # FSDP2 refuses uneven sizes on dims > 0 (12 over 3 is even, 8 over 3 is not)
        mesh = init_device_mesh("cpu", (world,))
        models.append(_shard(torch_fully_shard, copy.deepcopy(ref), mesh=mesh, shard_placement_fn=on_dim1))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (*models, ref)]
    for step in range(2):
        for m in models:
            m(_data(step, rank)).square().mean().backward()
        ref(torch.cat([_data(step, r) for r in range(world)])).square().mean().backward()
        for i, m in enumerate(models):
            for (name, p), r in zip(m.named_parameters(), ref.parameters()):
                assert p.placements == ((Shard(1),) if p.dim() >= 2 else (Shard(0),)), (name, p.placements)
                assert p.to_local().is_contiguous(), (i, name, p.to_local().stride())
                assert p.grad.to_local().is_contiguous(), (i, name, p.grad.to_local().stride())
                assert_close_tensors(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6, msg=f"{i} grad {name}")
        if len(models) == 2:
            for (name, a), b in zip(ours.named_parameters(), models[1].parameters()):
                assert_close_tensors(a.grad.to_local(), b.grad.to_local(), exact=True, msg=f"grad {name} vs FSDP2")
                assert_close_tensors(a.to_local(), b.to_local(), exact=True, msg=f"param {name} vs FSDP2")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for p in ours.parameters():  # the optimizer's state is laid out as the local shard
            assert opts[0].state[p]["exp_avg"].to_local().is_contiguous()


@pytest.mark.parametrize("world", [2, 3])
def test_shard1_local_shards_and_grads_are_contiguous_as_fsdp2(world: int) -> None:
    run_on_ranks(_shard1_contiguous, world)


# ----------------------------------------------------------------------------- a shard group of one rank


def _world_of_one(rank: int, world: int) -> dict[str, int]:
    torch.manual_seed(0)
    ref = Net()
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _shard(fully_shard, copy.deepcopy(ref), mp_policy=MixedPrecisionPolicy(**mp))
    theirs = _shard(torch_fully_shard, copy.deepcopy(ref), mp_policy=TorchMixedPrecisionPolicy(**mp))
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ours, theirs)]
    counts: dict[str, int] = {}
    for step in range(3):
        for which, model in enumerate((ours, theirs)):
            with count_collectives() as c:
                for micro in range(2):  # gradient accumulation: sync off for the first micro-batch
                    sync = micro == 1
                    if which == 0:
                        composable.set_requires_gradient_sync(model, sync)
                    else:
                        model.set_requires_gradient_sync(sync)
                    model(_data(step * 2 + micro, rank)).float().square().mean().backward()
            for kind in ("all_gather", "reduce_scatter"):
                counts[f"{which}.{kind}"] = counts.get(f"{which}.{kind}", 0) + c.counts[kind]
            norm = clip_grad_norm_(model.parameters(), 0.5)
            assert torch.isfinite(norm)
        step_and_match(ours, theirs, opts, f"step {step}", same_placements=True)
    # state dicts: DTensors, the same values as FSDP2's, and loadable
    sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        assert_close_tensors(value.to_local(), theirs_sd[key].to_local(), exact=True, msg=key)
    ours.load_state_dict(sd)
    return counts


def test_a_world_of_one_runs_no_all_gather_or_reduce_scatter() -> None:
    """As FSDP2: bf16 parameters, fp32 reduction, accumulation, clipping, AdamW, bit for bit."""
    (counts,) = run_on_ranks(_world_of_one, 1)
    assert counts == {"0.all_gather": 0, "0.reduce_scatter": 0, "1.all_gather": 0, "1.reduce_scatter": 0}


def _hsdp_one_rank_shards(rank: int, world: int) -> dict[str, int]:
    torch.manual_seed(0)
    ref = Net()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    ours = _shard(fully_shard, copy.deepcopy(ref), mesh=mesh)
    theirs = _shard(torch_fully_shard, copy.deepcopy(ref), mesh=mesh)
    counts: dict[str, int] = {}
    for which, model in enumerate((ours, theirs)):
        with count_collectives() as c:
            model(_data(0, rank)).square().mean().backward()
        counts.update({f"{which}.{k}": v for k, v in c.counts.items()})
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert_close_tensors(a.grad.to_local(), b.grad.to_local(), exact=True, msg=name)
    return counts


def test_hsdp_with_one_rank_per_shard_group_only_all_reduces() -> None:
    counts = run_on_ranks(_hsdp_one_rank_shards, 2)[0]
    assert counts.get("0.all_gather", 0) == counts.get("1.all_gather", 0) == 0, counts
    assert counts.get("0.reduce_scatter", 0) == counts.get("1.reduce_scatter", 0) == 0, counts
    assert counts["0.all_reduce"] == counts["1.all_reduce"] == 3, counts  # one per group


# ----------------------------------------------------------------------------- register_fsdp_forward_method


def _forward_method(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Net()
    models = [_shard(shard, copy.deepcopy(ref)) for shard in (torch_fully_shard, fully_shard, fsdp2_fully_shard)]
    x = _data(0, rank)
    outputs = []
    for model in models:
        torch.distributed.fsdp.register_fsdp_forward_method(model, "generate")
        torch.distributed.fsdp.register_fsdp_forward_method(model, "generate")  # again: FSDP2 takes it
        with torch.no_grad():
            outputs.append(model.generate(x))
        assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded after it
    for out in outputs[1:]:
        assert_close_tensors(out, outputs[0], exact=True, msg="generate")
    assert_close_tensors(outputs[0], ref.generate(x), exact=True, msg="generate vs the plain model")
    plain = Net()  # a module nobody manages: torch's own function, a no-op there
    torch.distributed.fsdp.register_fsdp_forward_method(plain, "generate")
    assert "generate" not in plain.__dict__
    with pytest.raises(ValueError, match="has no method 'sample'"):
        torch.distributed.fsdp.register_fsdp_forward_method(models[1], "sample")


def test_torch_register_fsdp_forward_method_works_on_composable_modules() -> None:
    run_on_ranks(_forward_method, 2)


# ----------------------------------------------------------------------------- adapter: unsharded after forward


def _shown_after_forward(rank: int, world: int) -> dict[str, tuple[bool, bool]]:
    torch.manual_seed(0)
    ref = Net()
    shown = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("adapter", fsdp2_fully_shard), ("core", fully_shard)):
        model = _shard(shard, copy.deepcopy(ref), reshard_after_forward=False)
        loss = model(_data(0, rank)).square().mean()
        after_forward = all(isinstance(p, DTensor) for p in model.parameters())
        loss.backward()
        shown[name] = (after_forward, all(isinstance(p, DTensor) for p in model.parameters()))
        if name == "adapter":
            assert isinstance(model, torch.distributed.fsdp.FSDPModule)
    return shown


def test_adapter_shows_unsharded_parameters_after_a_forward_that_keeps_them() -> None:
    """(sharded after forward, sharded after backward): FSDP2 and its adapter show the unsharded
    parameters between the passes; the core shows the sharded ones (docs/migrating.md)."""
    shown = run_on_ranks(_shown_after_forward, 2)[0]
    assert shown == {"fsdp2": (False, True), "adapter": (False, True), "core": (True, True)}


# ----------------------------------------------------------------------------- what FSDP2 refuses


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(8, 8), nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _train_like_reference(rank: int, world: int, case: str) -> None:
    torch.manual_seed(0)
    ref: nn.Module
    if case == "0-d":
        ref = Scaled()
    elif case == "channels_last":
        ref = nn.Sequential(nn.Conv2d(4, 6, 3), nn.Flatten(), nn.Linear(6 * 4, 8))
        ref[0].weight.data = ref[0].weight.data.to(memory_format=torch.channels_last)
    else:  # a 2D mesh without names: HSDP
        ref = Net()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (1, world)) if case == "unnamed 2D" else None
    fully_shard(model, mesh=mesh)
    expected = {"0-d": (Replicate(),), "channels_last": (Shard(0),), "unnamed 2D": (Replicate(), Shard(0))}[case]
    for name, p in model.named_parameters():
        if p.dim() == 0 or case != "0-d":
            assert p.placements == expected, (name, p.placements)
        assert p.to_local().is_contiguous(), name
    data = [
        torch.randn(2, *((4, 4, 4) if case == "channels_last" else (8,)), generator=torch.Generator().manual_seed(r))
        for r in range(world)
    ]
    model(data[rank]).square().mean().backward()
    ref(torch.cat(data)).square().mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert_close_tensors(p.full_tensor(), r, exact=True, msg=f"param {name}")
        assert_close_tensors(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6, msg=f"grad {name}")


@pytest.mark.parametrize("case", ["0-d", "channels_last", "unnamed 2D"])
def test_what_fsdp2_refuses_trains_like_the_reference(case: str) -> None:
    """FSDP2 refuses a 0-d parameter (ValueError), a non-contiguous one (NotImplementedError)
    and a 2D mesh without dim names (AssertionError); composable takes them."""
    run_on_ranks(_train_like_reference, 2, case)


def test_errors_where_fsdp2_differs() -> None:
    with fake_process_group(4):
        with pytest.raises(
            ValueError, match=r"fully_shard: 'shard_placement_fn' returned Shard\(dim=-3\) for 'weight'"
        ):
            fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(-3))
        with pytest.raises(
            ValueError, match=r"fully_shard: 'mesh' must be 1D or 2D, got a 3D mesh of shape \(1, 2, 2\)"
        ):
            fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 2, 2)))

        class Tied(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
                self.b.weight = self.a.weight

        tied = Tied()
        fully_shard(tied.a)
        with pytest.raises(
            RuntimeError,
            match=r"Cannot apply fully_shard to Linear: its parameter 'weight' is shared \(tied\) .* put the modules "
            r"that share it in one group \(fully_shard\(\[module_a, module_b\]\)\) or apply fully_shard to a common",
        ):
            fully_shard(tied.b)
        tied = Tied()
        fully_shard([tied.a, tied.b])  # the way it works, as in FSDP2
        assert tied.a.weight is tied.b.weight and isinstance(tied.a.weight, DTensor)
