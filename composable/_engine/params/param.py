"""One managed parameter: its sharded layout, its sharded DTensor and its unsharded twin.

Vocabulary (used everywhere in this package):
- sharded parameter: the `nn.Parameter(DTensor)` the optimizer sees; registered on the module
  outside forward/backward.
- local shard: the sharded parameter's `_local_tensor`: a view of this rank's region of the
  group's flat sharded buffer. The region is padded to `chunk_rows` rows so every rank's
  region has the same size (uneven dim-0 sizes are allowed; padding never leaks out).
- all-gather input / output: the flat sharded buffer (cast if needed) / the flat buffer of all
  ranks' regions, rank-major.
- unsharded parameter: the plain `nn.Parameter` the module computes with during
  forward/backward; a view into padded unsharded storage that `reshard` frees (storage resized
  to 0) and `unshard` refills in place, so autograd's saved references stay valid.
- unsharded gradient: the unsharded parameter's `.grad`, written by autograd.
- sharded gradient: the sharded parameter's `.grad`, a DTensor like the parameter.

Layout over a shard group of `W` ranks: a parameter with `n` rows of `row_numel` elements is
split torch.chunk-style into `chunk_rows = ceil(n / W)` rows per rank; rank `r` owns rows
`[r * chunk_rows, min(n, (r + 1) * chunk_rows))` (possibly none) — exactly DTensor's `Shard(0)`.
A 0-d parameter cannot be split: every rank's region holds the whole value (placement
`Replicate()`), and its gradient is summed by the same reduce-scatter by feeding a copy of
it into every rank's region.
"""

from __future__ import annotations

import copy
import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..comm import collectives as comm
from ..meshes.shard_dims import full_to_regions, regions_to_full
from .wrappers import new_dtensor, offset_free


