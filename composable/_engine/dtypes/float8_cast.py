"""A group's torchao float8 weights cast for their all-gather in one batch.

torchao's float8 training weights (`WeightWithDynamicFloat8CastTensor`, tensorwise scaling)
implement FSDP2's all-gather extension one parameter at a time: each `fsdp_pre_all_gather`
is an autograd function, three elementwise kernels and a new subclass object, and each
parameter then gets its own all-gather. With the scales precomputed after the optimizer step
(`precompute_float8_dynamic_scale_for_fsdp`, torchtitan's recipe) the cast is pure arithmetic,
so for a whole group it is done here at once (one kernel launch on CUDA), written straight into
this rank's slot of each parameter's all-gather output (no input buffer, no copy-in), and on
CUDA all the group's weights travel in one coalesced all-gather. Measured on one H100 (1B
model, compiled blocks, batch 4) the per-parameter path spent about 70 ms of host time per
step in `unshard` alone.

The arithmetic is torchao's, to the bit (`hp_tensor_and_scale_to_float8`: upcast to fp32,
multiply by the scale, clamp to the float8 range, cast), and the metadata handed to
`fsdp_post_all_gather` is the same scale tensor torchao's own pre-all-gather returns, so the
unsharded parameters are what the per-parameter path makes. Anything else (no precomputed
scale: torchao then computes amax with a collective per weight; other subclasses; the first
gather, which makes the unsharded parameters) takes the per-parameter path.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, cast

import torch

from . import float8_kernel

_FLOAT8_WEIGHT = "WeightWithDynamicFloat8CastTensor"


def precomputed_scales(locals_: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each local shard's precomputed scale if every one is a torchao float8 training weight
    with a precomputed scale and one float8 target dtype; else None (per-parameter path)."""
    scales = []
    dtype = None
    for local in locals_:
        cls = type(local)
        if cls.__name__ != _FLOAT8_WEIGHT or not cls.__module__.startswith("torchao."):
            return None
        scale = getattr(local, "_precomputed_scale", None)
        target = getattr(local, "_dtype", None)
        if scale is None or target is None or (dtype is not None and target != dtype):
            return None
        dtype = target
        scales.append(scale)
    return scales or None


def cast_into(locals_: list[torch.Tensor], scales: list[torch.Tensor], slots: list[torch.Tensor]) -> None:
    """Write each local shard, scaled and saturated, as float8 into `slots` (float8 tensors of
    the shards' shapes): `(x.float() * scale).clamp(-max, max).to(float8)` for all at once.

    On CUDA the group is cast by one hand-written Triton launch (float8_kernel.py), whose host
    cost is a table lookup and the launch. Where that kernel does not apply or fails, the cast
    is compiled once per group layout: one combo kernel for the group where inductor makes one,
    else one fused kernel per weight. Each of these reads the shard once and writes the float8
    bytes, 5 bytes per element from fp32 against about 29 for the eager passes, which the
    dim-4096 model felt. Elsewhere, and wherever compilation fails too, foreach kernels do the
    same arithmetic."""
    if not locals_:
        return
    bound = torch.finfo(slots[0].dtype).max
    hps = [local._tensor for local in locals_]  # type: ignore[attr-defined]  # torchao's float8 weight (untyped)
    with torch.no_grad():
        if slots[0].is_cuda and _KERNEL["usable"] and float8_kernel.supported(hps, scales, slots):
            try:
                if float8_kernel.cast(hps, scales, slots, bound):
                    return
            except Exception as error:  # noqa: BLE001 - no Triton, or it failed: the compiled cast does the same
                _KERNEL["usable"] = False
                warnings.warn(
                    f"fully_shard: the one-launch float8 cast is unavailable ({type(error).__name__}: {error}); "
                    "using the compiled cast instead (same values, more host time)",
                    stacklevel=3,
                )
        fused = _fused_cast() if slots[0].is_cuda else None
        layout = tuple((hp.shape, hp.dtype, slot.dtype) for hp, slot in zip(hps, slots)) if fused else ()
        if fused is not None and torch.cuda.is_current_stream_capturing() and layout not in _COMPILED_LAYOUTS:
            fused = None  # compiling inside a CUDA graph capture would break the capture
        if fused is not None:
            try:
                fused(hps, scales, slots, bound)
                _COMPILED_LAYOUTS.add(layout)
                return
            except Exception as error:  # noqa: BLE001 - any compiler failure: the next way does the same
                _disable_fused(error)
                cast_into(locals_, scales, slots)
                return
        scaled = torch._foreach_mul([hp.to(torch.float32) for hp in hps], scales)
        torch._foreach_clamp_min_(scaled, -bound)
        torch._foreach_clamp_max_(scaled, bound)
        torch._foreach_copy_(slots, scaled)


def _cast_each(hps: list[torch.Tensor], scales: list[torch.Tensor], slots: list[torch.Tensor], bound: float) -> None:
    for hp, scale, slot in zip(hps, scales, slots):
        slot.copy_((hp.to(torch.float32) * scale).clamp(-bound, bound))


# Compile options tried in turn: inductor's combo kernels launch the group's casts as one
# kernel (a launch costs 15-25 us of host time, and a group has 7 weights); without them, one
# kernel per weight. Past the last, the eager kernels.
_COMPILE_OPTIONS: tuple[dict[str, Any], ...] = ({"combo_kernels": True}, {})
_FUSED: dict[str, Any] = {}
_KERNEL = {"usable": True}  # the one-launch kernel; False once it failed (no Triton, say)
# Group layouts ((shape, dtype, float8 dtype) per weight) the compiled cast has run (graph capture may use it).
_COMPILED_LAYOUTS: set[tuple[tuple[torch.Size, torch.dtype, torch.dtype], ...]] = set()


def _fused_cast() -> Callable[..., None] | None:
    """The compiled cast, made on first use (None once every way of compiling it failed).
    Automatic dynamic shapes: the model's block groups share one compilation, the other groups
    one more."""
    if "fn" not in _FUSED:
        _FUSED["fn"] = torch.compile(
            _cast_each, fullgraph=True, options=_COMPILE_OPTIONS[_FUSED.setdefault("tried", 0)]
        )
    return cast("Callable[..., None] | None", _FUSED["fn"])  # torch.compile's result (typed Any) or None


def _disable_fused(error: Exception) -> None:
    """The compiled cast failed: the next compile options, or the eager kernels (a warning)."""
    _FUSED["tried"] = _FUSED.get("tried", 0) + 1
    _COMPILED_LAYOUTS.clear()
    if _FUSED["tried"] < len(_COMPILE_OPTIONS):
        del _FUSED["fn"]
        return
    _FUSED["fn"] = None
    warnings.warn(
        f"fully_shard: the fused float8 cast failed to compile ({type(error).__name__}: {error}); "
        "casting with eager kernels instead (same values, more memory traffic)",
        stacklevel=3,
    )


def metadata(scale: torch.Tensor) -> Any:
    """What torchao's `fsdp_pre_all_gather` returns beside the data: the scale itself."""
    return (scale,)
