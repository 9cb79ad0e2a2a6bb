"""`save_matmuls`: the usual selective activation checkpointing policy, as a `context_fn`.

Matmuls are most of a transformer block's FLOPs and their outputs a small part of its
activations; keeping them and recomputing the rest (norms, activations, element-wise ops)
saves most of the recompute for a little memory. This is torchtitan's op-level policy
(save mm/addmm/bmm outputs) for `checkpoint(module, context_fn=save_matmuls())`. It lives in
the library because the main job, the benchmark and users ask for the same policy by name.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# The matmul ops whose outputs are kept (OpOverloadPackets: every overload of each).
MATMUL_OPS: frozenset[Any] = frozenset({torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm})


def _save_matmul_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    # Not the `out=` forms: inductor's compiled code calls them with buffers it reuses for later
    # ops, so a kept output would be overwritten before backward ("Tensor cached during selective
    # activation checkpoint has been mutated"); those matmuls are recomputed instead.
    if packet in MATMUL_OPS and "out" not in kwargs:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_matmuls() -> Callable[[], tuple[Any, Any]]:
    """A `context_fn` for `checkpoint`: the forward keeps the output of every aten mm, addmm
    and bmm inside the checkpointed module; backward recomputes every other op and takes the
    kept matmul outputs instead of multiplying again. In a module compiled with
    `module.compile()` the policy is applied by the compiler's partitioner (the checkpoint is
    traced into the graph); `out=` matmuls, which only a checkpoint around compiled code sees
    (inductor's code writes into buffers it reuses), are recomputed."""
    return functools.partial(create_selective_checkpoint_contexts, _save_matmul_outputs)
