"""examples/models/moe.py's layer on its own: the grouped-GEMM path computes what the per-expert loop
computes; without expert parallelism the layer compiles into one graph (no host
synchronisation, no data-dependent shape); with it, blocks compiled as train.py compiles them
train as the eager ones (the dispatch runs between compiled graphs, with plain collectives);
the load-balancing loss and its gradient, scaled as the loss is over micro-batches."""

from __future__ import annotations

import argparse

import pytest
import torch
from _harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh

import composable
from models import moe
from models.model import Transformer, get_config, lm_loss
from trainer.parallel import expert_mesh, shard_experts, sharding_units
from trainer.train_step import make_train_step

CFG = get_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=48, n_experts=4)


def _weights(n: int, dim: int, ffn: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(n, ffn, dim) / dim**0.5, torch.randn(n, ffn, dim) / dim**0.5, torch.randn(n, dim, ffn) / ffn**0.5


def test_grouped_path_computes_what_the_loop_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The permutation into padded groups and back (run here with torch._grouped_mm's CPU
    forward in fp32): expert 2 gets no rows, expert 0 more than one aligned group."""
    torch.manual_seed(0)
    rows, (w1, w3, w2) = torch.randn(40, 16), _weights(4, 16, 24)
    ids = torch.tensor([0] * 20 + [1] * 7 + [3] * 13)[torch.randperm(40)]
    loop = moe.experts_forward(rows, ids, w1, w3, w2)
    monkeypatch.setattr(moe, "use_grouped_mm", lambda *_: True)
    try:
        grouped = moe.experts_forward(rows, ids, w1, w3, w2)
    except (RuntimeError, NotImplementedError) as err:  # older torch: no CPU kernel
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {err}")
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    row = 5
    e = int(ids[row])
    x = rows[row]
    expected = (torch.nn.functional.silu(w1[e] @ x) * (w3[e] @ x)) @ w2[e].T
    torch.testing.assert_close(loop[row], expected, rtol=1e-5, atol=1e-5)


def test_grouped_mm_only_on_cuda_bf16() -> None:
    rows, w1 = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(2, 24, 16, dtype=torch.bfloat16)
    assert not moe.use_grouped_mm(rows, w1)  # the CPU


def test_layer_compiles_as_one_graph_without_expert_parallelism() -> None:
    """fullgraph=True: routing, permutation, experts and the balance term trace without a
    graph break, so nothing reads a tensor on the host (the old loop's nonzero() did)."""
    torch.manual_seed(0)
    layer = moe.MoEFeedForward(CFG)
    for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
        torch.nn.init.normal_(w, std=0.1)
    x = torch.randn(2, 8, CFG.dim)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    eager_out, out = layer(x), compiled(x)
    torch.testing.assert_close(out, eager_out)
    grads = []
    for fn in (layer, compiled):
        layer.zero_grad()
        fn(x).square().sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_load_balance_loss_is_one_when_balanced_and_its_gradient_is_added() -> None:
    scores = torch.full((1, 4, 4), 0.25)
    balanced = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    assert moe.load_balance_loss(scores, balanced).item() == pytest.approx(1.0)
    # Every token on experts 0 and 1 with probability 1/2 each: f = (2, 2, 0, 0), P = (1/2, 1/2, 0, 0).
    skewed = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).expand(1, 4, 4)
    assert moe.load_balance_loss(skewed, torch.tensor([[[0, 1]] * 4])).item() == pytest.approx(2.0)
    # The router's gradient is that of loss + coef * aux computed by hand.
    torch.manual_seed(0)
    layer = moe.MoEFeedForward(CFG)
    for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
        torch.nn.init.normal_(w, std=0.1)
    x = torch.randn(2, 8, CFG.dim)
    layer(x).sum().backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.aux_loss_coef = 0.0
    scores = layer.router(x.reshape(-1, CFG.dim)).float().softmax(-1)
    aux = moe.load_balance_loss(scores.view(2, 8, -1), scores.topk(CFG.top_k, -1)[1].view(2, 8, -1))
    (layer(x).sum() + moe.AUX_LOSS_COEF * aux).backward()
    torch.testing.assert_close(got, layer.router.weight.grad)


def _step_params(grad_accum: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    args = argparse.Namespace(grad_accum=grad_accum, max_norm=0.0)
    step = make_train_step(model, opt, composable.ShardedGradScaler(enabled=False), args, hsdp_accum=False)
    torch.manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (4, 17))
    step(tokens[:, :-1], tokens[:, 1:])
    return [p.detach() for p in model.parameters()]


def test_micro_batches_scale_the_balance_gradient_as_the_loss() -> None:
    """Two micro-batches of 2 sequences step as one batch of 4: the balance term's gradient
    is divided by the micro-batches as the loss is (else the router's would be larger)."""
    for a, b in zip(_step_params(1), _step_params(2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _compiled_blocks(rank: int, world: int) -> None:
    torch._dynamo.reset()
    losses, grads = [], []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Transformer(CFG)
        if compiled:
            for block in model.layers:  # as train.py: every block, before the APIs
                block.compile(backend="aot_eager")
        shard_experts(model, expert_mesh("cpu", CFG.n_experts, ep=world), composable.fully_shard)
        mesh = init_device_mesh("cpu", (world,))
        for unit in sharding_units(model):
            composable.fully_shard(unit, mesh=mesh)
        torch.manual_seed(rank)
        tokens = torch.randint(0, CFG.vocab_size, (2, 17))
        for _ in range(2):  # the second step runs the compiled graphs again
            model.zero_grad()
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_blocks_with_expert_parallelism_train_as_eager() -> None:
    """Blocks compiled (aot_eager) over an all-to-all dispatch between 2 ranks: the same
    losses and gradients as eager."""
    run_on_ranks(_compiled_blocks, 2, timeout=300)
