"""DTensor's sharding propagation in the harness's persistent workers: a memo that outlives a call,
whose answers name the asking call's meshes.

DTensor caches sharding propagation (its Python LRU, the C++ dispatch cache) keyed by meshes that
compare equal across process groups (same ranks), and a cached answer names the mesh that was
current when it was computed. In a persistent worker a later call's ops would get answers naming
an earlier call's mesh: its destroyed groups do not resolve ("Could not resolve the process
group", seen on torch 2.11 with NCCL), and FSDP2 refuses a parameter whose mesh is not the very
mesh it was given. So the worker clears those caches after every call (``forget_sharding_cache``),
and each call propagated each of its ops afresh: about a third of the workers' time, since the
tests run the same few models again and again.

``remember_sharding`` puts a memo under DTensor's caches: on a miss there, an answer computed in an
earlier call for an equal schema is returned with every mesh in it replaced by the mesh at the
same place in the asking schema, the answer propagation would compute for it. An answer naming a
mesh that is not among the asking schema's, or holding an object this module does not know how
to rebind, is computed afresh. Registering a sharding strategy or rule empties the memo, as it
changes what propagation computes. Only CPU meshes (the gloo tests, nearly all of them) use the
memo; ops on GPU meshes are propagated by torch alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# Objects without a mesh that an operator schema or a propagation result holds: shared as they are.
_LEAVES = (
    int,
    float,
    bool,
    complex,
    str,
    bytes,
    type(None),
    type(Ellipsis),
    slice,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)


class _Unbindable(Exception):
    """An answer that cannot be rebound to the asking schema's meshes: computed afresh."""


