"""The benchmark's optimizers (`--optimizer`): fused AdamW, or Muon on the blocks' hidden matrices
beside fused AdamW on the rest (embeddings, head, norms: the usual split), as one optimizer
(examples/trainer/muon_adamw.py, the main job's `--optimizer muon`).

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
from trainer.muon_adamw import build_muon_adamw

OPTIMIZERS = ("adamw", "muon", "muon-gathered")


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


def build_optimizer(model: nn.Module, kind: str, lr: float, graphed: bool) -> torch.optim.Optimizer:
    """The contender's optimizer for `--optimizer kind`."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=graphed)
    return build_muon_adamw(
        model, lr, weight_decay=0.01, fused=True, muon_class=Muon if kind == "muon" else GatheredMuon
    )
