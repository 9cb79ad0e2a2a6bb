"""No-sync micro-steps (`no_sync`, `set_requires_gradient_sync(False)`): where a group keeps
the gradients it does not reduce yet, out of the user's sight, and how `zero_grad` discards
them. A `GradReducer` (`reduce.py`) holds one `NoSyncSums` for its group."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..meshes.layout import DataParallelLayout
    from ..params.param import ManagedParam
    from .grad_dtype import GroupDtypes


class NoSyncSums:
    """A group's unreduced gradient sums between synced backwards."""

    def __init__(self, params: list["ManagedParam"], layout: "DataParallelLayout", dtypes: "GroupDtypes") -> None:
        self.params = params
        self.layout = layout
        self.dtypes = dtypes  # the group's own, updated in place by `module.half()`
        self.held = False  # sharded groups: sums are stashed (`drop_discarded` has work to do)

    def stash(self) -> None:
        """No-sync backward: accumulate the unsharded gradients in the reduce dtype where it is
        wider than the compute dtype (bf16 compute, fp32 reduce), as PyTorch FSDP2 does, so the
        sum over micro-steps is not rounded to bf16 each time (at the price of holding a wider
        gradient). Otherwise they simply stay in `.grad`, where autograd accumulates them.
        Either way they are out of the user's sight: a visible sharded `.grad` stands for them
        (`ManagedParam.mark_visible_grad`), and `zero_grad` on it discards them."""
        if not self.layout.sharded:
            self._stash_as_visible_grads()
            return
        self.drop_discarded()
        dtype = self.dtypes.reduce
        widen = dtype.itemsize > self.dtypes.unsharded.itemsize
        for mp in self.params:
            if not mp.wants_grad:
                continue
            up = mp.unsharded_param
            if widen and up is not None and up.grad is not None:
                acc = mp.stashed_grad
                mp.stashed_grad = up.grad.to(dtype) if acc is None else acc.add_(up.grad)
                up.grad = None
            if mp.stashed_grad is not None or (up is not None and up.grad is not None):
                mp.mark_visible_grad()
                self.held = True

    def _stash_as_visible_grads(self) -> None:
        """Replicated groups (replicate, NO_SHARD), as in DDP: during no_sync the locally
        accumulated gradient is the parameter's visible `.grad` (in the parameter's dtype), so
        `zero_grad` discards it and the next synced backward reduces whatever is left there.
        Gradients already reduced are equal on every rank, so reducing them again with the
        new local ones leaves them unchanged: accumulation across steps stays right."""
        for mp in self.params:
            up = mp.unsharded_param
            if not mp.wants_grad or up is None or up.grad is None:
                continue
            grad, up.grad = up.grad, None
            sp = mp.sharded
            mp.add_to_sharded_grad(grad.to(device=sp._local_tensor.device, dtype=sp.dtype))
            mp.grad_is_unreduced = True

    def drop_discarded(self) -> None:
        """Sharded groups: forget the no-sync sums of every parameter whose visible `.grad`
        was cleared, replaced or zeroed since they were stashed (`optimizer.zero_grad()`,
        either `set_to_none`). Called before a backward adds to them and before they are
        reduced; free when nothing is stashed."""
        if not self.held:
            return
        for mp in self.params:
            if mp.grad_marker is not None and mp.grad_was_discarded():
                mp.stashed_grad, mp.grad_marker = None, None
                if mp.unsharded_param is not None:
                    mp.unsharded_param.grad = None

    def hand_over(self) -> None:
        """A synced backward's reduction takes the sums (`GradReducer._take_grads`): what is
        left of them, after `drop_discarded`, is no longer shown by the visible `.grad`s."""
        if self.held:
            self.held = False
            for mp in self.params:
                mp.grad_marker = None

    def discard(self) -> None:
        """Forget every sum (an aborted iteration): the stashed ones and, for replicated
        groups, the local sums shown as the visible `.grad`."""
        self.held = False
        for mp in self.params:
            mp.stashed_grad, mp.grad_marker = None, None
            if mp.take_grad_is_unreduced():  # replicated no-sync: the visible `.grad` holds local sums
                mp.sharded.grad = None
