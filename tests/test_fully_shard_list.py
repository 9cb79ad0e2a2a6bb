"""`fully_shard([m1, m2])`: one parameter group over several modules (as FSDP2).

- Parity (2 gloo ranks, and 2 GPUs with NCCL): a small LM with `[norm, head]`, `[tok, pos]`,
  the same listed in reverse of the order they run, and a tied embedding/head
  (`[tok, head]`: one weight shared by two listed modules), then per-block groups and the
  root; losses, every gradient and every parameter compared shard by shard with a
  single-process reference over several steps. Also forwards that run only some of the
  listed modules (the head skipped, the norm skipped, a head called per chunk of the loss
  outside the model's forward).
- Communication (fake process group, world 4): each group all-gathers once per forward and
  reduce-scatters once per backward, however many of its modules run or in which order.
- What keeps working: gradient accumulation, clip_grad_norm_, state dicts and DCP's full
  state dicts, register_forward_method, unshard()/reshard() and forward prefetching.
- Every error fully_shard raises for a bad list.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import fake_process_group, requires_gpus, run_on_ranks, trace_collectives
from _models import Block, batch_for
from _training import STEPS, TIMEOUT, TOL, rank_mean, sgd
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from composable import clip_grad_norm_, fully_shard, no_sync, register_forward_method, replicate
from composable._engine.groups.group import GroupState


class Head(nn.Linear):
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """The head's forward under another name (for register_forward_method)."""
        return F.linear(x, self.weight)


class LM(nn.Module):
    """Embeddings, two blocks, final norm, head (tied to `tok` if `tied`). The forward can skip
    the norm or the head, as chunked-loss training skips the head."""

    def __init__(self, tied: bool, vocab: int = 13, dim: int = 10, seq: int = 7) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, 2) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = Head(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, run_norm: bool = True, run_head: bool = True) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        if run_norm:
            x = self.norm(x)
        return self.head(x) if run_head else x


# Layout: (tied, the lists given to fully_shard before the root).
LAYOUTS: dict[str, tuple[bool, Callable[[LM], list[list[nn.Module]]]]] = {
    "norm_head": (False, lambda m: [[m.norm, m.head], [m.tok, m.pos]]),
    "listed_in_reverse": (False, lambda m: [[m.head, m.norm], [m.pos, m.tok]]),
    "tied": (True, lambda m: [[m.tok, m.head]]),  # the root keeps pos and norm
    "tied_spanning": (True, lambda m: [[m.tok, m.head], [m.pos, m.norm]]),
}


def shard(model: LM, layout: str, **options: Any) -> list[list[nn.Module]]:
    """Blocks, then the layout's lists, then the root; returns the lists."""
    lists = LAYOUTS[layout][1](model)
    for layer in model.layers:
        fully_shard(layer, **options)
    for modules in lists:
        assert fully_shard(modules, **options) is modules  # the call returns the list
    fully_shard(model, **options)
    return lists


def build(layout: str, device: str = "cpu") -> tuple[LM, LM]:
    torch.manual_seed(0)
    model = LM(LAYOUTS[layout][0]).to(device)
    return model, copy.deepcopy(model)


def lm(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def norm_only(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[:, :-1], run_head=False).square().mean()  # the head never runs


def head_only(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1], run_norm=False).flatten(0, 1), tokens[:, 1:].flatten())


def chunked(model: nn.Module, tokens: torch.Tensor, chunk: int = 3) -> torch.Tensor:
    """The model's forward stops before the head; the head runs per chunk of the sequence,
    outside it (chunked cross-entropy, as torchtitan/Liger do)."""
    hidden, targets = model(tokens[:, :-1], run_head=False), tokens[:, 1:]
    total = sum(
        F.cross_entropy(
            model.head(hidden[:, i : i + chunk]).flatten(0, 1), targets[:, i : i + chunk].flatten(), reduction="sum"
        )
        for i in range(0, targets.shape[1], chunk)
    )
    return total / targets.numel()


LOSSES = {"lm": lm, "norm_only": norm_only, "head_only": head_only, "chunked": chunked}


