"""fully_shard and its engine (parameter groups, collectives)."""

from .api import fully_shard
from .strategy import ShardingStrategy

__all__ = ["fully_shard", "ShardingStrategy"]
