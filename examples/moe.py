"""A mixture-of-experts feed-forward for model.py (`ModelConfig.n_experts > 0`): a router picks
`top_k` of `n_experts` SwiGLU experts per token, whose outputs are summed with the router's
renormalised weights.

The experts' weights are stacked (`GroupedExperts.w1` is (experts, ffn, dim)), so data
parallelism shards the expert dim and expert parallelism splits it: `GroupedExperts.split`
makes the weights DTensors `Shard(0)` on an expert-parallel mesh (this rank keeps its experts;
state dicts and checkpoints see every expert); the forward then all-gathers the group's tokens, runs the local experts on the tokens routed to them and reduce-scatters the
partial outputs back (differentiable collectives, so backward does the reverse). A local
expert's gradient then sums the losses of the whole group's batches, so it is scaled by
1 / group size: data parallelism's average over the other ranks (edp) then gives the average
over every rank's batch, as for the dense weights, with no custom divide factor (which
FSDP2 cannot apply on gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert-parallel weight (differentiable), the weight itself otherwise."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """`n` SwiGLU experts; `forward(tokens (N, dim), gates (N, n_experts))` -> (N, dim)."""

    def __init__(self, n: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, ffn_dim))
        self.ep_group: dist.ProcessGroup | None = None  # expert parallelism: see `split`

    @torch.no_grad()
    def split(self, mesh: DeviceMesh) -> None:
        """Expert parallelism over the 1D `mesh`: every weight becomes a DTensor `Shard(0)` on
        it, this rank keeping its `n / size` consecutive experts."""
        size, rank, n = mesh.size(), mesh.get_local_rank(), self.w1.shape[0]
        if n % size:
            raise ValueError(f"GroupedExperts.split: {size} expert-parallel ranks must divide the {n} experts")
        local = slice(rank * n // size, (rank + 1) * n // size)
        for name in ("w1", "w3", "w2"):
            weight = getattr(self, name)[local].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(weight, mesh, (Shard(0),), run_check=False)))
        self.ep_group = mesh.get_group()

    def forward(self, tokens: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        group, w1, w3, w2 = self.ep_group, *(_local(w) for w in (self.w1, self.w3, self.w2))
        if group is not None:  # every rank's tokens through this rank's experts
            size, rank, n = dist.get_world_size(group), dist.get_rank(group), w1.shape[0]
            tokens = funcol.all_gather_tensor_autograd(tokens, 0, group)
            gates = funcol.all_gather_tensor_autograd(gates, 0, group)[:, rank * n : (rank + 1) * n]
            w1, w3, w2 = (_ScaleGrad.apply(w, 1.0 / size) for w in (w1, w3, w2))
        out = torch.zeros_like(tokens)
        for e in range(w1.shape[0]):
            idx = gates[:, e].nonzero().squeeze(-1)
            x = tokens[idx]
            h = F.silu(x @ w1[e].T) * (x @ w3[e].T)
            out = out.index_add(0, idx, (h @ w2[e].T) * gates[idx, e, None])
        if group is not None:
            out = funcol.reduce_scatter_tensor_autograd(out, "sum", 0, group)
        return out


class MoEFeedForward(nn.Module):
    """Router (`nn.Linear(dim, n_experts)`) + `GroupedExperts`; top-k gates renormalised to 1."""

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]  # model.ModelConfig
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = self.router(tokens).float().softmax(-1)
        top, idx = scores.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(scores).scatter(-1, idx, top / top.sum(-1, keepdim=True)).to(x.dtype)
        return self.experts(tokens, gates).view_as(x)
