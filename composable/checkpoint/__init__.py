"""checkpoint: activation checkpointing installed by hooks."""

from .api import checkpoint

__all__ = ["checkpoint"]
