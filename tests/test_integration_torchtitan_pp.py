"""torchtitan's pipelined llama3 (`--parallelism.pipeline_parallel_degree 2`) with composable's data
parallelism (the `llama3_composable` train spec: `composable.integrations.torchtitan.pipeline_llama`
and `parallelize_llama`, called as torchtitan's trainer calls them) trains like torchtitan's own
`llama3` (`pipeline_llm` over its FSDP2 `parallelize_llama`): torchtitan's stage split, schedule,
sum-reduced cross-entropy, optimizer container and pipeline-aware `clip_grad_norm_`; same losses,
gradient norms and parameters step by step, one reduce-scatter per sharded group per step (not one
per microbatch) and never more all-gathers, as FSDP2. CPU, gloo, 4 ranks: pp 2 x dp 2."""

from __future__ import annotations

import copy
import os
import subprocess

import pytest
import torch
from _torchtitan import import_torchtitan

import_torchtitan()

from _harness import assert_close_tensors, count_collectives, requires_gpus, run_on_ranks  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "integrations")

VOCAB, SEQ, BATCH = 128, 16, 4  # local batch 4, microbatch 1: 4 microbatches per step


def _setup(schedule: str):
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.config import JobConfig
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    pd.device_type = "cpu"  # torchtitan's meshes default to "cuda" without an accelerator
    dims = pd.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=4)
    dims.build_mesh()
    job = JobConfig()
    job.training.mixed_precision_param = "float32"
    job.training.mixed_precision_reduce = "float32"
    job.training.seq_len = SEQ
    job.training.local_batch_size = BATCH
    job.parallelism.pipeline_parallel_degree = 2
    job.parallelism.pipeline_parallel_schedule = schedule
    job.parallelism.pipeline_parallel_microbatch_size = 1
    torch.manual_seed(0)
    args = TransformerModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ, rope_theta=500000)
    model = Transformer(args)
    with torch.no_grad():  # the whole model's weights, the same on every rank, split by pipeline_llm
        model.init_weights()
    return dims, job, args, model


def _train(rank: int, world_size: int, schedule: str, steps: int = 3) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.protocols.train_spec import get_train_spec

    from composable import fully_shard
    from composable.integrations.pipelining import ComposablePipelineStage
    from composable.integrations.torchtitan import register_llama3

    dims, job, args, model = _setup(schedule)
    dp_rank = dims.get_mesh("fsdp").get_local_rank()
    out = {}
    for name, model_name in (("composable", register_llama3()), ("fsdp2", "llama3")):
        spec = get_train_spec(model_name)  # the trainer's calls, as with --model.name <model_name>
        loss_fn = build_cross_entropy_loss(job)
        pp_schedule, parts, first, last = spec.pipelining_fn(
            copy.deepcopy(model), dims, job, torch.device("cpu"), args, spec.parallelize_fn, loss_fn
        )
        stages = getattr(pp_schedule, "_stages", None) or [pp_schedule._stage]
        assert all(isinstance(s, ComposablePipelineStage) == (name == "composable") for s in stages)
        assert all((fully_shard.state(m) is not None) == (name == "composable") for m in parts)
        if name == "fsdp2":  # gloo has no PREMUL_SUM, which FSDP2 uses for divide factor 1.0
            for m in parts:
                for module in m.modules():
                    if isinstance(module, FSDPModule):
                        module.set_force_sum_reduction_for_comms(True)
        optimizers = build_optimizers(parts, job.optimizer, dims)
        gen = torch.Generator().manual_seed(100 + dp_rank)  # each dp rank its own batch
        losses, norms, reduce_scatters, all_gathers = [], [], [], []
        for _ in range(steps):
            optimizers.zero_grad()
            tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            # train.py's pipelined forward_backward_step
            targets, mb_losses = (labels, []) if last else (None, None)
            with count_collectives() as c:
                if first:
                    pp_schedule.step(inputs, target=targets, losses=mb_losses, return_outputs=False)
                else:
                    pp_schedule.step(target=targets, losses=mb_losses, return_outputs=False)
            reduce_scatters.append(c.counts.get("reduce_scatter", 0))
            all_gathers.append(c.counts.get("all_gather", 0))
            params = [p for m in parts for p in m.parameters()]
            norm = dist_utils.clip_grad_norm_(params, 1.0, foreach=True, pp_mesh=dims.get_optional_mesh("pp"))
            norms.append(float(norm))
            optimizers.step()
            if last:
                losses.append(float(torch.stack(mb_losses).sum()) / labels.numel())
        out[name] = {
            "losses": losses,
            "norms": norms,
            "reduce_scatters": reduce_scatters,
            "all_gathers": all_gathers,
            # apply_fsdp's groups on this rank's stages: the embeddings, each block, [norm, output]
            "groups": sum((m.tok_embeddings is not None) + len(m.layers) + (m.norm is not None) for m in parts),
            "params": {k: v.full_tensor() for m in parts for k, v in m.state_dict().items()},
        }
    return out


