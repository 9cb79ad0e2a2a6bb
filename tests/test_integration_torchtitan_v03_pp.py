"""torchtitan 0.3's pipeline parallelism (`pipeline_llm`: its stage split, schedule and the
FSDPModule methods torch's PipelineStage drives: manual backward finalization, no gradient sync
between microbatches) over composable's data parallelism (`composable_model_spec`) trains like
the same code over PyTorch FSDP2: llama3, pp 2 x dp 2, under each of torchtitan's SPMD backends;
the same losses, gradient norms and parameters step by step. CPU, gloo, 4 ranks."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from _torchtitan import fsdp2_sums_on_gloo, import_torchtitan_v03, v03_build_kwargs

import_torchtitan_v03()  # skips this module without torchtitan 0.3 (or with a torch it cannot use)

from _harness import assert_close_tensors, register_fake_backend, run_on_ranks  # noqa: E402
from test_integration_torchtitan_v03 import BACKENDS  # noqa: E402

STEPS, BATCH, SEQ = 3, 4, 16  # local batch 4, microbatch 1: 4 microbatches per step


def _train(rank: int, world_size: int, backend: str, schedule: str) -> dict:
    import _torchtitan
    import torchtitan.distributed.parallel_dims as pd
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import full_dtensor
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.protocols.model_spec import ModelSpec

    from composable import fully_shard
    from composable.integrations.torchtitan import composable_model_spec

    register_fake_backend()
    pd.device_type = "cpu"
    dist_utils.set_spmd_backend(backend)
    parallelism = ParallelismConfig(
        spmd_backend=backend,
        data_parallel_shard_degree=2,
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_microbatch_size=1,
    )
    dims = pd.ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    spmd_context = dist_utils.get_spmd_context(parallel_dims=dims)
    config = _torchtitan.tiny_llama3()
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights()
    training = TrainingConfig(
        mixed_precision_param="float32", mixed_precision_reduce="float32", seq_len=SEQ, local_batch_size=BATCH
    )
    spec = ModelSpec(
        name="llama3",
        flavor="tiny",
        model=config,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )
    dp_rank = dims.get_mesh("batch").get_local_rank()
    out = {}
    for run, used in (("fsdp2", spec), ("composable", composable_model_spec(spec))):
        loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=config.vocab_size))
        pp_schedule, parts, first, last = used.pipelining_fn(
            copy.deepcopy(model),
            **v03_build_kwargs(dims, training, parallelism),
            device=torch.device("cpu"),
            model_config=config,
            parallelize_fn=used.parallelize_fn,
            loss_fn=loss_fn,
        )
        assert all((fully_shard.state(m) is not None) == (run == "composable") for m in parts)
        assert all(isinstance(m, FSDPModule) for m in parts)  # torch's stages drive FSDP2's methods
        if run == "fsdp2":
            fsdp2_sums_on_gloo(parts)
        optimizer = torch.optim.SGD([p for m in parts for p in m.parameters()], lr=0.5, foreach=False)
        gen = torch.Generator().manual_seed(100 + dp_rank)
        losses, norms = [], []
        for _ in range(STEPS):
            optimizer.zero_grad()
            tokens = torch.randint(config.vocab_size, (BATCH, SEQ + 1), generator=gen)
            global_tokens = dist_utils.dist_sum_tensor(torch.tensor(BATCH * SEQ), dims.get_mesh("batch"))
            args, kwargs, targets = [], [], [] if last else None
            for mb in range(BATCH):  # the trainer's pp_forward_backward_step
                inputs, labels, extra = tokens[mb : mb + 1, :-1], tokens[mb : mb + 1, 1:], {}
                if backend == "full_dtensor":
                    inputs, labels, extra = full_dtensor.parallelize_inputs(dims, inputs, labels, extra)
                elif backend == "spmd_types":
                    inputs, labels, extra = annotate_input_spmd_types(dims, inputs, labels, extra)
                if first:
                    args.append((inputs,))
                kwargs.append(extra)
                if targets is not None:
                    targets.append(labels)
            mb_losses = [] if last else None
            with spmd_context():
                pp_schedule.step(
                    arg_mbs=args if first else None,
                    kwarg_mbs=kwargs,
                    target_mbs=targets,
                    losses=mb_losses,
                    loss_kwargs={"global_valid_tokens": global_tokens},
                    return_outputs=False,
                )
            params = [p for m in parts for p in m.parameters()]
            norm = dist_utils.clip_grad_norm_(params, 1.0, foreach=True, pp_mesh=dims.get_optional_mesh("pp"))
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            optimizer.step()
            if last:
                local = [loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach() for loss in mb_losses]
                losses.append(torch.stack(local).sum())
        out[run] = {
            "losses": losses,
            "norms": norms,
            "params": {
                k: v.full_tensor() if hasattr(v, "full_tensor") else v for m in parts for k, v in m.state_dict().items()
            },
        }
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipelined_llama3_matches_torchtitan_fsdp2(backend: str) -> None:
    results = run_on_ranks(_train, 4, backend, "1F1B", timeout=300)
    for result in results:
        ours, theirs = result["composable"], result["fsdp2"]
        for key in ("losses", "norms", "params"):
            assert_close_tensors(ours[key], theirs[key], exact=True)
    last = [r["composable"]["losses"] for r in results if r["composable"]["losses"]]
    assert len(last) == 2 and all(not torch.equal(losses[0], losses[-1]) for losses in last)
