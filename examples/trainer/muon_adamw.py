"""Muon on the blocks' hidden matrices and AdamW on the rest, as one optimizer.

Muon is meant for the hidden weight matrices; embeddings, the output head and the norms' gains
keep AdamW (the split Muon's authors, Moonlight and torchtitan use). Two optimizers would each
need their own place in a training loop: the learning-rate schedule, gradient clipping's
unscale, the scaler's step and the checkpoint. `MuonAdamW` is one `torch.optim.Optimizer` whose
`param_groups` are the Muon groups followed by the AdamW groups and whose `state` holds both, so
`get_state_dict`, `ShardedGradScaler` and a schedule that sets every group's lr see one optimizer.

The learning rate is AdamW's for both: Muon's groups use `adjust_lr_fn="match_rms_adamw"`
(Moonlight's scaling, which gives Muon's update the RMS of AdamW's), so one schedule and one
weight decay serve every parameter. For a CUDA graph (train_step.py) the lr is one tensor both
read, changed in place, and AdamW is capturable.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from composable.optim import Muon


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A weight matrix inside a block (`layers.`, the model's list of blocks), or a stack of them
    (a mixture of experts' 3D weights, one matrix per expert): what Muon steps."""
    return param.ndim in (2, 3) and ".layers." in f".{name}"


class MuonAdamW(torch.optim.Optimizer):
    """`muon_class` (default `composable.optim.Muon`) over `muon_groups`, `torch.optim.AdamW` over
    `adamw_groups`, stepped, zeroed, saved and loaded as one optimizer. `lr` (a float, or a
    one-element tensor both take) and `weight_decay` are every group's defaults (a group may set
    its own); `betas`, `eps`, `fused` and `capturable` are AdamW's."""

    def __init__(
        self,
        muon_groups: list[dict[str, Any]],
        adamw_groups: list[dict[str, Any]],
        *,
        lr: float | torch.Tensor,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused: bool | None = None,
        capturable: bool = False,
        muon_class: type[torch.optim.Optimizer] = Muon,
    ) -> None:
        self.muon = muon_class(muon_groups, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(
            adamw_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused, capturable=capturable
        )
        # Optimizer's own set-up (its hooks and state); the groups are then the two optimizers' own.
        super().__init__([p for g in self._inner_groups() for p in g["params"]], {"lr": lr})
        self.param_groups = self._inner_groups()
        self._share()

    def _inner_groups(self) -> list[dict[str, Any]]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    def _share(self) -> None:
        """The inner optimizers read this optimizer's groups and state (the same objects)."""
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Optimizer.load_state_dict replaces the group dicts and the state: the inner optimizers
        # must read the new ones.
        super().load_state_dict(state_dict)
        self._share()


def build_muon_adamw(
    model: nn.Module, lr: float, weight_decay: float, fused: bool | None = None, muon_class: type | None = None
) -> MuonAdamW:
    """Muon on the model's hidden matrices, AdamW on the rest: weight decay on the matrices
    (embeddings and head included), none on the gains (1D)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    decay = [p for n, p in named if not is_hidden_matrix(n, p) and p.ndim >= 2]
    gains = [p for n, p in named if p.ndim < 2]
    adamw_groups = [{"params": decay}, {"params": gains, "weight_decay": 0.0}]
    return MuonAdamW(
        [{"params": hidden}],
        [g for g in adamw_groups if g["params"]],
        lr=lr,
        weight_decay=weight_decay,
        fused=fused,
        muon_class=muon_class or Muon,
    )
