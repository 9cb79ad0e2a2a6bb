"""Each matrix of a sharded parameter whole on one rank: a function of whole matrices (Muon's
Newton-Schulz) applied to DTensor shards, each matrix's result back in the shards' layout.

Whole-matrix optimizers step elementwise on the local shards, but for one function that needs the
whole matrix. `map_whole_matrices` gives each matrix to one owner rank:

1. all-to-alls send every rank's rows of each matrix to that matrix's owner, the owners chosen so
   that each rank computes about as many FLOPs as the others (matrix-product FLOPs: rows x cols x
   min(rows, cols));
2. each owner applies the function to the whole matrices it owns;
3. all-to-alls send each rank its rows of the results.

The matrices go in a few rounds, so that the collectives of one round run while the owners
compute another.

This serves every layout whose ranks each hold whole rows of a matrix, nested over some mesh dims
and whole over the others: `fully_shard`'s `Shard(0)` (uneven rows included), HSDP's `(Replicate(),
Shard(0))` (each replica group divides its matrices among its own ranks), and a column-parallel
matrix under `fully_shard` on dp x tp or HSDP x TP (`_StridedShard` over dp inside tp's rows: the
owners span the whole dp x tp group). A row-parallel matrix (columns split over tp) is first
redistributed to rows on the same dims, and back after. 3D expert weights split by experts are
computed where they are, matrix by matrix. Any other DTensor layout is gathered whole on every rank
and computed there: the same result, at more FLOPs (`replicate`'s parameters are whole on every
rank already). Plain tensors are whole here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .._engine.params.wrappers import local_tensor

__all__ = ["LocalMatrix", "map_whole_matrices", "whole_matrices"]


class LocalMatrix(Protocol):
    """This rank's part of a matrix to send: its shape and device, the tensor itself, or written
    into a buffer of the wire dtype (where a caller can fuse its last elementwise step)."""

    shape: torch.Size
    device: torch.device

    def tensor(self) -> torch.Tensor: ...

    def write(self, out: torch.Tensor) -> None: ...


class _Rows:
    """A local tensor as a `LocalMatrix`."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows, self.shape, self.device = rows, rows.shape, rows.device

    def tensor(self) -> torch.Tensor:
        return self.rows

    def write(self, out: torch.Tensor) -> None:
        out.copy_(self.rows)