def _meshes(obj: Any, spec_type: type, out: list) -> None:
    """The meshes of ``obj``'s DTensor specs, in order (nested lists, tuples and dicts)."""
    if isinstance(obj, spec_type):
        out.append(obj.mesh)
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for item in obj:
            _meshes(item, spec_type, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _meshes(item, spec_type, out)


def _rebind(obj: Any, mesh_for: dict[int, Any], types: tuple[type, type, type]) -> Any:
    """``obj`` with each DTensor spec's mesh replaced by ``mesh_for[id(mesh)]``; raises
    ``_Unbindable`` for an unmapped mesh or an object of an unknown type."""
    spec_type, schema_type, output_type = types
    if isinstance(obj, _LEAVES):
        return obj
    if isinstance(obj, spec_type):
        mesh = mesh_for.get(id(obj.mesh))
        if mesh is None:
            raise _Unbindable
        return obj if mesh is obj.mesh else dataclasses.replace(obj, mesh=mesh)
    if isinstance(obj, list):
        return [_rebind(item, mesh_for, types) for item in obj]
    if type(obj) is tuple:
        return tuple(_rebind(item, mesh_for, types) for item in obj)
    if isinstance(obj, dict):
        return {key: _rebind(value, mesh_for, types) for key, value in obj.items()}
    if isinstance(obj, schema_type):
        # A new schema, so that its comparison key is computed from the rebound specs.
        return dataclasses.replace(
            obj,
            args_schema=_rebind(obj.args_schema, mesh_for, types),
            kwargs_schema=_rebind(obj.kwargs_schema, mesh_for, types),
            _comparison_key=None,
        )
    if type(obj) is output_type:
        # A new result rather than a copy: OutputSharding caches its mesh in a cached_property.
        return dataclasses.replace(
            obj,
            output_spec=_rebind(obj.output_spec, mesh_for, types),
            redistribute_schema=_rebind(obj.redistribute_schema, mesh_for, types),
        )
    raise _Unbindable


def _stand_in(mesh: Any) -> Any:
    """A copy of ``mesh`` that compares and hashes as it does but holds no process group (nor
    other meshes): what the memo keeps, so that it pins no destroyed group's threads and sockets."""
    stand_in = object.__new__(type(mesh))
    stand_in.__dict__.update(mesh.__dict__)
    stand_in._pg_registry = {}
    stand_in._root_mesh = None
    stand_in._flatten_mapping = {}
    return stand_in


def remember_sharding() -> None:
    """Install the memo under DTensor's sharding-propagation caches in this process (a worker's)."""
    from torch.distributed._functional_collectives import _are_we_tracing
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    propagator = DTensor._op_dispatcher.sharding_propagator
    compute: Callable[[OpSchema], OutputSharding] = propagator.propagate_op_sharding_non_cached
    types = (DTensorSpec, OpSchema, OutputSharding)
    registries = (
        propagator.op_to_rules,
        propagator.op_strategy_funcs,
        getattr(propagator, "op_single_dim_strategy_funcs", {}),
        propagator.op_to_schema_info,
    )
    # A schema, its meshes stand-ins -> (that schema, the answer computed for it, in stand-ins).
    memo: dict[OpSchema, tuple[OpSchema, OutputSharding]] = {}
    stand_ins: dict[Any, Any] = {}  # one stand-in per distinct mesh value
    registered: list[tuple[int, ...]] = [()]

    def schema_meshes(schema: OpSchema) -> list:
        meshes: list = []
        _meshes((schema.args_schema, schema.kwargs_schema), DTensorSpec, meshes)
        return meshes

    def remember(op_schema: OpSchema, meshes: list, answer: OutputSharding) -> None:
        to_stand_in: dict[int, Any] = {}
        for mesh in meshes:
            candidate = _stand_in(mesh)
            to_stand_in[id(mesh)] = stand_ins.setdefault(candidate, candidate)
        if len({id(s) for s in to_stand_in.values()}) != len(to_stand_in):
            return  # two distinct but equal meshes in one schema: which is which is lost
        with contextlib.suppress(_Unbindable):
            kept = _rebind(op_schema, to_stand_in, types)
            memo[kept] = (kept, _rebind(answer, to_stand_in, types))

    def propagate(op_schema: OpSchema) -> OutputSharding:
        if _are_we_tracing():  # symbolic shapes: not hashable, and not what an eager op asks
            return compute(op_schema)
        new_meshes = schema_meshes(op_schema)
        if not all(type(mesh) is DeviceMesh for mesh in new_meshes):
            return compute(op_schema)  # under compile's fake kernels a mesh is an opaque stand-in
        if any(mesh.device_type != "cpu" for mesh in new_meshes):
            return compute(op_schema)  # GPU tests are few and slow anyway: torch's own answers there
        sizes = tuple(len(r) for r in registries)  # a strategy registered since: answers may differ
        if sizes != registered[0]:
            memo.clear()
            registered[0] = sizes
        known = memo.get(op_schema)
        if known is not None:
            kept, answer = known
            old_meshes = schema_meshes(kept)
            mesh_for = {id(old): new for old, new in zip(old_meshes, new_meshes)}
            # Each stand-in stands for one mesh of the asking schema (distinct but equal meshes
            # there would make the answer ambiguous: computed afresh).
            one_to_one = len(mesh_for) == len({id(new) for new in new_meshes})
            if len(old_meshes) == len(new_meshes) and one_to_one:
                with contextlib.suppress(_Unbindable):
                    return _rebind(answer, mesh_for, types)
        answer = compute(op_schema)
        remember(op_schema, new_meshes, answer)
        return answer

    # The C++ dispatch cache, on a miss, calls the uncached method directly (its own cache
    # subsumes the LRU); the LRU serves the other callers.
    propagator.propagate_op_sharding_non_cached = propagate
    propagator.propagate_op_sharding = LocalLRUCache(propagate)


def forget_sharding_cache() -> None:
    """Empty DTensor's own sharding caches (after each call): their answers name this call's
    meshes, whose groups are destroyed with it. So do every other `functools.lru_cache` of
    torch.distributed (`MeshTopoInfo.build_from_mesh`, the tensor-meta cache) and the
    redistribute planners' cache: a cached mesh holds its process groups (`_pg_registry`, `_root_mesh`), whose gloo
    threads and sockets then lived for the rest of the worker's life, three threads a group."""
    for cached in _distributed_lru_caches():
        cached.cache_clear()
    with contextlib.suppress(Exception):  # and its planners, by mesh, in a dict (torch >= 2.12)
        from torch.distributed.tensor import _redistribute

        getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    with contextlib.suppress(Exception):
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    with contextlib.suppress(Exception):  # the redistribute planner caches per mesh as well
        from torch.distributed.tensor import _redistribute

        _redistribute._gen_transform_infos.cache_clear()
    # And so does the C++ fast path of DTensor's dispatch (torch >= 2.11): missing this one made
    # a later NCCL test's optimizer state carry an earlier test's mesh, whose group name ("1")
    # no longer resolves once deep-copied (test_counters_on_mesh_with_fused_adamw_on_gpus).
    clear_cpp_cache = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_cpp_cache is not None:
        clear_cpp_cache()


def _distributed_lru_caches() -> list[Any]:
    """Every `functools.lru_cache` at module or class level in the loaded torch.distributed
    modules (a scan of a few hundred module dicts: milliseconds)."""
    import functools
    import sys

    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                members = [getattr(v, "__func__", v) for v in vars(value).values()]
            else:
                members = [value]
            found.extend(m for m in members if isinstance(m, functools._lru_cache_wrapper))
    return found