# Each schedule puts two of apply_fsdp's groups on every rank (2 layers: 4 stages, or 2 of 2).
# Importing torchtitan in the 4 workers is most of the time; each schedule adds 2-3 s.
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "1F1B", "ZBVZeroBubble"])
def test_torchtitan_pipelined_llama3_matches_fsdp2(schedule: str) -> None:
    results = run_on_ranks(_train, 4, schedule, timeout=300)
    for rank, result in enumerate(results):
        ours, theirs = result["composable"], result["fsdp2"]
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["norms"], theirs["norms"], rtol=1e-5, atol=1e-6)
        assert_close_tensors(ours["params"], theirs["params"], rtol=1e-5, atol=1e-6)
        # one reduce-scatter per sharded group per step (4 microbatches), from the first step on: as FSDP2
        assert ours["groups"] == theirs["groups"] == 2, rank
        assert ours["reduce_scatters"] == theirs["reduce_scatters"] == [2, 2, 2], (rank, ours, theirs)
        # never more all-gathers than FSDP2; after the first step (shape inference) one per group per step
        assert all(a <= b for a, b in zip(ours["all_gathers"], theirs["all_gathers"])), (rank, ours, theirs)
        assert ours["all_gathers"][1:] == [2, 2], (rank, ours)
    last = [r["composable"]["losses"] for r in results if r["composable"]["losses"]]
    assert len(last) == 2  # the two dp ranks of the pipeline rank that holds the last stage
    assert all(len(losses) == 3 and losses[0] != losses[-1] for losses in last)


@requires_gpus(4)
@pytest.mark.parametrize("model", ["llama3_composable", "llama3"])
def test_torchtitan_pipelined_trainer_on_gpus(model: str, tmp_path) -> None:
    """torchtitan's own Trainer with pipeline parallelism on 4 GPUs: pp 2 x dp 2, interleaved
    schedule, checkpointing. TORCHTITAN_REPO names a torchtitan v0.2.2 source checkout (its
    tests/assets: c4_test data, tokenizer)."""
    from _harness import env_without_launcher, torchrun_argv

    repo = os.environ.get("TORCHTITAN_REPO")
    if not repo:
        pytest.skip("set TORCHTITAN_REPO to a torchtitan v0.2.2 source checkout (for tests/assets)")
    script = os.path.abspath(os.path.join(EXAMPLES, "torchtitan_train.py"))
    cmd = [*torchrun_argv(4, script), "--model.name", model]
    cmd += ["--model.flavor", "debugmodel", "--model.hf_assets_path", "tests/assets/tokenizer"]
    cmd += ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
    cmd += ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    cmd += ["--training.steps", "10", "--training.dataset", "c4_test", "--debug.seed", "0"]
    cmd += ["--checkpoint.enable", "--checkpoint.interval", "5", "--job.dump_folder", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_without_launcher(), cwd=repo)
    assert done.returncode == 0, done.stderr[-4000:]


def test_pipeline_llama_refuses_pytorch_fsdp2_stages() -> None:
    """torchtitan's own FSDP2 `parallelize_llama` in composable's stages would leave every
    gradient unreduced: refused with one line naming the function."""
    from _harness import fake_process_group
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.models.llama3 import parallelize_llama as torchtitan_parallelize

    from composable.integrations.torchtitan import pipeline_llama

    with fake_process_group(4, rank=0):
        dims, job, args, model = _setup("1F1B")
        with pytest.raises(
            ValueError,
            match=r"^pipeline_llama: parallelize_fn must shard with composable .*parallelize_llama, which applied PyTorch's FSDP2$",
        ):
            pipeline_llama(
                model, dims, job, torch.device("cpu"), args, torchtitan_parallelize, build_cross_entropy_loss(job)
            )


def test_pipeline_llama_refuses_a_torchtitan_that_builds_no_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.distributed import pipeline_parallel

    from composable.integrations.torchtitan import pipeline_llama

    monkeypatch.setattr(pipeline_parallel, "pipeline_llm", lambda *args: (None, [], True, True))
    with pytest.raises(
        NotImplementedError,
        match=r"^pipeline_llama: torchtitan's pipeline_llm built no stage through torchtitan\.distributed\.pipeline_parallel\.PipelineStage",
    ):
        pipeline_llama(None, None, None, torch.device("cpu"), None, None, None)
