"""fully_shard and replicate nested in one module tree, both ways round.

Patterns are written bottom-up, a comma moving one level up the tree: `r` replicate, `f`
fully_shard, `m` applied manually, `a` applied through an auto-wrap `policy`. E.g.
`1r1fm,1fm`: at the bottom level one module gets replicate and its sibling fully_shard, then
the root (one level up) gets fully_shard. Each pattern is checked step by step against
`replicate` applied to an unsharded copy of the same model, with different data on each
rank: every rank's loss and every parameter (`full_tensor()`) after every optimizer step.
Both sides sum the ranks' gradients then halve the sum, so at world size 2 they agree bit
for bit.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors, count_collectives, fake_process_group, requires_gpus, run_on_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard

from composable import checkpoint, fully_shard, no_sync, replicate, set_requires_gradient_sync

DIM = 6
STEPS = 3


# ----------------------------------------------------------------------------- model


class Leaf(nn.Module):
    """Bottom level: two linears (targets for a `{nn.Linear}` policy) and a bare parameter
    (so a module wrapped by policy still manages something itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, 7)
        self.lin2 = nn.Linear(7, DIM)
        self.scale = nn.Parameter(torch.rand(DIM) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.lin2(torch.tanh(self.lin(x)))


class Inner(nn.Module):
    """A level above: its own linear, then its children in turn."""

    def __init__(self, kids: list[nn.Module]) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.kids = nn.ModuleList(kids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.lin(x))
        for kid in self.kids:
            x = kid(x)
        return x


def build(levels: int, width: int = 2) -> nn.Module:
    """A full tree `levels` deep (the root is level `levels - 1`, leaves level 0)."""
    if levels == 1:
        return Leaf()
    return Inner([build(levels - 1, width) for _ in range(width)])


def modules_at(root: nn.Module, level: int, levels: int) -> list[nn.Module]:
    """The modules of `level` (0 = leaves): every parent's first child, then every parent's
    second child, ... so that consecutive pattern items spread over different parents."""
    mods = [root]
    for _ in range(levels - 1 - level):
        mods = [m.kids[i] for i in range(len(mods[0].kids)) for m in mods]
    return mods


def apply_pattern(model: nn.Module, pattern: str, **fsdp_options: object) -> None:
    """Apply e.g. `1r1fa,1fm` bottom-up: level i's items go to the first modules of level i."""
    levels = pattern.split(",")
    for level, spec in enumerate(levels):
        items = re.findall(r"1(r|fm|fa)", spec)
        assert "".join(f"1{i}" for i in items) == spec, spec
        for module, item in zip(modules_at(model, level, len(levels)), items):
            if item == "r":
                replicate(module)
            elif item == "fm":
                fully_shard(module, **fsdp_options)
            else:
                fully_shard(module, policy={nn.Linear}, **fsdp_options)


def data(step: int, rank: int, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def which_api(model: nn.Module) -> dict[str, str]:
    """FQN -> the API whose state manages that parameter."""
    out = {}
    for prefix, sub in model.named_modules():
        for api in (fully_shard, replicate):
            state = api.state(sub)
            if state is not None:
                for name in state.param_names:
                    out[f"{prefix}.{name}" if prefix else name] = api.__name__
    return out


# ----------------------------------------------------------------------------- rank functions


def _pattern_parity(rank: int, world_size: int, pattern: str, device: str = "cpu") -> dict[str, str]:
    torch.manual_seed(5)
    model = build(len(pattern.split(","))).to(device)
    ref = replicate(copy.deepcopy(model))
    names = [n for n, _ in model.named_parameters()]
    apply_pattern(model, pattern)
    assert [n for n, _ in model.named_parameters()] == names  # FQNs unchanged
    managed = which_api(model)
    assert sorted(managed) == sorted(names), "every parameter managed by exactly one API"
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        # fully_shard: Shard(0) on the 1D world mesh; replicate: Replicate().
        assert p.placements == ((Shard(0),) if managed[name] == "fully_shard" else (Replicate(),)), (name, p.placements)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        batch = tuple(t.to(device) for t in data(step, rank))
        loss, ref_loss = loss_fn(model, batch), loss_fn(ref, batch)
        assert torch.equal(loss, ref_loss), (pattern, step, loss.item(), ref_loss.item())
        loss.backward()
        ref_loss.backward()
        optim.step()
        ref_optim.step()
        optim.zero_grad(set_to_none=step % 2 == 1)
        ref_optim.zero_grad(set_to_none=step % 2 == 1)
        assert_close_tensors(full_params(model), full_params(ref), exact=True, msg=f"{pattern} step {step}")
    return managed


def _no_sync_mixed_tree(rank: int, world_size: int, use_context: bool, reshard: bool | None) -> None:
    """Micro-batches 0, 1 under no_sync, 2 synced, over `1fm1fm,1r1r,1fm`; the reference is a
    plain model accumulating every rank's micro-batches, summed over ranks and halved."""
    torch.manual_seed(6)
    model = build(3)
    ref = copy.deepcopy(model)
    apply_pattern(model, "1fm1fm,1r1r,1fm", reshard_after_forward=reshard)
    assert set(which_api(model).values()) == {"fully_shard", "replicate"}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        for micro in range(3):
            loss = loss_fn(model, data(10 * step + micro, rank))
            if micro < 2:
                if use_context:
                    with no_sync(model), count_collectives() as comm:
                        loss.backward()
                else:
                    set_requires_gradient_sync(model, False)
                    with count_collectives() as comm:
                        loss.backward()
                    set_requires_gradient_sync(model, True)
                # No gradient communication from any API. Modules resharded after forward
                # gather their parameters again for backward (the two non-root
                # fully_shard leaves; by default the root keeps its parameters): that is all.
                assert comm.counts["reduce_scatter"] == comm.counts["all_reduce"] == 0, comm.events
                assert comm.total == (2 if reshard is None else 0), comm.events
            else:
                with count_collectives() as comm:
                    loss.backward()
                # The synced backward reduces fully_shard's groups (reduce-scatter) and
                # replicate's (all-reduce): everything accumulated so far.
                assert comm.counts["reduce_scatter"] >= 3 and comm.counts["all_reduce"] >= 2, comm.events
        # Reference gradient: each rank's micro-batches accumulated separately, summed, halved.
        per_rank = []
        for r in range(world_size):
            ref.zero_grad(set_to_none=True)
            for micro in range(3):
                loss_fn(ref, data(10 * step + micro, r)).backward()
            per_rank.append([p.grad.clone() for p in ref.parameters()])
        for p, *gs in zip(ref.parameters(), *per_rank):
            p.grad = sum(gs[1:], gs[0]) / world_size
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close_tensors(p.grad, q.grad, exact=True, msg=f"grad {n} step {step}")
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        assert_close_tensors(full_params(model), full_params(ref), exact=True, msg=f"step {step}")


# ----------------------------------------------------------------------------- tests

PATTERNS = {
    # pattern: the API expected to manage each parameter
    "1fm,1r": {"kids.0": "fully_shard", "": "replicate"},
    "1r,1fm": {"kids.0": "replicate", "": "fully_shard"},
    "1r,1fa": {"kids.0": "replicate", "": "fully_shard"},
    "1r1fm,1fm": {"kids.0": "replicate", "kids.1": "fully_shard", "": "fully_shard"},
    "1r1fa,1fm": {"kids.0": "replicate", "kids.1": "fully_shard", "": "fully_shard"},
    "1fm1fm,1r1r,1fm": {
        "kids.0.kids.0": "fully_shard",
        "kids.1.kids.0": "fully_shard",
        "kids.0": "replicate",
        "kids.1": "replicate",
        "": "fully_shard",
    },
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_nested_patterns_match_replicate_reference(pattern: str) -> None:
    managed = run_on_ranks(_pattern_parity, 2, pattern=pattern)[0]
    # Bottom-up claiming: a parameter belongs to the API on its deepest managed ancestor.
    for name, api in managed.items():
        owner = max(
            (prefix for prefix in PATTERNS[pattern] if name.startswith(prefix + "." if prefix else "")), key=len
        )
        assert api == PATTERNS[pattern][owner], (pattern, name, api)


@requires_gpus(2)
def test_nested_pattern_on_gpus_nccl() -> None:
    run_on_ranks(_pattern_parity, 2, pattern="1fm1fm,1r1r,1fm", device="cuda", backend="nccl")


@pytest.mark.parametrize("reshard", [None, False], ids=["reshard_default", "no_reshard"])
@pytest.mark.parametrize("use_context", [True, False], ids=["no_sync", "set_requires_gradient_sync"])
def test_no_sync_over_mixed_tree_defers_all_communication(use_context: bool, reshard: bool | None) -> None:
    run_on_ranks(_no_sync_mixed_tree, 2, use_context=use_context, reshard=reshard)


# -- forbidden compositions: one process on a fake world of 2 (no numerics needed) --------


def _tree() -> nn.Module:
    return build(2)


FORBIDDEN = [
    # (first, second, error pattern); "root"/"kid" name the module each API is applied to
    ("fully_shard root", "replicate root", r"Cannot apply .*replicate"),
    ("replicate root", "fully_shard root", r"Cannot apply .*fully_shard"),
    # A module whose parameters an ancestor already manages is managed by that API too.
    ("fully_shard root", "replicate kid", r"Cannot apply .*replicate"),
    ("replicate root", "fully_shard kid", r"Cannot apply .*fully_shard"),
    ("fully_shard root", "fully_shard root", r"fully_shard"),
    ("replicate root", "replicate root", r"replicate"),
    ("checkpoint root", "checkpoint root", r"checkpoint"),
]


def _apply(model: nn.Module, what: str) -> None:
    api, where = what.split()
    module = model if where == "root" else model.kids[0]
    {"fully_shard": fully_shard, "replicate": replicate, "checkpoint": checkpoint}[api](module)


@pytest.mark.parametrize("first,second,match", FORBIDDEN)
def test_forbidden_compositions_raise(first: str, second: str, match: str) -> None:
    with fake_process_group(2):
        model = _tree()
        _apply(model, first)
        with pytest.raises(RuntimeError, match=match):
            _apply(model, second)


def test_allowed_nesting_and_checkpoint_anywhere() -> None:
    """Nesting both ways round and checkpoint on managed modules do not raise."""
    with fake_process_group(2):
        model = build(3)
        fully_shard(model.kids[0].kids[0])
        replicate(model.kids[0])
        replicate(model.kids[1].kids[1])
        checkpoint(model.kids[1].kids[1])
        checkpoint(model.kids[0].kids[0])
        fully_shard(model)
        checkpoint(model.kids[1])
        # replicate on kids.0 manages its subtree minus what fully_shard on kids.0.kids.0 took.
        names = [n for n, _ in model.kids[0].named_parameters()]
        assert replicate.state(model.kids[0]).param_names == [n for n in names if not n.startswith("kids.0.")]
        assert fully_shard.state(model.kids[0].kids[0]).param_names == [
            n.removeprefix("kids.0.") for n in names if n.startswith("kids.0.")
        ]
        # The root takes the rest: its own, kids.1's and kids.1.kids.0's parameters.
        names = [n for n, _ in model.named_parameters()]
        assert fully_shard.state(model).param_names == [
            n for n in names if not n.startswith(("kids.0.", "kids.1.kids.1."))
        ]
