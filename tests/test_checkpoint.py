"""checkpoint: activation checkpointing installed by hooks, alone and with fully_shard/replicate.

Alone (one process): activations inside the module are not saved (bytes measured with
`torch.autograd.graph.saved_tensors_hooks`), the forward is recomputed in backward under the
same RNG state (dropout gives the same gradients as the plain model), `preserve_rng_state=False`.
Composed with fully_shard and replicate: test_checkpoint_composed.py (the models here are its).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors
from torch.distributed.tensor import DTensor

from composable import checkpoint

DIM, HIDDEN = 6, 10
STEPS = 3


# ----------------------------------------------------------------------------- models


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RecLinear(nn.Linear):
    """nn.Linear that records (input dtype, weight dtype, recomputing?) per call."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append((x.dtype, self.weight.dtype, in_backward()))
        return super().forward(x)


class Unit(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.seq = nn.Sequential(RecLinear(DIM, HIDDEN), nn.Tanh(), nn.Dropout(dropout), RecLinear(HIDDEN, DIM))
        self.l = RecLinear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l(torch.tanh(self.seq(x)))


class Net(nn.Module):
    def __init__(self, dropout: float = 0.2) -> None:
        super().__init__()
        self.pre = RecLinear(DIM, DIM)
        self.u1 = Unit(dropout)
        self.u2 = Unit(dropout)
        self.head = RecLinear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.u2(self.u1(torch.tanh(self.pre(x)))))


def data(step: int, rank: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, 3, generator=g)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def logs(model: nn.Module) -> dict[str, list[tuple[torch.dtype, torch.dtype, bool]]]:
    return {n: m.log for n, m in model.named_modules() if isinstance(m, RecLinear)}


def clear_logs(model: nn.Module) -> None:
    for log in logs(model).values():
        log.clear()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


class SavedBytes:
    """Bytes autograd saves for backward inside the block (tensors packed by saved-tensor
    hooks; checkpointed regions install their own hooks, so they count nothing here)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        self.nbytes += local.numel() * local.element_size()
        return t

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


# ----------------------------------------------------------------------------- one process

BIG = 64  # rows: the activations inside the checkpointed module dominate


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    with SavedBytes() as saved:
        out = model(x)
    out.sum().backward()
    return saved.nbytes


def test_activations_inside_are_not_saved() -> None:
    torch.manual_seed(0)
    model = Net(dropout=0.0)
    x = torch.randn(BIG, DIM, requires_grad=True)
    plain = _saved_bytes(model, x)
    inner = _saved_bytes(model.u1, torch.tanh(model.pre(x)).detach().requires_grad_())
    ckpt = copy.deepcopy(model)
    checkpoint(ckpt.u1)
    saved = _saved_bytes(ckpt, x)
    # Everything u1 saved (its activations, which scale with the batch, and its weights) is
    # gone; only its input (BIG x DIM floats) is kept to recompute from; the rest of the
    # model saves what it saved before.
    input_bytes = BIG * DIM * 4
    assert inner > BIG * HIDDEN * 4, inner
    assert saved == plain - inner + input_bytes, (plain, inner, saved)
    # Checkpointing the whole model keeps only its input.
    whole = copy.deepcopy(model)
    checkpoint(whole)
    assert _saved_bytes(whole, x) == input_bytes


def test_forward_is_recomputed_in_backward() -> None:
    model = checkpoint(Net(dropout=0.0).u1)
    x = torch.randn(3, DIM, requires_grad=True)
    out = model(x)
    assert [call[2] for call in model.seq[0].log] == [False]
    out.sum().backward()
    assert [call[2] for call in model.seq[0].log] == [False, True]  # once more, in backward
    # Under no_grad there is nothing to recompute: no checkpoint context is entered.
    with torch.no_grad():
        model(x)
    assert len(model.seq[0].log) == 3


def _grads_and_rng(
    model: nn.Module, x: torch.Tensor, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, out.detach(), torch.get_rng_state()


@pytest.mark.parametrize("where", ["u1.seq", "u1", "root"])
def test_dropout_gradients_identical_with_preserved_rng(where: str) -> None:
    torch.manual_seed(1)
    plain = Net(dropout=0.5)
    model = copy.deepcopy(plain)
    checkpoint(model.get_submodule("" if where == "root" else where))
    x = torch.randn(5, DIM)
    ref_grads, ref_out, ref_rng = _grads_and_rng(plain, x, seed=3)
    grads, out, rng = _grads_and_rng(model, x, seed=3)
    assert torch.equal(out, ref_out)
    assert_close_tensors(grads, ref_grads, exact=True)
    # Recomputation ran under a forked RNG: the global generator ends where the plain run's does.
    assert torch.equal(rng, ref_rng)
    assert checkpoint.state(model.get_submodule("" if where == "root" else where)).preserve_rng_state


def test_preserve_rng_state_false() -> None:
    torch.manual_seed(2)
    x = torch.randn(5, DIM)
    # Without randomness it is exact; it just skips saving and restoring the RNG state.
    plain = Net(dropout=0.0)
    model = copy.deepcopy(plain)
    checkpoint(model.u1, preserve_rng_state=False)
    assert checkpoint.state(model.u1).preserve_rng_state is False
    assert_close_tensors(_grads_and_rng(model, x, 4)[0], _grads_and_rng(plain, x, 4)[0], exact=True)
    # With dropout the recomputation draws a fresh mask: it runs, but gradients differ from
    # the plain model's (which is why True is the default).
    plain = Net(dropout=0.5)
    model = copy.deepcopy(plain)
    checkpoint(model.u1, preserve_rng_state=False)
    grads, ref = _grads_and_rng(model, x, 5)[0], _grads_and_rng(plain, x, 5)[0]
    assert torch.equal(grads["u2.l.weight"], ref["u2.l.weight"])  # outside the checkpoint
    assert not torch.equal(grads["u1.seq.0.weight"], ref["u1.seq.0.weight"])


def test_bad_arguments_and_twice() -> None:
    with pytest.raises(TypeError, match="checkpoint.*module"):
        checkpoint("not a module")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="checkpoint.*preserve_rng_state"):
        checkpoint(nn.Linear(2, 2), preserve_rng_state=1)  # type: ignore[arg-type]
    m = nn.Linear(2, 2)
    assert checkpoint(m) is m and type(m) is nn.Linear
    with pytest.raises(RuntimeError, match="checkpoint"):
        checkpoint(m)


def test_backward_after_the_module_was_freed_says_so() -> None:
    """The graph holds the recompute function but not the module (a strong reference would
    keep every dropped model alive): a backward after the user freed the module cannot
    recompute it, and says why instead of failing somewhere inside autograd."""
    import gc

    block = checkpoint(nn.Sequential(nn.Linear(3, 3), nn.Tanh()))
    loss = block(torch.ones(2, 3, requires_grad=True)).sum()
    del block
    gc.collect()
    with pytest.raises(RuntimeError, match="checkpoint: the module was freed before its backward recomputed it"):
        loss.backward()
