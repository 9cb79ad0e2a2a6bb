"""Optimizer step pre-hook: step counters on the parameters' mesh, and no replaced parameters.

PyTorch's fused and capturable optimizers (AdamW(fused=True), the default on CUDA in many
training scripts) keep each parameter's step count as a plain 0-d tensor on the parameter's
device. When the parameters are DTensors, DTensor's dispatcher meets those plain tensors in
every optimizer op and builds a fresh replicated `DTensorSpec` for each of them, every step:
fused AdamW over 128 replicated parameters took 3.4 ms per step on this project's 2-core CI
machine (1.1 ms with this module, 0.7 ms for plain parameters), a cost PyTorch DDP does not pay.

So, before each optimizer step, the step counters of the parameters this package manages are
made what DTensor would have made of them anyway: replicated 0-d DTensors on the parameter's
mesh, around the same local tensor (no copy), with one spec object per (mesh, dtype) that
every step reuses. The values, and what the optimizer computes, are unchanged.

What users see stays as with PyTorch FSDP2: `optimizer.state_dict()` hands out the plain
local tensors (a state-dict hook), so checkpoints have the same format, and loading one
brings plain counters back, converted again before the next step. An optimizer whose state
did not change since it was last converted costs one comparison per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..params.claim import REPLACED_BY_ATTR, replacement_count
from ..params.wrappers import new_dtensor

STEP_KEY = "step"
# Set on an optimizer whose state `composable.optim.offload_optimizer_state` keeps on the host
# (and on the copy of it that steps each bucket): graphed_step refuses to capture its step.
STATE_ON_HOST_ATTR = "_composable_state_on_host"
# Set on the parameters `composable.optim.step_in_backward` stepped during this backward,
# until `optimizer.step()`: clipping their gradients now would come after their steps.
STEPPED_IN_BACKWARD_ATTR = "_composable_stepped_in_backward"
_marks = 0  # parameters marked (some may have died marked: then only the fast path is lost)

# Set on the sharded parameters this package makes. An attribute, not a registry: weak
# references to parameters would forbid `torch.utils.swap_tensors` (`module.to_empty`).
MANAGED_FLAG = "_composable_counters_on_mesh"
_step_hook: Any = None
# Per optimizer: (its state object, its length) when its counters were last converted.
_converted: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, int]]" = weakref.WeakKeyDictionary()
_hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # state-dict hook installed
# The counters' specs, held by the counters alone: a cache that held them would hold their meshes,
# and through them the meshes' process groups (threads, sockets) for the life of the process.
_specs: "weakref.WeakValueDictionary[tuple[int, torch.dtype], DTensorSpec]" = weakref.WeakValueDictionary()
# Per optimizer: its parameter groups' shape when last checked for replaced parameters.
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def _dtensor_has_rule(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor's sharding propagator knows `op` (its registries differ across torch versions)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    registries = ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs")
    return any(op in getattr(propagator, name, {}) for name in registries)


DTENSOR_HAS_FOREACH_ADD_TENSOR = _dtensor_has_rule(torch.ops.aten._foreach_add_.Tensor)


def mark_stepped_in_backward(params: list[torch.Tensor], stepped: bool) -> None:
    """Record `params` as stepped during this backward (True) or no longer (False).

    The mark is an attribute of each parameter, so it dies with it: a set of ids would outlive
    a parameter dropped while marked (a backward that raised) and mark whichever tensor took
    its id next. The count of marks only keeps `first_stepped_in_backward` free when none is."""
    global _marks
    for p in params:
        if stepped and not getattr(p, STEPPED_IN_BACKWARD_ATTR, False):
            setattr(p, STEPPED_IN_BACKWARD_ATTR, True)
            _marks += 1
        elif not stepped and getattr(p, STEPPED_IN_BACKWARD_ATTR, False):
            delattr(p, STEPPED_IN_BACKWARD_ATTR)
            _marks -= 1


def first_stepped_in_backward(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The first of `params` stepped during this backward, if any (free when none is)."""
    if _marks <= 0:
        return None
    return next((p for p in params if getattr(p, STEPPED_IN_BACKWARD_ATTR, False)), None)


