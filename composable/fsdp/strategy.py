"""`ShardingStrategy` and how it combines with `reshard_after_forward` and the mesh."""

from __future__ import annotations

import enum


class ShardingStrategy(enum.Enum):
    """FULL_SHARD: shard, reshard after forward. SHARD_GRAD_OP: shard, keep parameters
    unsharded from forward to backward. NO_SHARD: replicate (`Replicate()`), all-reduce
    gradients. HYBRID_SHARD: 2D mesh, replicate over dim 0 and shard over dim 1."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"


def resolve_strategy(mesh_ndim: int, strategy: object, reshard_after_forward: object) -> tuple[ShardingStrategy, bool, bool]:
    """(strategy, reshard_after_forward, whether reshard_after_forward was left to defaults).

    Raises `TypeError` for wrong types and `ValueError` for contradictions, naming
    `fully_shard`, the argument and the value."""
    if strategy is not None and not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"fully_shard: 'strategy' must be a ShardingStrategy or None, got {strategy!r}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(f"fully_shard: 'reshard_after_forward' must be a bool or None, got {reshard_after_forward!r}")
    if strategy is None:
        if mesh_ndim == 2:
            strategy = ShardingStrategy.HYBRID_SHARD
        elif reshard_after_forward is False:
            strategy = ShardingStrategy.SHARD_GRAD_OP
        else:
            strategy = ShardingStrategy.FULL_SHARD
    if strategy is ShardingStrategy.HYBRID_SHARD and mesh_ndim != 2:
        raise ValueError(f"fully_shard: strategy=HYBRID_SHARD needs a 2D mesh (replicate, shard), got a {mesh_ndim}D mesh")
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and mesh_ndim != 1:
        raise ValueError(f"fully_shard: strategy={strategy.name} shards over a 1D mesh, got a {mesh_ndim}D mesh; use HYBRID_SHARD (or strategy=None) for 2D")
    implied = {
        ShardingStrategy.FULL_SHARD: True,
        ShardingStrategy.SHARD_GRAD_OP: False,
        ShardingStrategy.NO_SHARD: False,
        ShardingStrategy.HYBRID_SHARD: None,  # either works: HSDP with or without resharding
    }[strategy]
    if reshard_after_forward is None:
        return strategy, True if implied is None else implied, True
    if implied is not None and reshard_after_forward != implied:
        raise ValueError(
            f"fully_shard: reshard_after_forward={reshard_after_forward} contradicts strategy={strategy.name} (which implies {implied})"
        )
    return strategy, reshard_after_forward, False
