"""ShardedGradScaler: ``torch.amp.GradScaler`` for sharded (DTensor) and offloaded gradients.

What it adds to ``torch.amp.GradScaler``:

- no device argument: the scale lives on the device of the first output passed to
  :meth:`~ShardedGradScaler.scale` (so it works on CPU-only machines, and with gradients
  offloaded to the CPU while the loss is on an accelerator);
- ``unscale_`` works on the local tensors of DTensor gradients, allows fp16 gradients, and
  coalesces fp16 sparse gradients in fp32 so that duplicate entries that overflow fp16 when
  added are found as inf;
- whether any gradient is inf/NaN is agreed over ``process_group`` with a single
  ``all_reduce`` per ``unscale_`` (that is, per optimizer per iteration), whatever the number
  of parameters or devices, so every rank skips or steps together (also for optimizers that
  unscale themselves, e.g. fused Adam, whose check goes through the same ``_unscale_grads_``);
- bad constructor arguments raise ``ValueError`` instead of ``AssertionError``.
"""

from __future__ import annotations

import math
import numbers
from collections import abc, defaultdict
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, _MultiDeviceReplicator
from torch.distributed.tensor import DTensor

from ._engine.params.wrappers import local_tensor

__all__ = ["ShardedGradScaler"]

_API = "ShardedGradScaler"


class _HostSafeReplicator(_MultiDeviceReplicator):
    """Per-device copies of the scale or the inf flag, copied to the CPU synchronously.

    torch's replicator copies with ``non_blocking=True``. From a GPU to the CPU that returns
    before the bytes land, and the CPU kernels that use the copy run at once on the host: with
    offloaded (CPU) gradients the unscale read a stale inverse scale and its inf flag was then
    overwritten by the late copy, so an overflow went unseen whenever the GPU was busy.
    """

    def get(self, device: torch.device) -> torch.Tensor:
        copy = self._per_device_tensors.get(device)
        if copy is None:
            to_host = device.type == "cpu" and self.master.device.type != "cpu"
            copy = self.master.to(device=device, non_blocking=not to_host, copy=True)
            self._per_device_tensors[device] = copy
        return copy


