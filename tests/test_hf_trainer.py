"""HF `Trainer` with FSDP2 (`fsdp="full_shard"`, `fsdp_config={"version": 2}`) trains with
composable after `use_composable_in_accelerate()`, step by step as with PyTorch FSDP2: a tiny `LlamaForCausalLM`
loaded with `from_pretrained`, gradient accumulation, `max_grad_norm` clipping, bf16 mixed
precision, a checkpoint every 2 steps and a resume from it, and a final model that
`from_pretrained` loads back. CPU, gloo, 2 ranks."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import _hf  # noqa: E402
from _harness import run_on_ranks  # noqa: E402

STEPS = 4


class _Tokens(torch.utils.data.Dataset):
    """A fixed synthetic causal-LM dataset."""

    def __init__(self, n: int = 32) -> None:
        gen = torch.Generator().manual_seed(7)
        self.data = torch.randint(_hf.TINY_LLAMA["vocab_size"], (n, _hf.SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def _trainer_class() -> type:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import Trainer

    class CPUFSDPTrainer(Trainer):
        """accelerate takes its FSDP path only with accelerators; on CPU (gloo) force it, as the
        accelerate tests do. Not needed on GPUs."""

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            if self.accelerator.mixed_precision != "no":
                plugin.set_mixed_precision(self.accelerator.mixed_precision)
            _hf.force_fsdp_on_cpu(self.accelerator, plugin)
            self.is_fsdp_enabled = True

    return CPUFSDPTrainer


def _train(model_path: str, out: str, resume: str | None, bf16: bool) -> tuple[list, object]:
    from transformers import LlamaForCausalLM, TrainingArguments

    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=1e-2,
        bf16=bf16,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        fsdp="full_shard",
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "FULL_STATE_DICT",
        },
    )
    model = LlamaForCausalLM.from_pretrained(model_path, attn_implementation="eager")
    trainer = _trainer_class()(model=model, args=args, train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=resume)
    losses = [(log["step"], log["loss"], log["grad_norm"]) for log in trainer.state.log_history if "loss" in log]
    return losses, trainer


def _run(rank: int, world_size: int, root: str, composable: bool, bf16: bool) -> dict:
    from transformers import LlamaForCausalLM

    from composable import fully_shard

    name = "composable" if composable else "fsdp2"
    out = os.path.join(root, name)
    # composable: `use_composable_in_accelerate()`, the one line a Trainer user adds before trainer.train()
    with _hf.accelerate_path(rank, world_size, composable):
        losses, trainer = _train(os.path.join(root, "pretrained"), out, None, bf16)
        if composable:  # Trainer's bf16 reached composable as FSDP2's mixed-precision policy
            state = fully_shard.state(trainer.model)
            assert state.mp_policy.param_dtype == (torch.bfloat16 if bf16 else None), state.mp_policy
        _hf.reset_accelerate()
        resumed, trainer = _train(os.path.join(root, "pretrained"), out + "-resumed", f"{out}/checkpoint-2", bf16)
        trainer.save_model(out + "-final")
        params = {n: p.detach().full_tensor().clone() for n, p in trainer.model.named_parameters()}
        torch.distributed.barrier()
        loaded = LlamaForCausalLM.from_pretrained(out + "-final")
        reloaded = {n: p.detach().clone() for n, p in loaded.named_parameters()}
        return dict(losses=losses, resumed=resumed, params=params, reloaded=reloaded)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_trainer_matches_fsdp2_with_resume(bf16: bool) -> None:
    with tempfile.TemporaryDirectory() as root:
        _hf.save_tiny_llama(os.path.join(root, "pretrained"), seed=5)
        ours = run_on_ranks(_run, 2, root, True, bf16, timeout=240)
        theirs = run_on_ranks(_run, 2, root, False, bf16, timeout=240)
    for rank in range(2):
        mine = ours[rank]
        assert [s for s, _, _ in mine["losses"]] == list(range(1, STEPS + 1))
        assert mine["losses"] == theirs[rank]["losses"]  # loss and gradient norm of every step
        # the run resumed from checkpoint-2 (its log starts with the checkpoint's steps 1 and 2)
        # repeats steps 3 and 4 of the uninterrupted one
        assert mine["resumed"] == mine["losses"]
        torch.testing.assert_close(mine["params"], theirs[rank]["params"], rtol=0, atol=0)
        # what save_model wrote loads back with from_pretrained, equal to the trained parameters
        torch.testing.assert_close(mine["reloaded"], mine["params"], rtol=0, atol=0)
    assert ours[0]["losses"][0][1] != ours[0]["losses"][-1][1]
