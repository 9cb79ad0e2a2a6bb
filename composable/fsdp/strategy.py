"""`ShardingStrategy` and how it combines with `reshard_after_forward` and the mesh."""

from __future__ import annotations

import enum

from torch.distributed.device_mesh import DeviceMesh

from .._engine.meshes.mesh import check_mesh
from .._engine.params.spmd import SpmdDims, resolve_dp_mesh_dims


class ShardingStrategy(enum.Enum):
    """FULL_SHARD: shard, reshard after forward. SHARD_GRAD_OP: shard, keep parameters
    unsharded from forward to backward. NO_SHARD: replicate (`Replicate()`), all-reduce
    gradients. HYBRID_SHARD: 2D mesh, replicate over dim 0 and shard over dim 1."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"


def resolve_strategy(
    mesh_ndim: int, strategy: object, reshard_after_forward: object
) -> tuple[ShardingStrategy, bool | int, bool]:
    """(strategy, reshard_after_forward, whether reshard_after_forward was left to defaults).

    `reshard_after_forward` may be an int N (reshard to groups of N ranks; see
    `normalize_reshard`): for the strategy it counts as resharding when N > 1. Raises
    `TypeError` for wrong types and `ValueError` for contradictions, naming `fully_shard`,
    the argument and the value."""
    if strategy is not None and not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"fully_shard: 'strategy' must be a ShardingStrategy or None, got {strategy!r}")
    reshard = None if reshard_after_forward is None else check_reshard_type("fully_shard", reshard_after_forward)
    reshards = None if reshard is None else _reshards(reshard)
    if strategy is None:
        if mesh_ndim == 2:
            strategy = ShardingStrategy.HYBRID_SHARD
        elif reshards is False:
            strategy = ShardingStrategy.SHARD_GRAD_OP
        else:
            strategy = ShardingStrategy.FULL_SHARD
    if strategy is ShardingStrategy.HYBRID_SHARD and mesh_ndim != 2:
        raise ValueError(
            f"fully_shard: strategy=HYBRID_SHARD needs a 2D mesh (replicate, shard), got a {mesh_ndim}D mesh"
        )
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and mesh_ndim != 1:
        raise ValueError(
            f"fully_shard: strategy={strategy.name} shards over a 1D mesh, got a {mesh_ndim}D mesh; use HYBRID_SHARD (or strategy=None) for 2D"
        )
    implied = {
        ShardingStrategy.FULL_SHARD: True,
        ShardingStrategy.SHARD_GRAD_OP: False,
        ShardingStrategy.NO_SHARD: False,
        ShardingStrategy.HYBRID_SHARD: None,  # either works: HSDP with or without resharding
    }[strategy]
    if reshard is None:
        return strategy, True if implied is None else implied, True
    if implied is not None and reshards != implied:
        raise ValueError(
            f"fully_shard: reshard_after_forward={reshard_after_forward} contradicts strategy={strategy.name} (which implies {implied})"
        )
    return strategy, reshard, False


def check_reshard_type(api: str, value: object) -> bool | int:
    """`value` itself; `TypeError` naming `api` unless it is a bool or an int."""
    if not isinstance(value, (bool, int)):
        raise TypeError(f"{api}: 'reshard_after_forward' must be a bool or an int, got {value!r}")
    return value


def _reshards(value: bool | int) -> bool:
    return value if isinstance(value, bool) else value > 1


def normalize_reshard(api: str, value: bool | int, shard_world: int) -> bool | int:
    """`value` as the engine takes it: a bool, or an int N with 1 < N < shard world (the ranks
    one parameter is split over) that divides it. N == 1 keeps the parameters unsharded
    (False), N == shard world reshards fully (True), as in PyTorch FSDP2."""
    if isinstance(value, bool):
        return value
    if value < 1 or shard_world % value:
        raise ValueError(
            f"{api}: 'reshard_after_forward' must be a bool or an int that divides the shard world size {shard_world}, got {value}"
        )
    return False if value == 1 else True if value == shard_world else value


def spmd_strategy(
    api: str, mesh: object, dims: object, strategy: object, reshard_after_forward: object
) -> tuple[SpmdDims, ShardingStrategy, bool, bool]:
    """`resolve_strategy` for `dp_mesh_dims`: the named dims decide the strategy (shard dims:
    FULL_SHARD / SHARD_GRAD_OP, HYBRID_SHARD with replicate dims too, NO_SHARD with replicate
    dims only). `ValueError` for a `strategy`, `NotImplementedError` for an int
    `reshard_after_forward` (as PyTorch FSDP2)."""
    check_mesh(api, mesh, tuple(range(1, 1 + getattr(mesh, "ndim", 1))))
    assert isinstance(mesh, DeviceMesh)
    if strategy is not None:
        raise ValueError(
            f"{api}: 'strategy' must be left out with 'dp_mesh_dims' (the named dims decide it), got {strategy!r}"
        )
    if reshard_after_forward is not None:
        check_reshard_type(api, reshard_after_forward)
        if not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"{api}: an int 'reshard_after_forward' ({reshard_after_forward}) with 'dp_mesh_dims' is not supported"
            )
    spmd = resolve_dp_mesh_dims(api, mesh, dims)
    reshard = True if reshard_after_forward is None else bool(reshard_after_forward)
    if not spmd.shard_names:
        return spmd, ShardingStrategy.NO_SHARD, False, reshard_after_forward is None
    if spmd.replicate_names:
        chosen = ShardingStrategy.HYBRID_SHARD
    else:
        chosen = ShardingStrategy.FULL_SHARD if reshard else ShardingStrategy.SHARD_GRAD_OP
    return spmd, chosen, reshard, reshard_after_forward is None
