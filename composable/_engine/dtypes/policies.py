"""Mixed-precision and offload policies shared by `fully_shard` and `replicate`.

The engine owns them (its parameter groups and states read them); `composable` re-exports them
as the public types. They import only torch, so anything in the package may import them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, overload

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes a parameter group computes, reduces and outputs in.

    param_dtype: dtype of the unsharded parameters used in forward/backward (cast once per
        all-gather). None: the parameter's own dtype.
    reduce_dtype: dtype of gradient reduction. None: `param_dtype` if set, else the
        parameter's own dtype. Sharded gradients always end in the parameter's own dtype.
    output_dtype: cast floating-point forward outputs to this. None: leave them.
    cast_forward_inputs: cast floating-point forward inputs to `param_dtype`.
    param_dtype_override_fn: (keyword only) `fn(param) -> torch.dtype | None`, called once per
        managed parameter (the original, unsharded one) at the call: `param.dtype` keeps that
        parameter in its own dtype (e.g. norms in fp32 among bf16 weights), None or
        `param_dtype` uses `param_dtype`; anything else raises. Forward inputs are still cast
        to `param_dtype`. Must answer alike on every rank. As PyTorch FSDP2's (torch 2.15).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecisionPolicy: '{name}' must be a torch.dtype or None, got {value!r}")
            if not value.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy: '{name}' must be a floating-point dtype, got {value}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecisionPolicy: 'cast_forward_inputs' must be a bool, got {self.cast_forward_inputs!r}"
            )
        if self.param_dtype_override_fn is not None and not callable(self.param_dtype_override_fn):
            raise TypeError(
                "MixedPrecisionPolicy: 'param_dtype_override_fn' must be a callable(param) -> torch.dtype | None "
                f"or None, got {self.param_dtype_override_fn!r:.80}"
            )

    def param_dtype_for(self, api: str, fqn: str, param: nn.Parameter) -> torch.dtype | None:
        """The dtype `param` (managed as `fqn`) computes in: `param_dtype_override_fn`'s answer
        where it gives one, else `param_dtype`; None means the parameter's own dtype."""
        if self.param_dtype_override_fn is None:
            return self.param_dtype
        answer = self.param_dtype_override_fn(param)
        if answer is None:
            return self.param_dtype
        if not isinstance(answer, torch.dtype):
            raise TypeError(
                f"{api}: 'param_dtype_override_fn' must return a torch.dtype or None, got {answer!r:.80} for '{fqn}'"
            )
        if answer not in (self.param_dtype, param.dtype):
            raise ValueError(
                f"{api}: 'param_dtype_override_fn' must return None, param_dtype ({self.param_dtype}) or the "
                f"parameter's own dtype ({param.dtype}), got {answer} for '{fqn}'"
            )
        return None if answer == param.dtype else answer


class OffloadPolicy:
    """No offload: sharded parameters and gradients live on the compute device (the default)."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True, eq=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live on the CPU; the optimizer steps there.

    pin_memory: pin the CPU shards so host<->device copies are asynchronous. Ignored (no
        pinning) where no accelerator exists, unlike PyTorch FSDP2, which fails there.
    compute_shard_on_device: keep a copy of each group's sharded parameters, in the compute
        dtype (`MixedPrecisionPolicy.param_dtype`, else their own), on the compute device
        between steps. The host keeps the fp32 parameters, their gradients and the optimizer
        state; forward's and backward's all-gathers read the device copy, which is copied from
        the host again only after the host's parameters changed (an optimizer step, a
        `load_state_dict`, any in-place write). Costs the device that copy's memory (2 bytes a
        parameter with bf16 compute, divided over the shard group); spares one host-to-device
        copy of every parameter per pass. The same numbers as without it. A replicated group
        (`replicate`, NO_SHARD) keeps its replica on the device between steps likewise.
    """

    pin_memory: bool = True
    compute_shard_on_device: bool = False


def _qualname(cls: type) -> str:
    """`module.Class` as users import it (composable's policies live in `composable`)."""
    module = cls.__module__
    if module == "builtins":
        return cls.__qualname__
    if module.startswith("composable."):
        module = "composable"
    elif module.startswith("torch.distributed.fsdp."):
        module = "torch.distributed.fsdp"
    return f"{module}.{cls.__qualname__}"


def _torch_policy_classes() -> tuple[type[Any] | None, type[Any] | None, type[Any] | None]:
    """PyTorch FSDP2's (MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy), where it has them."""
    try:
        from torch.distributed import fsdp
    except ImportError:  # pragma: no cover - torch without distributed
        return None, None, None
    return (
        getattr(fsdp, "MixedPrecisionPolicy", None),
        getattr(fsdp, "OffloadPolicy", None),
        getattr(fsdp, "CPUOffloadPolicy", None),
    )


@overload
def check_policies(api: str, mp_policy: object) -> tuple[MixedPrecisionPolicy, None]: ...


@overload  # an offload policy in, one out (None only for None, which the APIs' types leave out)
def check_policies(
    api: str, mp_policy: object, offload_policy: object
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]: ...


def check_policies(
    api: str, mp_policy: object, offload_policy: object | None = None
) -> tuple[MixedPrecisionPolicy, OffloadPolicy | None]:
    """Type-check the policy arguments of `api` at the call and return them as composable's.

    PyTorch FSDP2's `torch.distributed.fsdp.MixedPrecisionPolicy`, `OffloadPolicy` and
    `CPUOffloadPolicy` are accepted too and converted field by field (same fields, same
    meaning). Anything else raises `TypeError` naming `api`, the argument and the value's type."""
    torch_mp, torch_offload, torch_cpu_offload = _torch_policy_classes()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        if torch_mp is None or not isinstance(mp_policy, torch_mp):
            raise TypeError(
                f"{api}: 'mp_policy' must be a composable.MixedPrecisionPolicy or a "
                f"torch.distributed.fsdp.MixedPrecisionPolicy, got {_qualname(type(mp_policy))}: {mp_policy!r:.120}"
            )
        mp_policy = MixedPrecisionPolicy(
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            output_dtype=mp_policy.output_dtype,
            cast_forward_inputs=mp_policy.cast_forward_inputs,
            param_dtype_override_fn=getattr(mp_policy, "param_dtype_override_fn", None),
        )
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        if torch_cpu_offload is not None and isinstance(offload_policy, torch_cpu_offload):
            offload_policy = CPUOffloadPolicy(pin_memory=offload_policy.pin_memory)
        elif torch_offload is not None and type(offload_policy) is torch_offload:
            offload_policy = OffloadPolicy()
        else:
            raise TypeError(
                f"{api}: 'offload_policy' must be a composable.OffloadPolicy (e.g. composable.CPUOffloadPolicy()) "
                f"or a torch.distributed.fsdp.OffloadPolicy, got {_qualname(type(offload_policy))}: {offload_policy!r:.120}"
            )
    return mp_policy, offload_policy


def param_dtype_resolver(
    api: str, mp_policy: MixedPrecisionPolicy
) -> Callable[[str, nn.Parameter], torch.dtype | None] | None:
    """`mp_policy.param_dtype_for` bound to `api` where the policy has an override, else None."""
    if mp_policy.param_dtype_override_fn is None:
        return None
    return lambda fqn, param: mp_policy.param_dtype_for(api, fqn, param)
