"""Mixed-precision and offload policies shared by `fully_shard` and `replicate`.

The engine owns them (its parameter groups and states read them); `composable` re-exports them
as the public types. They import only torch, so anything in the package may import them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes a parameter group computes, reduces and outputs in.

    param_dtype: dtype of the unsharded parameters used in forward/backward (cast once per
        all-gather). None: the parameter's own dtype.
    reduce_dtype: dtype of gradient reduction. None: `param_dtype` if set, else the
        parameter's own dtype. Sharded gradients always end in the parameter's own dtype.
    output_dtype: cast floating-point forward outputs to this. None: leave them.
    cast_forward_inputs: cast floating-point forward inputs to `param_dtype`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

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
    """

    pin_memory: bool = True


def check_policies(api: str, mp_policy: object, offload_policy: object | None = None) -> None:
    """Type-check the policy arguments of `api` at the call."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{api}: 'mp_policy' must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}: {mp_policy!r}"
        )
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"{api}: 'offload_policy' must be an OffloadPolicy (e.g. CPUOffloadPolicy()), got {type(offload_policy).__name__}: {offload_policy!r}"
        )
