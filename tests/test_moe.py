"""The main job's mixture-of-experts model (`--moe`) under expert parallelism + fully_shard.

On 4 gloo ranks the experts of every block are split over an expert-parallel dim of 2 and
sharded over the other (edp, 2), or split over all 4 ranks (tokens travel by all-to-all to
every other rank, edp of 1), then the blocks and the root are sharded over the world
(examples/trainer/parallel.py's `shard_experts`, then `sharding_units`); trained with PyTorch FSDP2's
`fully_shard` and with composable's, the losses and parameters are equal bit for bit, and losses and parameters follow a
single-process model trained on all ranks' batches (so the expert-parallel gradients are right too).
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh

import composable
from models.model import Transformer, get_config, lm_loss
from trainer.parallel import expert_mesh, shard_experts, sharding_units

try:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:  # pragma: no cover
    torch_fully_shard = None


CFG = get_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=48, n_experts=4)


def _tokens(step: int, rank: int) -> torch.Tensor:
    torch.manual_seed(1000 * step + rank)
    return torch.randint(0, CFG.vocab_size, (2, 17))


def _train(rank: int, world: int, library: str, ep: int = 2) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(CFG)
    if library != "single":
        shard = composable.fully_shard if library == "composable" else torch_fully_shard
        shard_experts(model, expert_mesh("cpu", CFG.n_experts, ep=ep), shard)
        mesh = init_device_mesh("cpu", (world,))
        for unit in sharding_units(model):
            shard(unit, mesh=mesh)
        w1 = model.layers[0].feed_forward.experts.w1  # every expert in the global view (checkpoints)
        assert w1.shape[0] == CFG.n_experts and w1.device_mesh.mesh_dim_names == ("edp", "ep"), w1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        ranks = range(world) if library == "single" else [rank]
        tokens = torch.cat([_tokens(step, r) for r in ranks])
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {
        n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()
    }


def _both(rank: int, world: int, ep: int) -> None:
    ref_losses, ref_params = _train(rank, world, "fsdp2", ep)
    losses, params = _train(rank, world, "composable", ep)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses)), (ref_losses, losses)
    single, single_params = _train(rank, world, "single")
    for step, loss in enumerate(losses):
        mean = loss.clone()
        torch.distributed.all_reduce(mean)
        torch.testing.assert_close(mean / world, single[step], rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert params.keys() == ref_params.keys() == single_params.keys()
    for name, p in params.items():
        # The reduce-scatter inputs are FSDP2's element for element, so every backend sums the
        # 4 ranks' values in FSDP2's order, on any CPU.
        assert torch.equal(p, ref_params[name]), name
        # AdamW's first steps move every element by about lr whatever its gradient's size, so
        # an element whose gradient is near zero (the load-balancing term and the language-model
        # term nearly cancel) carries the summation order's rounding into the weight: seen as
        # 1.1e-5 on one element of 1024.
        torch.testing.assert_close(p, single_params[name], rtol=1e-5, atol=5e-5, msg=name)


@pytest.mark.skipif(torch_fully_shard is None, reason="no FSDP2 in this torch")
@pytest.mark.parametrize("ep", [2, 4], ids=["ep2xedp2", "ep4"])
def test_moe_expert_parallel_equal_to_fsdp2(ep: int) -> None:
    run_on_ranks(_both, 4, ep)


def _bench(rank: int, world: int) -> None:
    from benchmarks.bench_build import build

    cfg = get_config("tiny", dim=32, n_layers=2, n_heads=2, ffn_dim=48, n_experts=4, max_seq_len=16)
    losses = []
    for run in ("fsdp2", "fully_shard"):
        torch.manual_seed(0)
        c = build(run, cfg, torch.device("cpu"))
        assert c.model.layers[0].feed_forward.experts.w1.device_mesh.mesh_dim_names == ("edp", "ep")
        tokens = _tokens(0, rank)[:, :16]
        losses.append(lm_loss(c.logits(c.model, tokens[:, :-1]), tokens[:, 1:]))
    torch.testing.assert_close(losses[0], losses[1])


@pytest.mark.skipif(torch_fully_shard is None, reason="no FSDP2 in this torch")
def test_benchmark_builds_moe() -> None:
    """benchmark.py --moe: both contenders split and shard the experts and compute the same loss."""
    run_on_ranks(_bench, 2)


def test_benchmark_moe_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`--moe` gives the model experts; with float8, graphed runs or a 2D --mesh it is refused, named."""
    from benchmarks.side_by_side import model_config, parse_args
    from trainer.parallel import MOE_EXPERTS

    assert model_config(parse_args(["--moe", "--preset", "tiny"])).n_experts == MOE_EXPERTS
    with pytest.raises(SystemExit):
        parse_args(["--moe", "--float8"])
    assert "--moe runs with --model own and --mesh dp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--moe", "--mesh", "hsdp"])
    assert "got --mesh hsdp" in capsys.readouterr().err
