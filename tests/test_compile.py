"""torch.compile composes with fully_shard, replicate and checkpoint.

Blocks compiled with `fullgraph=True` (so no graph break of ours can hide inside a block),
before or after the APIs are applied, train exactly like the same APIs in eager: every rank
runs an eager copy and a compiled copy of one model side by side on the same data and
compares losses and parameters after every step. Steady state has zero recompiles across
toggles of train/eval, no_grad, no_sync and reshard settings. One case uses inductor; the
rest the cheap `aot_eager` backend (CPU CI time).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from _harness import assert_close_tensors, requires_gpus, run_on_ranks
from _models import TinyTransformer, batch_for, lm_loss
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from composable import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardingStrategy,
    checkpoint,
    fully_shard,
    no_sync,
    replicate,
)

STEPS = 3
# aot_eager runs the same aten ops as eager; inductor fuses them (different rounding), which
# in bf16 compute is bf16's rounding (eps 2**-8: 1e-3 relative seen on the loss on H200).
TOL = {"aot_eager": dict(rtol=1e-5, atol=1e-6), "inductor": dict(rtol=1e-4, atol=1e-5)}
BF16_INDUCTOR_TOL = dict(rtol=1e-2, atol=1e-3)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _apply(variant: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if variant == "replicate":
        replicate(module, mesh=mesh)
        return
    if variant == "checkpoint" and module.__class__.__name__ == "Block":
        checkpoint(module)
    options: dict[str, Any] = {
        "full_shard": {},
        "checkpoint": {},
        "shard_grad_op": {"strategy": ShardingStrategy.SHARD_GRAD_OP},
        "no_shard": {"strategy": ShardingStrategy.NO_SHARD},
        "bf16": {"mp_policy": BF16},
        "offload": {"offload_policy": CPUOffloadPolicy()},
        "hsdp": {},
    }[variant]
    fully_shard(module, mesh=mesh, **options)


def _build(variant: str, order: str | None, backend: str, mesh: DeviceMesh, device: torch.device) -> TinyTransformer:
    """TinyTransformer with `variant` on every block and the root; blocks compiled
    (`fullgraph=True`) before or after the APIs when `order` is given."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=2).to(device)
    for block in model.layers:
        if order == "before":
            block.compile(backend=backend, fullgraph=True)
        _apply(variant, block, mesh)
        if order == "after":
            block.compile(backend=backend, fullgraph=True)
    _apply(variant, model, mesh)
    return model


def _mesh(variant: str, world: int, device: torch.device) -> DeviceMesh:
    if variant == "hsdp":
        return init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,))


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
        for n, p in model.named_parameters()
    }


def _side_by_side(
    eager: nn.Module,
    compiled: nn.Module,
    loss_of: Callable[[nn.Module, int], torch.Tensor],
    tol: dict[str, float],
    label: str,
    params: tuple[nn.Module, nn.Module] | None = None,
) -> None:
    """Train `eager` and `compiled` on the same batches (SGD: Adam would amplify rounding in
    ~0 gradients); losses and every parameter (of `params`, default the two models) agree
    after each step."""
    eager_params, compiled_params = params or (eager, compiled)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_params, compiled_params)]
    for step in range(STEPS):
        losses = []
        for model, opt in zip((eager, compiled), opts):
            loss = loss_of(model, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().float())
        assert_close_tensors(losses[1], losses[0], **tol, msg=f"{label} step {step} loss")
        full = _full_params(compiled_params), _full_params(eager_params)
        assert_close_tensors(*full, **tol, msg=f"{label} step {step} params")


def _compiled_matches_eager(
    rank: int,
    world: int,
    variant: str,
    order: str,
    backend: str = "aot_eager",
    device: str = "cpu",
    steady_state: bool = False,
) -> None:
    """With `steady_state`, the compiled model then goes on to `_no_recompiles`' check (it is
    that check's model: compiling another one would cost the same again)."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    torch._dynamo.reset()
    mesh = _mesh(variant, world, dev)
    eager, compiled = _build(variant, None, backend, mesh, dev), _build(variant, order, backend, mesh, dev)
    tol = BF16_INDUCTOR_TOL if variant == "bf16" and backend == "inductor" else TOL[backend]
    _side_by_side(
        eager, compiled, lambda m, step: lm_loss(m, batch_for(step, world, rank).to(dev)), tol, f"{variant}/{order}"
    )
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    if steady_state:
        _no_recompiles(compiled, rank, world)


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("variant", ["full_shard", "bf16", "checkpoint", "replicate"])
def test_compiled_blocks_train_like_eager(variant: str, order: str) -> None:
    # The full_shard blocks compiled after the API are also the steady-state model below.
    run_on_ranks(_compiled_matches_eager, 2, variant, order, steady_state=(variant, order) == ("full_shard", "after"))


@pytest.mark.parametrize("variant", ["shard_grad_op", "no_shard", "offload", "hsdp"])
def test_compiled_blocks_train_like_eager_other_layouts(variant: str) -> None:
    run_on_ranks(_compiled_matches_eager, 4 if variant == "hsdp" else 2, variant, "after")


def test_inductor_compiled_blocks_train_like_eager() -> None:
    run_on_ranks(_compiled_matches_eager, 2, "full_shard", "after", "inductor", timeout=300)


def _stock_blocks(variant: str, how: str | None, mesh: DeviceMesh) -> nn.Sequential:
    """Blocks whose forward is torch.nn's own (`nn.Sequential`): dynamo traces their
    `_call_impl`, hooks included, unless the API keeps the graph at `forward`. `how`: None
    (eager), "before"/"after" (`block.compile(fullgraph=True)` before/after the APIs) or
    "torch.compile" (`torch.compile(block, fullgraph=True)` after them)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)))
    for i, block in enumerate(model):
        if how == "before":
            block.compile(backend="aot_eager", fullgraph=True)
        if variant == "checkpoint":
            checkpoint(block)
        if variant != "replicate":
            fully_shard(block, mesh=mesh)
        else:
            replicate(block, mesh=mesh)
        if how == "after":
            block.compile(backend="aot_eager", fullgraph=True)
        if how == "torch.compile":
            model[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
    if variant != "replicate":
        fully_shard(model, mesh=mesh)
    return model


def _stock_blocks_compiled_match_eager(rank: int, world: int, variant: str, how: str) -> None:
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    eager, compiled = _stock_blocks(variant, None, mesh), _stock_blocks(variant, how, mesh)
    data = lambda step: torch.randn(4, 16, generator=torch.Generator().manual_seed(step * world + rank))  # noqa: E731
    originals = nn.Sequential(*(getattr(block, "_orig_mod", block) for block in compiled))  # FQNs as eager's
    loss_of = lambda m, step: m(data(step)).square().mean()  # noqa: E731
    _side_by_side(eager, compiled, loss_of, TOL["aot_eager"], f"{variant}/{how}", params=(eager, originals))
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])


