"""Autograd plumbing of the module hooks: the function whose backward marks the end of a
module's backward, the hook that marks its start, and traversal/casting of the (nested)
tensors a forward takes and returns."""

from __future__ import annotations

import weakref
from typing import Any, Callable, ParamSpec, Protocol, TypeVar, cast

import torch
from torch.distributed.utils import _apply_to_tensors


class BackwardHooks(Protocol):
    """What the autograd plumbing calls back (a module's state)."""

    def _pre_backward(self) -> None: ...

    def _post_backward(self) -> None: ...


P = ParamSpec("P")
R = TypeVar("R")


class PostBackward(torch.autograd.Function):
    """Identity on the module's inputs; its backward runs once all input gradients (and so,
    since AccumulateGrad runs first, the module's parameter gradients) are computed."""

    @staticmethod
    def forward(ctx: Any, state: BackwardHooks, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state_ref = weakref.ref(state)  # weak: see `attach_pre_backward`
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        state = ctx.state_ref()
        if state is not None:
            state._post_backward()
        return (None, *grads)


def run_eagerly(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` kept out of torch.compile's graphs: dynamo runs it as Python instead of tracing it."""
    return cast("Callable[P, R]", torch._dynamo.disable(fn, recursive=True))  # torch types the wrapper as Any


def attach_post_backward(
    state: BackwardHooks, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    tensors = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not tensors:
        return args, kwargs
    outputs = PostBackward.apply(state, *tensors)  # type: ignore[no-untyped-call]  # torch's Function.apply is untyped
    replaced = dict(zip(map(id, tensors), outputs))
    mapped = map_tensors(lambda t: replaced.get(id(t), t), (args, kwargs))
    return cast("tuple[tuple[Any, ...], dict[str, Any]]", mapped)  # the structure it was given


def attach_pre_backward(state: BackwardHooks, output: Any) -> Any:
    # The hook lives in the autograd graph, which holds the unsharded parameters that the
    # state holds too; a strong reference from the hook to the state makes a cycle through
    # C++ that the garbage collector cannot see, so a model whose forward was never followed
    # by a backward (or simply deleted) would never be freed.
    state_ref = weakref.ref(state)

    def hook(_grad: torch.Tensor) -> None:
        live = state_ref()
        if live is not None:
            live._pre_backward()

    for t in tensors_in(output):
        if t.requires_grad:
            t.register_hook(hook)
    return output


def map_tensors(fn: Any, tree: Any) -> Any:
    """`fn` applied to every tensor in nested lists/tuples/dicts/namedtuples/dataclasses (what
    PyTorch's own data-parallel wrappers look through), via `_apply_to_tensors`. That helper
    recurses through a nested function, a reference cycle that keeps `fn`, and whatever `fn`
    captured, alive until the garbage collector next runs: capturing tensors there kept every
    module's inputs and the model's output (the logits: 500 MiB at batch 4 of the 1B
    benchmark) alive past their last use, which raised the peak. So it is handed a trampoline
    that is emptied afterwards."""
    if _is_plain(tree):  # per module per step: the usual tensors-in-tuples-and-dicts, walked here
        return _map_plain(fn, tree)
    holder = [fn]
    try:
        return _apply_to_tensors(lambda t: holder[0](t), tree)
    finally:
        holder.clear()


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree` (see `map_tensors`)."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(keep, tree)
    return found


# Leaves `_apply_to_tensors` passes through unchanged.
_ATOMS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _is_plain(tree: Any) -> bool:
    """Whether `tree` holds only tensors and atoms in tuples, lists and dicts of exactly those
    types: then `_map_plain` gives what `_apply_to_tensors` would, without its generic
    (dataclass, namedtuple, PackedSequence) dispatch, which costs tens of microseconds per
    module per step."""
    if isinstance(tree, torch.Tensor) or isinstance(tree, _ATOMS):
        return True
    kind = type(tree)
    if kind is tuple or kind is list:
        return all(_is_plain(x) for x in tree)
    if kind is dict:
        return all(_is_plain(x) for x in tree.values())
    return False


def _map_plain(fn: Any, tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind(_map_plain(fn, x) for x in tree)
    if kind is dict:
        return {k: _map_plain(fn, v) for k, v in tree.items()}
    return tree


def any_requires_grad(tree: Any) -> bool:
    return any(t.requires_grad for t in tensors_in(tree))


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree)
