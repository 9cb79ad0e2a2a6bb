"""The benchmark's optimizers (`--optimizer`): fused AdamW, or Muon on the blocks' hidden matrices
beside fused AdamW on the rest (embeddings, head, norms: the usual split).

- `muon`: `composable.optim.Muon`, each matrix orthogonalized whole by one owner rank.
- `muon-gathered`: the simplest correct Muon over sharded parameters, the baseline: every matrix
  gathered whole on every rank and orthogonalized there (each rank does all the Newton-Schulz work).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from composable.optim import Muon

OPTIMIZERS = ("adamw", "muon", "muon-gathered")
MUON_LR = 0.02


class Optimizers:
    """Several optimizers stepped as one (the step function calls `step` and `zero_grad`)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def clear_state(self) -> None:
        for opt in self.optimizers:
            opt.state.clear()


class GatheredMuon(torch.optim.Muon):
    """Muon with every matrix gathered whole on every rank (`full_tensor`), orthogonalized there,
    and this rank's part taken back: correct, at world times the Newton-Schulz FLOPs."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                if isinstance(update, DTensor):
                    whole = _zeropower_via_newtonschulz(
                        update.full_tensor(), group["ns_coefficients"], group["ns_steps"], group["eps"]
                    )
                    mesh, placements = update.device_mesh, update.placements
                    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim)
                    update = replicated.redistribute(mesh, placements)
                else:
                    update = _zeropower_via_newtonschulz(
                        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
                    )
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], param.shape))


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A 2D weight inside a block (`layers.`): what Muon steps."""
    return param.ndim == 2 and ".layers." in f".{name}"


def build_optimizer(model: nn.Module, kind: str, lr: float, graphed: bool) -> Any:
    """The contender's optimizer(s) for `--optimizer kind`."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=graphed)
    hidden = [p for n, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not is_hidden_matrix(n, p)]
    muon = (Muon if kind == "muon" else GatheredMuon)(hidden, lr=MUON_LR, weight_decay=0.01)
    return Optimizers(muon, torch.optim.AdamW(rest, lr=lr, fused=True))
