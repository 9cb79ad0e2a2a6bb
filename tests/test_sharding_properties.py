"""Property tests (hypothesis) for fully_shard's sharding layout: shapes x world sizes x dtypes.

The layout (`composable/fsdp/_param.py`: `ParamLayout`, one flat sharded buffer per group) must
be exactly DTensor's `Shard(0)`, padding must stay internal, and shard -> gather must give back
the very same bits. Shapes include 0-d scalars, 1-D, 3-D, dim 0 smaller than the world (empty
shards on trailing ranks), dim 0 == 0 and empty rows.

- `test_layout_matches_dtensor` (fake process group, one process plays every rank of worlds
  1-8): each rank's local shard has DTensor's local shape and values, every rank's flat buffer
  has the same size (the all-gather needs that), and concatenating the ranks' local shards
  gives the original parameter bit for bit.
- `test_roundtrip_on_gloo` (2 and 3 real ranks): `full_tensor()`, `unshard()` and the
  unsharded parameters the module sees during forward all equal the original exactly, and the
  gradients that come back are exactly the average of the ranks' gradients (integer-valued
  per-rank gradients, so every summation order gives the same bits).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, fake_process_group, run_on_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from composable import fully_shard

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# A parameter shape: 0-d, or 1-3 dims with dim 0 in 0..9 (0 and < world included) and small
# trailing dims (0 included: rows without elements).
_shape = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 9)),
    st.tuples(st.integers(0, 9), st.integers(0, 4)),
    st.tuples(st.integers(0, 9), st.integers(1, 3), st.integers(1, 3)),
)
_shapes = st.lists(_shape, min_size=1, max_size=4)


class Bag(nn.Module):
    """Parameters of the given shapes (deterministic values from `seed`); with `nested`, the
    first half of them live in a child with its own fully_shard group. Forward computes
    sum((p * weights[fqn]).sum()) and records the (unsharded) parameters it computes with."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int, nested: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        split = len(shapes) // 2 if nested else 0
        self.child = Bag(shapes[:split], dtype, seed + 1) if split else None
        for i, shape in enumerate(shapes[split:]):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape, generator=g).to(dtype)))
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, weights: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float64)
        for name, p in self._parameters.items():
            self.seen[prefix + name] = p.detach().clone()
            loss = loss + (p * weights[prefix + name]).sum()
        if self.child is not None:
            loss = loss + self.child(weights, prefix + "child.")
        return loss

    def all_seen(self) -> dict[str, torch.Tensor]:
        return {**self.seen, **(self.child.all_seen() if self.child is not None else {})}


def _shard(bag: Bag, **options: object) -> None:
    if bag.child is not None:
        fully_shard(bag.child, **options)
    fully_shard(bag, **options)


def _expected_placement(p: torch.Tensor) -> tuple:
    # A 0-d parameter cannot be split: every rank holds it whole.
    return (Replicate(),) if p.dim() == 0 else (Shard(0),)


# ----------------------------------------------------------------------------- fake process group


@settings(max_examples=25)
@given(shapes=_shapes, world=st.integers(1, 8), dtype=st.sampled_from(DTYPES), nested=st.booleans())
def test_layout_matches_dtensor(shapes: list[tuple[int, ...]], world: int, dtype: torch.dtype, nested: bool) -> None:
    reference = Bag(shapes, dtype, seed=0, nested=nested)
    originals = {n: p.detach().clone() for n, p in reference.named_parameters()}
    locals_by_rank: list[dict[str, torch.Tensor]] = []
    flat_sizes = []
    for rank in range(world):
        with fake_process_group(world, rank=rank):
            bag = Bag(shapes, dtype, seed=0, nested=nested)
            _shard(bag)
            mesh = fully_shard.state(bag).mesh
            assert [n for n, _ in bag.named_parameters()] == list(originals)
            locals_by_rank.append({})
            for name, p in bag.named_parameters():
                full = originals[name]
                assert isinstance(p, DTensor) and p.shape == full.shape and p.dtype == dtype, name
                assert p.placements == _expected_placement(full), (name, p.placements)
                # No communication (src_data_rank=None): DTensor's own local chunk of `full`.
                expected = distribute_tensor(full, mesh, _expected_placement(full), src_data_rank=None).to_local()
                assert_close_tensors(
                    p.to_local(), expected, exact=True, msg=f"world {world} rank {rank}: local shard of {name}"
                )
                locals_by_rank[-1][name] = p.to_local().clone()
            flat_sizes.append([_flat_numel(s) for s in _states(bag)])
    # The flat all-gather input has the same size on every rank: the padded regions.
    assert all(sizes == flat_sizes[0] for sizes in flat_sizes), flat_sizes
    for name, full in originals.items():
        if full.dim() == 0:
            gathered = locals_by_rank[0][name]
        else:  # what an all-gather + unpad must produce: rank-major concatenation
            gathered = torch.cat([loc[name] for loc in locals_by_rank])
        assert_close_tensors(gathered, full, exact=True, msg=f"world {world}: shards of {name} concatenated")
    assert flat_sizes[0] == [_padded_numel(s, world) for s in _param_shape_groups(reference)]


