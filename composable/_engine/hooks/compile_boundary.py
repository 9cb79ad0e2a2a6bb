"""Where torch.compile's graph of a module starts: after the eager hooks, at `forward`.

`module.compile()` compiles `module._call_impl` and `torch.compile(module)` compiles the
module's `__call__`. For a module whose `forward` is user code, dynamo skips `_call_impl`
(torch's own file) and starts the graph at `forward`: the hooks, kept eager by `run_eagerly`,
run outside the graph. For a module whose `forward` lives in a file dynamo skips (torch.nn's
stock modules: `nn.Sequential`, `nn.Linear`, ...), dynamo instead wraps the call in a frame of
its own and traces `_call_impl` itself, hooks included (`torch.compile(module)` on every
supported torch, `module.compile()` since torch 2.15): an eager hook is then a graph break,
and with `fullgraph=True` an error ("Skip calling `torch.compiler.disable()`d function").

`keep_hooks_outside_graphs` gives such a module a `forward` that dynamo traces (a one-line
function of ours calling the stock one), so both kinds of compile start at `forward` again,
and re-creates a `module.compile()` made before the hooks were installed the same way.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn as nn

# One traceable forward per stock forward function (its own code object: dynamo keeps a
# cache of compiled graphs per code object, so one code shared by every stock module type
# would fill that cache and recompile).
_TRACEABLE: dict[Callable[..., Any], Callable[..., Any]] = {}


def with_own_code(fn: Callable[..., Any], name: str, qualname: str) -> types.FunctionType:
    """`fn` (same globals, closure and behaviour) with a code object of its own named `name`:
    dynamo keeps its cache of compiled graphs per code object, so each module type whose
    forward is such a function gets a cache of its own."""
    code = fn.__code__.replace(co_name=name)
    fresh = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    fresh.__qualname__ = qualname
    return fresh


def _traceable_forward(stock: Callable[..., Any]) -> Callable[..., Any]:
    if stock not in _TRACEABLE:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return stock(self, *args, **kwargs)

        name = f"forward_of_{stock.__qualname__.replace('.', '_')}"
        fresh = with_own_code(forward, name, f"traceable {stock.__qualname__}")
        setattr(fresh, "__wrapped__", stock)
        _TRACEABLE[stock] = fresh
    return _TRACEABLE[stock]


def _dynamo_skips(fn: Callable[..., Any]) -> bool:
    """Whether dynamo refuses `fn` as the start of a graph (it then traces `_call_impl`)."""
    try:
        from torch._dynamo import trace_rules
    except ImportError:  # no dynamo: nothing is compiled
        return False
    return bool(trace_rules.check(fn))


def _dynamo_context(compiled: Callable[..., Any]) -> Any:
    """The dynamo context (backend, fullgraph, dynamic, ...) that made the compiled callable
    `compiled`, or None where this torch keeps it elsewhere."""
    code, cells = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None)
    if code is None or cells is None:
        return None
    context = dict(zip(code.co_freevars, cells)).get("self")
    context = context.cell_contents if context is not None else None
    base = getattr(torch._dynamo.eval_frame, "_TorchDynamoContext", None)
    return context if base is not None and isinstance(context, base) else None


def keep_hooks_outside_graphs(module: nn.Module, api: str) -> None:
    """Make any compile of `module`, before or after this call, start its graph at
    `forward`, so the eager hooks installed by `api` run outside it (see the module note).
    Raises NotImplementedError where a `module.compile()` made earlier cannot be re-created."""
    forward = module.forward
    if isinstance(forward, types.MethodType) and forward.__self__ is module and _dynamo_skips(forward):
        # A bound method (not a closure), so `copy.deepcopy` rebinds it to the copy.
        module.forward = types.MethodType(_traceable_forward(forward.__func__), module)
    compiled = module.__dict__.get("_compiled_call_impl")
    traced = getattr(compiled, "_torchdynamo_orig_callable", None)
    if compiled is None or getattr(traced, "__wrapped__", None) != module._call_impl:
        return  # not compiled, or its graph already starts at `forward`
    context = _dynamo_context(compiled)
    if context is None:
        raise NotImplementedError(
            f"{api}: {type(module).__name__} was compiled (module.compile()) before {api}, and this "
            f"torch compiles its hooks into the graph; call module.compile() after {api}"
        )
    module._compiled_call_impl = context(module._call_impl)
