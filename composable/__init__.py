"""composable: composable data parallelism for PyTorch on DTensor.

Each API is a plain function that installs hooks and one state object on a module and
returns the same module: `fully_shard` (FSDP), `replicate` (DDP) and `checkpoint`
(activation checkpointing) compose freely on one module tree.
"""

from ._engine.dtypes.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._engine.params.placement_result import ShardPlacementResult
from ._engine.params.spmd import DataParallelMeshDims
from .accumulate import no_sync, set_requires_gradient_sync
from .checkpoint import checkpoint
from .clip_grad import clip_grad_norm_
from .forward_method import register_forward_method
from .fsdp import ShardingStrategy, fully_shard
from .fsdp.comm_ctx import share_comm_ctx
from .grad_scaler import ShardedGradScaler
from .graphed_step import GraphedStep, graphed_step
from .replicate import replicate

__all__ = [
    "fully_shard",
    "replicate",
    "checkpoint",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "ShardingStrategy",
    "DataParallelMeshDims",
    "ShardPlacementResult",
    "share_comm_ctx",
    "no_sync",
    "set_requires_gradient_sync",
    "clip_grad_norm_",
    "ShardedGradScaler",
    "register_forward_method",
    "graphed_step",
    "GraphedStep",
]
