"""Parameters annotated with spmd_types (torchtitan's default SPMD backend): plain tensors,
already local to their model-parallel shard, carrying spmd_types local types (R, I, V, P per
mesh axis) and a partition spec on a typechecking mesh (e.g. dp, cp, tp).

They are translated as PyTorch FSDP2 (torch 2.15) translates them, so one model works with
either library:
- storage: a DTensor on the whole mesh passed with `dp_mesh_dims` (the storage mesh); its
  data-parallel axes must be `R` (the group owns their reduction), every other storage axis
  needs an annotation, and the placements are the local types merged with the partition spec;
- compute: the module sees plain tensors of the local shape; under spmd_types typechecking
  the annotation is restored on them (axes of the typechecking mesh left out are `R`);
- gradients: the plain gradient is read as a DTensor with the backward types' placements
  (R -> Partial, I -> Replicate, S -> S), so a weight replicated over tp (a sequence-parallel
  norm) has its gradient all-reduced over tp; the data-parallel axes reduce as usual.
The engine's hooks run with typechecking paused (they move data the checker knows nothing of).

spmd_types stays optional: a tensor can only carry annotations once spmd_types was imported,
so nothing here imports it; until the first annotated parameter is built, the hooks' check
(`untyped`, `restore_annotations`) is one flag."""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, ParamSpec, TypeVar, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .param import DTensorSpecLite
from .spmd import SpmdDims

P = ParamSpec("P")
R = TypeVar("R")

_SEEN = [False]  # an annotated parameter was built: hooks check typechecking from now on
_PAUSED = [False]  # a hook paused typechecking (which the module's compute after it resumes)


def _spmd_types() -> Any:
    """The spmd_types module if imported (only then can a tensor carry its annotations)."""
    return sys.modules.get("spmd_types")


def is_annotated(param: torch.Tensor) -> bool:
    """Whether `param` is a plain tensor carrying spmd_types annotations (as FSDP2 tells)."""
    spmd = _spmd_types()
    return spmd is not None and not isinstance(param, DTensor) and bool(spmd.get_local_type(param))


@dataclass(frozen=True)
class Annotation:
    """What an annotated parameter needs after it became a DTensor on the storage mesh."""

    partition_spec: Any  # spmd_types.PartitionSpec | None
    restore_type: dict[object, object]  # per typechecking-mesh axis: the local type restored at compute
    grad_spec: DTensorSpecLite  # on the storage mesh: the backward types' placements


def to_storage(api: str, fqn: str, param: torch.Tensor, spmd_dims: SpmdDims | None) -> tuple[nn.Parameter, Annotation]:
    """`param` (annotated, plain) as an `nn.Parameter(DTensor)` on the storage mesh, sharing its
    data, and what compute and gradients need. Raises `ValueError` (naming the parameter) for:
    no `dp_mesh_dims` or an unnamed mesh; partial annotations with no spmd_types current mesh
    to restore them on; annotations on axes outside the typechecking mesh; a typechecking mesh
    over other ranks than the storage mesh; a data-parallel axis not `R`; an axis that is
    neither a storage axis nor inside the data-parallel mesh; a storage axis left out."""
    spmd = _spmd_types()
    from spmd_types._mesh_axis import flatten_axes
    from spmd_types.runtime import get_partition_spec
    from spmd_types.types import partition_spec_to_shard_types

    if spmd_dims is None or spmd_dims.mesh.mesh_dim_names is None:
        raise ValueError(
            f"{api}: parameter '{fqn}' carries spmd_types annotations, which need a mesh with named dims and "
            "'dp_mesh_dims' (DataParallelMeshDims(shard=..., replicate=...)) naming its data-parallel dims"
        )
    storage = spmd_dims.mesh
    named_axes = [(n, spmd.MeshAxis.of(storage.get_group(n))) for n in spmd_dims.mesh.mesh_dim_names]
    storage_axes = tuple(axis for _, axis in named_axes)
    init_type = spmd.get_local_type(param)
    spec = get_partition_spec(param)
    local_type = dict(init_type)
    if spec is not None:
        local_type.update(partition_spec_to_shard_types(spec))
    annotated = tuple(local_type)
    if _same_ranks(spmd, flatten_axes, annotated, storage_axes):
        restore_mesh = annotated
    elif spmd.current_mesh() is not None:
        restore_mesh = tuple(spmd.current_mesh())
    else:
        raise ValueError(
            f"{api}: parameter '{fqn}' has spmd_types annotations on {_axes(annotated)} only, which cannot be "
            f"restored on the storage mesh {_axes(storage_axes)}: annotate every axis, or call {api} inside "
            "spmd_types.set_current_mesh(...)"
        )
    unknown = [axis for axis in init_type if axis not in restore_mesh]
    if unknown:
        raise ValueError(
            f"{api}: parameter '{fqn}' is annotated on {_axes(unknown)}, outside the typechecking mesh "
            f"{_axes(restore_mesh)}"
        )
    if not _same_ranks(spmd, flatten_axes, restore_mesh, storage_axes):
        raise ValueError(
            f"{api}: parameter '{fqn}' is annotated on the typechecking mesh {_axes(restore_mesh)}, which spans "
            f"other ranks than the storage mesh {_axes(storage_axes)}"
        )
    dp_names = set(spmd_dims.shard_names + spmd_dims.replicate_names)
    dp_axis = flatten_axes(tuple(axis for name, axis in named_axes if name in dp_names))
    others = {axis for name, axis in named_axes if name not in dp_names}
    types = {axis: spmd.R for name, axis in named_axes if name in dp_names}
    for axis, kind in local_type.items():
        if axis <= dp_axis:  # on (or inside) the data-parallel mesh: the group reduces it
            if kind is not spmd.R:
                raise ValueError(
                    f"{api}: parameter '{fqn}' must be R on the data-parallel axis {_axes([axis])}, got {kind!r}"
                )
        elif axis not in others:
            raise ValueError(
                f"{api}: parameter '{fqn}' is annotated on {_axes([axis])}, neither a storage-mesh axis nor "
                f"inside the data-parallel dims {sorted(dp_names)}"
            )
        else:
            types[axis] = kind
    missing = [axis for axis in storage_axes if axis not in types]
    if missing:
        raise ValueError(
            f"{api}: parameter '{fqn}' has no spmd_types annotation on the storage axes {_axes(missing)} "
            f"(annotated: {_axes(annotated)})"
        )
    ordered = [types[axis] for axis in storage_axes]
    placements = tuple(spmd.spmd_type_to_dtensor_placement(t) for t in ordered)
    grad_placements = tuple(spmd.spmd_type_to_dtensor_placement(t.backward_type()) for t in ordered)
    restore = {axis: init_type.get(axis, spmd.R) for axis in restore_mesh}
    stored = nn.Parameter(
        DTensor.from_local(param.data, storage, placements, run_check=False), requires_grad=param.requires_grad
    )
    _start_watching(spmd)
    return stored, Annotation(spec, restore, DTensorSpecLite(storage, grad_placements, stored.shape))


