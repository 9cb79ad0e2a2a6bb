"""Which dtype the unsharded gradients are made, summed and reduced in, as the installed
PyTorch FSDP2 does it (mixed precision must equal FSDP2 bit for bit).

Up to torch 2.14, FSDP2 reduces in `reduce_dtype`, else in `param_dtype`, else in the
parameter's own dtype, and autograd writes unsharded gradients in the compute dtype. From
torch 2.15 on, FSDP2 reduces in `reduce_dtype`, else in the parameter's own dtype (no longer
`param_dtype`), and sets the unsharded parameter's `grad_dtype` (autograd casts each gradient
contribution to it before summing them) to that reduce dtype, with one exception: where it is
wider than the compute dtype (bf16 compute, fp32 reduce), `grad_dtype` is lifted during a
backward that reduces or that adds to an existing gradient, so autograd sums in the compute
dtype and the reduction's copy-in widens. The difference shows where one parameter gets
several gradient contributions in a backward (tied embeddings, a weight used twice) and in
no-sync accumulation. `FOLLOWS_GRAD_DTYPE` says which rule the installed torch follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import Replicate

if TYPE_CHECKING:
    from ..params.param import ManagedParam


def _fsdp2_follows_grad_dtype() -> bool:
    """Whether the installed FSDP2 gives unsharded parameters a `grad_dtype` (torch >= 2.15)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # FSDP2's private layout moved: assume the newer rule
        return hasattr(torch.Tensor, "grad_dtype")
    return hasattr(FSDPParam, "unsharded_grad_dtype")


FOLLOWS_GRAD_DTYPE = _fsdp2_follows_grad_dtype()


def default_reduce_dtype(param_dtype: torch.dtype | None, orig: torch.dtype) -> torch.dtype:
    """The reduce dtype of a policy without `reduce_dtype` (see the module docstring)."""
    if FOLLOWS_GRAD_DTYPE:
        return orig
    return param_dtype or orig


@dataclass
class GroupDtypes:
    """A group's dtypes. `orig` is the sharded parameters' own dtype, which `module.half()`
    after sharding changes (the group updates it in place; the reducer reads it live)."""

    param_dtype: torch.dtype | None  # the policy's; None: compute in `orig`
    reduce_policy: torch.dtype | None  # the policy's reduce dtype
    orig: torch.dtype = torch.float32

    @property
    def unsharded(self) -> torch.dtype:
        return self.param_dtype or self.orig

    @property
    def reduce(self) -> torch.dtype:
        return self.reduce_policy or default_reduce_dtype(self.param_dtype, self.orig)


def _keeps_upcast(mp: "ManagedParam") -> bool:
    """Tensor-parallel parameters replicated on a TP dim may get a `Partial` gradient that is
    reduced over TP in the gradient's dtype: FSDP2 keeps their gradients wide all along. The
    data-parallel dims of a `dp_mesh_dims` mesh do not count (the group reduces over them);
    an spmd_types parameter's backward types say it (a `Partial` gradient off those dims)."""
    if mp.tp is None:
        return False
    if mp.annotation is not None:
        placements = mp.annotation.grad_spec.placements
        return any(p.is_partial() for i, p in enumerate(placements) if i not in mp.dp_dims)
    return any(isinstance(p, Replicate) for i, p in enumerate(mp.tp.placements) if i not in mp.dp_dims)


def _has_unreduced_grad(mp: "ManagedParam") -> bool:
    """Whether earlier no-sync backwards left a gradient this backward adds to: in `.grad`,
    stashed (sharded groups) or in the visible sharded `.grad` (replicated groups)."""
    up = mp.unsharded_param
    return (up is not None and up.grad is not None) or mp.stashed_grad is not None or mp.grad_is_unreduced


def set_unsharded_grad_dtypes(group: Any, reducing: bool) -> None:
    """Before `group`'s backward (a `ParamGroup`; not imported: group.py imports this file): give each unsharded parameter the `grad_dtype` FSDP2 gives it
    (None where the rule lifts it). `reducing`: this backward reduces the gradients. Nothing to
    do where the reduce dtype is the compute dtype or under the older rule."""
    if not FOLLOWS_GRAD_DTYPE:
        return
    params, compute, reduce = group.params, group.config.param_dtypes, group.dtypes.reduce
    if compute is None:  # one compute dtype (mixed_dtypes.py: one per parameter)
        if group.dtypes.unsharded == reduce:
            return
        compute = (group.dtypes.unsharded,) * len(params)
    for mp, dtype in zip(params, compute):
        if dtype == reduce:
            continue
        wider = reduce.itemsize > dtype.itemsize
        up = mp.unsharded_param
        if up is None or not up.requires_grad:
            continue
        want: torch.dtype | None = reduce
        if wider and not _keeps_upcast(mp) and (reducing or _has_unreduced_grad(mp)):
            want = None  # autograd sums in the compute dtype; the reduction or the stash widens
        elif up.grad is not None and up.grad.dtype != reduce:
            up.grad = up.grad.to(reduce)
        if up.grad_dtype != want:
            up.grad_dtype = want
