"""Comparing tensors, DTensors and nests of them: `assert_close_tensors`, re-exported by `_harness`.

A DTensor compared with a full tensor (or with a DTensor of the same layout) is compared shard by
shard: each rank checks the elements it holds against the matching slice of the other side, with
no collective. Every element is still checked (by the rank that holds it), and it is what made
comparisons cheap: gathering each parameter and gradient with ``full_tensor()`` (a redistribution
plan and a gloo all-gather per tensor) took about a sixth of the ranks' time in the
compare-with-a-reference tests. Layouts that are not plain slices (``Partial``, strided shards, a
rank outside the mesh, two different layouts) are gathered with ``full_tensor()`` as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["assert_close_tensors"]


def assert_close_tensors(
    a: Any, b: Any, *, exact: bool = False, rtol: float | None = None, atol: float | None = None, msg: str = ""
) -> None:
    """Compare tensors or DTensors, or dicts/lists/tuples of them. ``exact``: ``torch.equal``
    plus equal dtypes; otherwise ``torch.testing.assert_close`` (``rtol``/``atol`` as there).

    A DTensor may need a collective (layouts other than ``Shard``/``Replicate`` slices): call it
    on every rank, as the ranks of a test do. A mismatch in a shard fails on the rank holding it;
    the message names the global index of the first differing element."""
    _compare(a, b, exact, rtol, atol, msg, path="")


def _compare(a: Any, b: Any, exact: bool, rtol: float | None, atol: float | None, msg: str, path: str) -> None:
    where = f"{msg} {'at ' + path if path else ''}".strip() or "tensors"
    if isinstance(a, (dict, list, tuple)):
        if not isinstance(b, (dict, list, tuple)) or isinstance(a, dict) != isinstance(b, dict):
            raise AssertionError(f"{where}: {type(a).__name__} vs {type(b).__name__}")
        keys = list(a) if isinstance(a, dict) else list(range(len(a)))
        other = list(b) if isinstance(b, dict) else list(range(len(b)))
        if sorted(map(repr, keys)) != sorted(map(repr, other)):
            raise AssertionError(f"{where}: keys differ: {keys} vs {other}")
        for k in keys:
            _compare(a[k], b[k], exact, rtol, atol, msg, f"{path}[{k!r}]")
        return
    a, b, offset = _local_pair(a, b)
    if offset:  # name the rank's shard: its first element's global index
        where = f"{where} (shard at {offset})"
    if not exact:
        if (rtol is None) != (atol is None):  # torch.testing wants both or neither
            rtol, atol = rtol or 0.0, atol or 0.0
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
    elif a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
    elif not torch.equal(a, b):
        diff = (a.double() - b.double()).abs()
        idx = tuple(int(i) for i in torch.nonzero(diff != 0)[0])
        at = tuple(i + o for i, o in zip(idx, offset)) if offset else idx
        raise AssertionError(
            f"{where}: not equal; {int((a != b).sum())} of {a.numel()} "
            f"elements differ, max abs diff {diff.nan_to_num().max().item()}, "
            f"first at {at}: {a[idx].item()} vs {b[idx].item()}"
        )


def _local_pair(a: Any, b: Any) -> tuple[Any, Any, tuple[int, ...]]:
    """What this rank compares: (a's part, b's part, the global index of the parts' first element
    when they are shards, else ``()``). Plain tensors come back as they are."""
    if not isinstance(a, DTensor) and not isinstance(b, DTensor):
        return a, b, ()
    if isinstance(a, DTensor) and isinstance(b, DTensor):
        if a.device_mesh == b.device_mesh and a.placements == b.placements and a.shape == b.shape and _sliced(a):
            return a.to_local(), b.to_local(), _offset(a)
        return a.full_tensor(), b.full_tensor(), ()
    dt, full, swap = (a, b, False) if isinstance(a, DTensor) else (b, a, True)
    if isinstance(full, torch.Tensor) and dt.shape == full.shape and _sliced(dt):
        shape, start = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        mine, theirs, offset = dt.to_local(), full[tuple(slice(i, i + n) for i, n in zip(start, shape))], _offset(dt)
    else:  # gathered, so that a shape mismatch is reported on whole tensors as before
        mine, theirs, offset = dt.full_tensor(), full, ()
    return (theirs, mine, offset) if swap else (mine, theirs, offset)


def _sliced(dt: DTensor) -> bool:
    """Whether this rank's local tensor is a plain slice of the global tensor: only ``Shard`` (not
    a strided shard, a subclass) and ``Replicate`` placements, on a mesh this rank belongs to."""
    plain = all(type(p) is Shard or isinstance(p, Replicate) for p in dt.placements)
    return plain and dt.device_mesh.get_coordinate() is not None


def _offset(dt: DTensor) -> tuple[int, ...]:
    """The global index of this rank's first element, for messages; ``()`` when it holds the
    whole tensor (only ``Replicate``)."""
    if not any(isinstance(p, Shard) for p in dt.placements):
        return ()
    return tuple(compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)[1])
