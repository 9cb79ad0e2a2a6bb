"""Training helpers shared by several test files; the small models live in `_models.py`.

- Step-by-step comparison with a single-process reference (`train_step`, `lm_steps`): every
  rank trains on different data, the reference on the concatenation of all ranks' data; the
  rank-averaged loss, every gradient (including which ones are None) and every parameter
  after every optimizer step (`full_tensor()` of the DTensors) must agree. Every rank builds
  the reference itself from the shared seed, so nothing but the losses needs communicating.
- Sharding a TinyTransformer per block + root, and inspecting the resulting states.
- The model, sharding and state-dict helpers of the state-dict and DCP tests (`TiedNet`).

Functions that communicate run on the ranks (inside a `run_on_ranks` worker).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors
from _models import Block, TinyTransformer, batch_for, lm_loss
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from composable import MixedPrecisionPolicy, ShardingStrategy, fully_shard

# fp32 on CPU: the only difference to the reference is the order of the gradient summation.
TOL = dict(rtol=1e-5, atol=1e-6)
TIMEOUT = 60.0
STEPS = 3

# fully_shard param_names of a TinyTransformer sharded per block + root.
BLOCK_PARAMS = [n for n, _ in Block(10, 2).named_parameters()]
ROOT_PARAMS = ["tok.weight", "pos.weight", "norm.weight", "norm.bias"]


# ----------------------------------------------------------------------------- sharding


def shard_transformer(
    model: TinyTransformer, layer_mp: MixedPrecisionPolicy | None = None, **options: Any
) -> TinyTransformer:
    """Per-block groups plus a root group (embeddings, final norm), as users wrap LMs; every
    call gets `options`, and the blocks get `layer_mp` as their mp_policy where given."""
    layer_options = options if layer_mp is None else {**options, "mp_policy": layer_mp}
    for layer in model.layers:
        fully_shard(layer, **layer_options)
    return fully_shard(model, **options)


def states(model: nn.Module) -> dict[str, list[str]]:
    """{module FQN: its fully_shard param_names} for every module with a state."""
    return {
        name: fully_shard.state(m).param_names for name, m in model.named_modules() if fully_shard.state(m) is not None
    }


def registered(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every registered parameter slot (tied ones under each name)."""
    return dict(model.named_parameters(remove_duplicate=False))


def assert_sharded_registered(model: nn.Module, expected: dict[str, nn.Parameter], tag: str) -> None:
    """The registered parameters are exactly the sharded DTensors (same objects as before)."""
    now = registered(model)
    assert now.keys() == expected.keys()
    for name, p in now.items():
        assert p is expected[name], f"{tag}: {name} is a {type(p).__name__}, not the sharded parameter"


def reference_of(model: TinyTransformer, full: dict[str, torch.Tensor]) -> TinyTransformer:
    """A plain TinyTransformer like `model` holding the parameter values `full`."""
    ref = TinyTransformer(layers=len(model.layers)).to(model.tok.weight.dtype)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(full[name])
    return ref


