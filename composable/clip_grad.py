"""Gradient norm clipping for any mix of plain tensors and DTensors on any meshes.

``torch.nn.utils.clip_grad_norm_`` works on DTensors only while every gradient lives on one
mesh (it stacks DTensor norms, which DTensor refuses across meshes: pytorch/pytorch#180346),
returns a DTensor, and its CPU cost grows badly with the number of parameters in some torch
versions. This module computes the norm from the local tensors instead:

1. group the gradients by ``(mesh, placements)``;
2. per group, one ``torch._foreach_norm`` over the local tensors gives the group's local
   ``sum |x|^p`` (``max |x|`` for ``inf``); host tensors (CPU offload) take the same norms side
   by side on a pool of threads (``host_norms``), where the foreach norm runs one core;
3. a group's local value covers only this rank's pieces of its gradients, so it is reduced over
   exactly the mesh dimensions on which the gradients are *sharded* (``Shard``, ``_StridedShard``);
   over ``Replicate`` dimensions every rank holds the same values and summing would count them
   twice. Groups reduced over the same process group share one tensor: one ``all_reduce`` (SUM,
   or MAX for ``inf``) per distinct process group, however many parameters or meshes there are;
4. the clip coefficient ``min(max_norm / (total + 1e-6), 1)`` scales every local tensor in
   place, with ``torch._foreach_mul_`` per (device, dtype).

Plain-tensor gradients are taken as replicated (the same on every rank, as after DDP); they add
to the norm locally and need no communication.
"""

from __future__ import annotations

import math
import numbers
import types
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Replicate

# Private; a subclass of Shard before torch 2.12, a separate placement after. (The engine
# imports it too, so every torch composable imports on has it.)
from torch.distributed.tensor.placement_types import _StridedShard

from ._engine.grads.local_norms import by_device_and_dtype, local_norm_value, use_foreach
from ._engine.optimizer.optim_state import first_stepped_in_backward
from ._engine.params.wrappers import local_tensor

__all__ = ["clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm"]

_TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]
_API = "clip_grad_norm_"


def clip_grad_norm_(
    parameters: _TensorOrTensors,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place so that their total norm is at most ``max_norm``.

    The same meaning as :func:`torch.nn.utils.clip_grad_norm_`: the norm is taken over all
    gradients as if they were concatenated into one vector (for a DTensor, its full logical
    tensor), and every gradient is multiplied by ``min(max_norm / (total_norm + 1e-6), 1)``.
    Gradients may be any mix of plain tensors (taken to be identical on every rank) and
    DTensors on any meshes (1D, HSDP, DP x TP, several meshes in one model).

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped; tensors
            without a gradient are skipped.
        max_norm: the largest allowed total norm, a number ``>= 0`` (``inf`` only measures).
        norm_type: the p of the p-norm, a number ``> 0`` or ``inf`` (also as ``"inf"``).
        error_if_nonfinite: raise ``RuntimeError`` (on every rank alike) instead of scaling
            when the total norm is NaN or infinite.
        foreach: ``None`` uses the foreach kernels where the device supports them,
            ``True`` requires them (``RuntimeError`` where unsupported), ``False`` avoids them.

    Returns:
        The total norm as a plain 0-dim tensor, the same value on every rank, on the device
        of the first gradient's local tensor, in float32 (float64 if any gradient is
        float64) so that half-precision gradients cannot overflow it. ``tensor(0.)`` when
        there are no gradients.

    Communication: at most one ``all_reduce`` per distinct process group of the mesh dimensions
    over which some parameter is sharded (none for a size-1 dimension). The collectives are
    planned from the parameters, not from their gradients, so a rank whose gradients are all
    ``None`` joins the same collectives as the others (and returns the same total norm). A
    gradient with a ``Partial`` placement is first redistributed to ``Replicate`` on that dimension
    (one extra collective each; autograd never makes them for ``fully_shard``/``replicate``).

    Raises:
        TypeError/ValueError: a bad ``max_norm``, ``norm_type`` or ``foreach``.
        RuntimeError: ``error_if_nonfinite`` and a non-finite norm, ``foreach=True`` on a device
            without foreach kernels, or a parameter stepped in this backward (``step_in_backward``).
    """
    max_norm_f = _check_max_norm(max_norm)
    p = _check_norm_type(norm_type)
    _check_foreach(foreach)
    if isinstance(parameters, torch.Tensor):
        params: list[torch.Tensor] = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        if is_generator and not params:
            warnings.warn(
                "`parameters` is an empty generator, no gradient clipping will occur.",
                stacklevel=2,
            )
    if (stepped := first_stepped_in_backward(params)) is not None:
        raise RuntimeError(
            f"composable.clip_grad_norm_: a parameter (shape {tuple(stepped.shape)}) was already stepped in this backward "
            "by composable.optim.step_in_backward; clipping must precede the step: clip without step_in_backward"
        )
    # The collectives are planned from the parameters, not from their gradients: a rank whose
    # gradients are missing (all None, say after a branch it did not take) must still join
    # every all_reduce the other ranks issue, or they block for ever.
    total = _total_norm([(q, q.grad) for q in params], p, error_if_nonfinite, foreach)
    grads = [q.grad for q in params if q.grad is not None]
    clip_grads_with_norm_(grads, max_norm_f, total, foreach, _are_grads=True)
    return total


@torch.no_grad()
def get_total_norm(
    tensors: _TensorOrTensors,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The total ``norm_type``-norm of ``tensors`` (plain tensors and DTensors on any meshes).

    What :func:`clip_grad_norm_` computes before it scales; the same arguments, return value
    and communication. Takes the tensors themselves (for example the gradients).
    """
    p = _check_norm_type(norm_type)
    _check_foreach(foreach)
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    return _total_norm([(t, t) for t in tensors], p, error_if_nonfinite, foreach)


