"""Misuse that would otherwise train wrongly without a word:

- an optimizer built before `fully_shard` / `replicate` holds the replaced plain parameters:
  its `step()` raises instead of changing tensors the model no longer uses;
- a parameter (or a submodule with parameters) registered on a managed module after the API
  call would be neither sharded nor reduced: the next forward raises naming it, unless an API
  applied afterwards manages it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, fake_process_group, run_on_ranks
from _models import MLP
from torch.distributed.device_mesh import init_device_mesh

from composable import fully_shard, replicate

APIS = ["fully_shard", "replicate"]


def _apply(api: str, model: nn.Module, mesh: object) -> None:
    if api == "replicate":
        replicate(model, mesh=mesh)
    else:
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    opt.zero_grad()


# ----------------------------------------------------------------------------- optimizer built too early


@pytest.mark.parametrize("api", APIS)
def test_optimizer_built_before_the_call_refuses_to_step(api: str) -> None:
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        model = MLP(5)
        early = torch.optim.AdamW(model.parameters(), lr=0.1)
        _apply(api, model, mesh)
        model(torch.randn(2, 5)).sum().backward()
        with pytest.raises(
            RuntimeError, match=rf"AdamW\.step\(\): 4 of its parameters .* replaced by {api}.*build it after"
        ):
            early.step()
        # One built after the call steps the sharded parameters the model uses.
        before = [p._local_tensor.clone() for p in model.parameters()]
        torch.optim.AdamW(model.parameters(), lr=0.1).step()
        assert all(not torch.equal(b, p._local_tensor) for b, p in zip(before, model.parameters()))


def test_replaced_parameter_added_later_to_a_good_optimizer_is_refused() -> None:
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        model = MLP(5)
        stale = list(model.fc2.parameters())
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(model, opt)  # checked once, then cached
        opt.add_param_group({"params": stale})
        model(torch.randn(2, 5)).sum().backward()
        with pytest.raises(RuntimeError, match=r"SGD\.step\(\): 2 of its parameters .* param group 1"):
            opt.step()


@pytest.mark.parametrize("api", APIS)
def test_optimizer_built_before_load_state_dict_with_assign_refuses_to_step(api: str) -> None:
    """`load_state_dict(assign=True)` replaces the sharded parameters themselves: an optimizer
    built before holds the old ones (PyTorch documents that it must be built after)."""
    with fake_process_group(2):
        model = MLP(5)
        _apply(api, model, init_device_mesh("cpu", (2,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(model, opt)
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(saved, assign=True)
        model(torch.randn(2, 5)).sum().backward()  # the group adopts the new parameters here
        with pytest.raises(RuntimeError, match=rf"SGD\.step\(\): 4 of its parameters .* replaced by {api}"):
            opt.step()
        torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_unrelated_optimizers_are_untouched() -> None:
    """Plain parameters of an unmanaged model step as usual once the hook is installed."""
    with fake_process_group(2):
        fully_shard(MLP(5), mesh=init_device_mesh("cpu", (2,)))
        plain = nn.Linear(3, 3)
        opt = torch.optim.SGD(plain.parameters(), lr=1.0)
        plain(torch.ones(1, 3)).sum().backward()
        before = plain.weight.detach().clone()
        opt.step()
        assert not torch.equal(before, plain.weight)


# ----------------------------------------------------------------------------- parameters registered late


@pytest.mark.parametrize("api", APIS)
def test_parameter_registered_after_the_call_raises_at_forward(api: str) -> None:
    with fake_process_group(2):
        model = MLP(5)
        _apply(api, model, init_device_mesh("cpu", (2,)))
        model(torch.randn(2, 5))
        model.fc2.scale = nn.Parameter(torch.ones(5))
        for _ in range(2):  # raised at every forward until dealt with, not once
            with pytest.raises(
                RuntimeError, match=rf"{api}: parameter\(s\) 'fc2.scale' were registered .* after {api}"
            ):
                model(torch.randn(2, 5))
        del model.fc2.scale
        model(torch.randn(2, 5))


def test_submodule_attached_after_the_call_raises_naming_its_parameters() -> None:
    with fake_process_group(2):
        model = MLP(5)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        model.adapter = nn.Linear(5, 5)
        with pytest.raises(RuntimeError, match=r"'adapter.weight', 'adapter.bias' were registered"):
            model(torch.randn(2, 5))


def test_registering_under_a_known_name_and_buffers_are_fine() -> None:
    """Replacing a managed slot is the group's business (adopted or refused with its own
    error); buffers are never sharded."""
    with fake_process_group(2):
        model = MLP(5)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        model.register_buffer("seen", torch.zeros(1))
        model.fc1.weight = model.fc1.weight  # the same sharded DTensor again
        model(torch.randn(2, 5))


def _claimed_by_a_later_call(rank: int, world_size: int) -> None:
    """A parameter added to a child that `fully_shard` manages, before the root's call: the
    root claims it (bottom-up), so it is sharded, reduced and trains like the reference."""
    torch.manual_seed(0)
    model = MLP(5)
    ref = copy.deepcopy(model)
    fully_shard(model.fc1)
    model.fc1.gain = nn.Parameter(torch.linspace(0.5, 1.5, 15))
    ref.fc1.gain = nn.Parameter(torch.linspace(0.5, 1.5, 15))
    fully_shard(model)
    assert "fc1.gain" in fully_shard.state(model).param_names
    for net in (model, ref):
        net.fc1.register_forward_hook(lambda m, args, out: out * m.gain)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(2 * world_size, 5, generator=torch.Generator().manual_seed(step))
        model(x[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert_close_tensors(p.full_tensor(), r, msg=name)


def test_parameter_claimed_by_a_later_call_trains_like_the_reference() -> None:
    run_on_ranks(_claimed_by_a_later_call, 2)
