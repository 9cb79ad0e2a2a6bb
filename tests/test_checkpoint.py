"""checkpoint: activation checkpointing installed by hooks, alone and with fully_shard/replicate.

Alone (one process): activations inside the module are not saved (bytes measured with
`torch.autograd.graph.saved_tensors_hooks`), the forward is recomputed in backward under the
same RNG state (dropout gives the same gradients as the plain model), `preserve_rng_state=False`.

Composed (world size 2, different data per rank): every configuration is checked step by step
against the plain model, which computes each rank's loss under the same dropout seed and
averages the gradients: losses and parameters agree bit for bit, with
`zero_grad(set_to_none=True)` and `False`. Mixed precision additionally records the dtypes
each linear sees in the original and in the recomputed forward.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors, run_on_ranks, step_and_match
from torch.distributed.tensor import DTensor

from composable import MixedPrecisionPolicy, ShardingStrategy, checkpoint, fully_shard, replicate

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


# ----------------------------------------------------------------------------- composed


def _cfg_seq_policy(m: Net) -> None:
    checkpoint(m.u1.seq)
    fully_shard(m.u1.seq, policy={nn.Linear})
    fully_shard(m)


def _cfg_inside_sharded(m: Net) -> None:
    fully_shard(m.u1)
    checkpoint(m.u1.seq)
    fully_shard(m)


def _cfg_sharded_root(m: Net) -> None:
    checkpoint(m.u1.seq)
    fully_shard(m)


def _cfg_sharded_root_no_shard(m: Net) -> None:
    checkpoint(m.u1.seq)
    fully_shard(m, strategy=ShardingStrategy.NO_SHARD)


def _cfg_same_ckpt_first(m: Net) -> None:
    checkpoint(m.u1)
    fully_shard(m.u1)
    checkpoint(m.u2)
    fully_shard(m.u2, strategy=ShardingStrategy.SHARD_GRAD_OP)
    fully_shard(m)


def _cfg_same_fsdp_first(m: Net) -> None:
    fully_shard(m.u1)
    checkpoint(m.u1)
    fully_shard(m.u2, strategy=ShardingStrategy.NO_SHARD)
    checkpoint(m.u2)
    fully_shard(m)


def _cfg_checkpointed_root(m: Net) -> None:
    fully_shard(m.u1)
    checkpoint(m)
    fully_shard(m)


def _cfg_replicate_same_ckpt_first(m: Net) -> None:
    checkpoint(m.u1)
    replicate(m.u1)
    fully_shard(m)


def _cfg_replicate_same_replicate_first(m: Net) -> None:
    replicate(m.u1)
    checkpoint(m.u1)
    fully_shard(m)


def _cfg_replicate_root(m: Net) -> None:
    checkpoint(m.u1.seq)
    fully_shard(m.u2)
    checkpoint(m.u2)
    replicate(m)


CONFIGS: dict[str, Callable[[Net], None]] = {
    "checkpoint(u1.seq); fully_shard(u1.seq, policy); fully_shard(root)": _cfg_seq_policy,
    "fully_shard(u1); checkpoint(u1.seq); fully_shard(root)": _cfg_inside_sharded,
    "checkpoint(u1.seq); fully_shard(root)": _cfg_sharded_root,
    "checkpoint(u1.seq); fully_shard(root, NO_SHARD)": _cfg_sharded_root_no_shard,
    "checkpoint(u); fully_shard(u)": _cfg_same_ckpt_first,
    "fully_shard(u); checkpoint(u)": _cfg_same_fsdp_first,
    "fully_shard(u1); checkpoint(root); fully_shard(root)": _cfg_checkpointed_root,
    "checkpoint(u1); replicate(u1); fully_shard(root)": _cfg_replicate_same_ckpt_first,
    "replicate(u1); checkpoint(u1); fully_shard(root)": _cfg_replicate_same_replicate_first,
    "checkpoint(u1.seq); fully_shard(u2); checkpoint(u2); replicate(root)": _cfg_replicate_root,
}


def _reference_step(ref: nn.Module, step: int, world_size: int) -> list[torch.Tensor]:
    """Every rank's loss under that rank's dropout seed; gradients averaged over ranks."""
    losses = []
    for r in range(world_size):
        torch.manual_seed(10 * step + r)
        loss = loss_fn(ref, data(step, r))
        loss.backward()
        losses.append(loss.detach())
    for p in ref.parameters():
        p.grad.div_(world_size)
    return losses


def _composed_parity(rank: int, world_size: int, name: str, set_to_none: bool) -> None:
    apply = CONFIGS[name]
    torch.manual_seed(7)
    model = Net()
    ref = copy.deepcopy(model)
    apply(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for step in range(STEPS):
        clear_logs(model)
        torch.manual_seed(10 * step + rank)
        loss = loss_fn(model, data(step, rank))
        loss.backward()
        ref_losses = _reference_step(ref, step, world_size)
        step_and_match(model, ref, opts, f"step {step}", losses=(loss, ref_losses[rank]), set_to_none=set_to_none)
        if not set_to_none:
            assert all(p.grad is not None for p in model.parameters())
        # Linears inside a checkpointed module ran twice (the second time in backward), the
        # others once.
        ckpt = [n for n, m in model.named_modules() if checkpoint.state(m) is not None]
        for mod, seen in logs(model).items():
            inside = any(p == "" or mod == p or mod.startswith(p + ".") for p in ckpt)
            assert [c[2] for c in seen] == ([False, True] if inside else [False]), (mod, seen)


# Which zero_grad each composition runs with (a covering set of config x set_to_none):
# set_to_none decides how the APIs' post-backward hooks find the gradients (None, or zeros to
# accumulate into), not how checkpoint recomputes, so every API and strategy (fully_shard's
# FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, replicate) runs with both, each config with one.
_SET_TO_NONE = {
    "checkpoint(u1.seq); fully_shard(u1.seq, policy); fully_shard(root)": [True],
    "fully_shard(u1); checkpoint(u1.seq); fully_shard(root)": [False],
    "checkpoint(u1.seq); fully_shard(root)": [True],
    "checkpoint(u1.seq); fully_shard(root, NO_SHARD)": [True],
    "checkpoint(u); fully_shard(u)": [True, False],  # SHARD_GRAD_OP's only config
    "fully_shard(u); checkpoint(u)": [False],
    "fully_shard(u1); checkpoint(root); fully_shard(root)": [True],
    "checkpoint(u1); replicate(u1); fully_shard(root)": [False],
    "replicate(u1); checkpoint(u1); fully_shard(root)": [True],
    "checkpoint(u1.seq); fully_shard(u2); checkpoint(u2); replicate(root)": [False],
}
assert list(_SET_TO_NONE) == list(CONFIGS)


@pytest.mark.parametrize(
    "name,set_to_none",
    [
        pytest.param(name, none, id=f"{name}-{'none' if none else 'zeros'}")
        for name, values in _SET_TO_NONE.items()
        for none in values
    ],
)
def test_composed_with_fully_shard_and_replicate(name: str, set_to_none: bool) -> None:
    run_on_ranks(_composed_parity, 2, name=name, set_to_none=set_to_none)


def _saved_bytes_composed(rank: int, world_size: int) -> tuple[int, int]:
    """Saved bytes of one forward with u1 sharded, without and with checkpoint(u1)."""
    out = []
    for ckpt in (False, True):
        torch.manual_seed(8)
        model = Net(dropout=0.0)
        fully_shard(model.u1)
        if ckpt:
            checkpoint(model.u1)
        fully_shard(model)
        x = torch.randn(BIG, DIM)
        out.append(_saved_bytes(model, x))
    return out[0], out[1]


def test_activations_not_saved_under_fully_shard() -> None:
    plain, ckpt = run_on_ranks(_saved_bytes_composed, 2)[0]
    # u1 saves at least its hidden activations (BIG x HIDDEN floats, several times) without.
    assert plain - ckpt >= 2 * BIG * HIDDEN * 4, (plain, ckpt)


# -- mixed precision ------------------------------------------------------------------------

FP16_CHILD = MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32, cast_forward_inputs=True)
FP32_ROOT = MixedPrecisionPolicy(param_dtype=torch.float32)


def _apply_mp(m: Net, where: str | None) -> None:
    fully_shard(m.u2, mp_policy=FP16_CHILD)
    if where is not None:
        checkpoint(m.get_submodule(where))
    fully_shard(m.u1)
    fully_shard(m, mp_policy=FP32_ROOT)


def _mixed_precision(rank: int, world_size: int, where: str, set_to_none: bool) -> None:
    torch.manual_seed(9)
    model = Net()
    plain = copy.deepcopy(model)  # fp32 throughout: loose parity
    same = copy.deepcopy(model)  # the same fp16 child without checkpoint: exact parity
    _apply_mp(model, where)
    _apply_mp(same, None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, same, plain)]
    for step in range(STEPS):
        clear_logs(model)
        torch.manual_seed(10 * step + rank)
        loss = loss_fn(model, data(step, rank))
        loss.backward()
        torch.manual_seed(10 * step + rank)
        same_loss = loss_fn(same, data(step, rank))
        same_loss.backward()
        plain_losses = _reference_step(plain, step, world_size)
        torch.testing.assert_close(loss.detach(), plain_losses[rank], atol=5e-3, rtol=5e-3)
        # Bit for bit against the same model without checkpoint (every optimizer steps).
        step_and_match(model, same, opts, f"step {step}", losses=(loss, same_loss), set_to_none=set_to_none)
        assert_close_tensors(full_params(model), full_params(plain), atol=5e-3, rtol=5e-3, msg=f"step {step}")
        for n, p in model.named_parameters():  # sharded parameters keep their own dtype
            assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32), n
        # What each linear saw: u2's in fp16 (inputs cast by u2's policy), in the original
        # forward and again in the recomputed one; everything else fp32.
        fp16, fp32 = (torch.float16, torch.float16), (torch.float32, torch.float32)
        for mod, seen in logs(model).items():
            recomputing = mod.startswith(where + ".") or mod == where
            want = fp16 if mod.startswith("u2.") else fp32
            assert seen == [(*want, False)] + ([(*want, True)] if recomputing else []), (mod, seen)


# A covering set: each place of the checkpoint, and each zero_grad mode, once.
@pytest.mark.parametrize("where,set_to_none", [("u2", False), ("u2.l", True)], ids=["u2-zeros", "u2.l-none"])
def test_mixed_precision_recompute_sees_cast_inputs(where: str, set_to_none: bool) -> None:
    run_on_ranks(_mixed_precision, 2, where=where, set_to_none=set_to_none)
