"""One collective per unshard for a group's all-gather-extension parameters (extension.py).

A subclass's `fsdp_pre_all_gather` may hand over several tensors of several dtypes (torchao's
NF4: int8 scalers, float factors and 4-bit data as uint8), and a QLoRA block holds seven such
weights: gathered one tensor at a time that is dozens of small collectives per block. FSDP2
gathers all of a group's inputs in one all-gather, as bytes (`foreach_all_gather`), and so
does this module. The bytes are exact, whatever the dtype, so the result is the same.

How the bytes travel, per unshard (`ExtensionBatch`):
- direct way (gather.py, CUDA): in place, as float8 weights do: each input is copied into
  this rank's slot of its own all-gather output (byte views) on the all-gather stream, and the
  outputs ride in the group's one coalesced all-gather. Nothing is copied out.
- flat way (gather.py): the inputs' bytes are a tail of each rank's row of the flat all-gather
  (after the flat parameters' region, padded to whole elements of the flat dtype), split back
  into the outputs after the wait.
- alone (`start_alone`: a custom all-gather, several compute dtypes, or no flat gather to ride):
  one all-gather of a byte buffer holding every input, split back into the outputs after the
  wait; torchao float8 weights with precomputed scales keep their fused cast (extension.py).
Either way `extension.finish_gathers` then makes or refills the unsharded parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import collectives as comm
from ..comm.streams import current_stream
from ..dtypes.policies import MixedPrecisionPolicy
from ..meshes.layout import DataParallelLayout
from ..params.param import ManagedParam
from .extension import (
    ExtensionGather,
    _alloc,
    _outputs_fit,
    _pre_all_gather,
    _start_batched,
    prepare_batched,
    shard_mesh,
)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous) as a 1D `uint8` view of its bytes."""
    return tensor.view(-1).view(torch.uint8)