class ShardedGradScaler(GradScaler):
    """Dynamic loss scaling for fp16 training of sharded models, with the ``torch.amp.GradScaler`` interface.

    Usage is exactly that of ``torch.amp.GradScaler``::

        scaler = ShardedGradScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)              # optional, e.g. before composable.clip_grad_norm_
        scaler.step(opt)                  # None, and no optimizer step, if any rank saw inf/NaN
        scaler.update()                   # backoff on inf/NaN; growth after growth_interval clean steps

    Args:
        init_scale: initial scale, a finite number > 0.
        growth_factor: multiplies the scale after ``growth_interval`` consecutive clean
            steps; a number > 1.
        backoff_factor: multiplies the scale after a step with inf/NaN; in (0, 1).
        growth_interval: clean steps needed before growing; an int > 0.
        enabled: ``False`` makes ``scale``/``unscale_``/``update`` no-ops and ``step`` a
            plain ``optimizer.step()``.
        process_group: the ranks that agree on inf/NaN; ``None`` means the default (world)
            group. Without an initialised process group (single process) nothing is
            communicated.

    ``state_dict()`` holds ``scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval`` and ``_growth_tracker`` (the same keys as ``torch.amp.GradScaler``,
    so states load either way round).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_number("init_scale", init_scale, lambda v: 0 < v < math.inf, "a finite number > 0")
        _check_number("growth_factor", growth_factor, lambda v: 1 < v < math.inf, "a finite number > 1")
        _check_number("backoff_factor", backoff_factor, lambda v: 0 < v < 1, "a number in (0, 1)")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval <= 0:
            raise ValueError(f"{_API}: growth_interval must be an int > 0, got {growth_interval!r}")
        if not isinstance(enabled, bool):
            raise TypeError(f"{_API}: enabled must be a bool, got {enabled!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"{_API}: process_group must be a ProcessGroup or None, got {process_group!r}")
        # device="cpu" only keeps the base class from probing CUDA; the real device is taken
        # from the first output given to scale() (see _lazy_init_scale_growth_tracker).
        super().__init__(
            "cpu",
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._device = dev.type  # update(new_scale=tensor) checks new_scale against it

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor, or any nesting of lists/tuples of tensors) by the scale.

        Returns the same structure with every tensor scaled and its dtype kept (an fp16 loss
        stays fp16). The scale tensor is created on the device of the first tensor met.
        Non-tensor leaves raise ``ValueError``. A no-op when disabled.
        """
        if not self._enabled:
            return outputs
        copies: dict[torch.device, torch.Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(val.device)
                assert self._scale is not None
                s = copies.get(val.device)
                if s is None:
                    s = copies[val.device] = self._scale.to(val.device, non_blocking=True)
                return (val * s).to(val.dtype)
            if isinstance(val, (list, tuple)):
                return type(val)(apply(v) for v in val)
            if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes, dict)):
                return map(apply, val)  # what torch.amp.GradScaler does for other iterables
            raise ValueError(
                f"{_API}.scale: outputs must be a tensor or a nesting of lists/tuples of tensors, "
                f"got {type(val).__name__}"
            )

        return apply(outputs)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply every local gradient by ``inv_scale`` and record inf/NaN, agreed over all ranks.

        Returns ``{scale_device: found_inf}`` with one entry: the per-device flags are added up
        on the scale's device and all-reduced once there.
        """
        del allow_fp16  # fp16 gradients are the point of a sharded scaler (fp16 models)
        inv = _HostSafeReplicator(inv_scale)
        per_device_found = _HostSafeReplicator(found_inf)
        buckets: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    local = local_tensor(grad)
                    if local.is_sparse:
                        if local.dtype == torch.float16 and not local.is_coalesced():
                            # Duplicate indices are added by coalesce(); in fp16 those sums may
                            # overflow. Add in fp32 and cast back, so an overflow becomes inf
                            # that the check below sees.
                            local = local.float().coalesce().half()
                            param.grad = local  # DTensor has no sparse layout: plain here
                        local = local._values()
                    buckets[local.device][local.dtype].append(local)
            for device, per_dtype in buckets.items():
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grads, per_device_found.get(device), inv.get(device)
                    )
        # A rank without gradients still joins the all_reduce, with found_inf = 0.
        flags = list(per_device_found._per_device_tensors.values())
        combined = found_inf if not flags else flags[0].to(found_inf.device)
        for f in flags[1:]:
            combined = combined + f.to(found_inf.device)
        self._all_reduce_found_inf(combined)
        return {combined.device: combined}

    def _all_reduce_found_inf(self, found_inf: torch.Tensor) -> None:
        """One all_reduce(MAX) of the 1-element flag over ``process_group``, in place."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        group = self.process_group
        if dist.get_world_size(group) == 1:
            return
        # The flag lives on the scale's device (the loss's). gloo takes CPU and CUDA tensors;
        # NCCL alone has no CPU support and needs the flag on the GPU.
        buf = found_inf
        if found_inf.device.type == "cpu" and str(dist.get_backend(group)) == "nccl":
            buf = found_inf.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
        if buf is not found_inf:
            found_inf.copy_(buf)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and find inf/NaN on any rank.

        At most once per optimizer between :meth:`update` calls; needed only to look at
        unscaled gradients (e.g. to clip them) before :meth:`step`, which calls it otherwise.
        One all_reduce over ``process_group``.
        """
        # The base class would refuse fp16 gradients; ours allows them (see _unscale_grads_).
        super().unscale_(optimizer)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        # A call out of order is the user's mistake, not an internal invariant: RuntimeError.
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"{_API}.{funcname}() was called before {_API}.scale(loss): scale the loss "
                "(or outputs) first in each iteration"
            )
        return self._scale, self._growth_tracker

    def load_state_dict(self, state_dict: abc.Mapping[str, Any]) -> None:
        """Load a state returned by :meth:`state_dict` (ours or ``torch.amp.GradScaler``'s).

        Every entry is checked before anything is changed, so a bad state leaves the scaler as
        it was: a missing key raises ``ValueError``, a value of the wrong type ``TypeError``,
        a value out of range (the constructor's rules) ``ValueError``, each naming the key and
        the value. Extra keys are ignored, as ``torch.amp.GradScaler`` does. A no-op when
        disabled; an empty dict (saved from a disabled scaler) raises ``RuntimeError``.
        """
        where = f"{_API}.load_state_dict"
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError(
                f"{where}: state_dict must be a dict as returned by state_dict(), got {_describe_value(state_dict)}"
            )
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(f"{where}: state_dict is empty, possibly because it was saved from a disabled {_API}")
        # The values present first: {"scale": "x"} is wrong in its scale before it is short of keys.
        checked = {
            key: _check_state_value(where, key, state_dict[key], *rule)
            for key, rule in _STATE_RULES.items()
            if key in state_dict
        }
        missing = [key for key in _STATE_RULES if key not in checked]
        if missing:
            raise ValueError(
                f"{where}: state_dict is missing key(s) {', '.join(map(repr, missing))} "
                f"(it has {sorted(map(str, state_dict))}); pass the dict returned by state_dict()"
            )
        super().load_state_dict(checked)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["process_group"] = None  # process groups do not pickle; None is the world
        return state


def _check_number(name: str, value: object, ok: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(float(value)):
        raise ValueError(f"{_API}: {name} must be {what}, got {value!r}")


# key -> (integer?, condition on the value, what the condition says): the constructor's rules.
_STATE_RULES: dict[str, tuple[bool, Any, str]] = {
    "scale": (False, lambda v: 0 < v < math.inf, "a finite number > 0"),
    "growth_factor": (False, lambda v: 1 < v < math.inf, "a finite number > 1"),
    "backoff_factor": (False, lambda v: 0 < v < 1, "a number in (0, 1)"),
    "growth_interval": (True, lambda v: v > 0, "an int > 0"),
    "_growth_tracker": (True, lambda v: v >= 0, "an int >= 0"),
}


def _check_state_value(where: str, key: str, value: object, integer: bool, ok: Any, what: str) -> float | int:
    """``value`` as a Python number if it fits the rule of ``key``; TypeError/ValueError otherwise."""
    v = value
    if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.numel() == 1:
        v = v.item()  # a 1-element tensor (say, a scale saved from get_scale's tensor) is fine
    kinds = (numbers.Integral,) if integer else (numbers.Real,)
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise TypeError(f"{where}: state_dict[{key!r}] must be {what}, got {_describe_value(value)}")
    v = int(cast(numbers.Integral, v)) if integer else float(v)  # `kinds` checked it
    if not ok(v):
        raise ValueError(f"{where}: state_dict[{key!r}] must be {what}, got {value!r}")
    return v


def _describe_value(value: object) -> str:
    """``repr`` and type, shortened: enough to recognise a wrong value in one line."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"
