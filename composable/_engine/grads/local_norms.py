"""Each rank's part of a gradient norm: ``sum |x|^p`` (``max |x|`` for inf) of its local tensors.

`composable.clip_grad_norm_` plans which ranks reduce what over which process groups; what each
rank adds is computed here, per device and dtype, in the accumulation dtype: one foreach norm on
an accelerator, and on the host the same norms side by side on a pool of threads (host_norms.py),
where the foreach norm runs one core. Norms already taken (the step in backward's, as gradients
land) are taken as they are.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from .host_norms import host_norms


def local_norm_value(
    tensors: list[torch.Tensor],
    p: float,
    acc_dtype: torch.dtype,
    foreach: bool | None,
    device_if_empty: torch.device,
    known_norms: dict[tuple[int, torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """This rank's ``sum |x|^p`` (``max |x|`` for inf) over ``tensors``, 0-dim, in ``acc_dtype``."""
    if not tensors:
        return torch.zeros((), dtype=acc_dtype, device=device_if_empty)
    parts: list[torch.Tensor] = []
    first_device = tensors[0].device
    known = known_norms or {}
    for device, ts in by_device_and_dtype(tensors):
        missing = [t for t in ts if (id(t), acc_dtype) not in known] if known else ts
        if not missing:
            computed: list[torch.Tensor] = []
        elif device.type == "cpu" and not foreach:  # the foreach norm's bits, on every core
            computed = host_norms(missing, p, acc_dtype)
        elif use_foreach(missing, device, foreach):
            # dtype=acc_dtype: a half-precision norm would overflow at 65504.
            computed = list(torch._foreach_norm(missing, p, dtype=acc_dtype))
        else:
            computed = [torch.linalg.vector_norm(t, p, dtype=acc_dtype) for t in missing]
        if known:
            fresh = iter(computed)
            computed = [known[(id(t), acc_dtype)] if (id(t), acc_dtype) in known else next(fresh) for t in ts]
        stacked = torch.stack(computed)
        parts.append((stacked.max() if p == math.inf else stacked.pow(p).sum()).to(first_device))
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack(parts)
    return stacked.max() if p == math.inf else stacked.sum()


def by_device_and_dtype(tensors: list[torch.Tensor]) -> list[tuple[torch.device, list[torch.Tensor]]]:
    """`tensors` grouped by device and dtype; torch's helper is typed for lists holding None too."""
    grouped = _group_tensors_by_device_and_dtype([cast("list[torch.Tensor | None]", tensors)])
    return [(device, cast("list[torch.Tensor]", ts)) for (device, _), ([ts], _) in grouped.items()]


def use_foreach(ts: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """Whether to run foreach kernels over `ts` on `device`: torch's choice when `foreach` is
    None, else `foreach` (True on a device without them raises, as torch does)."""
    if foreach is None:
        return _has_foreach_support(ts, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return bool(foreach)