def whole_matrices(
    fn: Callable[[torch.Tensor], torch.Tensor],
    tensors: Sequence[torch.Tensor],
    wire_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """`fn` of each whole matrix of `tensors`, each result laid out as its tensor: the mechanism
    `composable.optim.Muon` orthogonalizes with, for any function of a whole matrix (another
    whole-matrix optimizer's preconditioner, a polar decomposition, a spectral norm clip).

    `tensors` are laid out as parameters are: DTensors sharded by `fully_shard`, HSDP, tensor
    parallelism and their compositions, `replicate`'s, or plain tensors (whole here). Each is a
    matrix (2D) or a stack of matrices along dim 0 (3D, one per expert). Each matrix goes whole to
    one owner rank, which applies `fn` to it and sends each rank its part back (see the module's
    note), so the result is, bit for bit, `fn` of the whole matrix on one process.

    `fn(matrix) -> matrix` takes and returns one whole matrix, of the same shape, in
    `wire_dtype` (default: the tensors' dtype), which is what the rows travel in. Every rank calls
    this with the same `fn` and tensors of the same shapes, in the same order (it runs
    collectives). Returns one tensor per input, in `wire_dtype`: a DTensor with the input's mesh
    and placements, or a plain tensor.

    Raises:
        TypeError: `fn` is not callable, or a member of `tensors` is not a tensor.
        ValueError: a tensor is not 2D or 3D, or the tensors' dtypes differ and no `wire_dtype`
            is given.
    """
    api = "composable.optim.whole_matrices"
    if not callable(fn):
        raise TypeError(f"{api}: 'fn' must be callable, got {type(fn).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{api}: tensors[{i}] must be a tensor, got {type(t).__name__}")
        if t.ndim not in (2, 3):
            raise ValueError(f"{api}: tensors[{i}] must be 2D or a 3D stack of matrices, got shape {tuple(t.shape)}")
    if wire_dtype is None and tensors:
        dtypes = sorted({str(t.dtype) for t in tensors})
        if len(dtypes) > 1:
            raise ValueError(f"{api}: the tensors' dtypes differ ({', '.join(dtypes)}); pass 'wire_dtype'")
        wire_dtype = tensors[0].dtype
    wire = wire_dtype or torch.float32
    locals_ = [_Rows(local_tensor(t).to(wire)) for t in tensors]
    results = map_whole_matrices(fn, locals_, tensors, wire)
    return [
        DTensor.from_local(r, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)
        if isinstance(t, DTensor)
        else r
        for t, r in zip(tensors, results)
    ]


def map_whole_matrices(
    fn: Callable[[torch.Tensor], torch.Tensor],
    updates: Sequence[LocalMatrix],
    params: Sequence[torch.Tensor],
    wire_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """`fn` of each whole matrix, this rank's part of it returned: `updates[i]` is this rank's
    part of a tensor laid out as `params[i]` (a DTensor, or a plain tensor whole here; a 3D one
    is a stack of matrices along dim 0, `fn` applied to each). `fn` takes and returns
    `wire_dtype` (its first step would convert its input to it: the rows travel converted);
    the same on every rank, in the same order of `params`."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    by_rows: dict[Any, list[int]] = {}  # (mesh, the row nesting, redistributed?) -> the parameters
    for i, (pending, param) in enumerate(zip(updates, params)):
        if isinstance(param, DTensor) and (layout := _row_layout(param)) is not None:
            by_rows.setdefault((param.device_mesh, *layout), []).append(i)
            continue
        update = pending.tensor()
        if update.ndim == 3 and _whole_matrices_here(param):  # one matrix per expert, each whole here
            out[i] = _each_matrix(fn, update, wire_dtype)
        elif not isinstance(param, DTensor):
            out[i] = fn(update)
        else:  # any other layout: whole on every rank, then this rank's part of the result
            mesh, placements = param.device_mesh, param.placements
            whole = DTensor.from_local(update, mesh, placements, shape=param.shape, stride=param.stride())
            full = whole.full_tensor()
            result = _each_matrix(fn, full, wire_dtype) if full.ndim == 3 else fn(full)
            replicated = DTensor.from_local(result, mesh, [Replicate()] * mesh.ndim)
            out[i] = replicated.redistribute(mesh, placements)._local_tensor
    for (mesh, nest, columns_split), indices in by_rows.items():
        rows = [Shard(0) if d in nest else Replicate() for d in range(mesh.ndim)]
        as_rows = [_as_rows(updates[i], _dtensor(params[i]), rows) if columns_split else updates[i] for i in indices]
        group, order = _rows_group(mesh, nest)
        sizes = [_nested_rows(params[i].shape[0], [mesh.size(d) for d in nest]) for i in indices]
        shapes = [params[i].shape for i in indices]
        results = _on_owners(as_rows, shapes, sizes, group, order, fn, wire_dtype)
        for i, result in zip(indices, results):
            if columns_split:  # back to the parameter's own layout
                param = _dtensor(params[i])
                laid = DTensor.from_local(result, mesh, rows, shape=param.shape, stride=param.stride())
                result = laid.redistribute(mesh, param.placements)._local_tensor
            out[i] = result
    return cast("list[torch.Tensor]", out)  # every index filled: above, or by its rows' group


def _row_layout(param: torch.Tensor) -> tuple[tuple[int, ...], bool] | None:
    """How the owners' path takes `param` (a 2D DTensor), as (nest, columns_split), or None
    (gathered on every rank instead). Each rank's part is whole rows, nested over the mesh dims
    `nest` (the first of them splits the matrix, the next each of its parts, and so on):

    - `Shard(0)` on some dims, `Replicate()` on the others: `fully_shard`'s rows, HSDP's
      `(Replicate(), Shard(0))`, nested in mesh-dim order;
    - a column-parallel matrix under `fully_shard` on (dp, tp): `(_StridedShard(0, sf=tp),
      Shard(0))`, tp's rows split over dp, nested tp first (HSDP x TP's 3D layout alike);
    - `columns_split`: `Shard` on dims 0 and 1 (a row-parallel matrix under `fully_shard`),
      redistributed to `Shard(0)` on those dims first (DTensor moves the elements), nested in
      mesh-dim order.

    Several dims make one flattened group, which needs the mesh's dim names."""
    if not isinstance(param, DTensor) or param.ndim != 2:
        return None
    placements, mesh = param.placements, param.device_mesh
    dims = tuple(d for d, p in enumerate(placements) if not p.is_replicate())
    if not dims or (len(dims) > 1 and mesh.mesh_dim_names is None):
        return None
    if all(placements[d] == Shard(0) for d in dims):
        return dims, False
    strided = [d for d in dims if isinstance(placements[d], _StridedShard)]
    if len(dims) == 2 and strided == [dims[0]]:
        first, second = dims
        outer = cast(_StridedShard, placements[first])  # `strided` holds it
        if outer.dim == 0 and placements[second] == Shard(0) and outer.split_factor == mesh.size(second):
            return (second, first), False
        return None
    if not strided and all(isinstance(p, Shard) and p.dim in (0, 1) for p in (placements[d] for d in dims)):
        return dims, True
    return None


def _dtensor(param: torch.Tensor) -> DTensor:
    """A parameter `_row_layout` took: a DTensor (it takes no other)."""
    return cast(DTensor, param)


def _as_rows(pending: LocalMatrix, param: DTensor, rows: list[Any]) -> LocalMatrix:
    """The update of a matrix split by columns somewhere, redistributed to `Shard(0)` on the
    same dims (the same fp32 elements moved; the send buffer converts them once)."""
    mesh = param.device_mesh
    update = DTensor.from_local(pending.tensor(), mesh, param.placements, shape=param.shape, stride=param.stride())
    return _Rows(update.redistribute(mesh, rows)._local_tensor)


def _rows_group(mesh: Any, nest: tuple[int, ...]) -> tuple[dist.ProcessGroup, list[int]]:
    """The process group over the dims of `nest` (one dim's own, or the flattened group of
    several: each replica of the other dims its own) and `order`: the group rank holding each
    nested row part, in row order (row-major over `nest`)."""
    if len(nest) == 1:
        group = mesh.get_group(nest[0])
    else:
        names = tuple(mesh.mesh_dim_names[d] for d in sorted(nest))
        group = mesh[names]._flatten().get_group()
    others = [d for d in range(mesh.ndim) if d not in nest]
    size = 1
    for d in nest:
        size *= mesh.size(d)
    members = mesh.mesh.permute(*others, *nest).reshape(-1, size)
    me = dist.get_rank()
    in_row_order = next(row for row in members.tolist() if me in row)
    group_ranks = dist.get_process_group_ranks(group)
    return group, [group_ranks.index(r) for r in in_row_order]


def _nested_rows(rows: int, sizes: list[int]) -> list[int]:
    """Rows each part holds when `rows` are split as `Shard(0)` over mesh dims of `sizes`, one
    after the other (torch.chunk's sizes: ceil-sized parts, the last ones short or empty)."""
    parts = [rows]
    for n in sizes:
        parts = [max(0, min(-(-p // n), p - k * -(-p // n))) for p in parts for k in range(n)]
    return parts


def _each_matrix(fn: Callable[[torch.Tensor], torch.Tensor], stack: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`fn` of each matrix of a 3D stack (dim 0: one matrix per expert)."""
    if stack.shape[0] == 0:
        return stack.to(dtype)
    return torch.stack([fn(matrix) for matrix in stack.unbind(0)])


def _whole_matrices_here(param: torch.Tensor) -> bool:
    """Whether a 3D parameter's local part holds whole matrices: no placement splits dims 1 or 2
    (expert parallelism and `fully_shard` split the experts, dim 0)."""
    if not isinstance(param, DTensor):
        return True
    return all(getattr(p, "dim", 0) == 0 for p in param.placements if not p.is_replicate())


def _owners(shapes: list[torch.Size], world: int) -> list[int]:
    """An owner rank per matrix, balancing matrix-product FLOPs (about rows * cols * min(rows, cols)
    per matrix): the largest first, each to the least loaded rank. The same on every rank."""
    load = [0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i].numel() * min(shapes[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += shapes[i].numel() * min(shapes[i])
    return owners


def _buckets(owners: list[int], world: int) -> list[list[int]]:
    """The matrices split into up to `_BUCKETS` rounds, each owner's list cut into consecutive
    parts, so every round gives every owner about the same share of its work: the
    owners compute one round while the next round's rows arrive and the last round's
    results leave. Owner-major within a round (the order the all-to-all's blocks take)."""
    mine = [[i for i, owner in enumerate(owners) if owner == rank] for rank in range(world)]
    rounds = min(_BUCKETS, max(len(m) for m in mine))
    buckets: list[list[int]] = [[] for _ in range(rounds)]
    for matrices in mine:
        for b in range(rounds):
            buckets[b] += matrices[len(matrices) * b // rounds : len(matrices) * (b + 1) // rounds]
    return [b for b in buckets if b]


# Rounds the owners' work is pipelined in: enough that the first round's all-to-all and the last
# round's return (the part no owner's work hides) are a small share of the whole, few enough that
# each collective stays large.
_BUCKETS = 4


def _on_owners(
    updates: Sequence[LocalMatrix],
    shapes: list[torch.Size],
    sizes: list[list[int]],
    group: dist.ProcessGroup,
    order: list[int],
    fn: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Matrices split by rows over `group` (whole on any other mesh dim): each whole on its
    owner, `fn` of it there, its rows back where they came from. `sizes[i][k]`: the rows of
    matrix i that the k-th part (in row order) holds; `order[k]`: the group rank holding part k.
    Each round (`_buckets`) is two all-to-alls, in flight while the owners compute another
    round; each rank's rows padded to the largest part so every block has the size the receiver
    expects (the padding is never read). The rows travel in `dtype`, `fn`'s input and output."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    part_of = {g: k for k, g in enumerate(order)}
    chunk_rows = [max(part) for part in sizes]  # a rank's rows, padded
    chunk = [r * s[1] for r, s in zip(chunk_rows, shapes)]  # the same, in elements
    starts = [[sum(part[:k]) for k in range(world)] for part in sizes]  # each part's first row
    owners = _owners(shapes, world)
    device = updates[0].device

    # Every round's rows to their owners, all in flight at once: block d of a round holds this
    # rank's padded rows of every matrix of the round that d owns.
    inbound = []
    for bucket in _buckets(owners, world):
        send = torch.empty(sum(chunk[i] for i in bucket), dtype=dtype, device=device)
        send_sizes, offset = [], 0
        for dest in range(world):
            start = offset
            for i in bucket:
                if owners[i] == dest:
                    local_shape = updates[i].shape
                    updates[i].write(send[offset : offset + local_shape.numel()].view(local_shape))
                    offset += chunk[i]
            send_sizes.append(offset - start)
        mine = [i for i in bucket if owners[i] == rank]
        per_source = sum(chunk[i] for i in mine)
        received = torch.empty(world * per_source, dtype=dtype, device=device)
        work = dist.all_to_all_single(received, send, [per_source] * world, send_sizes, group=group, async_op=True)
        inbound.append((bucket, mine, per_source, received, send, work))

    # Round by round: whole matrices on their owner (the parts in row order), computed, each
    # rank's rows sent back while the next round is computed. Block g of `back` holds
    # rank g's rows of every result this rank owns in the round, each matrix's at its padded offset.
    outbound = []
    for bucket, mine, per_source, received, send, work in inbound:
        work.wait()
        blocks = received.view(world, per_source)
        back = torch.empty(world * per_source, dtype=dtype, device=device)
        back_blocks = back.view(world, per_source)
        column = 0
        for i in mine:
            cols = shapes[i][1]
            parts = [blocks[order[k], column : column + n * cols].view(n, cols) for k, n in enumerate(sizes[i])]
            result = fn(torch.cat(parts))
            for dest in range(world):
                k = part_of[dest]
                first, count = starts[i][k], sizes[i][k]
                if count:
                    back_blocks[dest, column : column + count * cols].view(count, cols).copy_(
                        result[first : first + count]
                    )
            column += chunk[i]
        receive_sizes = [sum(chunk[i] for i in bucket if owners[i] == src) for src in range(world)]
        returned = torch.empty(sum(receive_sizes), dtype=dtype, device=device)
        work = dist.all_to_all_single(returned, back, receive_sizes, [per_source] * world, group=group, async_op=True)
        outbound.append((bucket, returned, back, work))

    outputs: list[torch.Tensor | None] = [None] * len(updates)
    for bucket, returned, _back, work in outbound:
        work.wait()
        offset = 0
        for src in range(world):
            for i in bucket:
                if owners[i] == src:
                    local_shape = updates[i].shape
                    outputs[i] = returned[offset : offset + local_shape.numel()].view(local_shape)
                    offset += chunk[i]
    return cast("list[torch.Tensor]", outputs)  # every matrix is in one bucket, its rows from each source
