"""replicate: DDP-style data parallelism, a thin front end on the shared engine (composable._engine)."""

from .api import replicate

__all__ = ["replicate"]
