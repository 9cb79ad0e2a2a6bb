"""A parameter group: the parameters one API call manages on one module.

It owns their sharded storage (one flat buffer per group, the local shards views of it), gathers
them (`unshard`), frees them (`reshard`), reduces their gradients (`reduce_grads`, `finish_reduce`).
Two communication modes share everything else. Sharded (`Shard(0)`, HSDP `(Replicate(), Shard(0))`): one
all-gather per unshard, one reduce-scatter (+ HSDP: one all-reduce across replicas) per gradient reduction.
Replicated (NO_SHARD, replicate): no all-gather; gradients all-reduced as one flat buffer or, for `replicate`,
in buckets launched as soon as their gradients are ready."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from ..comm import collectives as comm
from ..comm.profiling import labelled
from ..comm.streams import streams_for
from ..dtypes.policies import MixedPrecisionPolicy
from ..grads.buckets import BucketedReducer
from ..grads.grad_dtype import GroupDtypes
from ..grads.reduce import GradReducer, ReduceSpec
from ..meshes.layout import DataParallelLayout
from ..optimizer.optim_state import track_for_optimizers
from ..params.claim import mark_replaced
from ..params.param import ManagedParam, is_freed, raise_still_on_meta
from ..unshard import extension, extension_batch
from ..unshard.device_copy import DeviceShardCopy
from ..unshard.gather import PendingGather, free_storages, gathers_directly, start_gather
from ..unshard.mixed_dtypes import finish_gather_mixed


class GroupState(Enum):
    SHARDED = auto()
    UNSHARDING = auto()  # all-gather in flight
    UNSHARDED = auto()


@dataclass(frozen=True)
class GroupConfig:
    """How a group lays out and communicates; decided by the API at the call."""

    layout: DataParallelLayout
    device: torch.device  # compute device
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    offload: bool
    pin_memory: bool
    compute_shard_on_device: bool = False  # offload: a copy of the shard stays on the device (device_copy.py)
    bucket_cap_bytes: int | None = None  # replicate: bucketed all-reduce as gradients become ready
    api: str = "fully_shard"  # the front end that made the group, for error messages
    param_dtypes: tuple[torch.dtype, ...] | None = None  # per parameter where they differ (mixed_dtypes.py)


class ParamGroup:
    """Sharded storage and communication for a list of parameters of one module subtree."""

    shows_unsharded_between_passes = False  # see `register_sharded`
    all_gather_comm: Any = None  # set_custom_all_gather (an FSDP2 `AllGather`) and kin: the flat way

    def __init__(self, params: list[ManagedParam], originals: list[torch.Tensor], config: GroupConfig) -> None:
        self.params = params
        # Parameters whose local shard implements FSDP2's all-gather extension keep storage of
        # their own and gather through it (extension.py); the rest share the flat buffer.
        self.flat_params = [mp for mp in params if not mp.extension]
        self.extension_params = [mp for mp in params if mp.extension]
        self._extension_gathers: list[extension.ExtensionGather] = []
        self.config = config
        self.layout = config.layout
        self.dtypes = GroupDtypes(config.param_dtype, config.reduce_dtype)
        self.state = GroupState.SHARDED
        self._unsharded_registered = False  # which parameters the modules show: sharded
        self._pending_gather: PendingGather | None = None
        # reshard_after_forward=N: this rank's 1/N of the unsharded parameters, kept from the
        # end of forward to backward's all-gather within its N ranks (1D, unsharded dtype).
        self._post_forward_shard: tuple[torch.Tensor, int] | None = None
        self._kept_versions: tuple[int, ...] | None = None  # see `keep_unsharded`
        self.keep_unsharded_storage = False  # set_keep_unsharded_storage: reshard keeps it (stable data pointers)
        self._coalesced_gather_ok: bool | None = None  # see `gather.gathers_directly`
        # Replicated groups that cast (or copy back from the CPU): one persistent flat buffer
        # in the unsharded dtype, refilled in place, the unsharded parameters views of it.
        self._replica_flat: torch.Tensor | None = None
        self._device_copy = DeviceShardCopy()  # CPUOffloadPolicy(compute_shard_on_device=True)
        self.streams = streams_for(config.device)
        pin_host = config.offload and config.pin_memory and config.device.type == "cuda"
        spec = ReduceSpec(self.layout, config.device, config.offload, self.dtypes, pin_host)
        self.reducer = (
            GradReducer(params, spec, self.streams)
            if config.bucket_cap_bytes is None
            else BucketedReducer(params, spec, self.streams, config.bucket_cap_bytes)
        )
        extension_sources = [src for mp, src in zip(params, originals) if mp.extension]
        self._build_flat_shard(
            [src for mp, src in zip(params, originals) if not mp.extension],
            fresh=True,
            dtype_if_empty=extension_sources[0].dtype if extension_sources else torch.float32,
        )
        lay = self.layout
        extension.init_shards(
            self.extension_params, extension_sources, lay.shard_world, lay.shard_rank, self._storage_device, config.api
        )

    _SHARED_ON_COPY = ("streams", "all_gather_comm")  # runtime handles: a deep copy of the model shares them

    def __deepcopy__(self, memo: dict[int, Any]) -> "ParamGroup":
        new = ParamGroup.__new__(ParamGroup)
        memo[id(self)] = new
        for name, value in vars(self).items():
            if name == "_replica_flat" and is_freed(value):
                value = None  # freed storage cannot be copied; the copy makes its own when needed
            setattr(new, name, value if name in self._SHARED_ON_COPY else copy.deepcopy(value, memo))
        return new

    # -- sharded storage ----------------------------------------------------------------
    @property
    def orig_dtype(self) -> torch.dtype:
        return self.dtypes.orig

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.dtypes.unsharded

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.dtypes.reduce

    def _storage_device(self, like: torch.Tensor) -> torch.device:
        if like.device.type == "meta":
            return like.device
        return torch.device("cpu") if self.config.offload else self.config.device

    def _build_flat_shard(self, sources: list[torch.Tensor], fresh: bool, dtype_if_empty: torch.dtype) -> None:
        """(Re)build the flat sharded buffer from `sources`: full tensors when `fresh`, else the
        current local shards (after `module.half()`, `to_empty`, ...). Re-points every
        sharded parameter's local shard at a view of the new buffer. With no flat parameters
        (only extension ones) the group's dtype is `dtype_if_empty`."""
        dtypes = {t.dtype for t in sources}
        if len(dtypes) > 1:
            raise NotImplementedError(
                f"fully_shard: parameters of one group must share a dtype, got {sorted(map(str, dtypes))} for {[p.fqn for p in self.flat_params]}"
            )
        dtype = dtypes.pop() if dtypes else dtype_if_empty
        device = self._storage_device(sources[0]) if sources else self.config.device
        offset = 0
        for mp in self.flat_params:
            mp.layout.offset = offset
            offset += mp.layout.region_numel
        flat = torch.zeros(offset, dtype=dtype, device=device)
        if self.config.offload and self.config.pin_memory and device.type == "cpu" and torch.cuda.is_available():
            flat = flat.pin_memory()
        self.flat_shard = flat  # 1D, this rank's region
        self._device_copy.forget()  # a copy of the old buffer
        self.dtypes.orig = dtype
        with torch.no_grad():
            for mp, src in zip(self.flat_params, sources):
                local = mp.local_view(flat)
                if device.type != "meta":
                    local.copy_(self._local_rows(mp, src) if fresh else src)
                if fresh:
                    mp.sharded_param = mp.make_sharded_param(local)
                else:
                    mp.point_local_shard_at(local)
                track_for_optimizers(mp.sharded)  # again after a swap (`to_empty`)
                mp.local_registered = mp.sharded._local_tensor
        self._unsharded_aliases_shard = (
            not self.layout.sharded
            and not self.config.offload
            and self.unsharded_dtype == dtype
            and device.type != "meta"
        )

    def _local_rows(self, mp: ManagedParam, full: torch.Tensor) -> torch.Tensor:
        if mp.layout.replicated or full.dim() == 0:
            return full.detach()
        dim = mp.layout.dim
        start = min(self.layout.shard_rank * mp.layout.chunk_rows, full.shape[dim])  # trailing ranks may own no rows
        return full.detach().narrow(dim, start, mp.layout.local_rows)

    def refresh_sharded_params(self) -> None:
        """Adopt sharded parameters that were swapped or re-materialised behind our back
        (`model.half()`, `to_empty`, `load_state_dict(assign=True)`) so the flat buffer, the
        local shards and the registered parameters agree again."""
        stale = swapped = False
        for mp in self.params:
            registered = mp.registered()
            if registered is not mp.sharded_param and not self._unsharded_registered:
                assert mp.spec is not None  # made with the sharded parameter
                if not isinstance(registered, DTensor) or registered.shape != mp.spec.shape:
                    raise RuntimeError(
                        f"fully_shard: parameter '{mp.fqn}' was replaced by a {type(registered).__name__} of shape {tuple(registered.shape)}; expected a DTensor of shape {tuple(mp.spec.shape)}"
                    )
                # The old one is gone from the model: an optimizer still holding it (built before
                # `load_state_dict(assign=True)`) would train nothing, so its step refuses it.
                mark_replaced([mp.sharded], self.config.api)
                mp.sharded_param = registered
                mp.register(registered)
            if mp.sharded._local_tensor is not mp.local_registered:
                stale, swapped = stale or not mp.extension, swapped or mp.extension
        if swapped:  # extension parameters keep their own storage: the next gather starts afresh
            self.reshard()
            extension.adopt_swapped(self.extension_params)
        if stale:
            self.reshard()  # unsharded storage kept from an earlier forward belongs to the old shards
            self._build_flat_shard(
                [mp.sharded._local_tensor for mp in self.flat_params], fresh=False, dtype_if_empty=self.orig_dtype
            )
            for mp in self.flat_params:  # unsharded storage must follow a dtype change
                mp.unsharded_padded = None
            self._replica_flat = None

    # -- unshard / reshard ------------------------------------------------------------------
    @labelled("composable::unshard")
    def unshard(self, async_op: bool = False) -> None:
        """Gather the unsharded parameters and register them on their modules."""
        if self._kept_versions is not None and self._shard_versions() != self._kept_versions:
            self.reshard()  # kept unsharded (reshard_after_backward=False) across an optimizer step
        if self.state is GroupState.SHARDED:
            self._start_unshard(prefetch=async_op)
        if not async_op:
            self.wait_for_unshard()
            if not self._unsharded_registered:
                self._register_unsharded()

    def _register_unsharded(self) -> None:
        for mp in self.params:
            mp.sync_requires_grad()
            mp.register(mp.unsharded)
        self._unsharded_registered = True

    def register_sharded(self) -> None:
        """Register the sharded DTensors but keep the unsharded storage (no reshard): outside
        forward/backward the module shows its sharded parameters (state dicts, DCP, the optimizer's
        view; not under FSDP2's adapter, as FSDP2), while backward, which holds its own references
        to the unsharded parameters, needs no new all-gather; `unshard` registers them again."""
        if self.state is GroupState.UNSHARDING:
            self.wait_for_unshard()
        if self.shows_unsharded_between_passes:
            return
        for mp in self.params:
            mp.register(mp.sharded)
        self._unsharded_registered = False

    def keep_unsharded(self) -> None:
        """End of backward with `reshard_after_backward=False`: show the sharded parameters
        but keep the unsharded storage for the next forward. The sharded parameters' versions
        are remembered, so an optimizer step in between (in place, through DTensor: it bumps
        the wrappers' versions) makes the next `unshard` gather again."""
        self.register_sharded()
        self._kept_versions = self._shard_versions()

    def _shard_versions(self) -> tuple[int, ...]:
        """Version counters that change whenever the sharded parameters do (an optimizer's step
        bumps them even where its kernels do not: optim_state.py)."""
        return (self.flat_shard._version, *(mp.sharded._version for mp in self.params))

    def reshard_to(self, size: int) -> None:
        """End of forward with `reshard_after_forward=size`: keep only this rank's 1/`size` of
        the unsharded parameters (a slice of the all-gather output), so backward all-gathers
        within `size` ranks instead of the whole shard group; free the rest. A `size` of the
        whole shard group (or more) reshards fully: one of per-parameter meshes may be that narrow."""
        if self.state is GroupState.UNSHARDING:
            self.wait_for_unshard()
        full = self.extension_params or self._unsharded_aliases_shard or self.config.param_dtypes
        if self.state is GroupState.SHARDED or full or size >= self.layout.shard_world:
            self.reshard()  # (all-gather extensions decide what travels: they regather fully)
            return
        _, rank = self.layout.post_forward_group(size)
        world, share = self.layout.shard_world, self.layout.shard_world // size
        kept = comm.pack_regions(
            [mp.rank_major(world) for mp in self.flat_params], world, rank * share, (rank + 1) * share
        )
        self.reshard()
        self._post_forward_shard = (kept, size)

    def _start_unshard(self, prefetch: bool) -> None:
        if self.flat_shard.is_meta:
            raise_still_on_meta(self.config.api, self.params, self.layout.mesh.get_rank())
        self.state = GroupState.UNSHARDING
        if self._unsharded_aliases_shard:
            self._pending_gather = None
            return
        if not self.layout.sharded:
            self._refill_replica()
            return
        lay, shard_group = self.layout, self.layout.shard_group
        assert shard_group is not None  # a sharded layout (above) has one
        source, group, rank = self.flat_shard, shard_group, lay.shard_rank
        if self._post_forward_shard is not None:  # backward after reshard_after_forward=N
            (source, size), self._post_forward_shard = self._post_forward_shard, None
            group, rank = lay.post_forward_group(size)
        streams = self.streams
        if streams is not None:
            streams.before_all_gather(keep_newest=not prefetch)
            if source is not self.flat_shard:  # made on the compute stream during forward
                streams.all_gather.wait_stream(streams.current())
        if self._coalesced_gather_ok is None:  # asked once, when the process groups exist; CUDA only (gather.py)
            self._coalesced_gather_ok = streams is not None and comm.supports_coalesced_gather(
                shard_group, self.flat_shard
            )
        custom = self.all_gather_comm
        ok = self._coalesced_gather_ok and not self.config.param_dtypes  # several dtypes: flat way (mixed_dtypes.py)
        direct = custom is None and gathers_directly(self.flat_params, ok, full_group=source is self.flat_shard)
        # The group's extension parameters ride in the flat parameters' collective, unless it
        # is a custom one, one of several dtypes or a post-forward one (extension_batch.py).
        riders: Any = None
        gather_stream = streams.all_gather if streams is not None else None
        if self.extension_params:  # only they need the policy (not every unshard's hot path)
            policy = MixedPrecisionPolicy(self.config.param_dtype, self.config.reduce_dtype)
            if custom is None and not self.config.param_dtypes and source is self.flat_shard:
                riders = extension_batch.prepare_riders(self.extension_params, lay, policy, gather_stream)
        dtype = self.unsharded_dtype if self.config.param_dtypes is None else self.orig_dtype
        if self.config.compute_shard_on_device and source is self.flat_shard:
            source = self._device_copy.refresh(source, dtype, self.config.device, gather_stream, self._shard_versions())
        pending = start_gather(
            self.flat_params, source, group, rank, lay.shard_world, self.flat_shard.numel(), dtype, self.config.device,
            streams, direct, custom, riders,
        )  # fmt: skip
        self._pending_gather = pending  # first: waited for even if an extension gather below raises
        if riders is not None:
            self._extension_gathers = riders.pending
        elif self.extension_params:
            coalesced = bool(self._coalesced_gather_ok)
            self._extension_gathers = extension_batch.start_alone(
                self.extension_params, lay, policy, coalesced, gather_stream
            )

    def _refill_replica(self) -> None:
        """Replicated group, no gather: cast (or copy back from the CPU) the shard into the
        persistent replica buffer that the unsharded parameters are views of. On the current
        stream: the buffer is allocated and freed there too, so no cross-stream lifetime
        arises, and nothing could overlap this copy anyway (the forward needs it next)."""
        versions = self._shard_versions() if self.config.compute_shard_on_device else None
        alive = self._replica_flat is not None and not is_freed(self._replica_flat)
        if versions is not None and alive and self._device_copy.holds(versions):
            self._pending_gather = None  # the replica kept on the device still holds these values
            return
        replica = self._grow_replica_flat()
        if versions is not None:
            self._device_copy.mark(versions)
        # Refilling with the same values is not a mutation autograd should see (a second
        # forward before backward would otherwise invalidate the first one's graph).
        with comm.refilling(replica):
            replica.copy_(self.flat_shard, non_blocking=True)
        self._pending_gather = None

    def _grow_replica_flat(self) -> torch.Tensor:
        """The replica buffer, created on first use (and after a dtype change), its storage
        re-grown after `reshard` freed it."""
        n, dtype, device = self.flat_shard.numel(), self.unsharded_dtype, self.config.device
        replica = self._replica_flat
        if replica is None or replica.dtype != dtype or replica.device != device:
            replica = self._replica_flat = torch.empty(n, dtype=dtype, device=device)
        elif replica.untyped_storage().size() != n * replica.element_size():
            replica.untyped_storage().resize_(n * replica.element_size())
        return replica

    def _point_unsharded_at(self, flat: torch.Tensor) -> None:
        for mp in self.params:
            mp.alias_unsharded(flat)

    @labelled("composable::wait_for_unshard")
    def wait_for_unshard(self) -> None:
        if self.state is not GroupState.UNSHARDING:
            return
        if self._unsharded_aliases_shard:
            self._point_unsharded_at(self.flat_shard)
        elif not self.layout.sharded:
            self._point_unsharded_at(cast(torch.Tensor, self._replica_flat))  # made by `_refill_replica`
        else:
            world, dtypes, pending = self.layout.shard_world, self.config.param_dtypes, self._pending_gather
            assert pending is not None  # a sharded group's unshard started its gather
            finish_gather_mixed(pending, self.flat_params, dtypes, world, self.config.device, self.streams)
            extension.finish_gathers(self.extension_params, self._extension_gathers, world, self.dtypes.param_dtype)
            self._extension_gathers = []
        self._pending_gather = None
        self.state = GroupState.UNSHARDED
        self._register_unsharded()

    @labelled("composable::reshard")
    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage."""
        self._post_forward_shard = None
        self._kept_versions = None
        if self.state is GroupState.UNSHARDING:
            self.wait_for_unshard()
        if self.state is GroupState.SHARDED:
            return
        for mp in self.params:
            mp.register(mp.sharded)
        if not self.keep_unsharded_storage:
            if not self._unsharded_aliases_shard and not (
                self.config.compute_shard_on_device and not self.layout.sharded
            ):
                free_storages(self.flat_params, self.streams)
            extension.free(self.extension_params)
        self.state = GroupState.SHARDED
        self._unsharded_registered = False

    # -- gradients --------------------------------------------------------------------------
    def has_unsharded_grads(self) -> bool:
        return any(self.reducer.has_grads(mp) for mp in self.params)

    def stash_grads(self) -> None:
        """No-sync backward: keep the unsharded gradients for a later reduction (see
        `GradReducer.stash`)."""
        self.reducer.stash()

    @labelled("composable::reduce_grads")
    def reduce_grads(self) -> None:
        """Launch the reduction of the accumulated unsharded gradients (asynchronously)."""
        self.reducer.launch()

    @labelled("composable::finish_reduce")
    def finish_reduce(self) -> None:
        """Wait for launched reductions and accumulate them into the sharded gradients."""
        self.reducer.finish()