def _states(bag: Bag) -> list:
    return [fully_shard.state(m) for m in ([bag.child] if bag.child is not None else []) + [bag]]


def _flat_numel(state: object) -> int:
    """Size of one group's flat sharded buffer (the all-gather input)."""
    group = state.groups[0]  # type: ignore[attr-defined]
    return 0 if group is None else group.flat_shard.numel()


def _param_shape_groups(bag: Bag) -> list[list[torch.Size]]:
    return [[p.shape for p in b._parameters.values()] for b in ([bag.child] if bag.child is not None else []) + [bag]]


def _padded_numel(shapes: list[torch.Size], world: int) -> int:
    """Per-rank region: ceil(rows / world) rows of each parameter; a 0-d one whole."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) if len(s) else 1 for s in shapes)


# ----------------------------------------------------------------------------- real ranks


def _roundtrip(
    rank: int, world: int, shapes: list, dtype: torch.dtype, nested: bool, reshard_after_forward: bool
) -> None:
    bag = Bag(shapes, dtype, seed=0, nested=nested)
    originals = {n: p.detach().clone() for n, p in bag.named_parameters()}
    _shard(bag, reshard_after_forward=reshard_after_forward)
    mesh = fully_shard.state(bag).mesh
    for name, p in bag.named_parameters():
        full = originals[name]
        expected = distribute_tensor(full, mesh, _expected_placement(full))
        assert p.placements == expected.placements, name
        assert_close_tensors(p.to_local(), expected.to_local(), exact=True, msg=f"rank {rank}: local shard of {name}")
        assert_close_tensors(p.full_tensor(), full, exact=True, msg=f"full_tensor of {name}")

    # Explicit unshard: the registered parameters are the unsharded originals, bit for bit.
    for state in _states(bag):
        state.unshard()
    for name, p in bag.named_parameters():
        assert not isinstance(p, DTensor), f"{name} should be unsharded"
        assert_close_tensors(p.detach(), originals[name], exact=True, msg=f"unsharded {name}")
    for state in _states(bag):
        state.reshard()
    assert all(isinstance(p, DTensor) for p in bag.parameters())

    # Forward sees the originals; backward returns the exact average of per-rank gradients.
    # Per-rank gradients are small integers: sums are exact in any order, so the only rounding
    # is the final division by the world size, the same on both sides.
    weights = [
        {
            n: torch.randint(-8, 9, t.shape, generator=torch.Generator().manual_seed(100 * r + i)).to(dtype)
            for i, (n, t) in enumerate(originals.items())
        }
        for r in range(world)
    ]
    for step in range(2):  # the second step runs after lazy init, with gradients accumulating
        bag(weights[rank]).backward()
        seen = bag.all_seen()
        assert sorted(seen) == sorted(originals)
        for name, t in seen.items():
            assert_close_tensors(t, originals[name], exact=True, msg=f"step {step}: {name} during forward")
    for name, p in bag.named_parameters():
        total = sum(w[name].double() for w in weights)  # exact
        expected = 2 * (total.to(dtype) / world)  # two accumulated steps: x + x is exact
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
        assert_close_tensors(p.grad.full_tensor(), expected, exact=True, msg=f"rank {rank}: grad of {name}")


@settings(max_examples=30)
@given(
    shapes=_shapes,
    world=st.sampled_from([2, 3]),
    dtype=st.sampled_from(DTYPES),
    nested=st.booleans(),
    reshard_after_forward=st.booleans(),
)
def test_roundtrip_on_gloo(
    shapes: list, world: int, dtype: torch.dtype, nested: bool, reshard_after_forward: bool
) -> None:
    run_on_ranks(_roundtrip, world, shapes, dtype, nested, reshard_after_forward)


@pytest.mark.parametrize("world", [2, 3])
def test_roundtrip_edge_shapes_on_gloo(world: int) -> None:
    """The shapes hypothesis may not draw together: 0-d, dim 0 of 0, 1 (< world), world + 1."""
    shapes = [(), (0,), (1, 3), (world + 1,), (0, 2), (3, 0), (2, 2, 2)]
    for dtype in (torch.float32, torch.bfloat16):
        run_on_ranks(_roundtrip, world, shapes, dtype, True, True)
