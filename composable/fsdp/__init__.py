"""fully_shard: FSDP-style sharding, a thin front end on the shared engine (composable._engine)."""

from .api import fully_shard
from .strategy import ShardingStrategy

__all__ = ["fully_shard", "ShardingStrategy"]
