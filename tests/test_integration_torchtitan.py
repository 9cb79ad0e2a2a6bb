"""torchtitan's llama3 with composable (`composable.integrations.torchtitan`) trains like torchtitan's
own FSDP2 `parallelize_llama`: its debug-shaped `Transformer`, its `ParallelDims` meshes, its
sum-reduced cross-entropy scaled by the global count of valid tokens (train.py's recipe), its
optimizer container and its DTensor-aware `clip_grad_norm_`; same losses, gradient norms and
parameters step by step. CPU, gloo, 2 ranks. torchtitan's `Trainer` itself picks CUDA when no
accelerator exists, so the full trainer runs in the GPU test below."""

from __future__ import annotations

import copy
import os
import subprocess

import pytest
import torch
from _torchtitan import import_torchtitan

import_torchtitan()  # torchtitan 0.2.x; skips this module without it

from _harness import assert_close_tensors, requires_gpus, run_on_ranks  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "integrations")


def _build(world_size: int):
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.config import JobConfig
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    pd.device_type = "cpu"  # torchtitan's meshes default to "cuda" without an accelerator
    dims = pd.ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world_size)
    dims.build_mesh()
    job = JobConfig()
    job.training.mixed_precision_param = "float32"
    job.training.mixed_precision_reduce = "float32"
    job.training.seq_len = 16
    torch.manual_seed(0)
    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=16, rope_theta=500000)
    model = Transformer(args)
    with torch.no_grad():  # the trainer calls it under no_grad too
        model.init_weights()
    return dims, job, model


def _train(rank: int, world_size: int, steps: int = 4) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama as torchtitan_parallelize

    from composable import fully_shard
    from composable.integrations.torchtitan import parallelize_llama

    dims, job, model = _build(world_size)
    out = {}
    for name, parallelize in (("composable", parallelize_llama), ("fsdp2", torchtitan_parallelize)):
        m = parallelize(copy.deepcopy(model), dims, job)
        assert (fully_shard.state(m) is not None) == (name == "composable")
        if name == "fsdp2":  # gloo has no PREMUL_SUM, which FSDP2 uses for divide factor 1.0
            for module in m.modules():
                if isinstance(module, FSDPModule) and fully_shard.state(module) is None:
                    module.set_force_sum_reduction_for_comms(True)
        loss_fn = build_cross_entropy_loss(job)
        optimizers = build_optimizers([m], job.optimizer, dims)
        gen = torch.Generator().manual_seed(100 + rank)
        losses, norms = [], []
        for _ in range(steps):
            optimizers.zero_grad()
            micro = [torch.randint(128, (2, 17), generator=gen) for _ in range(2)]
            # train.py's recipe: loss sum / global valid tokens, gradient accumulation by plain backward
            local_tokens = torch.tensor(sum(t[:, 1:].numel() for t in micro), dtype=torch.float32)
            global_tokens = dist_utils.dist_sum(local_tokens, dims.get_mesh("batch"))
            total = 0.0
            for tokens in micro:
                loss = loss_fn(m(tokens[:, :-1]), tokens[:, 1:]) / global_tokens
                loss.backward()
                total += loss.detach()
            norms.append(float(dist_utils.clip_grad_norm_([p for p in m.parameters()], 1.0, foreach=True)))
            optimizers.step()
            dist.all_reduce(total)
            losses.append(float(total))
        out[name] = {
            "losses": losses,
            "norms": norms,
            "params": {k: v.full_tensor() for k, v in m.state_dict().items()},
        }
    return out


def test_torchtitan_llama3_matches_fsdp2() -> None:
    for result in run_on_ranks(_train, 2, timeout=240):
        ours, theirs = result["composable"], result["fsdp2"]
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["norms"], theirs["norms"], rtol=1e-5, atol=1e-6)
        assert_close_tensors(ours["params"], theirs["params"], rtol=1e-5, atol=1e-6)
        assert ours["losses"][0] != ours["losses"][-1]


def test_register_llama3() -> None:
    from torchtitan.protocols.train_spec import get_train_spec

    from composable.integrations.torchtitan import parallelize_llama, pipeline_llama, register_llama3

    assert register_llama3() == register_llama3() == "llama3_composable"  # idempotent
    spec = get_train_spec("llama3_composable")
    assert spec.parallelize_fn is parallelize_llama
    assert spec.pipelining_fn is pipeline_llama  # pipeline parallelism builds composable stages
    assert spec.model_args is get_train_spec("llama3").model_args


@requires_gpus(2)
@pytest.mark.parametrize("model", ["llama3_composable", "llama3"])
def test_torchtitan_trainer_on_gpus(model: str, tmp_path) -> None:
    """torchtitan's own Trainer (its loop, loss, optimizer, checkpointing) on 2 GPUs. The wheel
    ships no data or tokenizer: TORCHTITAN_REPO names a torchtitan source checkout (tag v0.2.2)
    whose tests/assets (c4_test, tokenizer) it trains on."""
    from _harness import env_without_launcher, torchrun_argv

    repo = os.environ.get("TORCHTITAN_REPO")
    if not repo:
        pytest.skip("set TORCHTITAN_REPO to a torchtitan v0.2.2 source checkout (for tests/assets)")
    script = os.path.abspath(os.path.join(EXAMPLES, "torchtitan_train.py"))
    cmd = [*torchrun_argv(2, script), "--model.name", model]
    cmd += ["--model.flavor", "debugmodel", "--model.hf_assets_path", "tests/assets/tokenizer"]
    cmd += ["--training.steps", "10", "--training.dataset", "c4_test", "--debug.seed", "0"]
    cmd += ["--checkpoint.enable", "--checkpoint.interval", "5", "--job.dump_folder", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_without_launcher(), cwd=repo)
    assert done.returncode == 0, done.stderr[-4000:]
