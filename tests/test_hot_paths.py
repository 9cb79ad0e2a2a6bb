"""The per-step hot paths: their shortcuts keep the semantics of the general code they skip.

- `map_tensors` walks plain tuples/lists/dicts itself (falling back to PyTorch's
  `_apply_to_tensors` for anything else): same structure, same leaves, same tensors.
- A sharded gradient carries its parameter's own `DTensorSpec` object (as FSDP2's do), so the
  optimizer's DTensor ops between the two skip a field-by-field spec comparison.
- A sharded gradient is a view of the reduction output (no copy) for every API.
- The reduce-scatter input of tensors that need no padding is built by one multi-tensor copy
  instead of `torch._chunk_cat`: the same bytes, for every world size, layout and dtype cast.
- The engine's current-stream and stream-switch shortcuts (CUDA) answer what
  `torch.cuda.current_stream` and `torch.cuda.stream` would.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch
from _harness import requires_gpus
from _models import MLP
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.utils import _apply_to_tensors

import composable
from composable._engine import collectives, streams
from composable._engine.autograd import map_tensors, tensors_in

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Box:
    x: Any
    y: Any = None


_TENSORS = [torch.full((2,), float(i)) for i in range(4)]
_leaves = st.one_of(
    st.sampled_from(_TENSORS),
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.just(torch.float16),
    st.just(object()),  # an opaque leaf: passed through untouched
)
_trees = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
        st.builds(Pair, inner, inner),
        st.builds(Box, inner, inner),
        st.dictionaries(st.text(max_size=2), inner, max_size=2).map(collections.OrderedDict),
    ),
    max_leaves=8,
)


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a is b
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a is b or a == b


@given(_trees)
def test_map_tensors_agrees_with_pytorchs_walk(tree: Any) -> None:
    doubled = {id(t): t * 2 for t in _TENSORS}
    ours = map_tensors(lambda t: doubled[id(t)], tree)
    reference = _apply_to_tensors(lambda t: doubled[id(t)], tree)
    _same(ours, reference)
    seen: list[torch.Tensor] = []
    _apply_to_tensors(lambda t: seen.append(t) or t, tree)
    assert [id(t) for t in tensors_in(tree)] == [id(t) for t in seen]


@pytest.mark.parametrize("api", ["fully_shard", "replicate", "fully_shard_bf16"])
def test_sharded_grads_share_their_parameters_spec(world2: DeviceMesh, api: str) -> None:
    torch.manual_seed(0)
    net = MLP(4, 8)
    if api == "replicate":
        composable.replicate(net, mesh=world2)
    else:
        policy = composable.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if api.endswith("bf16") else None
        kwargs = {"mp_policy": policy} if policy is not None else {}
        composable.fully_shard(net.fc1, mesh=world2, **kwargs)
        composable.fully_shard(net, mesh=world2, **kwargs)
    for _ in range(2):
        net(torch.randn(3, 4)).sum().backward()
        for name, p in net.named_parameters():
            assert p.grad is not None, name
            assert p.grad._spec is p._spec, name
            assert p.grad.dtype == p.dtype and p.grad.shape == p.shape, name
            assert p.grad._local_tensor.shape == p._local_tensor.shape, name
        net.zero_grad()


_piece_kinds = st.sampled_from(["contiguous", "rows", "scalar", "permuted", "uneven"])


@given(
    st.integers(1, 4), st.lists(_piece_kinds, min_size=1, max_size=5), st.sampled_from([torch.float32, torch.bfloat16])
)
def test_chunk_cat_equals_pytorchs(world: int, kinds: list[str], source_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(kinds) * 10 + world)
    pieces = []
    for kind in kinds:
        if kind == "contiguous":
            pieces.append(torch.randn(2 * world, 3, generator=g))
        elif kind == "rows":
            pieces.append(torch.randn(world * 3, generator=g))
        elif kind == "scalar":  # a 0-d gradient, replicated into every region (a stride-0 view)
            pieces.append(torch.randn((), generator=g).expand(world))
        elif kind == "permuted":  # a gradient sharded on dim 1, moved to dim 0 (no row view)
            pieces.append(torch.randn(3, 2 * world, generator=g).movedim(1, 0))
        else:  # dim 0 not a multiple of the world: padded chunks
            pieces.append(torch.randn(world * 2 + 1, 2, generator=g))
    pieces = [p.to(source_dtype) for p in pieces]
    ours = collectives.chunk_cat(pieces, world, torch.float32, torch.device("cpu"))
    total = sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in pieces)
    reference = torch.empty(world, total)
    torch._chunk_cat(pieces, dim=0, num_chunks=world, out=reference)
    assert torch.equal(ours, reference.view(-1))
    shortcut = collectives._even_rows(pieces, world) is not None
    assert shortcut == all(k in ("contiguous", "rows", "scalar") or (k == "uneven" and world == 1) for k in kinds)


@requires_gpus(1)
def test_stream_shortcuts_answer_as_torch_cuda() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    outer = torch.cuda.current_stream()
    assert streams.current_stream(device) == outer
    with streams.stream_context(side):
        assert torch.cuda.current_stream() == side
        assert streams.current_stream(device) == side
        with streams.stream_context(outer):
            assert streams.current_stream(device) == torch.cuda.current_stream() == outer
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == outer
    with torch.cuda.stream(side):  # a stream set by the user is what the engine sees as current
        assert streams.current_stream(device) == side
    assert streams.current_stream(device) is streams.current_stream(device)  # one object per stream
