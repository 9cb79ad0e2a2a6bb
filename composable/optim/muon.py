"""Muon over sharded parameters: each matrix orthogonalized whole, by one rank.

Muon's update is elementwise except for one step: Newton-Schulz orthogonalizes the (Nesterov)
momentum of each weight matrix, and that needs the whole matrix. `torch.optim.Muon` run on the
row shards `fully_shard` leaves on each rank orthogonalizes each rank's rows on their own, which
is not Muon's update. Here the elementwise steps run on the local shards (the same arithmetic on
the same elements as one process), and each matrix goes whole to one owner rank
(`_whole_matrices.map_whole_matrices`), which runs torch's own Newton-Schulz on it: the same
function, on the same whole matrix, as `torch.optim.Muon` on one process, so the same bits.

The rows travel in bfloat16: Newton-Schulz's first step is `.bfloat16()` of its input, so
converting each element before sending gives the owner the very tensor it would make itself, at
half the bytes; it computes and returns in bfloat16 too. The Nesterov step is written straight
into the send buffer (`_Update.write`). Plain tensors take torch's path.

`lr` may be a one-element tensor, as for torch's capturable optimizers: a schedule changes it in
place and a CUDA graph (`composable.graphed_step`) reads it at every replay. The step then reads
nothing on the host: the weight decay factor and each matrix's adjusted lr are device tensors, in
forms that round as the float lr's scalar arguments do (`_apply_tensor_lr`), so a tensor lr steps
fp32 parameters bit for bit as the float it holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Muon as TorchMuon
from torch.optim import Optimizer
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

from .._engine.params.wrappers import local_tensor
from ._whole_matrices import map_whole_matrices

__all__ = ["Muon"]


class Muon(TorchMuon):
    """`torch.optim.Muon` (same arguments, defaults, state and state dict) whose step gives every
    parameter exactly the update one process would: for a parameter sharded by `fully_shard`, the
    Newton-Schulz orthogonalization of the whole momentum matrix, bit for bit with
    `torch.optim.Muon` on one process fed the same gradients. The momentum buffers are sharded as
    their parameters (DTensors), so checkpoints save and load them as any optimizer state.

    Build it after sharding, from the parameters the model shows (2D hidden matrices; embeddings,
    head and norms usually go to AdamW), as any optimizer. A 3D parameter is a stack of matrices
    along dim 0 (a mixture of experts' weights, one matrix per expert): each is stepped as
    `torch.optim.Muon` steps a 2D parameter of that matrix's shape. Other shapes: `ValueError`.

    `lr` may be a one-element tensor on the parameters' device, changed in place by a schedule:
    the step then never reads it on the host, so it runs inside `composable.graphed_step`, and
    steps fp32 parameters bit for bit as the float the tensor holds."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        # torch.optim.Muon's arguments, defaults and checks, but for the shapes: it takes 2D alone.
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"Muon: a tensor 'lr' must have one element, got {lr.numel()}")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not float(value) >= 0.0:
                raise ValueError(f"Muon: '{name}' must be >= 0, got {value}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(
                f"Muon: 'adjust_lr_fn' must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        Optimizer.__init__(self, params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon: parameters must be matrices (2D) or stacks of them (3D), got one of shape {tuple(p.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            # Elementwise steps on the local tensors: the same kernels as one process runs, on the
            # same elements, without DTensor's dispatch on the host for each op of each parameter.
            momentum, lr = group["momentum"], group["lr"]
            updates = []
            for grad, buf in zip(grads, bufs):
                grad, buf = local_tensor(grad), local_tensor(buf)
                buf.lerp_(grad, 1 - momentum)
                updates.append(_Update(grad, buf, momentum if group["nesterov"] else None))
            coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]

            def newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
                return _zeropower_via_newtonschulz(matrix, coefficients, steps, eps)  # noqa: B023

            ortho = map_whole_matrices(newton_schulz, updates, params, wire_dtype=torch.bfloat16)
            if isinstance(lr, torch.Tensor):
                _apply_tensor_lr(params, ortho, lr, group["weight_decay"], group["adjust_lr_fn"])
                continue
            lr = float(lr)
            for param, update in zip(params, ortho):
                adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape[-2:])
                local = local_tensor(param)
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(update, alpha=-adjusted_lr)
        return loss


def _apply_tensor_lr(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    lr: torch.Tensor,
    weight_decay: float,
    adjust_lr_fn: str | None,
) -> None:
    """The float lr's `mul_(1 - lr * wd)` and `add_(update, alpha=-adjusted_lr)` with `lr` a
    one-element tensor, never read on the host.

    The float path computes `1 - lr * wd` and `lr * ratio` (`_adjust_lr`'s ratio, from the shape
    alone) in Python doubles, which its kernels convert to fp32. Here the same doubles are fp64
    device tensors (an fp32 lr is exact in fp64), 0-dim so that they take no part in type
    promotion: an fp32 kernel converts them to fp32 as it converts a scalar. `add_(update,
    alpha=a)` computes `param + a * update` as one fused multiply-add (CUDA's compiler contracts
    it, the CPU's vectorized kernel calls fmadd); `addcmul_(update, t)`, value 1, is one fused
    multiply-add as well (on CUDA an explicit `fma`), where `update * t` then an add would round
    twice. So fp32 and fp64 parameters get the float path's bits.

    Other dtypes step through fp32 copies, rounded back after each op: CUDA's bf16 and fp16
    kernels compute in fp32 with the scalar in fp32, but would convert a tensor argument to the
    parameter's dtype first. (The CPU's bf16 `add_` rounds its alpha to bf16; there a bf16
    parameter steps within rounding of the float path, not bit for bit.)"""
    per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    scaled: dict[tuple[torch.device, float], torch.Tensor] = {}
    for param, update in zip(params, updates):
        local = local_tensor(param)
        device = local.device
        if device not in per_device:
            lr64 = lr.detach().to(device=device, dtype=torch.float64).reshape(())
            per_device[device] = lr64, 1 - lr64 * weight_decay
        lr64, decay = per_device[device]
        ratio = _adjust_lr(1.0, adjust_lr_fn, param.shape[-2:])
        if (device, ratio) not in scaled:
            scaled[device, ratio] = lr64 * -ratio
        step = scaled[device, ratio]
        if local.dtype in (torch.float32, torch.float64):
            local.mul_(decay)
            local.addcmul_(update, step)
        else:  # each op rounded to the parameter's dtype, as its own kernel rounds
            local.copy_(local.float().mul_(decay))
            local.copy_(local.float().addcmul_(update, step))


class _Update:
    """The matrix Newton-Schulz takes for one parameter's local part: the Nesterov momentum
    `grad.lerp(buf, momentum)`, or the momentum `buf` itself. Written straight into the
    owners' bfloat16 send buffer, the lerp rounds its fp32 result once, as `.bfloat16()` of the
    fp32 tensor does: the same bits without the fp32 tensor in between."""

    def __init__(self, grad: torch.Tensor, buf: torch.Tensor, nesterov_momentum: float | None) -> None:
        self.grad, self.buf, self.nesterov_momentum = grad, buf, nesterov_momentum
        self.shape, self.device = buf.shape, buf.device

    def tensor(self) -> torch.Tensor:
        if self.nesterov_momentum is None:
            return self.buf
        return self.grad.lerp(self.buf, self.nesterov_momentum)

    def write(self, out: torch.Tensor) -> None:
        if self.nesterov_momentum is None:
            out.copy_(self.buf)
        else:
            torch.lerp(self.grad, self.buf, self.nesterov_momentum, out=out)
