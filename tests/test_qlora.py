"""QLoRA under `fully_shard`: frozen torchao `NF4Tensor` base weights with trainable LoRA
adapters, as torchtune's distributed recipes run it under FSDP2.

The NF4 weights are sharded with the ops FSDP2 uses on them (dim-0 chunk, `new_zeros`,
`copy_`: NF4 has no slice at an offset, which failed the call), kept as NF4 shards, and
all-gathered as 4-bit data plus scalers through NF4's own all-gather extension. Checked on
gloo against PyTorch's FSDP2 on the same model and data, bit for bit (losses, gradients,
trained adapters, the untouched NF4 data), with `reshard_after_forward` True, False and an
int, and with a bf16 mixed-precision policy; against one process (the same losses, close
adapters); state dicts, DCP round trips and full state dicts of NF4 shards; a model built on
the meta device then loaded; an HF Llama with NF4 projections (examples/qlora.py's model).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import (
    assert_close_tensors,
    count_collectives,
    gpu_worlds,
    run_on_ranks,
    step_and_match,
    trace_collectives,
)

from composable import MixedPrecisionPolicy, fully_shard

pytest.importorskip("torchao", reason="QLoRA needs torchao's NF4Tensor: pip install torchao")

from trainer.qlora import (
    LoRALinear,
    base_weight_bytes,
    build_llama,
    load_full_state_dict,
    make_step,
    run_steps,
    shard,
    to_nf4,
    train,
)

DIM, LAYERS = 256, 3


class QLoRANet(nn.Module):
    """Three residual LoRA layers over 256 x 256 NF4 base weights (rank 4)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(LoRALinear(nn.Linear(DIM, DIM, bias=False), 4, 8.0, True) for _ in range(LAYERS))
        for layer in self.layers:  # B starts at zero in LoRA; nonzero here so every adapter trains from step 0
            nn.init.normal_(layer.lora_b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return x


def _nf4_type() -> type:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    return NF4Tensor


def _inner(t: torch.Tensor) -> dict[str, torch.Tensor]:
    names, _ = t.__tensor_flatten__()
    return {n: getattr(t, n) for n in names}


def _shard(model: nn.Module, api: str, reshard: bool | int = True, bf16: bool = False) -> nn.Module:
    """`fully_shard` (composable's or FSDP2's) per layer and on the root; `bf16`: compute in
    bf16, reduce in fp32."""
    if api == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy as Policy
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard, Policy = fully_shard, MixedPrecisionPolicy
    policy = Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else Policy()
    for layer in [*model.layers, model]:
        shard(layer, reshard_after_forward=reshard, mp_policy=policy)
    return model


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(step * world + rank))


