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
from composable._engine.comm import collectives, streams
from composable._engine.hooks.autograd import map_tensors, tensors_in

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


# The one-launch float8 cast (float8_kernel.py) against the eager arithmetic it replaces: every
# byte, for each source and float8 dtype; weights of 0, 1 and odd element counts, one longer than
# a grid of programs covers in one pass (the kernel loops), slots at odd addresses (a rank's slot
# of an all-gather output), values from subnormal to beyond the float8 range, infinities, zeros
# of both signs, and NaN (which stays NaN).
_CAST_SHAPES = [(0,), (1,), (37, 5), (3001,), (2500, 1013)]


def _cast_inputs(source: torch.dtype, target: torch.dtype, device: torch.device) -> tuple[list, list, list]:
    generator = torch.Generator(device="cpu").manual_seed(0)
    hps, scales, slots = [], [], []
    for i, shape in enumerate(_CAST_SHAPES):
        magnitude = torch.randint(-12, 8, shape, generator=generator).float()
        hp = torch.randn(shape, generator=generator) * torch.pow(10.0, magnitude)
        if hp.numel() > 8:
            hp.view(-1)[:7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -3e38])
        hps.append(hp.to(source).to(device))
        scales.append(torch.tensor([1.0, 3.5, 1e-2, 448 / 7, 2.0**-20][i], device=device))
        buffer = torch.empty(hp.numel() + 3, dtype=target, device=device)
        slots.append(buffer.narrow(0, 3, hp.numel()).view(shape))  # an odd address
    return hps, scales, slots


def _eager_cast(hp: torch.Tensor, scale: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    bound = torch.finfo(target).max
    return (hp.to(torch.float32) * scale).clamp(-bound, bound).to(target)


def _assert_same_float8(ours: torch.Tensor, reference: torch.Tensor) -> None:
    nan = reference.float().isnan()
    assert torch.equal(ours.float().isnan(), nan)
    assert torch.equal(ours.view(torch.uint8)[~nan], reference.view(torch.uint8)[~nan])


@requires_gpus(1)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_one_launch_float8_cast_is_the_eager_arithmetic(source: torch.dtype, target: torch.dtype) -> None:
    from composable._engine.dtypes import float8_kernel

    device = torch.device("cuda", torch.cuda.current_device())
    hps, scales, slots = _cast_inputs(source, target, device)
    assert float8_kernel.supported(hps, scales, slots)
    assert float8_kernel.cast(hps, scales, slots, torch.finfo(target).max)
    for hp, scale, slot in zip(hps, scales, slots):
        _assert_same_float8(slot, _eager_cast(hp, scale, target))
    # The same tensors again: the table is found by their addresses, and the values are read anew.
    tables = len(float8_kernel._TABLES)
    for hp in hps:
        hp.mul_(-2)
    assert float8_kernel.cast(hps, scales, slots, torch.finfo(target).max)
    assert len(float8_kernel._TABLES) == tables
    for hp, scale, slot in zip(hps, scales, slots):
        _assert_same_float8(slot, _eager_cast(hp, scale, target))


@requires_gpus(1)
def test_one_launch_float8_cast_replays_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured after it ran outside a capture, the cast replays with each replay's values; a
    kernel that has not run yet is not compiled inside a capture (the caller casts another way)."""
    from composable._engine.dtypes import float8_kernel

    device = torch.device("cuda", torch.cuda.current_device())
    target = torch.float8_e4m3fn
    hps, scales, slots = _cast_inputs(torch.float32, target, device)
    bound = torch.finfo(target).max
    float8_kernel.cast(hps, scales, slots, bound)  # warm, outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        assert float8_kernel.cast(hps, scales, slots, bound)
    for step in range(3):
        for hp in hps:
            hp.copy_(torch.randn_like(hp) * 10**step)
        for scale in scales:
            scale.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        for hp, scale, slot in zip(hps, scales, slots):
            _assert_same_float8(slot, _eager_cast(hp, scale, target))
    monkeypatch.setattr(float8_kernel, "_WARM", set())
    other = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(other, stream=side):
        assert not float8_kernel.cast(hps, scales, slots, bound)
        hps[1].mul_(1)  # a graph with no work at all makes torch warn


@requires_gpus(1)
def test_float8_cast_without_the_one_launch_kernel_warns_once_and_casts_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No Triton (or a kernel that fails): one warning naming the error, then the compiled cast,
    the same bytes."""
    import warnings

    from composable._engine.dtypes import float8_cast, float8_kernel

    def no_triton() -> None:
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(float8_kernel, "_STATE", {})
    monkeypatch.setattr(float8_kernel, "_kernel", no_triton)
    monkeypatch.setattr(float8_cast, "_KERNEL", {"usable": True})
    device = torch.device("cuda", torch.cuda.current_device())
    target = torch.float8_e4m3fn
    hps, scales, slots = _cast_inputs(torch.float32, target, device)
    locals_ = [_Float8Weight(hp) for hp in hps]
    with pytest.warns(UserWarning, match=r"one-launch float8 cast is unavailable \(ImportError: No module"):
        float8_cast.cast_into(locals_, scales, slots)
    for hp, scale, slot in zip(hps, scales, slots):
        _assert_same_float8(slot, _eager_cast(hp, scale, target))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        float8_cast.cast_into(locals_, scales, slots)


@dataclasses.dataclass
class _Float8Weight:
    """What `cast_into` reads of a torchao float8 weight's local shard: its high-precision data."""

    _tensor: torch.Tensor