def local_piece(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's rows of `full` under Shard(0) (chunks of ceil(rows / world))."""
    rows = -(-full.shape[0] // world)
    return full[rank * rows : (rank + 1) * rows]


def assert_shards(model: nn.Module, ref: nn.Module, rank: int, world: int, tag: str, grads: bool, tol: dict) -> None:
    """Every parameter (or gradient) is a Shard(0) DTensor whose local shard equals this rank's
    rows of the reference's; exactly the reference's gradients are None."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        mine, theirs = (p.grad, ref_params[name].grad) if grads else (p, ref_params[name])
        if theirs is None:
            assert mine is None, f"{tag}: {name} has a gradient, the reference has none"
            continue
        assert isinstance(mine, DTensor), f"{tag}: {name} is a {type(mine).__name__}"
        torch.testing.assert_close(
            mine.to_local(), local_piece(theirs.detach(), world, rank), **tol, msg=lambda m: f"{tag} {name}: {m}"
        )


def _parity(
    rank: int, world: int, layout: str, reshard: bool | None, loss: str, device: str = "cpu", prefetch: bool = False
) -> None:
    model, ref = build(layout, device)
    lists = shard(model, layout, reshard_after_forward=reshard)
    for modules in lists:  # one state, on each listed module
        state = fully_shard.state(modules[0])
        assert all(fully_shard.state(m) is state for m in modules)
        # FQNs as in an nn.ModuleList of the listed modules; a tied weight once.
        expected: dict[int, str] = {}
        for i, m in enumerate(modules):
            for n, p in m.named_parameters():
                expected.setdefault(id(p), f"{i}.{n}")
        assert state.param_names == list(expected.values())
    if prefetch:  # the last block starts gathering the [norm, head] group
        fully_shard.state(model.layers[-1]).set_modules_to_forward_prefetch([lists[0][0]])
    opt, ref_opt = sgd(model), sgd(ref)
    loss_fn = LOSSES[loss]
    tol = TOL if device == "cpu" else dict(rtol=1e-4, atol=1e-5)
    for step in range(STEPS):
        tag = f"{layout} {loss} step {step}"
        value = loss_fn(model, batch_for(step, world, rank).to(device))
        for modules in lists:  # resharded by the end of the forward, whichever modules ran
            group = fully_shard.state(modules[0]).groups[0]
            assert group.state is (GroupState.SHARDED if reshard is None else GroupState.UNSHARDED), tag
            assert all(isinstance(p, DTensor) for m in modules for p in m.parameters()), tag
        value.backward()
        ref_value = loss_fn(ref, batch_for(step, world, None).to(device))
        ref_value.backward()
        torch.testing.assert_close(rank_mean(value), ref_value.detach(), **tol, msg=lambda m: f"{tag} loss: {m}")
        for modules in lists:
            assert fully_shard.state(modules[0]).groups[0].state is GroupState.SHARDED, tag
        assert_shards(model, ref, rank, world, f"{tag} grad", grads=True, tol=tol)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
        assert_shards(model, ref, rank, world, f"{tag} param", grads=False, tol=tol)
    if LAYOUTS[layout][0]:
        assert model.tok.weight is model.head.weight  # still one parameter


@pytest.mark.parametrize("reshard", [None, False], ids=["reshard_default", "no_reshard"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_reference(layout: str, reshard: bool | None) -> None:
    run_on_ranks(_parity, 2, layout, reshard, "lm", timeout=TIMEOUT)


@pytest.mark.parametrize("reshard", [None, False], ids=["reshard_default", "no_reshard"])
@pytest.mark.parametrize(
    "layout, loss",
    [("norm_head", "norm_only"), ("norm_head", "head_only"), ("norm_head", "chunked"), ("tied", "chunked")],
)
def test_parity_when_only_some_listed_modules_run(layout: str, loss: str, reshard: bool | None) -> None:
    run_on_ranks(_parity, 2, layout, reshard, loss, timeout=TIMEOUT)


def test_parity_with_forward_prefetch_of_a_listed_module() -> None:
    run_on_ranks(_parity, 2, "norm_head", None, "lm", prefetch=True, timeout=TIMEOUT)


@requires_gpus(2)
@pytest.mark.parametrize("layout, loss", [("norm_head", "lm"), ("tied", "lm"), ("norm_head", "chunked")])
def test_parity_on_gpus_nccl(layout: str, loss: str) -> None:
    run_on_ranks(_parity, 2, layout, None, loss, device="cuda", backend="nccl", timeout=300)


# ----------------------------------------------------------------------------- communication


def _expected_counts(model: LM, reshard: bool | None) -> tuple[int, int]:
    """(groups with parameters, those that gather again in backward)."""
    seen = {id(s): s for m in model.modules() if (s := fully_shard.state(m)) is not None and s.groups}
    root = fully_shard.state(model)
    regathers = sum(1 for s in seen.values() if s is not root) if reshard is None else 0
    return len(seen), regathers


@pytest.mark.parametrize("reshard", [None, False], ids=["reshard_default", "no_reshard"])
@pytest.mark.parametrize("loss", ["lm", "norm_only", "head_only", "chunked"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_all_gather_and_one_reduce_scatter_per_group(layout: str, loss: str, reshard: bool | None) -> None:
    """Forward gathers each group once (a listed module that does not run costs nothing, nor
    does the order they run in); backward gathers each resharded group once and
    reduce-scatters each group once. A head called per chunk outside the model's forward
    gathers per call (each call is a pass of its own: it reshards after), but its backward
    still gathers and reduces the group once."""
    with fake_process_group(4):
        model, _ = build(layout)
        shard(model, layout, reshard_after_forward=reshard)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        groups, regathers = _expected_counts(model, reshard)
        # 7 positions in chunks of 3: 3 head calls, each gathering when the group was resharded.
        chunk_calls = 3 if loss == "chunked" and reshard is None else 0
        for step in range(2):
            with trace_collectives() as fwd:
                value = LOSSES[loss](model, batch_for(step, 4, 0))
            with trace_collectives() as bwd:
                value.backward()
            opt.step()
            opt.zero_grad()
            assert dict(fwd.counts) == {"all_gather": groups + chunk_calls}, (step, fwd.events)
            expected = {"reduce_scatter": groups} | ({"all_gather": regathers} if regathers else {})
            assert dict(bwd.counts) == expected, (step, bwd.events)


# ----------------------------------------------------------------------------- what keeps working


def _accumulation_clipping_state_dicts(rank: int, world: int) -> None:
    model, ref = build("tied_spanning")
    lists = shard(model, "tied_spanning")
    # Gradient accumulation: two micro-batches without communication, the third synced.
    for micro in range(3):
        tokens = batch_for(10 + micro, world, rank)
        if micro < 2:
            with no_sync(model), trace_collectives() as comm:
                lm(model, tokens).backward()
            assert comm.counts["reduce_scatter"] == 0, comm.events
        else:
            lm(model, tokens).backward()
        lm(ref, batch_for(10 + micro, world, None)).backward()
    state = fully_shard.state(lists[0][0])
    state.set_requires_gradient_sync(False)  # recurses over both listed modules' subtrees
    assert not state.requires_gradient_sync
    state.set_requires_gradient_sync(True)
    # clip_grad_norm_ over the sharded gradients equals the reference's.
    total = clip_grad_norm_(model.parameters(), 0.5)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.testing.assert_close(total, ref_total, **TOL)
    assert_shards(model, ref, rank, world, "accumulated, clipped grad", grads=True, tol=TOL)
    opt, ref_opt = sgd(model), sgd(ref)
    opt.step()
    ref_opt.step()
    # State dicts: the same keys as the plain model's, DTensor values; DCP's full state dict
    # equals the reference's, and loads into a freshly sharded model.
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    assert all(isinstance(v, DTensor) for v in sd.values())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        for key, value in full.items():
            torch.testing.assert_close(value, ref_sd[key], **TOL, msg=lambda m: f"{key}: {m}")
    fresh, _ = build("tied_spanning")
    shard(fresh, "tied_spanning")
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_shards(fresh, ref, rank, world, "loaded param", grads=False, tol=TOL)
    assert fresh.tok.weight is fresh.head.weight


def test_accumulation_clipping_and_state_dicts() -> None:
    run_on_ranks(_accumulation_clipping_state_dicts, 2, timeout=TIMEOUT)


def _methods_and_manual_unshard(rank: int, world: int) -> None:
    model, ref = build("norm_head")
    lists = shard(model, "norm_head")
    state = fully_shard.state(model.head)
    tokens = batch_for(0, world, rank)
    # register_forward_method on a listed module, called outside the model's forward: a pass
    # of its own, resharded after it.
    register_forward_method(model.head, "scores")
    with torch.no_grad():
        hidden = model(tokens[:, :-1], run_head=False)
        scores = model.head.scores(hidden)
        ref_scores = ref.head.scores(ref(tokens[:, :-1], run_head=False))
    torch.testing.assert_close(scores, ref_scores, **TOL)
    assert state.groups[0].state is GroupState.SHARDED
    # unshard()/reshard() act on the whole group, both modules.
    state.unshard()
    assert not isinstance(model.norm.weight, DTensor) and model.head.weight.shape == ref.head.weight.shape
    state.reshard()
    assert isinstance(model.norm.weight, DTensor) and isinstance(model.head.weight, DTensor)
    handle = state.unshard(async_op=True)
    handle.wait()
    with trace_collectives() as comm:
        value = lm(model, tokens)  # the group gathered already: not again
    assert comm.counts["all_gather"] == _expected_counts(model, None)[0] - 1, comm.events
    value.backward()
    assert lists[0][0] is model.norm


def test_forward_method_and_manual_unshard() -> None:
    run_on_ranks(_methods_and_manual_unshard, 2, timeout=TIMEOUT)


def test_policy_applies_within_each_listed_module() -> None:
    with fake_process_group(2):
        model = LM(tied=False)
        block = model.layers[0]
        fully_shard([block, model.norm], policy={nn.Linear})
        listed = fully_shard.state(model.norm)
        assert fully_shard.state(block) is listed
        linears = [block.qkv, block.proj, block.mlp.fc1, block.mlp.fc2]
        for linear in linears:  # each its own group, below the list's
            assert fully_shard.state(linear) not in (None, listed)
        assert fully_shard.state(model.head) is None  # outside the listed subtrees
        # The Linears' parameters are taken; the list has the rest of both subtrees.
        assert listed.param_names == [f"0.{n}.{p}" for n in ("norm1", "norm2") for p in ("weight", "bias")] + [
            "1.weight",
            "1.bias",
        ]
        fully_shard(model)
        lm(model, batch_for(0, 2, 0)).backward()


def test_tuple_is_returned_as_given_and_state_dedupes() -> None:
    with fake_process_group(2):
        model = LM(tied=True)
        pair = (model.tok, model.head)
        assert fully_shard(pair) is pair
        assert fully_shard.state(model.tok).param_names == ["0.weight"]  # tied: one parameter
        fully_shard(model)
        from composable._engine.hooks.contract import param_states

        states = param_states(model)
        assert len(states) == len({id(s) for s in states}) == 2


# ----------------------------------------------------------------------------- errors


def test_bad_lists_are_refused_clearly() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"fully_shard: argument 'module' must be an nn.Module or a non-empty list of them, got \[\]"
    ):
        fully_shard([])
    with pytest.raises(
        TypeError,
        match=r"fully_shard: argument 'module' must be an nn.Module or a list of nn.Modules, got a list holding int at index 1: 3",
    ):
        fully_shard([a, 3])
    with pytest.raises(
        ValueError, match=r"fully_shard: argument 'module' lists the same Linear twice \(indices 0 and 2\)"
    ):
        fully_shard([a, b, a])
    outer = nn.Sequential(a, nn.ReLU())
    with pytest.raises(
        ValueError, match=r"fully_shard: argument 'module' lists Linear \(index 1\) inside Sequential \(index 0\)"
    ):
        fully_shard([outer, a])
    with pytest.raises(TypeError, match=r"fully_shard: argument 'module' must be an nn.Module, got str"):
        fully_shard("model")


def test_forbidden_compositions_with_lists() -> None:
    with fake_process_group(2):
        model = LM(tied=True)
        fully_shard(model.norm)
        with pytest.raises(RuntimeError, match=r"fully_shard has already been applied to this LayerNorm"):
            fully_shard([model.pos, model.norm])
        replicate(model.layers[0])
        with pytest.raises(
            RuntimeError, match=r"Cannot apply fully_shard to Block: it is already managed by replicate"
        ):
            fully_shard([model.layers[0], model.pos])
        # The tied weight stays with an API applied to one of its users only: refused.
        fully_shard(model.head)
        with pytest.raises(
            RuntimeError,
            match=r"Cannot apply fully_shard to ListedModules: its parameter '0\.weight' is shared \(tied\)",
        ):
            fully_shard([model.tok, model.pos])


def test_a_list_cannot_be_the_root() -> None:
    with fake_process_group(2):
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        fully_shard([a, b])
        with pytest.raises(
            RuntimeError,
            match=r"fully_shard: the group of modules \[Linear, Linear\] ran forward outside any module that an API manages; .*cannot be the root",
        ):
            b(a(torch.randn(2, 4)))
