"""`composable.optim.whole_matrices`: any function of whole matrices over sharded tensors, the
mechanism Muon orthogonalizes with, open to other whole-matrix optimizers.

A whole-matrix optimizer a user writes in a few lines (SGD whose update is the exact polar factor
U V^T of its momentum, by SVD) steps sharded parameters as one process steps the whole ones, bit
for bit, on the layouts Muon's tests cover: fully_shard with uneven rows (a rank without a row),
HSDP x TP (column- and row-parallel matrices), and replicate.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _harness import run_on_ranks
from test_muon import _model, _shard, _whole
from torch.distributed.tensor import DTensor

from composable.optim import whole_matrices


def _polar(matrix: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u @ vh


class PolarSGD(torch.optim.Optimizer):
    """SGD with momentum whose update is the polar factor of the momentum matrix."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            momenta = []
            for p in params:
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                momenta.append(buf)
            for p, update in zip(params, whole_matrices(_polar, momenta)):
                p.add_(update, alpha=-group["lr"])


def _vs_one_process(rank: int, world: int, layout: str) -> None:
    model = _model(layout)
    ref = copy.deepcopy(model)
    _shard(model, layout, world)
    hidden = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2]
    ref_hidden = [p for n, p in ref.named_parameters() if p.requires_grad and p.ndim == 2]
    opt, ref_opt = PolarSGD(hidden, lr=0.05), PolarSGD(ref_hidden, lr=0.05)
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 8)).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = None if p.grad is None else _whole(p.grad).clone()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(_whole(p), q), f"{layout}: {name} differs from one process after step {step}"
    for p in hidden:
        momentum = opt.state[p]["momentum"]
        assert not isinstance(p, DTensor) or momentum.placements == p.placements


@pytest.mark.parametrize("layout, world", [("fully_shard", 4), ("hsdp_tp", 4), ("replicate", 2)], ids=str)
def test_a_whole_matrix_optimizer_steps_as_one_process(layout: str, world: int) -> None:
    run_on_ranks(_vs_one_process, world, layout)


def test_plain_tensors_and_stacks() -> None:
    """Plain tensors are whole here: `fn` of each matrix, a 3D tensor matrix by matrix."""
    torch.manual_seed(0)
    matrix, stack = torch.randn(5, 3), torch.randn(2, 4, 4)
    out = whole_matrices(_polar, [matrix, stack])
    assert torch.equal(out[0], _polar(matrix))
    assert torch.equal(out[1], torch.stack([_polar(m) for m in stack]))
    as_bf16 = whole_matrices(lambda m: m * 2, [matrix], wire_dtype=torch.bfloat16)[0]
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, matrix.bfloat16() * 2)


def test_errors() -> None:
    api = "composable.optim.whole_matrices"
    with pytest.raises(TypeError, match=f"^{api}: 'fn' must be callable, got str$"):
        whole_matrices("svd", [torch.ones(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"^{api}: tensors\[1\] must be a tensor, got list$"):
        whole_matrices(_polar, [torch.ones(2, 2), [[1.0]]])  # type: ignore[list-item]
    with pytest.raises(
        ValueError, match=rf"^{api}: tensors\[0\] must be 2D or a 3D stack of matrices, got shape \(4,\)$"
    ):
        whole_matrices(_polar, [torch.ones(4)])
    with pytest.raises(
        ValueError, match=rf"^{api}: the tensors' dtypes differ \(torch.bfloat16, torch.float32\); pass 'wire_dtype'$"
    ):
        whole_matrices(_polar, [torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bfloat16)])
