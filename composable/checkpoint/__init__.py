"""checkpoint: activation checkpointing installed by hooks (selective with `context_fn`)."""

from .api import checkpoint
from .selective import save_matmuls

# `composable.checkpoint` is the function (the package re-exports it under the package's name),
# so the policy is reachable from it as well as from this package.
setattr(checkpoint, "save_matmuls", save_matmuls)

__all__ = ["checkpoint", "save_matmuls"]
