"""A mixture-of-experts feed-forward for model.py (`ModelConfig.n_experts > 0`), as MoE models
are trained at scale: a router picks `top_k` of `n_experts` SwiGLU experts per token, tokens
are permuted so that each expert's rows are contiguous, the experts run as one grouped GEMM,
and the outputs are summed with the router's renormalised weights.

The experts' weights are stacked (`GroupedExperts.w1` is (experts, ffn, dim)), so data
parallelism shards the expert dim and expert parallelism splits it: `GroupedExperts.split`
makes the weights DTensors `Shard(0)` on an expert-parallel mesh (this rank keeps its experts;
state dicts and checkpoints see every expert). The forward then sends every routed token to
the rank that holds its expert with one all-to-all (variable split sizes: the ranks exchange
their per-expert counts first), runs the local experts, and returns the outputs with the
reverse all-to-all (differentiable: backward does the same two exchanges the other way).
A local expert's gradient then sums the losses of the whole group's batches, so it is scaled
by 1 / group size: data parallelism's average over the other ranks (edp) then gives the
average over every rank's batch, as for the dense weights, with no custom divide factor
(which FSDP2 cannot apply on gloo).

Compilation and CUDA graphs: without expert parallelism (one rank, or an expert-parallel mesh
of one) the layer has static shapes and never synchronises with the host, so it compiles into
the block's graph and can be captured. With it, the split sizes are read on the host (the
all-to-all needs them as numbers), so the dispatch, the experts and the combine run eagerly
outside the compiled region (`torch.compiler.disable`: a graph break, with plain c10d
collectives, never an AsyncCollectiveTensor crossing the compiled graph's boundary), and a
step cannot be captured in a CUDA graph (`NOT_CAPTURABLE`, which train.py's `--cuda-graph`
reports).

Fixed capacity (`ModelConfig.moe_capacity_factor` > 0, as Switch Transformer and GShard train):
each rank sends each expert at most `expert_capacity` of its routed rows, in token order; the
rest are dropped (that expert adds nothing to the token, which keeps its residual and its other
experts). Every shape is then fixed: the all-to-alls have equal splits known before the step, so
nothing is read on the host and the step can be captured in a CUDA graph. Without expert
parallelism the same rows are dropped, so a model means the same on any number of ranks.

Load balancing: `MoEFeedForward` adds the sequence-wise auxiliary loss of DeepSeek-V3
(`load_balance_loss`) to the gradients, not to the returned value (`_AddAuxGrad`), so the
model's interface and the reported loss stay the language-model loss.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

AUX_LOSS_COEF = 1e-2  # weight of the load-balancing loss, per MoE layer (Switch Transformer's)
GROUP_ALIGN = 16  # rows per expert group padded to a multiple of this for the grouped GEMM (TMA alignment)
NOT_CAPTURABLE = (
    "--moe with expert parallelism over more than one rank: the all-to-all's split sizes are read on the host, "
    "which a CUDA graph cannot capture"
)


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


class _AddAuxGrad(torch.autograd.Function):
    """Returns `out` unchanged; backward also differentiates `coef * aux` (a 0-dim loss), as if
    it had been added to the loss being differentiated."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:  # type: ignore[override]
        ctx.coef = coef
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        return grad, torch.full((), ctx.coef, dtype=torch.float32, device=grad.device), None


class _AllToAll(torch.autograd.Function):
    """c10d `all_to_all_single` of the rows of a 2D tensor with the given split sizes (rows per
    peer); backward sends the gradients back the same way, with the splits swapped."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (out_splits, in_splits), group = ctx.splits, ctx.group
        out = grad.new_empty((sum(out_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), out_splits, in_splits, group=group)
        return out, None, None, None


def _counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How many of `ids` are 0 .. n-1 (int64, on their device). Not `bincount`, which reads the
    largest id on the host."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def expert_capacity(routed_rows: int, n_experts: int, factor: float) -> int:
    """Rows each expert takes from one rank's `routed_rows` (tokens x top_k) at capacity
    `factor`: `factor` times an even share, rounded up (at least one)."""
    return max(1, math.ceil(factor * routed_rows / n_experts))


def capacity_slots(ids: torch.Tensor, n: int, capacity: int) -> torch.Tensor:
    """Each routed row's slot in a buffer of `n * capacity` rows laid out expert by expert:
    `ids[r] * capacity` plus the number of earlier rows routed to the same expert, or
    `n * capacity` (one past the end: dropped) where that number reaches `capacity`. Fixed
    shapes, no host synchronisation."""
    place = _place_in_expert(ids, _counts(ids, n))
    return torch.where(place < capacity, ids * capacity + place, n * capacity)


def _place_in_expert(ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For each row, how many earlier rows (in row order) chose the same expert; `counts` is
    `_counts(ids, n)`. Fixed shapes, no host synchronisation."""
    order = ids.argsort(stable=True)  # rows of expert 0 in row order, then expert 1, ...
    place_sorted = torch.arange(len(ids), device=ids.device) - (counts.cumsum(0) - counts)[ids[order]]
    return torch.empty_like(place_sorted).scatter_(0, order, place_sorted)