def _byte_views(
    mp: ManagedParam, tensors: list[torch.Tensor], rank: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`mp`'s all-gather outputs as bytes and this rank's slot of each (as long as its input),
    made once per outputs: the views stay valid across `extension.free` (storage resized in
    place), and a QLoRA block gathers a score of inner tensors per unshard."""
    sizes = tuple(t.numel() * t.element_size() for t in tensors)
    cached = mp.extension_byte_views
    if cached and cached[0] is mp.extension_outputs and cached[1] == rank and cached[2] == sizes:
        return cached[3], cached[4]
    outs = [_bytes(o) for o in mp.extension_outputs]
    slots = [o.narrow(0, rank * n, n) for o, n in zip(outs, sizes)]
    mp.extension_byte_views = (mp.extension_outputs, rank, sizes, outs, slots)
    return outs, slots


@dataclass
class ExtensionBatch:
    """A group's extension inputs, ready to travel in one collective.

    `sources` are this rank's inputs as bytes (kept alive until the gather is waited for),
    `outputs` the parameters' all-gather outputs as bytes (`world` rows of each input's size),
    `inputs` this rank's slot of each output. `pending` is what `extension.finish_gathers`
    takes (no works of its own where the batch rides in the group's collective)."""

    sources: list[torch.Tensor]
    outputs: list[torch.Tensor]
    inputs: list[torch.Tensor]
    pending: list[ExtensionGather]
    world: int

    @property
    def nbytes(self) -> int:
        """Bytes each rank sends."""
        return sum(s.numel() for s in self.sources)

    def cast(self) -> None:
        """Direct way: copy this rank's inputs into its slots of the outputs (one fused copy)."""
        torch._foreach_copy_(self.inputs, self.sources)

    def copy_in(self, slot: torch.Tensor) -> None:
        """Flat way and alone: pack this rank's inputs into `slot` (1D uint8, `nbytes` long)."""
        torch.cat(self.sources, out=slot)

    def copy_out(self, rows: torch.Tensor) -> None:
        """Split the gathered bytes `rows` (`world` x `nbytes` uint8, rank-major) back into the
        outputs: one fused copy."""
        sizes = [s.numel() for s in self.sources]
        outs = [o.view(self.world, n) for o, n in zip(self.outputs, sizes)]
        torch.split_with_sizes_copy(rows, sizes, dim=1, out=outs)


def prepare(
    params: list[ManagedParam],
    layout: DataParallelLayout,
    mp_policy: MixedPrecisionPolicy,
    gather_stream: "torch.cuda.Stream | None",
) -> ExtensionBatch:
    """Ask each parameter's local shard what to all-gather and ready the outputs: made at the
    first gather (or when a subclass changes what it sends), re-grown after `extension.free`.
    On the current stream, which wrote the inputs and owns the outputs' memory: `gather_stream`
    (where the batch is copied in and gathered) is ordered after it."""
    world, rank = layout.shard_world, layout.shard_rank
    assert layout.shard_group is not None  # extension parameters need a sharded layout (build.py)
    mesh = shard_mesh(layout.mesh, layout.shard_group)
    sources: list[torch.Tensor] = []
    outputs, inputs, pending = [], [], []
    for mp in params:
        tensors, metadata = _pre_all_gather(mp.sharded._local_tensor, mesh, mp, mp_policy)
        tensors = [t.contiguous() for t in tensors]
        fresh = not _outputs_fit(mp, tensors, world)
        if fresh:
            mp.extension_outputs = [torch.empty(world * t.numel(), dtype=t.dtype, device=t.device) for t in tensors]
            mp.extension_inner = []
        else:
            for out in mp.extension_outputs:
                _alloc(out)
        versions = tuple(o._version for o in mp.extension_outputs)
        pending.append(ExtensionGather([], [t.shape for t in tensors], metadata, fresh, versions))
        sources.extend(_bytes(t) for t in tensors)
        outs, slots = _byte_views(mp, tensors, rank)
        outputs.extend(outs)
        inputs.extend(slots)
    if gather_stream is not None and outputs:
        gather_stream.wait_stream(current_stream(outputs[0].device))
    # The sources live until the gather is waited for (the current stream waits, then drops them).
    pending[0].keep = sources
    return ExtensionBatch(sources, outputs, inputs, pending, world)


def start_alone(
    params: list[ManagedParam],
    layout: DataParallelLayout,
    mp_policy: MixedPrecisionPolicy,
    coalesced: bool,
    gather_stream: "torch.cuda.Stream | None" = None,
) -> list[ExtensionGather]:
    """Gather `params` on a collective of their own: torchao float8 weights with precomputed
    scales through their fused cast (extension.py), anything else as one all-gather of a byte
    buffer on the current stream (asynchronous: `extension.finish_gathers` waits, then splits
    the bytes back into the outputs)."""
    group, world, rank = layout.shard_group, layout.shard_world, layout.shard_rank
    assert group is not None  # extension parameters need a sharded layout (build.py)
    batched = _start_batched(params, group, world, rank, coalesced, gather_stream)
    if batched is not None:
        return batched
    batch = prepare(params, layout, mp_policy, None)
    return _gather_bytes(batch, group, rank)


def _gather_bytes(batch: ExtensionBatch, group: dist.ProcessGroup, rank: int) -> list[ExtensionGather]:
    n, world = batch.nbytes, batch.world
    buffer = torch.empty(world * n, dtype=torch.uint8, device=batch.sources[0].device)
    slot = buffer.narrow(0, rank * n, n)  # in place: this rank's slot is the input
    batch.copy_in(slot)
    first = batch.pending[0]
    first.works.append(comm.all_gather(buffer, slot, group, async_op=True))
    first.after = lambda: batch.copy_out(buffer.view(world, n))
    return batch.pending


def prepare_riders(
    params: list[ManagedParam],
    lay: DataParallelLayout,
    policy: MixedPrecisionPolicy,
    stream: "torch.cuda.Stream | None",
) -> object | None:
    """A group's extension parameters made ready to ride in its flat parameters' collective:
    torchao float8 weights with precomputed scales through their fused cast (extension.py),
    any other subclass as bytes (`prepare`); None where they cannot ride."""
    riders = prepare_batched(params, lay.shard_world, lay.shard_rank, stream)
    return riders if riders is not None else prepare(params, lay, policy, stream)