def _same_ranks(
    spmd: Any, flatten: Callable[[tuple[object, ...]], object], lhs: tuple[object, ...], rhs: tuple[object, ...]
) -> bool:
    """Whether two sets of mesh axes span the same ranks in the same order."""
    left, right = spmd.normalize_mesh(frozenset(lhs)), spmd.normalize_mesh(frozenset(rhs))
    if not left or not right:
        return bool(left == right)  # frozensets of axes (spmd_types, untyped here)
    return flatten(tuple(left)) == flatten(tuple(right))


def _axes(axes: Any) -> str:
    return "(" + ", ".join(str(a) for a in axes) + ")"


def _start_watching(spmd: Any) -> None:
    """From the first annotated parameter on, the engine's autograd function is typed as a
    local one and hooks pause typechecking."""
    if _SEEN[0]:
        return
    from ..hooks.autograd import PostBackward

    spmd.register_local_autograd_function(PostBackward)
    _SEEN[0] = True


def restore_annotations(params: Any) -> None:
    """Under typechecking, give the unsharded (plain) parameters of annotated managed params
    their compute annotation again (FSDP2 does this before every forward)."""
    spmd = _spmd_types() if _SEEN[0] else None
    if spmd is None or not spmd.is_type_checking():
        return
    for mp in params:
        note = mp.annotation
        if note is not None and mp.unsharded_param is not None and note.restore_type:
            spmd.assert_type(mp.unsharded_param, note.restore_type, partition_spec=note.partition_spec)


def untyped(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator for engine hooks: run `fn` with spmd_types typechecking paused (collectives,
    copies and storage swaps are not model compute). Costs one flag check until an annotated
    parameter exists."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if not _SEEN[0]:
            return fn(*args, **kwargs)
        spmd = _spmd_types()
        if not spmd.is_type_checking():
            return fn(*args, **kwargs)
        paused, _PAUSED[0] = _PAUSED[0], True
        try:
            with spmd.no_typecheck():
                return fn(*args, **kwargs)
        finally:
            _PAUSED[0] = paused

    return wrapper


def resumed() -> contextlib.AbstractContextManager[None]:
    """Inside an `untyped` hook: typechecking back on for what belongs to the module's compute
    (restored annotations, the autograd function on its inputs, whose outputs keep their
    types), if it was on when the hook began."""
    if not _PAUSED[0]:
        return contextlib.nullcontext()
    from spmd_types.checker import typecheck

    return cast("contextlib.AbstractContextManager[None]", typecheck())  # spmd_types is untyped here
