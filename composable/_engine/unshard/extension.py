"""PyTorch FSDP2's all-gather extension, honoured for parameters whose local tensor is a
subclass that implements it (torchao's float8 training weights, for example).

Such a subclass decides what travels: `fsdp_pre_all_gather` turns this rank's shard into
the tensors to all-gather (float8 data: half the bytes of bf16) plus metadata, and
`fsdp_post_all_gather` turns the gathered tensors into the unsharded parameter (first
time), or refills it in place (`out=`), naming the inner tensors whose storage may be freed
between uses. These parameters keep their own storage (they are not in the group's flat
buffer); a group's extension inputs all travel in one collective per unshard, with the flat
parameters' where they can (extension_batch.py); their gradients are plain and go through
the group's usual reduction.

The protocol is FSDP2's (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), to the letter
where subclasses rely on it:
- `fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)` (or the older
  `fsdp_pre_all_gather(mesh)`) gets the shard mesh (the mesh's last dim under HSDP), the
  parameter's global size and contiguous stride, the module it is registered on, and the
  group's mixed-precision policy;
- the all-gather outputs are made once per parameter and gathered into again every time
  (their storage freed in between), and each is handed to `fsdp_post_all_gather` as
  `output.view(-1, *input_shape[1:])`. A subclass may keep them as its inner tensors: torchao's
  `out=` path only swaps the scale and relies on the data being gathered into the same storage.
- float8 (1-byte, non-integer) tensors travel as their bytes (`uint8` views): exact, and gloo
  has no float8 type at all (NCCL moves them as bytes too).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..comm import collectives as comm
from ..comm.streams import current_stream, stream_context
from ..dtypes import float8_cast
from ..dtypes.policies import MixedPrecisionPolicy
from ..optimizer.optim_state import track_for_optimizers
from ..params.param import ExtensionViews, ManagedParam, _contiguous_stride
from ..params.wrappers import local_tensor

HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")

# Meshes handed to `fsdp_pre_all_gather`: the shard mesh of each group's mesh, found once.
# Keyed by identity (equal meshes of earlier process groups must not answer), held weakly.
_SHARD_MESHES: dict[int, tuple[weakref.ref[DeviceMesh], DeviceMesh]] = {}


class _Extension(Protocol):
    """A local shard that implements the all-gather extension: a tensor subclass with FSDP2's
    two hooks (their signatures are the subclass's; see the module's docstring)."""

    def fsdp_pre_all_gather(self, *args: Any) -> Any: ...

    def fsdp_post_all_gather(self, *args: Any, **kwargs: Any) -> Any: ...


def has_extension(tensor: object) -> bool:
    """Whether `tensor` implements the all-gather extension (both methods, as FSDP2 requires);
    for a DTensor, its local tensor (what is sharded and gathered, as FSDP2 reads it)."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return all(hasattr(tensor, name) for name in HOOKS)


@dataclass
class ExtensionGather:
    """One extension parameter's all-gathers in flight."""

    works: list[Any]
    input_shapes: list[torch.Size]
    metadata: Any
    fresh: bool  # new all-gather outputs: `fsdp_post_all_gather` makes the unsharded parameter
    versions: tuple[int, ...]  # the outputs' version counters before the collectives wrote them
    batched: bool = False  # cast and gathered with its group's other float8 weights (float8_cast.py)
    # Batched with its group's other extension parameters (extension_batch.py), on the first:
    keep: list[torch.Tensor] = field(default_factory=list)  # inputs alive until the gather is waited for
    after: Callable[[], None] | None = None  # after the wait: split the gathered bytes into the outputs


def init_shards(
    params: list[ManagedParam],
    sources: list[torch.Tensor],
    world: int,
    rank: int,
    storage_device: Callable[[torch.Tensor], torch.device],
    api: str,
) -> None:
    """Make each parameter's sharded DTensor: its local shard is this rank's dim-0 chunk of
    the parameter, a copy of the parameter's own kind on the storage device (also on the meta
    device), taken with the ops FSDP2 takes (`shard_rows`), so that whatever FSDP2 can shard
    shards here. Raises `NotImplementedError` naming the parameter, its type and the op its
    type lacks."""
    with torch.no_grad():
        for mp, src in zip(params, sources):
            device = storage_device(src)
            if src.device != device:  # FSDP2 moves the whole parameter before sharding it too
                src = src.to(device)
            mp.sharded_param = mp.make_sharded_param(shard_rows(api, mp.fqn, src.detach(), world, rank))
            _adopt(mp)


