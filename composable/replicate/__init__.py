"""replicate: DDP-style data parallelism on the fully_shard engine."""

from .api import replicate

__all__ = ["replicate"]
