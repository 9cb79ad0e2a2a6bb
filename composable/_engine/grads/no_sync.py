"""No-sync micro-steps (`no_sync`, `set_requires_gradient_sync(False)`): where a group keeps
the gradients it does not reduce yet, out of the user's sight, and how `zero_grad` discards
them. Part of `GradReducer` (`reduce.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..params.param import ManagedParam


class NoSyncSums:
    """Stashing of unreduced gradient sums between synced backwards (mixed into `GradReducer`)."""

    spec: Any  # the reducer's `ReduceSpec` (reduce.py imports this file, not the other way)
    params: list["ManagedParam"]
    _holds_no_sync_sums: bool

    def _grad_params(self) -> list["ManagedParam"]:
        return [mp for mp in self.params if mp.wants_grad]

    def stash(self) -> None:
        """No-sync backward: accumulate the unsharded gradients in the reduce dtype where it is
        wider than the compute dtype (bf16 compute, fp32 reduce), as PyTorch FSDP2 does, so the
        sum over micro-steps is not rounded to bf16 each time (at the price of holding a wider
        gradient). Otherwise they simply stay in `.grad`, where autograd accumulates them.
        Either way they are out of the user's sight: a visible sharded `.grad` stands for them
        (`ManagedParam.mark_visible_grad`), and `zero_grad` on it discards them."""
        if not self.spec.layout.sharded:
            self._stash_as_visible_grads()
            return
        self.drop_discarded_sums()
        dtype = self.spec.dtypes.reduce
        widen = dtype.itemsize > self.spec.dtypes.unsharded.itemsize
        for mp in self._grad_params():
            up = mp.unsharded_param
            if widen and up is not None and up.grad is not None:
                acc = mp.stashed_grad
                mp.stashed_grad = up.grad.to(dtype) if acc is None else acc.add_(up.grad)
                up.grad = None
            if mp.stashed_grad is not None or (up is not None and up.grad is not None):
                mp.mark_visible_grad()
                self._holds_no_sync_sums = True

    def _stash_as_visible_grads(self) -> None:
        """Replicated groups (replicate, NO_SHARD), as in DDP: during no_sync the locally
        accumulated gradient is the parameter's visible `.grad` (in the parameter's dtype), so
        `zero_grad` discards it and the next synced backward reduces whatever is left there.
        Gradients already reduced are equal on every rank, so reducing them again with the
        new local ones leaves them unchanged: accumulation across steps stays right."""
        for mp in self._grad_params():
            up = mp.unsharded_param
            if up is None or up.grad is None:
                continue
            grad, up.grad = up.grad, None
            sp = mp.sharded
            mp.add_to_sharded_grad(grad.to(device=sp._local_tensor.device, dtype=sp.dtype))
            mp.grad_is_unreduced = True

    def drop_discarded_sums(self) -> None:
        """Sharded groups: forget the no-sync sums of every parameter whose visible `.grad`
        was cleared, replaced or zeroed since they were stashed (`optimizer.zero_grad()`,
        either `set_to_none`). Called before a backward adds to them and before they are
        reduced; free when nothing is stashed."""
        if not self._holds_no_sync_sums:
            return
        for mp in self.params:
            if mp.grad_marker is not None and mp.grad_was_discarded():
                mp.stashed_grad, mp.grad_marker = None, None
                if mp.unsharded_param is not None:
                    mp.unsharded_param.grad = None
