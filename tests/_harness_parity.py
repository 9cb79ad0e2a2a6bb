"""Training two models side by side: `step_and_match`, re-exported by `_harness`.

The loop the parity tests share (ours against PyTorch FSDP2, or any model against another with
the same parameters in the same order): after both have run backward, their gradients must
match (and their losses, when given); each optimizer steps and zeroes; then the parameters must
match. The test keeps what is its own (building the models, the batches, the losses, any check
of its own before or after)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from _harness_compare import assert_close_tensors

__all__ = ["step_and_match"]


def step_and_match(
    ours: nn.Module,
    theirs: nn.Module,
    opts: Sequence[torch.optim.Optimizer],
    tag: str,
    *,
    exact: bool = True,
    grad_tol: dict[str, float] | None = None,
    param_tol: dict[str, float] | None = None,
    same_placements: bool = False,
    grad_word: str = "grad",
    losses: tuple[torch.Tensor, torch.Tensor] | None = None,
    set_to_none: bool = True,
) -> None:
    """Gradients of ``ours`` equal those of ``theirs`` (parameters paired in order, named by
    ``ours``), then every optimizer in ``opts`` steps and zeroes its gradients, then the
    parameters are equal. ``exact``: bit for bit (``assert_close_tensors``' ``exact``);
    otherwise ``grad_tol``/``param_tol`` (``rtol``/``atol``) or torch's default tolerance.
    ``same_placements``: the DTensor parameters and their gradients also have the same
    placements on both sides. ``losses``: (ours, theirs), compared first, as the gradients are.
    ``set_to_none``: passed to each ``zero_grad``. Both models have as many parameters.
    A frozen parameter (``requires_grad`` False in ``ours``: quantized base weights) has no
    gradient on either side and is not compared after the step, which does not train it.
    Messages read ``"{tag} loss"``, ``"{tag} {grad_word} {name}"`` and ``"{tag} param {name}"``."""
    pairs = list(zip(ours.named_parameters(), theirs.parameters(), strict=True))
    if losses is not None:
        a, b = (loss.detach() for loss in losses)
        assert_close_tensors(a, b, exact=exact, msg=f"{tag} loss", **_tol(exact, grad_tol))
    frozen = [(name, p, q) for (name, p), q in pairs if not p.requires_grad]
    for name, p, q in frozen:
        assert p.grad is None and q.grad is None, f"{tag}: frozen {name} got a gradient"
    pairs = [((name, p), q) for (name, p), q in pairs if p.requires_grad]
    for (name, p), q in pairs:
        if same_placements:
            assert p.placements == q.placements, (name, p.placements, q.placements)
            assert p.grad.placements == q.grad.placements, (name, p.grad.placements, q.grad.placements)
        assert_close_tensors(p.grad, q.grad, exact=exact, msg=f"{tag} {grad_word} {name}", **_tol(exact, grad_tol))
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    for (name, p), q in pairs:
        assert_close_tensors(p, q, exact=exact, msg=f"{tag} param {name}", **_tol(exact, param_tol))


def _tol(exact: bool, tol: dict[str, float] | None) -> dict[str, Any]:
    return {} if exact or tol is None else dict(tol)