def _vs_fsdp2(rank: int, world: int, reshard: bool | int, bf16: bool) -> None:
    import torch.distributed as dist

    single = QLoRANet()
    ours, theirs = (
        _shard(copy.deepcopy(single), "composable", reshard, bf16),
        _shard(copy.deepcopy(single), "fsdp2", reshard, bf16),
    )
    local = ours.layers[0].weight.to_local()
    assert type(local) is _nf4_type() and local.shape == (DIM // world, DIM), "an NF4 shard of 1/world of the rows"
    assert local.quantized_data.numel() * world == single.layers[0].weight.quantized_data.numel()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ours, theirs, single)]
    for step in range(3):
        x = _batch(step, rank, world)
        with trace_collectives() as t:
            ours_loss = ours(x).square().mean()
        # One all-gather per layer: its adapters (compute dtype) with the NF4 weight's bytes (4-bit data,
        # int8 scalers, factors) riding in the same collective.
        gathers = [r for r in t.records if r.kind == "all_gather"]
        sent = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
        nf4 = sum(t.numel() * t.element_size() for t in sent)
        adapters = 2 * 4 * DIM // world  # this rank's rows of lora_a and lora_b
        assert len(gathers) == LAYERS, t.render()
        padded = [world * (adapters + -(-nf4 // r.dtype.itemsize)) for r in gathers]  # whole elements
        assert [r.numel for r in gathers] == padded, f"{nf4} NF4 bytes: {t.render()}"
        losses = [ours_loss, theirs(x).square().mean()]
        for loss in losses:
            loss.backward()
        # One process on every rank's batch: the same mean loss, the same mean gradients.
        full = torch.cat([_batch(step, r, world) for r in range(world)])
        if not bf16:
            mean = losses[0].detach().clone()
            dist.all_reduce(mean)
            single_loss = single(full).square().mean()
            assert_close_tensors(mean / world, single_loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step} single")
            single_loss.backward()
        step_and_match(ours, theirs, opts, f"step {step}", losses=(losses[0], losses[1]))
    for (name, a), (_, b), (_, c) in zip(ours.named_parameters(), theirs.named_parameters(), single.named_parameters()):
        if a.requires_grad:
            assert_close_tensors(a.full_tensor(), b.full_tensor(), exact=True, msg=f"param {name}")
            if not bf16:
                assert_close_tensors(a.full_tensor(), c, rtol=1e-4, atol=1e-5, msg=f"param {name} vs one process")
        else:  # frozen NF4: still NF4 shards, the same bytes as FSDP2's
            assert type(a.to_local()) is _nf4_type()
            for key, value in _inner(a.to_local()).items():
                assert torch.equal(value, _inner(b.to_local())[key]), f"{name}.{key}"


@pytest.mark.parametrize(
    "reshard, bf16",
    [(True, False), (False, False), (2, False), (True, True)],
    ids=["reshard", "no_reshard", "reshard_int", "bf16_policy"],
)
def test_qlora_matches_fsdp2_and_one_process(reshard: bool | int, bf16: bool) -> None:
    """Failed at the call before NF4 was sharded with FSDP2's ops ("aten.slice(NF4Tensor) with
    start=128")."""
    run_on_ranks(_vs_fsdp2, 2, reshard, bf16)


def _checkpoints(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    trained = _shard(QLoRANet(), "composable")
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2)
    trained(_batch(0, rank, world)).square().mean().backward()
    opt.step()
    sd = trained.state_dict()
    assert type(sd["layers.0.weight"].to_local()) is _nf4_type(), "state dicts hold the NF4 shards"
    dcp.save(sd, checkpoint_id=path)
    fresh = _shard(QLoRANet(seed=1), "composable")
    target = fresh.state_dict()
    dcp.load(target, checkpoint_id=path)
    fresh.load_state_dict(target)
    for (name, a), (_, b) in zip(trained.named_parameters(), fresh.named_parameters()):
        if a.requires_grad:
            assert torch.equal(a.to_local(), b.to_local()), name
        else:
            assert type(b.to_local()) is _nf4_type()
            for key, value in _inner(a.to_local()).items():
                assert torch.equal(value, _inner(b.to_local())[key]), f"{name}.{key}"
    x = _batch(1, rank, world)
    assert torch.equal(trained(x), fresh(x)), "the loaded model computes as the saved one"
    # Full state dicts: NF4 weights of the whole shape, as FSDP2's.
    theirs = _shard(QLoRANet(), "fsdp2")
    full = [get_model_state_dict(m, options=StateDictOptions(full_state_dict=True)) for m in (fresh, theirs)]
    weight = full[0]["layers.0.weight"]
    assert type(weight) is _nf4_type() and weight.shape == (DIM, DIM)
    for key, value in _inner(full[1]["layers.0.weight"]).items():
        assert torch.equal(_inner(weight)[key], value), key


def test_nf4_state_dict_and_dcp_round_trip(tmp_path: Path) -> None:
    run_on_ranks(_checkpoints, 2, str(tmp_path / "ckpt"))


def _meta_then_load(rank: int, world: int) -> None:
    torch.manual_seed(5)  # "pretrained" weights, other than QLoRANet's own
    full = {f"layers.{i}.weight": torch.randn(DIM, DIM) / DIM**0.5 for i in range(LAYERS)}
    direct = QLoRANet()
    for i, layer in enumerate(direct.layers):
        layer.weight = nn.Parameter(to_nf4(full[f"layers.{i}.weight"]), requires_grad=False)
    for name, p in direct.named_parameters():
        if p.requires_grad:
            full[name] = p.detach().clone()
    direct = _shard(direct, "composable")
    losses = []
    for api in ("composable", "fsdp2"):
        with torch.device("meta"):
            model = QLoRANet()
        _shard(model, api)
        load_full_state_dict(model, full, torch.device("cpu"))
        assert all(not p.is_meta for p in model.parameters())
        losses.append(model(_batch(0, rank, world)).square().mean())
    losses.append(direct(_batch(0, rank, world)).square().mean())
    assert_close_tensors(losses[0], losses[1], exact=True, msg="vs FSDP2")
    assert_close_tensors(losses[0], losses[2], exact=True, msg="vs built on the CPU")


def test_meta_init_then_load_matches_direct_and_fsdp2() -> None:
    run_on_ranks(_meta_then_load, 2)


def _hf_llama(rank: int, world: int) -> None:
    model = build_llama("tiny", torch.float32, torch.device("cpu"), nf4=True)
    models = [shard(copy.deepcopy(model), api) for api in ("composable", "fsdp2")]
    assert type(models[0].model.layers[0].self_attn.q_proj.weight.to_local()) is _nf4_type()
    losses = [train(m, steps=2, batch=2, seq=16, device=torch.device("cpu")) for m in models]
    assert losses[0] == losses[1], losses
    for (name, a), (_, b) in zip(*(m.named_parameters() for m in models)):
        if a.requires_grad:
            assert_close_tensors(a.full_tensor(), b.full_tensor(), exact=True, msg=name)


def _gathers_per_unshard(rank: int, world: int) -> None:
    model = build_llama("tiny", torch.float32, torch.device("cpu"), nf4=True)
    layers = len(model.model.layers)
    nf4 = sum(type(p.data) is _nf4_type() for p in model.model.layers[0].parameters())
    assert nf4 == 7, "q, k, v, o, gate, up and down projections are NF4"
    counts = []
    for api in ("composable", "fsdp2"):
        sharded = shard(copy.deepcopy(model), api)
        tokens = torch.randint(model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
        with count_collectives() as forward:
            loss = sharded(input_ids=tokens).logits.float().square().mean()
        with count_collectives() as backward:
            loss.backward()
        counts.append((forward.counts["all_gather"], backward.counts["all_gather"]))
    # Forward: the root, then each decoder layer; backward regathers each layer (resharded after
    # forward). One collective each, however many NF4 tensors the layer holds.
    assert counts[0] == (layers + 1, layers), counts
    assert counts[0] == counts[1], f"as many as FSDP2: {counts}"


def test_one_all_gather_per_group_unshard() -> None:
    """An HF Llama QLoRA decoder layer (seven NF4 projections, three tensors each to gather, and
    their LoRA adapters) is one all-gather per unshard, as in FSDP2. Each NF4 tensor was an
    all-gather of its own before: 22 per layer."""
    pytest.importorskip("transformers", reason="the HF Llama QLoRA test needs transformers")
    run_on_ranks(_gathers_per_unshard, 2)


def test_hf_llama_qlora_matches_fsdp2() -> None:
    """examples/qlora.py's model: an HF Llama whose projections are NF4 with LoRA adapters."""
    pytest.importorskip("transformers", reason="the HF Llama QLoRA test needs transformers")
    run_on_ranks(_hf_llama, 2)


def test_nf4_base_weights_take_about_a_quarter_of_bf16() -> None:
    """examples/qlora.py's weight count: the LoRA layers' NF4 base weights (4-bit data plus
    their scalers) against the same weights in bf16, as bench_qlora.py reports them."""
    pytest.importorskip("transformers", reason="the HF Llama QLoRA test needs transformers")
    nf4 = base_weight_bytes(build_llama("tiny", torch.bfloat16, torch.device("cpu"), nf4=True))
    bf16 = base_weight_bytes(build_llama("tiny", torch.bfloat16, torch.device("cpu"), nf4=False))
    assert 0.25 < nf4 / bf16 < 0.30, (nf4, bf16)


def _graphed_like_eager(rank: int, world: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for warmup in (None, 3):
        model = shard(build_llama("tiny", torch.bfloat16, device, nf4=True), "composable")
        step = make_step(model, device, graphed_warmup=warmup, capturable=True)  # the same AdamW both ways
        losses = run_steps(step, model.config.vocab_size, 6, 2, 32, device)
        if warmup is not None:
            assert step.graph is not None, "the QLoRA step was never captured"
        adapters = {n: p.to_local().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
        results[warmup] = (losses, adapters)
    (eager_losses, eager), (graphed_losses, graphed) = results[None], results[3]
    assert eager_losses == graphed_losses, f"losses eager {eager_losses} vs graphed {graphed_losses}"
    for name, value in eager.items():
        assert torch.equal(value, graphed[name]), f"{name}: the graphed step's adapter differs"


@pytest.mark.parametrize("world", gpu_worlds(1, 2))
def test_gpu_graphed_qlora_step_trains_like_eager(world: int) -> None:
    """examples/qlora.py's QLoRA step (NF4 base weights gathered through their extension, LoRA
    adapters, capturable AdamW) captured whole by `graphed_step` and replayed: the same losses
    and adapters as the eager step, bit for bit."""
    pytest.importorskip("transformers", reason="the HF Llama QLoRA test needs transformers")
    run_on_ranks(_graphed_like_eager, world, backend="nccl", timeout=600)