def use_grouped_mm(rows: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether `experts_forward` runs `torch._grouped_mm`: on CUDA in bf16, where the matrices'
    rows are 16-byte aligned (dim and ffn multiples of 8)."""
    return (
        hasattr(torch, "_grouped_mm")
        and rows.is_cuda
        and rows.dtype == w1.dtype == torch.bfloat16
        and rows.shape[-1] % 8 == 0
        and w1.shape[1] % 8 == 0
    )


def experts_forward(
    rows: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """SwiGLU expert `ids[i]` of the stacked weights (experts, ffn, dim) / (experts, dim, ffn)
    applied to `rows[i]`, for every row: (M, dim) -> (M, dim). Never synchronises with the host
    and keeps static shapes (M rows in, M out).

    With `use_grouped_mm`: rows are permuted by expert into groups padded to `GROUP_ALIGN`
    rows, and each weight is one `torch._grouped_mm` over the groups. Else a loop over the
    experts, each applied to every row and kept where it is the row's expert: the same
    numbers with `n_experts` times the FLOPs (the CPU and small models; a loop over
    each expert's own rows would need their counts on the host)."""
    n = w1.shape[0]
    if not use_grouped_mm(rows, w1):
        out = rows.new_zeros(rows.shape)
        for e in range(n):
            h = F.silu(rows @ w1[e].T) * (rows @ w3[e].T)
            out = torch.where((ids == e).unsqueeze(-1), h @ w2[e].T, out)
        return out
    counts = _counts(ids, n)
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = padded.cumsum(0)
    dest = _place_in_expert(ids, counts) + (ends - padded)[ids]  # row i's slot in the padded groups
    buf = rows.new_zeros((len(ids) + n * GROUP_ALIGN, rows.shape[-1])).index_copy(0, dest, rows)
    offs = ends.to(torch.int32)
    h = F.silu(torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(buf, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)[dest]


class GroupedExperts(nn.Module):
    """`n` SwiGLU experts; `forward(tokens (N, dim), weights (N, k), experts (N, k))` -> (N, dim):
    each token's chosen experts' outputs summed with its weights."""

    def __init__(self, n: int, dim: int, ffn_dim: int, capacity_factor: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, ffn_dim))
        self.n_experts = n
        self.capacity_factor = capacity_factor  # > 0: fixed capacity per expert (module docstring)
        self.ep_group: dist.ProcessGroup | None = None  # expert parallelism over > 1 rank: see `split`

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
        self.ep_group = mesh.get_group() if size > 1 else None

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        k, ids = experts.shape[-1], experts.flatten()
        slots, buffer_rows = None, 0
        if self.capacity_factor:
            capacity = expert_capacity(len(ids), self.n_experts, self.capacity_factor)
            buffer_rows = self.n_experts * capacity
            slots = capacity_slots(ids, self.n_experts, capacity)
        if self.ep_group is not None and slots is not None:
            out = _expert_parallel_fixed(tokens, slots, w1, w3, w2, buffer_rows, self.ep_group)
        elif self.ep_group is not None:
            out = _expert_parallel(tokens, ids, w1, w3, w2, self.n_experts, self.ep_group)
        else:  # token t's k rows are rows t*k .. t*k+k-1
            if slots is not None:  # at fixed capacity the same rows are dropped, as a zero weight
                weights = weights * (slots < buffer_rows).view_as(weights)
            rows = tokens.unsqueeze(1).expand(-1, k, -1).reshape(-1, tokens.shape[-1])
            out = experts_forward(rows, ids, w1, w3, w2)
        return (out.view(-1, k, out.shape[-1]) * weights.unsqueeze(-1).to(out.dtype)).sum(1)


@torch.compiler.disable  # data-dependent sizes read on the host: eager, between compiled graphs
def _expert_parallel(
    tokens: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    n: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """`experts_forward` of the (N * k) routed rows (row r is token r // k for expert ids[r])
    where this rank holds experts `rank * n / size ..` of `n` (w1 etc. are its own): rows sorted
    by expert go to their experts' ranks (all-to-all), through the local experts, and back."""
    size, k = dist.get_world_size(group), len(ids) // len(tokens)
    local = n // size
    order = ids.argsort(stable=True)  # grouped by destination rank, then expert
    counts = _counts(ids, n)
    received = torch.empty_like(counts)  # (size, local): from each rank, rows per local expert
    dist.all_to_all_single(received, counts, group=group)
    in_splits = counts.view(size, local).sum(1).tolist()
    out_splits = received.view(size, local).sum(1).tolist()
    rows = _AllToAll.apply(tokens[order // k], out_splits, in_splits, group)
    local_ids = torch.arange(local, device=ids.device).repeat(size)
    local_ids = local_ids.repeat_interleave(received, output_size=sum(out_splits))
    w1, w3, w2 = (_ScaleGrad.apply(w, 1.0 / size) for w in (w1, w3, w2))
    back = _AllToAll.apply(experts_forward(rows, local_ids, w1, w3, w2), in_splits, out_splits, group)
    return back.new_empty(back.shape).index_copy(0, order, back)


@torch.compiler.disable  # plain c10d all-to-alls, between compiled graphs (as `_expert_parallel`)
def _expert_parallel_fixed(
    tokens: torch.Tensor,
    slots: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    buffer_rows: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """`_expert_parallel` at fixed capacity: routed row r (token r // k) goes to slot
    `slots[r]` of a buffer of `buffer_rows` (= experts x capacity) rows laid out expert by
    expert, so rank j's experts are the buffer's j-th equal part; one all-to-all with equal
    splits sends each part to its rank, the local experts run on the received rows (empty
    slots are zero rows, whose outputs are zero), and the reverse all-to-all brings the outputs
    back to the same slots. Dropped rows (slot `buffer_rows`) get zero."""
    size, k = dist.get_world_size(group), len(slots) // len(tokens)
    part = buffer_rows // size  # one rank's experts' slots
    rows = tokens.repeat_interleave(k, dim=0)
    # One spare row past the end takes the dropped rows (summed there, then cut off).
    send = rows.new_zeros((buffer_rows + 1, rows.shape[-1])).index_add(0, slots, rows)[:buffer_rows]
    splits = [part] * size
    received = _AllToAll.apply(send, splits, splits, group)  # from each rank: its rows for my experts
    local, capacity = w1.shape[0], part // w1.shape[0]
    local_ids = torch.arange(local, device=slots.device).repeat_interleave(capacity).repeat(size)
    w1, w3, w2 = (_ScaleGrad.apply(w, 1.0 / size) for w in (w1, w3, w2))
    back = _AllToAll.apply(experts_forward(received, local_ids, w1, w3, w2), splits, splits, group)
    return torch.cat([back, back.new_zeros((1, back.shape[-1]))]).index_select(0, slots)


def load_balance_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences: for each sequence,
    sum over experts of f_e * P_e, where f_e is the fraction of its routed slots that chose
    expert e times `n_experts` (1 everywhere when balanced) and P_e the mean router
    probability of e. Per sequence, so the mean over data-parallel ranks' batches is the
    loss of the whole batch. `scores` (B, S, E) softmax probabilities, `experts` (B, S, k)."""
    b, s, n = scores.shape
    chosen = experts.reshape(b, -1)
    counts = torch.zeros(b, n, device=scores.device).scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float))
    return ((counts * n / chosen.shape[1]) * scores.mean(1)).sum(-1).mean()


class MoEFeedForward(nn.Module):
    """Router (`nn.Linear(dim, n_experts)`) + `GroupedExperts`; top-k gates renormalised to 1.
    In training, backward adds `aux_loss_coef * aux_grad_scale * load_balance_loss` to the
    loss being differentiated (`set_aux_grad_scale`)."""

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]  # model.ModelConfig
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.ffn_dim, cfg.moe_capacity_factor)
        self.aux_loss_coef = AUX_LOSS_COEF
        self.aux_grad_scale: float | torch.Tensor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = self.router(tokens).float().softmax(-1)
        top, experts = scores.topk(self.top_k, dim=-1)
        out = self.experts(tokens, top / top.sum(-1, keepdim=True), experts).view_as(x)
        if self.training and self.aux_loss_coef and torch.is_grad_enabled():
            aux = load_balance_loss(scores.view(*x.shape[:-1], -1), experts.view(*x.shape[:-1], -1))
            out = _AddAuxGrad.apply(out, aux * self.aux_grad_scale, self.aux_loss_coef)
        return out


def set_aux_grad_scale(model: nn.Module, scale: float | torch.Tensor) -> bool:
    """Scale every MoE layer's load-balancing gradient by `scale`, the factor the language-model
    loss is multiplied by before its backward (1 / micro-batches; times a loss scaler's scale).
    A tensor is copied into the one the layer kept from the first call (a CUDA graph reads
    it at every replay, and a compiled block sees the same tensor). Whether `model` has any."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    for layer in layers:
        if isinstance(scale, torch.Tensor) and isinstance(layer.aux_grad_scale, torch.Tensor):
            layer.aux_grad_scale.copy_(scale)
        else:
            layer.aux_grad_scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else scale
    return bool(layers)