@torch.no_grad()
def _total_norm(
    entries: list[tuple[torch.Tensor, torch.Tensor | None]],
    p: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
    known_norms: dict[tuple[int, torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The total p-norm of the values of ``entries``, pairs ``(layout, value)``.

    ``layout`` (a parameter, or the value itself) decides the group, the accumulation dtype
    and so the collectives; ``value`` (its gradient, or ``None``) only adds to a group's local
    partial value. Every rank passes the same layouts in the same order, so every rank issues
    the same collectives, whichever values it holds. ``known_norms``: norms of local values
    already computed as `host_norms` computes them, by (id of the local tensor, dtype).
    """
    if not entries:
        return torch.tensor(0.0)

    # 1. Group by the layout's (mesh, placements). Keyed by id(mesh): cheap, and two equal
    # meshes that are different objects only cost a second group, never a second collective
    # (step 3 deduplicates by process group).
    groups: dict[object, tuple[DTensor | None, list[torch.Tensor]]] = {}
    acc_dtype = torch.float32
    out_device: torch.device | None = None
    for layout, t in entries:
        sample: DTensor | None = layout if isinstance(layout, DTensor) else None
        if sample is not None:
            key: object = (id(sample.device_mesh), sample.placements)
            layout_local = sample._local_tensor
        else:
            key, layout_local = None, layout
        # From the layout, not only the value: ranks must agree on the dtype of the collective.
        if layout_local.dtype == torch.float64:
            acc_dtype = torch.float64
        entry = groups.get(key)
        if entry is None:
            entry = groups[key] = (sample, [])
        if t is None:
            continue
        local = _local_as_laid_out(layout, t)
        if local.layout != torch.strided:  # sparse: duplicates must add up before the norm
            local = local.coalesce()._values()
        if out_device is None:
            out_device = local.device
        if local.dtype == torch.float64:
            acc_dtype = torch.float64
        # An empty shard (uneven sharding) adds nothing, and the infinity norm of an empty
        # tensor raises; its group still exists, so this rank joins the collective.
        if local.numel():
            entry[1].append(local)
    if out_device is None:  # no values on this rank: answer where the layouts live
        first = entries[0][0]
        out_device = local_tensor(first).device

    # 2. One local partial value (sum |x|^p, or max |x|) per group, and the process groups
    # over which it must still be reduced.
    values: list[torch.Tensor] = []
    needs: list[list[tuple[int, ...]]] = []
    comm: dict[tuple[int, ...], tuple[dist.ProcessGroup, torch.device]] = {}  # ordered by first use
    for sample, locals_ in groups.values():
        pgs: list[tuple[int, ...]] = []
        if sample is not None:
            mesh = sample.device_mesh
            if mesh.get_coordinate() is None:
                continue  # this rank is not on the mesh: it holds nothing and joins no collective
            for dim, pl in enumerate(sample.placements):
                if not _is_shard(pl):
                    if pl.is_replicate() or pl.is_partial():  # a Partial value became Replicate
                        continue
                    raise NotImplementedError(f"{_API}: placement {pl!r} of a gradient is not supported")
                if mesh.size(dim) == 1:
                    continue
                pg = mesh.get_group(dim)
                # Key by the ranks, not the object: meshes sliced from one another may hold
                # distinct group objects for the same ranks, and those need only one reduction.
                ranks = tuple(dist.get_process_group_ranks(pg))
                if ranks not in comm:
                    comm[ranks] = (pg, _comm_device(mesh.device_type))
                pgs.append(ranks)
        values.append(local_norm_value(locals_, p, acc_dtype, foreach, out_device, known_norms))
        needs.append(pgs)

    # 3. One all_reduce per process group. Every rank meets the groups in the order of the
    # (identical) parameter list, so ranks sharing a group issue its collective in the same
    # order: no deadlock. A value sharded over two dims is reduced over one, then the other.
    is_max = p == math.inf
    for ranks, (pg, device) in comm.items():
        idx = [i for i, pgs in enumerate(needs) if ranks in pgs]
        buf = torch.stack([values[i].to(device) for i in idx])
        if is_max:
            # A MAX reduction may drop NaN (gloo's max keeps the first operand when
            # comparing with NaN), which would make ranks disagree: carry a NaN flag per
            # value in the same collective.
            buf = torch.cat([buf, buf.isnan().to(buf.dtype)])
        dist.all_reduce(buf, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=pg)
        if is_max:
            n = len(idx)
            buf = torch.where(buf[n:] > 0, torch.full_like(buf[:n], math.nan), buf[:n])
        for j, i in enumerate(idx):
            values[i] = buf[j]

    # 4. Combine the groups.
    if not values:
        total = torch.zeros((), dtype=acc_dtype, device=out_device)
    else:
        stacked = torch.stack([v.to(out_device) for v in values])
        total = stacked.max() if is_max else stacked.sum().pow(1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return total


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: _TensorOrTensors,
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
    *,
    _are_grads: bool = False,
) -> None:
    """Scale the gradients of ``parameters`` in place by ``min(max_norm / (total_norm + 1e-6), 1)``.

    The second half of :func:`clip_grad_norm_` for a precomputed ``total_norm``; DTensor
    gradients are scaled through their local tensors, so no communication happens.
    """
    max_norm = _check_max_norm(max_norm)
    _check_foreach(foreach)
    if _are_grads:
        grads = list(parameters)
    else:
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        grads = [q.grad for q in params if q.grad is not None]
    if not grads:
        return
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    # Multiply even when the coefficient is 1: branching on it would sync with the device.
    coef = clip_coefficient(max_norm, total_norm)
    locals_ = [local_tensor(g) for g in grads]
    for device, ts in by_device_and_dtype(locals_):
        coef_d = coef.to(device)
        if use_foreach(ts, device, foreach):
            torch._foreach_mul_(ts, coef_d)
        else:
            for t in ts:
                t.mul_(coef_d)


# --- helpers ---------------------------------------------------------------------------


def _local_as_laid_out(layout: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The local tensor of ``value`` laid out as ``layout`` (its parameter, or itself).

    A DTensor value whose placements differ from its layout's (a ``Partial`` gradient of a
    replicated parameter, say) is redistributed to them first: one collective for each such
    value, the only one here that needs every rank to hold that value. A plain value of a
    DTensor layout is taken as this rank's local piece.
    """
    if isinstance(value, DTensor):
        spec = layout if isinstance(layout, DTensor) else value
        mesh, placements = spec.device_mesh, spec.placements
        if any(pl.is_partial() for pl in placements):
            placements = tuple(Replicate() if pl.is_partial() else pl for pl in placements)
        # `is` first: the common case (a gradient laid out as its parameter) costs no mesh compare.
        if value.placements != placements or (value.device_mesh is not mesh and value.device_mesh != mesh):
            value = value.redistribute(mesh, placements)
        return value._local_tensor  # not to_local(): no autograd bookkeeping per grad
    return value


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """What `clip_grads_with_norm_` multiplies every gradient by: min(max_norm / (total + 1e-6), 1)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def grad_norm_with_known_norms(
    params: list[torch.Tensor], p: float, known: dict[tuple[int, torch.dtype], torch.Tensor]
) -> torch.Tensor:
    """`clip_grad_norm_(params, _, p)`'s total norm, bit for bit, the local norms in `known`
    (`host_norms`', by id and dtype) taken as they are."""
    return _total_norm([(q, q.grad) for q in params], p, False, None, known)


def _is_shard(pl: Placement) -> bool:
    return bool(pl.is_shard()) or isinstance(pl, _StridedShard)


def _comm_device(device_type: str) -> torch.device:
    """The device a collective on a mesh of ``device_type`` takes its tensors on."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _check_max_norm(value: object) -> float:
    f = _to_float("max_norm", value)
    if math.isnan(f) or f < 0:
        raise ValueError(f"{_API}: max_norm must be a number >= 0 (or inf), got {value!r}")
    return f


def _check_norm_type(value: object) -> float:
    f = _to_float("norm_type", value)
    if not f > 0:  # also catches NaN
        raise ValueError(f"{_API}: norm_type must be a number > 0 or inf, got {value!r}")
    return f


def _check_foreach(value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{_API}: foreach must be None, True or False, got {value!r}")


def _to_float(name: str, value: object) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not isinstance(value, DTensor):
        return float(value.item())
    if isinstance(value, str):
        try:
            return float(value)  # "inf", as torch accepts
        except ValueError:
            pass
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{_API}: {name} must be a real number, got {value!r} ({type(value).__name__})")