# ----------------------------------------------------------------------------- step-by-step comparison


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: linear in the gradients, so tiny summation-order differences stay
    # tiny (Adam can blow them up where a gradient is close to zero).
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def xy(
    step: int, world_size: int, rank: int | None, din: int = 5, dout: int = 3, per_rank: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Regression batch of step `step`: all ranks' rows (rank None) or only `rank`'s rows."""
    g = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(world_size * per_rank, din, generator=g), torch.randn(world_size * per_rank, dout, generator=g)
    if rank is None:
        return x, y
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], y[rows]


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def rank_mean(loss: torch.Tensor) -> torch.Tensor:
    """The loss over all ranks' data (every rank has the same batch size)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def check_grads(model: nn.Module, ref: nn.Module, tag: str, skip: tuple[str, ...] = ()) -> None:
    """Every gradient equals the reference's, and exactly the same ones are None."""
    for (name, p), (ref_name, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name
        if name in skip:
            continue
        if rp.grad is None:
            assert p.grad is None, f"{tag}: {name} has a gradient, the reference has none"
            continue
        assert p.grad is not None, f"{tag}: {name} has no gradient, the reference has one"
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, f"{tag}: {name} grad {type(p.grad)}"
        assert_close_tensors(p.grad, rp.grad, **TOL, msg=f"{tag} grad {name}")


def check_params(model: nn.Module, ref: nn.Module, tag: str, skip: tuple[str, ...] = ()) -> None:
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if name not in skip:
            assert_close_tensors(p, rp, **TOL, msg=f"{tag} param {name}")


def step_and_compare(
    model: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer, tag: str
) -> None:
    """Gradients match the reference's (looked up by name, default tolerance), then one
    optimizer step and zero_grad on both, then the parameters match."""
    for name, p in model.named_parameters():
        assert_close_tensors(p.grad, ref.get_parameter(name).grad, msg=f"{tag} grad {name}")
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()
    for name, p in model.named_parameters():
        assert_close_tensors(p, ref.get_parameter(name), msg=f"{tag} param {name}")


def train_step(
    model: nn.Module,
    ref: nn.Module,
    opt: torch.optim.Optimizer,
    ref_opt: torch.optim.Optimizer,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    local: Any,
    full: Any,
    tag: str,
    skip: tuple[str, ...] = (),
) -> float:
    """One step on both models; checks loss, gradients and parameters. Returns the loss."""
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, local)
    loss.backward()
    ref_loss = loss_fn(ref, full)
    ref_loss.backward()
    assert_close_tensors(rank_mean(loss), ref_loss.detach(), **TOL, msg=f"{tag} loss")
    check_grads(model, ref, tag, skip)
    opt.step()
    ref_opt.step()
    check_params(model, ref, tag, skip)
    return ref_loss.item()


def lm_steps(
    model: nn.Module,
    ref: nn.Module,
    rank: int,
    world_size: int,
    steps: range,
    tag: str,
    opt: torch.optim.Optimizer | None = None,
    ref_opt: torch.optim.Optimizer | None = None,
) -> list[float]:
    opt, ref_opt = opt or sgd(model), ref_opt or sgd(ref)
    return [
        train_step(
            model,
            ref,
            opt,
            ref_opt,
            lm_loss,
            batch_for(s, world_size, rank),
            batch_for(s, world_size, None),
            f"{tag} step {s}",
        )
        for s in steps
    ]


# ----------------------------------------------------------------------------- state dicts and DCP

# Full state dicts gathered to rank 0's CPU (the other ranks get empty dicts).
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class TiedNet(nn.Module):
    """Tied embedding/head around two pre-norm MLP blocks, plus a persistent buffer.

    No attention on purpose: a key bias has an exactly-zero gradient, which Adam turns
    into lr-sized noise steps and would need a loose tolerance. Vocab 13 and width 10 do
    not divide 2 or 4, so shards are uneven (and at world 4 some are empty)."""

    def __init__(self, vocab: int = 13, dim: int = 10, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_MLPBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, two FQNs
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x) * self.scale.to(x.dtype))  # buffers are not cast by mp_policy


class _MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def tied_net(seed: int) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def shard_layers(model: nn.Module, layout: str) -> nn.Module:
    """fully_shard per block + root. layout: "fsdp" (1D world), "no_shard", "hsdp" (2x2)."""
    if layout == "hsdp":
        kwargs: dict[str, Any] = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    elif layout == "no_shard":
        kwargs = {"strategy": ShardingStrategy.NO_SHARD}
    else:
        kwargs = {}
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def expected_placements(layout: str) -> tuple:
    return {"fsdp": (Shard(0),), "no_shard": (Replicate(),), "hsdp": (Replicate(), Shard(0))}[layout]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: range, world: int, rank: int | None
) -> list[torch.Tensor]:
    """`steps` optimizer steps on this rank's rows (all rows when `rank` is None)."""
    losses = []
    for step in steps:
        loss = lm_loss(model, batch_for(step, world, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def full_state(sd: dict[str, Any]) -> dict[str, Any]:
    """Plain tensors (DTensors gathered) of a state dict; nested dicts recursively."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = full_state(v)
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor()
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
        else:
            out[k] = v
    return out


def param_groups(osd: dict[str, Any]) -> list[dict[str, Any]]:
    """Optimizer param groups, with tuples as lists (a loaded `betas` is a list)."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in osd["param_groups"]]


def assert_same_params(model: nn.Module, other: nn.Module | dict[str, torch.Tensor], msg: str) -> None:
    """Every parameter of `model` equals `other`'s exactly (a model or a dict of full tensors)."""
    theirs = dict(other.named_parameters()) if isinstance(other, nn.Module) else other
    for name, p in model.named_parameters():
        assert_close_tensors(p, theirs[name], exact=True, msg=f"{msg}: {name}")
