"""Counting and tracing the collectives a block of code issues (eager `c10d` and functional
ops, with their process group, dtype and size): the harness's `count_collectives()` and
`trace_collectives()`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# Normalised kind by prefix of the normalised op name; order matters (reduce_scatter < reduce).
_KINDS = (
    "all_gather",
    "all_reduce",
    "all_to_all",
    "reduce_scatter",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "monitored_barrier",
    "barrier",
    "send",
    "isend",
    "recv",
    "irecv",
    "batch_p2p",
)


def _kind(op_name: str) -> str | None:
    """``c10d::_allgather_base_`` and ``_c10d_functional::all_gather_into_tensor`` -> all_gather."""
    n = op_name.split("::")[-1].strip("_")
    n = n.replace("allgather", "all_gather").replace("allreduce", "all_reduce")
    n = n.replace("alltoall", "all_to_all")
    for k in _KINDS:
        if n.startswith(k):
            return {"isend": "send", "irecv": "recv"}.get(k, k)
    return None  # wait_tensor, _wrap_tensor_autograd, check_for_nan: not collectives


def _group_label(value: Any) -> str | None:
    """``g[0,1]`` (global ranks) for a ProcessGroup, its boxed form, or a group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        pg = (
            value
            if isinstance(value, dist.ProcessGroup)
            else dist.ProcessGroup.unbox(value)
            if isinstance(value, torch.ScriptObject)
            else _resolve_process_group(value)
            if isinstance(value, str)
            else None
        )
        return pg and "g[" + ",".join(map(str, dist.get_process_group_ranks(pg))) + "]"
    except Exception:  # a destroyed or foreign group: its name is the best we have
        return f"g{value!r}" if isinstance(value, str) else None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@dataclass(frozen=True)
class Collective:
    """One recorded collective. ``numel`` is the larger side: gathered output, scattered input."""

    kind: str
    group: str
    dtype: torch.dtype | None
    numel: int
    op: str  # the raw op, e.g. "c10d::_allgather_base_"

    def __str__(self) -> str:
        if self.dtype is None:
            return f"{self.kind}({self.group})"
        return f"{self.kind}({self.group}, {str(self.dtype).removeprefix('torch.')}, {self.numel})"


class CollectiveTracer(TorchDispatchMode):
    """Records every eager (``c10d``) and functional collective issued inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Let DTensor run first with this mode still active, so the collectives it issues
        # on its local tensors are seen (as CommDebugMode does).
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        kind = _kind(func.name()) if func.namespace in _NAMESPACES else None
        if kind is not None:
            self.records.append(self._describe(func, kind, args, kwargs, out))
        return out

    @staticmethod
    def _describe(func: Any, kind: str, args: tuple, kwargs: dict, out: Any) -> Collective:
        names = [a.name for a in func._schema.arguments]
        bound = {**dict(zip(names, args)), **kwargs}
        group = None
        for key in ("process_group", "group_name", "group"):
            if key in bound and group is None:
                group = _group_label(bound[key])
        tensors_in = [_tensors(v) for v in bound.values()] + [_tensors(out)]
        tensors = [t for ts in tensors_in for t in ts]
        numel = max((sum(t.numel() for t in ts) for ts in tensors_in), default=0)
        return Collective(kind, group or "g?", tensors[0].dtype if tensors else None, numel, func.name())

    @property
    def events(self) -> list[str]:
        """``"all_gather(g[0,1], float32, 24)"`` per collective, in issue order."""
        return [str(r) for r in self.records]

    @property
    def counts(self) -> Counter[str]:
        """Counts per normalised kind; a missing kind reads as 0."""
        return Counter(r.kind for r in self.records)

    @property
    def total(self) -> int:
        return len(self.records)

    def render(self) -> str:
        """One event per line, for ``assertExpectedInline``."""
        return "\n".join(self.events)


def count_collectives() -> CollectiveTracer:
    """``with count_collectives() as c: ...`` then ``c.counts["all_gather"]``, ``c.total``."""
    return CollectiveTracer()


def trace_collectives() -> CollectiveTracer:
    """``with trace_collectives() as t: ...`` then ``t.events`` / ``t.render()``."""
    return CollectiveTracer()
