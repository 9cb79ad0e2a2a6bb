"""The FSDP2 adapter's `fsdp2_fully_shard` answers what FSDP2's `fully_shard` answers about
itself, side by side with FSDP2 on the same modules: `.state(module)` (one state per call), the
class it swaps in (`FSDP<Cls>`, only on the module given; a slice of a sharded `Sequential` is a
plain one), a second application (refused with FSDP2's type and words), containers without a
`forward` (`ValueError`). One decided difference, pinned here and stated in docs/migrating.md:
`copy.deepcopy` of a sharded module works (FSDP2 raises).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import fake_process_group
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import composable
from composable.integrations.fsdp2_module import AlreadyShardedError, fsdp2_fully_shard

SHARDERS = {"fsdp2": torch_fully_shard, "adapter": fsdp2_fully_shard}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


@pytest.mark.parametrize("library", SHARDERS)
def test_one_state_per_call(library: str) -> None:
    shard = SHARDERS[library]
    with fake_process_group(1):
        model = nn.Sequential(MLP(), MLP(), MLP())
        for mlp in model:
            shard(mlp)
        shard(model)
        states = [shard.state(m) for m in [model, *model]]  # type: ignore[attr-defined]
        assert all(s is not None for s in states)
        assert len({id(s) for s in states}) == 4
        if library == "adapter":
            assert all(s is composable.fully_shard.state(m) for s, m in zip(states, [model, *model]))


@pytest.mark.parametrize("library", SHARDERS)
def test_class_swapped_on_the_given_module_only(library: str) -> None:
    shard = SHARDERS[library]
    with fake_process_group(1):
        model = MLP()
        shard(model)
        assert isinstance(model, MLP) and isinstance(model, FSDPModule)
        assert type(model).__name__ == "FSDPMLP"
        assert not any(isinstance(m, FSDPModule) for m in model.modules() if m is not model)
        seq = nn.Sequential(MLP(), MLP(), MLP())
        shard(seq)
        assert type(seq).__name__ == "FSDPSequential"
        sliced = seq[:2]
        assert type(sliced) is nn.Sequential and not isinstance(sliced, FSDPModule)


@pytest.mark.parametrize("library", SHARDERS)
def test_second_application_refused(library: str) -> None:
    shard = SHARDERS[library]
    with fake_process_group(1):
        model = MLP()
        shard(model)
        with pytest.raises(AssertionError, match="can only be applied to a module once") as caught:
            shard(model)
        if library == "adapter":  # also composable's type for a forbidden composition, naming the argument
            assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, AlreadyShardedError)
            assert "argument 'module' (FSDPMLP)" in str(caught.value)


@pytest.mark.parametrize("container", [nn.ModuleList, nn.ModuleDict])
@pytest.mark.parametrize("library", SHARDERS)
def test_container_without_forward_refused(library: str, container: type) -> None:
    shard = SHARDERS[library]
    with fake_process_group(1):
        members = [MLP(), MLP()]
        module = container(members) if container is nn.ModuleList else container(dict(zip("ab", members)))
        with pytest.raises(ValueError, match="fully_shard does not support containers that do not implement forward"):
            shard(module)
        assert not isinstance(module, FSDPModule)
        assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in module.parameters())


def test_deepcopy_is_a_decided_difference() -> None:
    """FSDP2 refuses `copy.deepcopy`; the adapter copies, as composable's core does: the copy is
    sharded on its own (its own state and storage) and computes what the original computes."""
    with fake_process_group(1):
        theirs = MLP()
        torch_fully_shard(theirs)
        with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
            copy.deepcopy(theirs)
        torch.manual_seed(0)
        ours = MLP()
        fsdp2_fully_shard(ours)
        twin = copy.deepcopy(ours)
        assert type(twin).__name__ == "FSDPMLP" and isinstance(twin, FSDPModule)
        assert fsdp2_fully_shard.state(twin) is not fsdp2_fully_shard.state(ours)  # type: ignore[attr-defined]
        x = torch.randn(3, 8)
        assert torch.equal(twin(x), ours(x))
        with torch.no_grad():
            next(twin.parameters()).add_(1.0)
        assert not torch.equal(twin(x), ours(x))  # its own storage