# checkpoint's recompute calls the module itself, so under torch.compile(module) (a wrapper
# the module does not know of) it would recompute eagerly what the graph computed: checkpoint
# takes module.compile() (or is applied to the compiled wrapper).
@pytest.mark.parametrize(
    "variant,how",
    [("checkpoint", "before"), ("checkpoint", "after")]
    + [(v, h) for v in ("full_shard", "replicate") for h in ("before", "after", "torch.compile")],
)
def test_compiled_stock_modules_train_like_eager(variant: str, how: str) -> None:
    run_on_ranks(_stock_blocks_compiled_match_eager, 2, variant, how)


def _whole_model_compiled(rank: int, world: int) -> None:
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    eager, inner = (
        _build("full_shard", None, "aot_eager", mesh, torch.device("cpu")),
        _build("full_shard", None, "aot_eager", mesh, torch.device("cpu")),
    )
    compiled = torch.compile(inner, backend="aot_eager")  # graph breaks at our hooks are allowed here
    loss_of = lambda m, step: lm_loss(m, batch_for(step, world, rank))  # noqa: E731
    _side_by_side(eager, compiled, loss_of, TOL["aot_eager"], "whole model", params=(eager, inner))


def test_whole_model_compile_trains_like_eager() -> None:
    run_on_ranks(_whole_model_compiled, 2)


def _cycle(model: TinyTransformer, opt: torch.optim.Optimizer, rank: int, world: int, step: int) -> None:
    """One of everything a training loop does: a no_sync micro-step, a synced step, an eval
    forward, a no_grad forward and a toggle of every block's reshard setting."""
    tokens = batch_for(step, world, rank)
    with no_sync(model):
        lm_loss(model, tokens).backward()
    lm_loss(model, tokens).backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    lm_loss(model, tokens)
    model.train()
    with torch.no_grad():
        lm_loss(model, tokens)
    for block in model.layers:
        state = fully_shard.state(block)
        state.reshard_after_forward = not state.reshard_after_forward


def _no_recompiles(model: TinyTransformer, rank: int, world: int) -> None:
    """Steady state of full_shard blocks compiled after the API (`_build("full_shard", "after",
    "aot_eager", ...)`): once every mode and both reshard settings have run, no recompiles.
    Run by test_compiled_blocks_train_like_eager[full_shard-after] on its compiled model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):  # warm-up: every mode and both reshard settings once
        _cycle(model, opt, rank, world, step)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(2, 6):
            _cycle(model, opt, rank, world, step)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@requires_gpus(2)
@pytest.mark.parametrize("variant", ["full_shard", "bf16", "replicate"])
def test_gpu_inductor_compiled_blocks_train_like_eager(variant: str) -> None:
    run_on_ranks(_compiled_matches_eager, 2, variant, "after", "inductor", "cuda", backend="nccl", timeout=600)


def _hf_llama_compiled_matches_eager(rank: int, world: int, device: str = "cpu", backend: str = "aot_eager") -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    torch._dynamo.reset()
    mesh = init_device_mesh(dev.type, (world,))
    config = LlamaConfig(
        vocab_size=37,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )

    def build(compiled: bool) -> nn.Module:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(dev)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
            if compiled:
                layer.compile(backend=backend, fullgraph=True)
        return fully_shard(model, mesh=mesh)

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(step * world + rank)).to(dev)
        return model(input_ids=tokens, labels=tokens).loss

    _side_by_side(build(False), build(True), loss_of, TOL[backend], "hf llama")
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_hf_llama_compiled_decoder_layers_train_like_eager() -> None:
    pytest.importorskip("transformers", reason="HuggingFace transformers is not installed (pip install transformers)")
    run_on_ranks(_hf_llama_compiled_matches_eager, 2)


@requires_gpus(2)
def test_gpu_hf_llama_inductor_decoder_layers_train_like_eager() -> None:
    pytest.importorskip("transformers", reason="HuggingFace transformers is not installed")
    run_on_ranks(_hf_llama_compiled_matches_eager, 2, "cuda", "inductor", backend="nccl", timeout=600)