@dataclass
class ParamLayout:
    """Where one parameter lives in its group's flat buffers (all sizes in elements)."""

    shape: torch.Size  # ND: the parameter's global shape
    rows: int  # dim-0 size (1 for a 0-d parameter)
    row_numel: int  # elements per row
    chunk_rows: int  # rows per rank region, padded (== rows when replicated)
    local_rows: int  # rows this rank really owns
    replicated: bool  # True: every rank holds all rows (0-d params, NO_SHARD)
    offset: int = 0  # start of this parameter in a rank region
    # The sharded dim (`shard_placement_fn`). Rows are taken along it; a rank region holds the
    # rank's local shard contiguous (its natural layout, as FSDP2 hands it out), padding after it.
    dim: int = 0

    @property
    def region_numel(self) -> int:
        """Elements this parameter takes in one rank region (padded)."""
        return self.chunk_rows * self.row_numel

    @staticmethod
    def make(shape: torch.Size, shard_world: int, shard_rank: int, replicated: bool, dim: int = 0) -> "ParamLayout":
        if replicated or len(shape) == 0:
            dim = 0
        rows = shape[dim] if len(shape) > 0 else 1
        row_numel = math.prod(s for i, s in enumerate(shape) if i != dim)
        if replicated or len(shape) == 0:
            return ParamLayout(shape, rows, row_numel, rows, rows, True)
        chunk = -(-rows // shard_world) if rows > 0 else 0
        local = max(0, min(chunk, rows - shard_rank * chunk))
        return ParamLayout(shape, rows, row_numel, chunk, local, False, dim=dim)

    def local_shape(self) -> torch.Size:
        """This rank's local shard's shape (the sharded dim cut to its rows)."""
        if len(self.shape) == 0 or self.replicated:
            return self.shape
        return torch.Size((*self.shape[: self.dim], self.local_rows, *self.shape[self.dim + 1 :]))

    def local_at(self, flat: torch.Tensor, offset: int) -> torch.Tensor:
        """The local shard stored in the 1D `flat` from `offset` on, as a contiguous view (on
        any sharded dim). Runs per parameter per step (gradients): one `as_strided` with sizes
        computed once, instead of a slice, a shape and a view."""
        sizes, strides = self._local_geometry
        return flat.as_strided(sizes, strides, flat.storage_offset() + offset)

    @functools.cached_property
    def _local_geometry(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        sizes = tuple(self.local_shape())
        return sizes, _contiguous_stride(sizes)


# An all-gather extension parameter's views, made once per outputs (their makers say what each holds).
ExtensionViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]  # extension._views
ByteViews = tuple[list[torch.Tensor], int, tuple[int, ...], list[torch.Tensor], list[torch.Tensor]]  # _byte_views
ShapedOutputs = tuple[list[torch.Tensor], tuple[tuple[int, ...], ...], tuple[torch.Tensor, ...]]  # _shaped_outputs


class AnnotationLike(Protocol):
    """What the engine reads of an spmd_types-annotated parameter's `annotated.Annotation`."""

    @property
    def grad_spec(self) -> DTensorSpecLite: ...


@dataclass
class ManagedParam:
    """A parameter managed by one parameter group.

    `slots` lists every (module, attribute) the parameter is registered under inside the
    group's subtree (shared/tied parameters have several); `fqn` is the first one, relative
    to the module the API was applied to.
    """

    fqn: str
    slots: list[tuple[nn.Module, str]]
    layout: ParamLayout
    requires_grad: bool  # at the call; `wants_grad` is the live value (users may freeze later)
    spec: "DTensorSpecLite | None" = None  # how the sharded parameter presents itself
    tp: "DTensorSpecLite | None" = None  # tensor-parallel spec of the unsharded parameter, if any
    dp_dims: frozenset[int] = frozenset()  # dp_mesh_dims: dims of `tp`'s mesh the group reduces over (spmd.py)
    # spmd_types-annotated parameter (annotated.py): computes as a plain tensor; its gradient is
    # read as `annotation.grad_spec` (the backward types' placements on `tp`'s mesh).
    annotation: "AnnotationLike | None" = None  # an annotated.Annotation (that module builds on this one)
    sharded_param: nn.Parameter | None = None  # DTensor parameter the optimizer sees
    unsharded_param: nn.Parameter | None = None  # plain parameter the module computes with
    unsharded_padded: torch.Tensor | None = None  # 1D padded storage behind unsharded_param
    unsharded_on_gather_stream: bool = False  # that storage came from the all-gather stream's pool
    # Bookkeeping the engine keeps per parameter (each owned by one step of the cycle):
    local_registered: torch.Tensor | None = None  # the local shard we installed (a swap is noticed)
    unsharded_alias_of: torch.Tensor | None = None  # flat buffer `unsharded_param` is a view of
    stashed_grad: torch.Tensor | None = None  # no-sync sum in the reduce dtype (sharded groups)
    grad_is_unreduced: bool = False  # replicated no-sync: the visible `.grad` holds local sums
    # Sharded no-sync: (weak reference to the visible sharded `.grad`, its versions) when the
    # sums were stashed; a replaced, cleared or modified `.grad` (zero_grad) discards them.
    grad_marker: tuple[weakref.ref[DTensor], int, int] | None = None
    bucket_index: int | None = None  # replicate: which all-reduce bucket the gradient goes in
    hooked_param: nn.Parameter | None = None  # replicate: the unsharded parameter with our grad hook
    extension: bool = False  # the local shard implements FSDP2's all-gather extension (extension.py)
    # Its all-gather outputs, 1D, and its unsharded inner tensors (each made once, freed between uses).
    extension_outputs: list[torch.Tensor] = field(default_factory=list)
    extension_inner: list[torch.Tensor] = field(default_factory=list)
    extension_views: ExtensionViews | tuple[()] = ()  # float8_cast's batched path: see `ExtensionViews`
    extension_byte_views: ByteViews | tuple[()] = ()  # the byte path's views of the outputs (extension_batch.py)
    extension_shaped: ShapedOutputs | tuple[()] = ()  # the outputs shaped for `fsdp_post_all_gather` (extension.py)
    # (dtype, device) -> the offset-free stand-in of a sharded gradient: see `make_sharded_grad`.
    grad_standins: dict[tuple[torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def wants_grad(self) -> bool:
        """Whether the parameter trains now: the sharded parameter's live `requires_grad`, so
        freezing or unfreezing after `fully_shard` takes effect (as in PyTorch FSDP2)."""
        return self.requires_grad if self.sharded_param is None else self.sharded_param.requires_grad

    # The engine reads its parameters only after `register_sharded`/`unshard` made them: these
    # give them their types (the DTensor behind the sharded one), with a clear error before.
    @property
    def sharded(self) -> DTensor:
        if self.sharded_param is None:
            raise RuntimeError(f"parameter '{self.fqn}' has no sharded parameter yet")
        return cast(DTensor, self.sharded_param)

    @property
    def unsharded(self) -> nn.Parameter:
        if self.unsharded_param is None:
            raise RuntimeError(f"parameter '{self.fqn}' is not unsharded")
        return self.unsharded_param

    def take_stashed_grad(self) -> torch.Tensor | None:
        """The no-sync sum kept by `stash`, handed over once to the next reduction."""
        grad, self.stashed_grad = self.stashed_grad, None
        return grad

    def mark_visible_grad(self) -> None:
        """No-sync sums are held out of sight (unsharded): keep a visible sharded `.grad` (zeros
        if there is none) and remember it, so `zero_grad` (to None or to zeros) is noticed."""
        sp = self.sharded
        if sp.grad is None:
            local = torch.zeros(self.layout.local_shape(), dtype=sp.dtype, device=sp._local_tensor.device)
            sp.grad = self.make_sharded_grad(local)
        grad = cast(DTensor, sp.grad)
        # DTensor in-place ops bump the wrapper's version, direct ones the local tensor's.
        self.grad_marker = (weakref.ref(grad), grad._version, grad._local_tensor._version)

    def grad_was_discarded(self) -> bool:
        """Whether the visible `.grad` was replaced, cleared or modified since `mark_visible_grad`."""
        assert self.grad_marker is not None  # callers ask only with a marker set
        ref, version, local_version = self.grad_marker
        grad = cast("DTensor | None", self.sharded.grad)  # as `make_sharded_grad` made it (or None)
        return (
            grad is None
            or grad is not ref()
            or grad._version != version
            or grad._local_tensor._version != local_version
        )

    def take_grad_is_unreduced(self) -> bool:
        """Whether the visible `.grad` holds unreduced no-sync sums; cleared by asking."""
        flag, self.grad_is_unreduced = self.grad_is_unreduced, False
        return flag

    def sync_requires_grad(self) -> None:
        """Make the unsharded parameter follow the sharded one's `requires_grad`."""
        up = self.unsharded_param
        if up is not None and up.requires_grad != self.wants_grad:
            up.requires_grad_(self.wants_grad)

    # -- sharded side -------------------------------------------------------------------
    def local_view(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded local shard as a view of the flat sharded buffer."""
        lay = self.layout
        return lay.local_at(flat_shard, lay.offset)

    def make_sharded_param(self, local: torch.Tensor) -> nn.Parameter:
        """Wrap `local` (a view of the flat sharded buffer) as the sharded DTensor parameter."""
        assert self.spec is not None  # every managed parameter is made with its spec (build.py, spmd.py)
        param = nn.Parameter(self.spec.wrap(offset_free(local)), requires_grad=self.requires_grad)
        cast(DTensor, param)._local_tensor = local  # a parameter around a DTensor is that DTensor
        return param

    def make_sharded_grad(self, local: torch.Tensor) -> DTensor:
        """`local` (a slice of a reduction output) as the sharded gradient DTensor. Runs once
        per parameter per step, so the offset-free stand-in is made once and kept."""
        standin = local
        if local.storage_offset() != 0:
            key = (local.dtype, local.device)
            kept = self.grad_standins.get(key)
            if kept is None or kept.shape != local.shape:
                kept = self.grad_standins[key] = offset_free(local)
            standin = kept
        sp = self.sharded_param
        if sp is not None and sp.dtype == local.dtype:
            # The parameter's own spec object: DTensor ops between the parameter and its
            # gradient (every optimizer step) then skip comparing two equal specs field by
            # field (a few microseconds per parameter per op).
            grad = new_dtensor(standin, cast(DTensor, sp)._spec)  # the sharded parameter is a DTensor
        else:
            assert self.spec is not None  # every managed parameter is made with its spec
            grad = self.spec.wrap(standin)
        grad._local_tensor = local
        return grad

    def add_to_sharded_grad(self, local: torch.Tensor) -> None:
        """`local` becomes the sharded gradient if there is none, else is added to it."""
        sp = self.sharded
        if sp.grad is None:
            sp.grad = self.make_sharded_grad(local)
        else:
            with torch.no_grad():
                cast(DTensor, sp.grad)._local_tensor.add_(local)

    def point_local_shard_at(self, local: torch.Tensor) -> None:
        """Make the existing sharded parameter's local shard be `local` (keeps its identity)."""
        self.sharded._local_tensor = local

    # -- unsharded side -----------------------------------------------------------------
    def alloc_unsharded(
        self, world: int, dtype: torch.dtype, device: torch.device, on_gather_stream: bool = False
    ) -> None:
        """Create (first time) or re-grow (after `free_unsharded`) the padded unsharded
        storage, on the current stream; `on_gather_stream` says that stream is the all-gather
        stream (then its free must be deferred: `CommStreams.defer_free`)."""
        lay = self.layout
        # dim > 0: the natural layout, unpadded (filled by `fill_from_rank_major`).
        numel = world * lay.region_numel if lay.dim == 0 else lay.rows * lay.row_numel
        if (
            self.unsharded_padded is None
            or self.unsharded_padded.dtype != dtype
            or self.unsharded_padded.device != device
        ):
            self.unsharded_padded = torch.empty(numel, dtype=dtype, device=device)
            view = self.unsharded_padded[: lay.rows * lay.row_numel].view(lay.shape)
            # With tensor parallelism the module computes with TP DTensors.
            self.unsharded_param = nn.Parameter(self.presented(view), requires_grad=self.wants_grad)
            self.unsharded_on_gather_stream = on_gather_stream
            return
        storage = self.unsharded_padded.untyped_storage()
        nbytes = numel * self.unsharded_padded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
            self.unsharded_on_gather_stream = on_gather_stream

    def presented(self, view: torch.Tensor) -> torch.Tensor:
        """What the module computes with: a tensor-parallel DTensor around `view`, or `view`
        itself (no tensor parallelism, or spmd_types annotations: plain local tensors)."""
        return view if self.tp is None or self.annotation is not None else self.tp.wrap(view)

    def fill_from_rank_major(self, staging: torch.Tensor, world: int) -> None:
        """dim > 0: fill the (natural, contiguous) unsharded parameter from its rank-major
        all-gather slices (`staging`, `world` regions of local shards), keeping autograd's
        version counter: refilling freed storage is not a mutation autograd should see."""
        target = self.unsharded_padded
        assert target is not None  # `alloc_unsharded` ran first
        with comm.refilling(target):
            regions_to_full(self.layout, staging, target)

    def rank_major(self, world: int) -> torch.Tensor:
        """The unsharded parameter as `world` padded regions, rank-major (the all-gather
        output's layout): the storage itself for dim 0, a copy otherwise."""
        lay, padded = self.layout, self.unsharded_padded
        assert padded is not None  # asked of an unsharded parameter only
        if lay.dim == 0:
            return padded
        return full_to_regions(lay, padded, world).view(-1)

    def alias_unsharded(self, flat: torch.Tensor) -> None:
        """Replicated groups: make the unsharded parameter a view of `flat` (the shard itself,
        or the replica buffer); the parameter object is made once, so hooks on it stay."""
        if self.unsharded_param is None or self.unsharded_alias_of is not flat:
            view = self.local_view(flat)
            self.unsharded_padded = view.view(-1)
            self.unsharded_param = nn.Parameter(self.presented(view), requires_grad=self.wants_grad)
            self.unsharded_alias_of = flat

    def free_unsharded(self) -> None:
        """Release the unsharded storage; views (and autograd's saved references) stay valid."""
        if self.unsharded_padded is not None:
            self.unsharded_padded.untyped_storage().resize_(0)

    def is_unsharded_allocated(self) -> bool:
        return self.unsharded_padded is not None and self.unsharded_padded.untyped_storage().size() > 0

    def __deepcopy__(self, memo: dict[int, Any]) -> "ManagedParam":
        """`copy.deepcopy(model)` copies this too. The copy re-creates its unsharded parameter
        at its first unshard where a copy would be wrong: freed storage (resized to 0: reading
        it crashes), and an unsharded parameter that is a view of the flat shard (replicated
        groups: `nn.Parameter.__deepcopy__` clones it apart from the copy's shard, which
        the optimizer then updates unseen). Gradient hooks are not copied with a parameter:
        the copy registers its own (`hooked_param`)."""
        new = copy.copy(self)
        memo[id(self)] = new
        freed = self.unsharded_padded is not None and not self.is_unsharded_allocated()
        drop = freed or self.unsharded_alias_of is not None
        gathered_freed = any(is_freed(t) for t in self.extension_outputs)
        for name, value in vars(self).items():
            if name in _EXTENSION_VIEWS:  # views of this parameter's outputs, not of the copy's
                value = ()
            elif name == "hooked_param" or (
                drop and name in ("unsharded_param", "unsharded_padded", "unsharded_alias_of")
            ):
                value = None
            elif gathered_freed and name in _EXTENSION_GATHERED:  # the copy gathers afresh
                value = [] if name != "unsharded_param" else None
            elif freed and (value is self.unsharded_param or is_freed(value)):  # nothing that points at freed storage
                value = None
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    # -- registration on modules --------------------------------------------------------
    def register(self, param: torch.Tensor) -> None:
        """Register `param` in every slot (without going through `setattr` checks); an
        `nn.Parameter`, the sharded one typed as the DTensor it also is (`sharded`)."""
        for module, name in self.slots:
            module._parameters[name] = cast(nn.Parameter, param)

    def registered(self) -> nn.Parameter:
        module, name = self.slots[0]
        return cast(nn.Parameter, module._parameters[name])  # `register` put a parameter in every slot


@dataclass(frozen=True)
class DTensorSpecLite:
    """Mesh, placements and global shape a local tensor is wrapped into a DTensor with."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    _specs: dict[torch.dtype, DTensorSpec] = field(default_factory=dict, compare=False, repr=False)

    def wrap(self, local: torch.Tensor) -> DTensor:
        """`local` as this spec's DTensor, without a copy and without autograd.

        Built with DTensor's constructor, not `from_local`: `from_local` costs an autograd
        Function call (tens of microseconds, paid per parameter per step for the sharded
        gradients) and copies a CPU-offloaded shard to the mesh's device, leaving a wrapper
        that claims "cuda" around a CPU local tensor."""
        spec = self._specs.get(local.dtype)
        if spec is None:
            meta = TensorMeta(self.shape, _contiguous_stride(self.shape), local.dtype)
            spec = self._specs[local.dtype] = DTensorSpec(self.mesh, tuple(self.placements), tensor_meta=meta)
        return new_dtensor(local, spec)


# Views of an all-gather extension parameter's outputs, cached to spare host work per gather.
_EXTENSION_VIEWS = ("extension_views", "extension_byte_views", "extension_shaped")
# What an all-gather extension parameter's gathers made (see extension.py).
_EXTENSION_GATHERED = ("unsharded_param", "extension_outputs", "extension_inner")


def is_freed(value: object) -> bool:
    """A tensor whose storage was resized to 0 (freed unsharded storage)."""
    return isinstance(value, torch.Tensor) and value.numel() > 0 and value.untyped_storage().size() == 0


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def raise_still_on_meta(api: str, params: list[ManagedParam], rank: int) -> None:
    """The error of a gather whose parameters were never materialised (meta device)."""
    names = [mp.fqn for mp in params]
    shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise RuntimeError(
        f"{api}: parameters {shown} are still on the meta device (rank {rank}); "
        "materialise them before the forward, e.g. model.to_empty(device=...) then initialise them "
        "(reset_parameters() or a load_state_dict)"
    )