def install_step_hook() -> None:
    """Install the global optimizer step pre-hook (once): it refuses replaced parameters and
    puts step counters on the mesh."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_before_step)


def track_for_optimizers(param: torch.Tensor) -> None:
    """Mark `param` (a sharded DTensor parameter made by the engine) as one whose optimizer
    step counters live on its mesh; installs the global optimizer hook on first use."""
    setattr(param, MANAGED_FLAG, True)
    install_step_hook()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():
        return  # a compiled step traces its own graph (its writes bump the versions); the checks are eager-mode ones
    # Fused optimizers (`AdamW(fused=True)`: `torch._fused_adamw_`) write the parameters in place
    # without bumping their version counters, and copies of the sharded parameters kept across
    # passes (unsharded ones kept after backward, an offloaded group's device copy) are
    # refreshed when those versions change: bump them for every optimizer (a second bump is harmless).
    increment_version([p for group in optimizer.param_groups for p in group["params"]])
    check_no_replaced_params(optimizer)
    _check_whole_matrix_optimizer(optimizer)
    _counters_on_mesh(optimizer, args, kwargs)


def check_no_replaced_params(optimizer: torch.optim.Optimizer) -> None:
    """Raise `RuntimeError` if `optimizer` holds a parameter that `fully_shard`/`replicate`
    replaced by a sharded DTensor: built before the API call, it would step tensors the model
    no longer uses, silently, step after step. The same after `load_state_dict(assign=True)`
    replaced the sharded parameters themselves. Checked again only when the optimizer's
    parameter groups change (`add_param_group`) or parameters were replaced since."""
    groups = optimizer.param_groups
    shape = (replacement_count(), id(groups), *(len(g["params"]) for g in groups))
    if _checked.get(optimizer) == shape:
        return
    stale = [(i, p) for i, g in enumerate(groups) for p in g["params"] if hasattr(p, REPLACED_BY_ATTR)]
    if stale:
        index, param = stale[0]
        api = getattr(param, REPLACED_BY_ATTR)
        rank = f" (rank {torch.distributed.get_rank()})" if torch.distributed.is_initialized() else ""
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {len(stale)} of its parameters (the first of shape "
            f"{tuple(param.shape)} in param group {index}) were replaced by {api}, which the model no longer "
            f"uses{rank}: the optimizer was built before {api} was applied; build it after, from "
            f"model.parameters()"
        )
    _checked[optimizer] = shape


def _check_whole_matrix_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """`torch.optim.Muon` orthogonalizes each parameter as a whole matrix: over a sharded DTensor
    it would orthogonalize each rank's rows on their own, without a word (not Muon's update).
    Refused at its first step; `composable.optim.Muon` (a subclass) takes the same arguments."""
    if type(optimizer) is not getattr(torch.optim, "Muon", None):
        return
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if isinstance(param, DTensor) and any(p.is_shard() for p in param.placements):
                rank = f" (rank {torch.distributed.get_rank()})" if torch.distributed.is_initialized() else ""
                raise RuntimeError(
                    f"torch.optim.Muon.step(): a parameter of shape {tuple(param.shape)} in param group {index} is "
                    f"sharded ({param.placements}){rank}, and Muon orthogonalizes whole matrices: each rank would "
                    "orthogonalize its own part; use composable.optim.Muon, which takes the same arguments"
                )


def _step_spec(mesh: DeviceMesh, dtype: torch.dtype) -> DTensorSpec:
    """One replicated 0-d spec per (mesh, dtype), shared by every counter: DTensor compares
    the same object by identity, not field by field. Kept only while a counter holds it (an id
    reused by a later mesh finds a spec of the dead one's: made anew)."""
    key = (id(mesh), dtype)
    spec = _specs.get(key)
    if spec is None or spec.mesh is not mesh:
        meta = TensorMeta(torch.Size(()), (), dtype)
        spec = _specs[key] = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
    return spec


def _counters_on_mesh(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step counters on the mesh: see the module docstring."""
    state = optimizer.state
    seen = _converted.get(optimizer)
    if seen is not None and seen[0] is state and seen[1] == len(state):
        return
    converted_any = False
    # torch's multi-tensor capturable Adam/AdamW computes its bias corrections with
    # `aten._foreach_pow.ScalarAndTensor`, which DTensor has no rule for (torch 2.11-2.13):
    # their counters stay plain tensors, as under FSDP2 (the fused kernels take either).
    plain = {id(p) for g in optimizer.param_groups if g.get("capturable") and not g.get("fused") for p in g["params"]}
    if not DTENSOR_HAS_FOREACH_ADD_TENSOR:
        # torch 2.11-2.12's DTensor has no rule for `aten._foreach_add_.Tensor`, with which the
        # multi-tensor optimizers count steps held on the CPU: those counters stay plain too.
        plain |= {
            id(p) for g in optimizer.param_groups if g.get("foreach") for p in g["params"] if p.device.type == "cpu"
        }
    for param, entry in state.items():
        step = entry.get(STEP_KEY) if isinstance(entry, dict) else None
        if (
            id(param) in plain
            or type(step) is not torch.Tensor
            or step.dim() != 0
            or not isinstance(param, DTensor)
            or not getattr(param, MANAGED_FLAG, False)
            or step.device != param._local_tensor.device
        ):
            continue
        entry[STEP_KEY] = new_dtensor(step, _step_spec(param.device_mesh, step.dtype))
        converted_any = True
    if converted_any and optimizer not in _hooked:
        optimizer.register_state_dict_post_hook(_plain_counters)
        _hooked.add(optimizer)
    _converted[optimizer] = (state, len(state))


def _plain_counters(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`optimizer.state_dict()` post-hook: counters handed out as the plain local tensors
    (PyTorch FSDP2's format), without touching the optimizer's own state."""
    packed = state_dict.get("state", {})
    for key, entry in packed.items():
        step = entry.get(STEP_KEY) if isinstance(entry, dict) else None
        if isinstance(step, DTensor):
            packed[key] = {**entry, STEP_KEY: step._local_tensor}
    return state_dict
