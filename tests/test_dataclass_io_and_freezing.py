"""Less common shapes of real use, each found broken by review and fixed: dataclass forward
outputs and inputs (backward hooks and mixed-precision casts must look inside them, as
PyTorch's own wrappers do), and freezing or unfreezing parameters after `fully_shard`."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
from _harness import run_on_ranks
from torch.distributed.tensor import DTensor

from composable import MixedPrecisionPolicy, fully_shard

TIMEOUT = 120


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(5, 4)  # same batch on every rank: averaged grads == single-process grads


def _full(g: torch.Tensor) -> torch.Tensor:
    return g.full_tensor() if isinstance(g, DTensor) else g


def _check_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name}: expected no gradient (frozen), got one"
        else:
            assert p.grad is not None, f"{name}: gradient missing"
            torch.testing.assert_close(_full(p.grad), q.grad, msg=f"{name}: gradient differs")


# ----------------------------------------------------------------------------- dataclass outputs / inputs


@dataclass
class _Output:
    y: torch.Tensor
    aux: object = None


class _DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(self.b(torch.tanh(self.a(x))))


def _dataclass_output(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _DataclassOut()
    ref = copy.deepcopy(model)
    fully_shard(model.a)
    fully_shard(model)
    x = _x()
    model(x).y.sum().backward()
    ref(x).y.sum().backward()
    _check_grads(model, ref)


def test_dataclass_output_trains() -> None:
    run_on_ranks(_dataclass_output, 2, timeout=TIMEOUT)


@dataclass
class _Input:
    x: torch.Tensor


class _DataclassIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, inp: _Input) -> torch.Tensor:
        return self.lin(inp.x)


def _dataclass_input_cast(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _DataclassIn()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out = model(_Input(_x()))  # RuntimeError: mat1 and mat2 must have the same dtype (Float vs BFloat16)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()


def test_dataclass_input_is_cast_to_param_dtype() -> None:
    run_on_ranks(_dataclass_input_cast, 2, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- requires_grad changed after fully_shard


def _requires_grad_changed_after_wrap(rank: int, world_size: int, mode: str) -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    initially = mode == "freeze"
    for m in (model, ref):
        m[0].weight.requires_grad_(initially)
    fully_shard(model[0])
    fully_shard(model)
    for m in (model, ref):  # flip it before the first forward
        m[0].weight.requires_grad_(not initially)
    assert model[0].weight.requires_grad is (not initially)
    x = _x()
    model(x).sum().backward()
    ref(x).sum().backward()
    _check_grads(model, ref)


def test_freeze_after_fully_shard() -> None:
    run_on_ranks(_requires_grad_changed_after_wrap, 2, "freeze", timeout=TIMEOUT)


def test_unfreeze_after_fully_shard() -> None:
    run_on_ranks(_requires_grad_changed_after_wrap, 2, "unfreeze", timeout=TIMEOUT)
