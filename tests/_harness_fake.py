"""torch's fake process group, re-exported by `_harness`: this process as one rank of any world
(real shapes, no numerics), and its backend for code that makes groups on it itself. Both need
torch's private ``torch.testing._internal``."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["fake_process_group", "register_fake_backend"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be ``rank`` of a ``world_size`` world in this process: real shapes, no numerics."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a default process group already exists")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def register_fake_backend() -> None:
    """Register torch's "fake" process-group backend (importing torch's private fake process
    group module registers it), for code that builds groups on it itself, as torchtitan's
    `ParallelDims` does for its size-1 mesh dims."""
    importlib.import_module("torch.testing._internal.distributed.fake_pg")