def shard_rows(api: str, fqn: str, full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's rows of `full` as a new tensor of its own kind, through the ops FSDP2's
    `FSDPParam._init_sharded_param` uses on a subclass: `torch.chunk` on dim 0 (its `split`),
    a `new_zeros` of the first (largest) chunk's size and a `copy_` into it. Quantized weights
    (torchao's NF4, int8 training weights) implement these and few other ops: a narrow or a
    slice at an offset is what they cannot do. Dim 0 is divisible by `world` here (the
    builder's check), so the copy fills the new tensor."""
    step = "torch.chunk on dim 0 (aten.split)"
    try:
        chunks = torch.chunk(full, world, dim=0)
        if len(chunks) != world:
            raise NotImplementedError(f"got {len(chunks)} chunks for {world} ranks")
        step = "new_zeros"
        shard = chunks[0].new_zeros(chunks[0].shape)
        if type(shard) is not type(full):
            raise NotImplementedError(f"it returned a {type(shard).__name__}")
        step = "copy_"
        shard.copy_(chunks[rank])
    except (NotImplementedError, AssertionError, RuntimeError, TypeError) as error:
        why = " ".join(str(error).split())[:200]  # one line, however the subclass words it
        raise NotImplementedError(
            f"{api}: parameter '{fqn}' of type {type(full).__name__} cannot be sharded: it lacks {step} "
            f"as FSDP2 shards it ({type(error).__name__}: {why})"
        ) from None
    return shard


def _adopt(mp: ManagedParam) -> None:
    track_for_optimizers(mp.sharded)
    mp.local_registered = mp.sharded._local_tensor


def shard_mesh(mesh: DeviceMesh, group: dist.ProcessGroup) -> DeviceMesh:
    """The mesh FSDP2 hands to `fsdp_pre_all_gather`: `mesh` itself when 1D, else its last
    (sharded) dim, by name when the mesh has names (the sub-mesh FSDP2 uses), else wrapped
    around the shard process group."""
    if mesh.ndim == 1:
        return mesh
    found = _SHARD_MESHES.get(id(mesh))
    if found is None or found[0]() is not mesh:
        names = mesh.mesh_dim_names
        sub = mesh[names[-1]] if names else DeviceMesh.from_group(group, mesh.device_type)
        found = _SHARD_MESHES[id(mesh)] = (weakref.ref(mesh), sub)
    return found[1]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """float8 as `uint8` (the same bytes); any other dtype as it is."""
    if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8, torch.bool):
        return tensor.view(torch.uint8)
    return tensor


def _alloc(tensor: torch.Tensor) -> None:
    """Re-grow storage that `free` released (a no-op where it is allocated)."""
    storage = tensor.untyped_storage()
    nbytes = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.size() < nbytes:
        storage.resize_(cast(int, nbytes))  # a SymInt only while tracing, which resize_ takes too


# Per `fsdp_pre_all_gather` function: whether it has FSDP2's older signature (mesh only). Read
# once per function: `inspect.signature` costs more host time than the rest of a gather's setup.
_OLD_SIGNATURE: dict[Any, bool] = {}


def _pre_all_gather(local: torch.Tensor, mesh: DeviceMesh, mp: ManagedParam, mp_policy: MixedPrecisionPolicy) -> Any:
    pre = cast(_Extension, local).fsdp_pre_all_gather  # only extension parameters gather here
    func = getattr(pre, "__func__", pre)  # a bound method's function (one per class), else the callable
    old = _OLD_SIGNATURE.get(func)
    if old is None:
        old = _OLD_SIGNATURE[func] = len(inspect.signature(pre).parameters) == 1
    if old:
        return pre(mesh)
    shape = mp.layout.shape
    return pre(mesh, shape, _contiguous_stride(shape), mp.slots[0][0], mp_policy)


def _outputs_fit(mp: ManagedParam, inputs: list[torch.Tensor], world: int) -> bool:
    """Whether the outputs made at an earlier gather take these inputs (they always should;
    a subclass that changes what it sends gets a fresh unsharded parameter)."""
    outs = mp.extension_outputs
    return (
        mp.unsharded_param is not None
        and len(outs) == len(inputs)
        and all(
            o.dtype == t.dtype and o.numel() == world * t.numel() and o.device == t.device for o, t in zip(outs, inputs)
        )
    )


@dataclass
class BatchedFloat8:
    """A group's float8 weights made ready to travel together (see float8_cast.py): their
    all-gather outputs allocated, the gather stream ordered after the current one. `cast`
    (on the gather stream) writes this rank's slots; the collective then gathers `inputs` (byte
    views of the slots) into `outputs` (byte views of the outputs)."""

    locals_: list[torch.Tensor]
    scales: list[torch.Tensor]
    slots: list[torch.Tensor]
    outputs: list[torch.Tensor]
    inputs: list[torch.Tensor]
    pending: list[ExtensionGather]

    def cast(self) -> None:
        float8_cast.cast_into(self.locals_, self.scales, self.slots)

    @property
    def nbytes(self) -> int:
        """Bytes each rank sends (the flat way packs them: gather.py's `TailRiders`)."""
        return sum(i.numel() for i in self.inputs)

    def copy_in(self, slot: torch.Tensor) -> None:
        """Flat way: cast into this rank's slots, then pack them into `slot` (1D uint8)."""
        self.cast()
        torch.cat(self.inputs, out=slot)

    def copy_out(self, rows: torch.Tensor) -> None:
        """Flat way: split the gathered bytes `rows` (ranks x `nbytes`) into the outputs."""
        sizes = [i.numel() for i in self.inputs]
        outs = [o.view(len(rows), n) for o, n in zip(self.outputs, sizes)]
        torch.split_with_sizes_copy(rows, sizes, dim=1, out=outs)


def prepare_batched(
    params: list[ManagedParam], world: int, rank: int, gather_stream: "torch.cuda.Stream | None"
) -> BatchedFloat8 | None:
    """The batched float8 path for `params`, ready to cast and gather, or None where it does
    not apply: the parameters' unsharded twins do not exist yet (the first gather makes them
    through the per-parameter path) or a local shard is not a torchao float8 weight with a
    precomputed scale. Runs on the current stream, whose pool and order own the outputs' memory
    (and wrote the shards and scales): `gather_stream` is ordered after it."""
    locals_ = [mp.sharded._local_tensor for mp in params]
    scales = float8_cast.precomputed_scales(locals_)
    if scales is None:
        return None
    outputs = []
    for mp, local in zip(params, locals_):
        outs = mp.extension_outputs
        if mp.unsharded_param is None or len(outs) != 1 or outs[0].numel() != world * local.numel():
            return None
        outputs.append(outs[0])
    for out in outputs:
        _alloc(out)
    versions = [(o._version,) for o in outputs]
    # In place: this rank's slot of each output is the all-gather input, written by the cast.
    views = [_views(mp, out, local, rank) for mp, out, local in zip(params, outputs, locals_)]
    if gather_stream is not None:
        gather_stream.wait_stream(current_stream(outputs[0].device))
    pending = [
        ExtensionGather([], [local.shape], float8_cast.metadata(scale), False, v, batched=True)
        for local, scale, v in zip(locals_, scales, versions)
    ]
    return BatchedFloat8(locals_, scales, [v[1] for v in views], [v[2] for v in views], [v[3] for v in views], pending)


def _start_batched(
    params: list[ManagedParam],
    group: dist.ProcessGroup,
    world: int,
    rank: int,
    coalesced: bool,
    gather_stream: "torch.cuda.Stream | None",
) -> list[ExtensionGather] | None:
    """The batched float8 path on its own collective(s) (see `prepare_batched`), or None where
    it does not apply."""
    batch = prepare_batched(params, world, rank, gather_stream)
    if batch is None:
        return None
    with stream_context(gather_stream):
        batch.cast()
        if coalesced:
            comm.all_gather_coalesced(batch.outputs, batch.inputs, group)  # waited on the gather stream
        else:
            for gather, out, slot in zip(batch.pending, batch.outputs, batch.inputs):
                gather.works.append(comm.all_gather(out, slot, group, async_op=True))
        if gather_stream is not None:
            batch.pending[0].works.append(gather_stream.record_event())  # `finish_gathers` waits on the current stream
    return batch.pending


def _views(mp: ManagedParam, out: torch.Tensor, local: torch.Tensor, rank: int) -> ExtensionViews:
    """(output, this rank's slot of it shaped as the shard, byte views of both), made once per
    output object: the batched path's per-gather host work is the cast and the collective."""
    views = mp.extension_views
    if not views or views[0] is not out or views[4] != rank:
        slot = out.narrow(0, rank * local.numel(), local.numel())
        views = mp.extension_views = (out, slot.view(local.shape), _as_bytes(out), _as_bytes(slot), rank)
    return views


def post_dtype(local: torch.Tensor, policy_dtype: torch.dtype | None) -> torch.dtype:
    """The `param_dtype` handed to `fsdp_post_all_gather`, per parameter as FSDP2 hands it:
    the policy's for a floating-point parameter, else the parameter's own dtype (not the
    group's: a bf16 quantized weight in a group of fp32 adapters is made in bf16)."""
    return policy_dtype if policy_dtype is not None and local.dtype.is_floating_point else local.dtype


def finish_gathers(
    params: list[ManagedParam], pending: list[ExtensionGather], world: int, policy_dtype: torch.dtype | None
) -> None:
    """Wait, then make (first time) or refill each unsharded parameter through
    `fsdp_post_all_gather` (in `post_dtype`), keeping autograd's version counters: refilling
    freed storage with the same values is not a mutation autograd should see."""
    if pending and pending[0].batched:
        _finish_batched(params, pending, policy_dtype)
        return
    for mp, gather in zip(params, pending):
        for work in gather.works:
            if work is not None:
                work.wait()
        if gather.after is not None:
            gather.after()
        outputs = _shaped_outputs(mp, gather.input_shapes)
        local = mp.sharded._local_tensor
        post = cast(_Extension, local).fsdp_post_all_gather  # only extension parameters gather here
        param_dtype = post_dtype(local, policy_dtype)
        if gather.fresh:
            unsharded, inner = post(outputs, gather.metadata, param_dtype)
            # On a mesh beyond the data-parallel one (dp_mesh_dims) the module computes with a
            # DTensor of the original spec around it, as FSDP2 does; refills go through that
            # DTensor (`out=`), which torchao's float8 weights take.
            unsharded = mp.presented(unsharded)  # spmd_types-annotated: stays plain
            mp.unsharded_param = nn.Parameter(unsharded, requires_grad=mp.wants_grad)
            mp.extension_inner = list(inner)
        else:
            for tensor in mp.extension_inner:
                _alloc(tensor)
            with comm.refilling(mp.unsharded, *mp.extension_inner):
                post(outputs, gather.metadata, param_dtype, out=mp.unsharded_param)
        # The collectives wrote into storage the unsharded parameter may hold (inner tensors).
        torch._C._autograd._unsafe_set_version_counter(tuple(mp.extension_outputs), gather.versions)


def _shaped_outputs(mp: ManagedParam, input_shapes: list[torch.Size]) -> tuple[torch.Tensor, ...]:
    """The outputs as `fsdp_post_all_gather` takes them (`output.view(-1, *input_shape[1:])`),
    made once per outputs and shapes: views stay valid across `free` (storage resized in place)."""
    shapes = tuple(tuple(s[1:]) for s in input_shapes)
    cached = mp.extension_shaped
    if cached and cached[0] is mp.extension_outputs and cached[1] == shapes:
        return cached[2]
    outputs = tuple(o.view(-1, *s) for o, s in zip(mp.extension_outputs, shapes))
    mp.extension_shaped = (mp.extension_outputs, shapes, outputs)
    return outputs


def _finish_batched(
    params: list[ManagedParam], pending: list[ExtensionGather], policy_dtype: torch.dtype | None
) -> None:
    """The batched path's finish, with one host step per group rather than per weight: each
    unsharded float8 weight already holds the gathered bytes (its data is its all-gather
    output), so torchao's `fsdp_post_all_gather(out=)`, which only sets the scale, is called
    where the scale tensor is not the one the weight holds (it is, when the scales are
    precomputed in place)."""
    for gather in pending:
        for work in gather.works:
            work.wait()
    outputs: list[torch.Tensor] = []
    versions: list[int] = []
    for mp, gather in zip(params, pending):
        unsharded = mp.unsharded
        if getattr(local_tensor(unsharded), "_scale", None) is not gather.metadata[0]:
            data = mp.extension_outputs[0].view(-1, *gather.input_shapes[0][1:])
            local = mp.sharded._local_tensor
            with comm.refilling(unsharded):
                cast(_Extension, local).fsdp_post_all_gather(
                    (data,),
                    gather.metadata,
                    post_dtype(local, policy_dtype),
                    out=unsharded,
                )
        outputs.extend(mp.extension_outputs)
        versions.extend(gather.versions)
    torch._C._autograd._unsafe_set_version_counter(tuple(outputs), tuple(versions))


def free(params: list[ManagedParam]) -> None:
    """Release the all-gather outputs' and inner tensors' storage between uses (the parameter
    objects stay)."""
    for mp in params:
        for tensor in (*mp.extension_outputs, *mp.extension_inner):
            tensor.untyped_storage().resize_(0)


def adopt_swapped(params: list[ManagedParam]) -> None:
    """Adopt local shards that were swapped (`to_empty`, `module.half()`, a
    `load_state_dict(assign=True)`) while resharded: the next gather starts from scratch (a
    fresh unsharded parameter; the old one may have another dtype)."""
    for mp in params:
        if mp.sharded._local_tensor is not mp.local_registered:
            _adopt(mp)
            mp.unsharded_param = None
            mp.extension_outputs = []
            mp.extension_inner = []
