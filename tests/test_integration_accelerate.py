"""HF accelerate's own FSDP2 loop (`fsdp_version=2`) with composable (`use_composable_in_accelerate()`)
matches the same loop with PyTorch FSDP2 step by step: losses, gradient norms, the full state
dict after `save_state` / train on / `load_state` / train. CPU, gloo, 2 ranks."""

from __future__ import annotations

import inspect
import os
import tempfile

import pytest
import torch

pytest.importorskip("accelerate")

import _hf  # noqa: E402
from _harness import assert_close_tensors, requires_gpus, run_on_ranks  # noqa: E402

from composable import fully_shard  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "integrations")


def _train_both(rank: int, world_size: int, tail: bool, checkpoint_root: str) -> tuple[dict, dict, list]:
    from accelerate_train import TinyLM, train
    from torch.distributed.fsdp import FSDPModule

    _hf.accelerate_env(rank, world_size)
    kw = dict(steps=3, accumulation=2, tail=tail)
    ours = train(composable=True, checkpoint_dir=os.path.join(checkpoint_root, "composable"), **kw)
    theirs = train(composable=False, checkpoint_dir=os.path.join(checkpoint_root, "fsdp2"), **kw)
    # Which modules accelerate sharded, and that they have FSDP2's interface: one fresh prepare.
    from accelerate_train import make_accelerator

    with _hf.accelerate_path(rank, world_size, composable=True):
        accelerator = make_accelerator(cpu=True, accumulation=1)
        model = TinyLM(tail=tail)
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        sharded = [
            name or "<root>"
            for name, m in model.named_modules()
            if fully_shard.state(m) is not None and isinstance(m, FSDPModule)
        ]
    return ours, theirs, sharded


def _list_groups_supported() -> bool:
    return "list" in str(inspect.signature(fully_shard).parameters["module"].annotation)


@pytest.mark.parametrize("tail", [False, True], ids=["blocks", "hf_tail"])
def test_accelerate_loop_matches_fsdp2(tail: bool) -> None:
    if tail and not _list_groups_supported():
        pytest.skip("needs fully_shard(list_of_modules): accelerate groups [final norm, lm_head]")
    with tempfile.TemporaryDirectory() as root:
        results = run_on_ranks(_train_both, 2, tail, root, timeout=240)
    for rank, (ours, theirs, sharded) in enumerate(results):
        assert len(ours["losses"]) == 4
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["norms"], theirs["norms"], rtol=1e-5, atol=1e-6)
        if rank == 0:  # get_state_dict gathers the full state dict on rank 0
            assert ours["state"].keys() == theirs["state"].keys() and ours["state"]
            assert_close_tensors(ours["state"], theirs["state"], rtol=1e-5, atol=1e-6)
        expected = ["layers.0", "layers.1", "<root>"] + (["embed", "norm", "lm_head"] if tail else [])
        assert sorted(sharded) == sorted(expected)
    # the losses move: the comparison is over training, not over a constant
    assert results[0][0]["losses"][0] != results[0][0]["losses"][-1]


def test_use_composable_in_accelerate_is_undone() -> None:
    import accelerate.accelerator as acc
    from accelerate.utils import fsdp_utils

    from composable.integrations import accelerate as integration

    original = acc.fsdp2_prepare_model
    integration.use_composable_in_accelerate()
    integration.use_composable_in_accelerate()  # idempotent
    assert acc.fsdp2_prepare_model is integration.fsdp2_prepare_model
    integration.use_fsdp2()
    assert acc.fsdp2_prepare_model is original is fsdp_utils.fsdp2_prepare_model


def _prepare_without_composable(rank: int, world_size: int) -> str:
    """A future accelerate whose FSDP2 code no longer looks up torch's fully_shard when it runs
    (here: one that shards nothing): prepare fails instead of silently training with FSDP2."""
    from accelerate_train import TinyLM, make_accelerator

    from composable.integrations import accelerate as integration

    with _hf.accelerate_path(rank, world_size, composable=True):
        accelerator = make_accelerator(cpu=True, accumulation=1)
        saved, integration._original = integration._original, lambda acc, model: model
        try:
            with pytest.raises(RuntimeError, match="without composable's fully_shard"):
                integration.fsdp2_prepare_model(accelerator, TinyLM(tail=False))
            return "ok"
        finally:
            integration._original = saved


def test_prepare_fails_loudly_when_accelerate_bypasses_the_patch() -> None:
    assert run_on_ranks(_prepare_without_composable, 2) == ["ok", "ok"]


@requires_gpus(2)
def test_accelerate_script_on_gpus() -> None:
    """The real launch: `torchrun` on 2 GPUs with NCCL, composable against FSDP2 (losses printed)."""
    import subprocess

    from _harness import env_without_launcher, torchrun_argv

    script = os.path.join(EXAMPLES, "accelerate_train.py")
    outputs = []
    for flag in (["--composable"], []):
        cmd = [*torchrun_argv(2, script), "--steps", "6", *flag]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_without_launcher())
        assert done.returncode == 0, done.stderr[-4000:]
        outputs.append([float(line.split()[-1]) for line in done.stdout.splitlines() if " loss " in line])
    assert len(outputs[0]) == 6
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
