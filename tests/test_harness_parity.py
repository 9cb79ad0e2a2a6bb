"""The harness's `step_and_match`: both models step and zero, gradients and parameters are
matched by name in order, and frozen parameters must have no gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from _harness import step_and_match


def _twin_models() -> tuple[torch.nn.Module, torch.nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    a[0].weight.requires_grad_(False)  # a frozen base weight
    b = copy.deepcopy(a)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (a, b)]
    return a, b, opts


def test_step_and_match_steps_both_and_skips_frozen_parameters() -> None:
    a, b, opts = _twin_models()
    x = torch.randn(3, 4)
    losses = (a(x).sum(), b(x).sum())
    for loss in losses:
        loss.backward()
    before = a[1].weight.detach().clone()
    step_and_match(a, b, opts, "step 0", losses=losses)
    assert not torch.equal(a[1].weight, before) and a[1].weight.grad is None  # stepped and zeroed
    a(x).sum().backward()
    b(x).sum().backward()
    b[1].bias.grad.add_(1.0)
    with pytest.raises(AssertionError, match="step 1 grad 1.bias"):
        step_and_match(a, b, opts, "step 1")


def test_step_and_match_refuses_a_gradient_on_a_frozen_parameter() -> None:
    a, b, opts = _twin_models()
    a(torch.randn(3, 4)).sum().backward()
    a[0].weight.grad = torch.zeros_like(a[0].weight)
    with pytest.raises(AssertionError, match="step 0: frozen 0.weight got a gradient"):
        step_and_match(a, b, opts, "step 0")
