"""A group's float8 cast in one hand-written Triton launch.

The cast itself is a few arithmetic operations per element; what a host-bound float8 step pays
for is calling it: the compiled cast (`torch.compile`) spends about 360 us of host time per group
in dynamo's guards, the AOT wrapper and the launch, and it runs twice per group per step. This
kernel takes a table of the group's weights (shard address, scale address, slot address, element
count; one row per weight) and casts them all in one launch whose host cost is a dictionary
lookup and Triton's launcher.

The table lives on the device. Shards and scales keep their addresses from step to step and the
caching allocator hands an unsharded group the same output blocks again, so a group's table is
uploaded once per distinct set of addresses (a bounded cache) and found by those addresses after
that. A table uploaded while a CUDA graph is being captured is part of the graph (its upload is a
captured copy from pinned host memory), so it is kept for the life of the process, in an arena of
pinned memory allocated before any capture.

The arithmetic is torchao's (`hp_tensor_and_scale_to_float8`): upcast to fp32, multiply by the
fp32 scale, clamp to the float8 range (NaN stays NaN), round to nearest even.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.streams import current_stream

_BLOCK = 2048  # elements per program and loop step: 16 per thread at 4 warps
_MAX_PROGRAMS = 1024  # per weight; larger weights loop (a grid-stride loop)
_MAX_TABLES = 256  # distinct address sets remembered outside graph captures
_ARENA_ROWS = 8192  # weights' rows uploadable inside graph captures, over the process's life (256 KiB)
_TABLES: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # (stream, the rows' numbers) -> table
_CAPTURED_TABLES: list[tuple[torch.Tensor, torch.Tensor]] = []  # referenced by captured graphs: kept
_WARM: set[tuple[torch.device, torch.dtype, torch.dtype]] = (
    set()
)  # (device, source dtype, float8 dtype) launched outside a capture
_STATE: dict[str, Any] = {}


def _kernel() -> Any:
    """The Triton kernel, defined on first use (Triton is imported only where CUDA runs)."""
    if "kernel" not in _STATE:
        import triton
        import triton.language as tl

        @triton.jit
        def cast_rows(table, bound, SOURCE: tl.constexpr, TARGET: tl.constexpr, BLOCK: tl.constexpr):
            row = table + tl.program_id(1) * 4
            source = tl.load(row).to(tl.pointer_type(SOURCE))
            scale = tl.load(tl.load(row + 1).to(tl.pointer_type(tl.float32)))
            target = tl.load(row + 2).to(tl.pointer_type(TARGET))
            numel = tl.load(row + 3)
            offsets = tl.arange(0, BLOCK).to(tl.int64)
            first = tl.program_id(0).to(tl.int64) * BLOCK
            step = tl.num_programs(0).to(tl.int64) * BLOCK
            for start in range(first, numel, step):
                index = start + offsets
                mask = index < numel
                x = tl.load(source + index, mask=mask).to(tl.float32) * scale
                x = tl.clamp(x, -bound, bound, propagate_nan=tl.PropagateNan.ALL)
                tl.store(target + index, x.to(TARGET), mask=mask)

        _STATE["kernel"] = cast_rows
        _STATE["types"] = {
            torch.float32: tl.float32,
            torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16,
            torch.float8_e4m3fn: tl.float8e4nv,
            torch.float8_e5m2: tl.float8e5,
        }
    return _STATE["kernel"]


def supported(hps: list[torch.Tensor], scales: list[torch.Tensor], slots: list[torch.Tensor]) -> bool:
    """Whether one launch can cast this group: CUDA tensors on one device, contiguous, one
    source dtype and one float8 dtype the kernel knows, fp32 scales."""
    first, slot0 = hps[0], slots[0]
    if not slot0.is_cuda or slot0.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return False
    if first.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    device = slot0.device
    for hp, scale, slot in zip(hps, scales, slots):
        if hp.dtype != first.dtype or slot.dtype != slot0.dtype or scale.dtype != torch.float32:
            return False
        if hp.device != device or slot.device != device or scale.device != device:
            return False
        if not (hp.is_contiguous() and slot.is_contiguous()) or hp.numel() != slot.numel():
            return False
    return True


def cast(hps: list[torch.Tensor], scales: list[torch.Tensor], slots: list[torch.Tensor], bound: float) -> bool:
    """Cast every `hps[i]` into `slots[i]` (`(x.float() * scale).clamp(-bound, bound)` in the
    slot's float8 dtype) with one launch on the current stream. False, having done nothing, while
    a CUDA graph is being captured and this kernel has not yet run outside one (compiling and
    loading it inside a capture would break the capture). The caller checks `supported` first."""
    device = slots[0].device
    kernel = _kernel()
    variant = (device, hps[0].dtype, slots[0].dtype)
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing and variant not in _WARM:
        return False
    if "arena" not in _STATE:
        _STATE["arena"] = torch.empty(_ARENA_ROWS * 4, dtype=torch.int64, pin_memory=True)
        _STATE["arena_used"] = 0
    stream = current_stream(device)
    rows: list[int] = []
    longest = 0
    for hp, scale, slot in zip(hps, scales, slots):
        numel = hp.numel()
        rows += (hp.data_ptr(), scale.data_ptr(), slot.data_ptr(), numel)
        longest = max(longest, numel)
    key = (stream.cuda_stream, *rows)
    table = _TABLES.get(key)
    if table is None:
        table = _upload(rows, device, capturing)
        if table is None:
            return False
        if capturing:
            _CAPTURED_TABLES.append(table)
        else:
            if len(_TABLES) >= _MAX_TABLES:
                del _TABLES[next(iter(_TABLES))]  # the oldest address set
            _TABLES[key] = table
    if longest == 0:
        return True
    programs = min(-(-longest // _BLOCK), _MAX_PROGRAMS)
    types = _STATE["types"]
    with _on_device(device):
        kernel[(programs, len(hps))](
            table[1], bound, SOURCE=types[hps[0].dtype], TARGET=types[slots[0].dtype], BLOCK=_BLOCK
        )
    if not capturing:
        _WARM.add(variant)
    return True


def _upload(rows: list[int], device: torch.device, capturing: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pinned host table, device table), the upload ordered on the current stream; None while
    capturing once the capture arena is full. The host copy is kept beside the device one: the
    copy may still be reading it, and a captured copy reads it at every replay. Inside a capture
    no pinned memory is allocated (the arena was, outside it) and no arena slice is reused."""
    if not capturing:
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=True)
    else:
        arena, used = _STATE["arena"], _STATE["arena_used"]
        if used + len(rows) > arena.numel():
            return None
        host = arena[used : used + len(rows)]
        _STATE["arena_used"] = used + len(rows)
        host.copy_(torch.tensor(rows, dtype=torch.int64))
    return host, host.to(device, non_blocking=True)


class _on_device:
    """`torch.cuda.device(device)` where it is not the current device already (Triton launches
    on the current device); nothing otherwise, at no host cost."""

    __slots__ = ("index", "previous")

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.previous = -1

    def __enter__(self) -> None:
        current = torch.cuda.current_device()
        if current != self.index:
            self.previous = current
            torch.cuda.set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.previous >= 0:
            torch.cuda.set_device(self.previous)
