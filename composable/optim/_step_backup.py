"""`StepBackup`: what an optimizer step overwrites, kept so that the step can be taken back.

`step_in_backward` with clipping steps each group before the gradient norm is known, as if no
clipping were needed; when the norm says otherwise, the parameters and their optimizer state are
put back as they were before that step, and the step is taken again with the clipped gradients.
Put back means the same bits: each parameter's local values and every state value (tensors
copied, numbers kept; state that did not exist yet is removed again, so the next step makes it
as the first one did). The buffers are made on first use and reused every step: the host memory
is one more copy of the parameters and their state, the time a copy of them.
"""

from __future__ import annotations

from typing import Any

import torch

from .._engine.params.wrappers import local_tensor


class StepBackup:
    """Per parameter: its values and its optimizer state before the last speculative step."""

    def __init__(self) -> None:
        self._params: dict[int, torch.Tensor] = {}  # id(param) -> a copy of its local values
        self._state: dict[int, dict[str, Any] | None] = {}  # id(param) -> its state's copy; None: it had none

    @torch.no_grad()
    def save(self, params: list[torch.Tensor], state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Copy `params`' local values and their entries of `state` (the optimizer's) aside."""
        for p in params:
            self._params[id(p)] = _copy_into(self._params.get(id(p)), local_tensor(p))
            current = state.get(p)
            if not current:
                self._state[id(p)] = None
                continue
            kept = self._state.get(id(p)) or {}
            self._state[id(p)] = {
                key: _copy_into(kept.get(key), local_tensor(value)) if isinstance(value, torch.Tensor) else value
                for key, value in current.items()
            }

    @torch.no_grad()
    def restore(self, params: list[torch.Tensor], state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Put `params`' values and state back as `save` found them."""
        for p in params:
            local_tensor(p).copy_(self._params[id(p)])
            saved = self._state[id(p)]
            if saved is None:
                state.pop(p, None)
                continue
            current = state[p]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    local_tensor(current[key]).copy_(value)
                else:
                    current[key] = value


def _copy_into(buffer: torch.Tensor | None, source: torch.Tensor) -> torch.Tensor:
    """`source` copied into `buffer` (made anew when missing or of another shape or dtype)."""
    if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
        buffer = torch.empty_like(source)
    buffer.copy_(source)
    return buffer
