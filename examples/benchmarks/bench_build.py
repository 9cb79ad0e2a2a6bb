"""The benchmark's contenders: one model (ours or HuggingFace's Llama), parallelised five ways.

Every contender is built the same way, in the order the APIs need:
1. the model on the meta device (no memory, no init cost);
2. with `float8`, its linears swapped for torchao's `Float8Linear` (bench_float8.py);
3. with `compile_backend`, every block (`TransformerBlock` / `LlamaDecoderLayer`) `.compile()`d,
   before any API is applied, as torchtitan does; with `ac` "full" or "selective" every block
   checkpointed (composable's `checkpoint` for our contenders, torch's `checkpoint_wrapper`
   for FSDP2, DDP and DeepSpeed; "selective" keeps the matmuls: `composable.checkpoint.save_matmuls`);
4. the API: nothing (floor; and `deepspeed_offload`, whose engine shards the materialised
   model later: bench_deepspeed.py), `fully_shard` on every sharding unit bottom-up (ours or FSDP2;
   its `*_offload` runs with `CPUOffloadPolicy`: shards, gradients and the step on the host),
   or `replicate` on the root; on `--mesh hsdp` / `tp` (bench_mesh.py) the FSDP-style ones
   shard over its data-parallel mesh, under `tp` after train.py's tensor-parallel recipe;
5. materialised on the device and initialised *after* sharding (each rank fills its shards);
6. DDP last: it broadcasts rank 0's initialised parameters when it is constructed.
The floor and DDP compute in fp32 under bf16 autocast; fully_shard, FSDP2 and replicate keep
fp32 sharded parameters and compute in bf16 (`param_dtype`), reducing in fp32; DeepSpeed's
engine computes in bf16 parameters over fp32 master weights on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
from torch import nn

import composable
from benchmarks import bench_float8
from benchmarks.bench_mesh import MESH_RUNS, BenchMesh, tensor_parallel
from models.model import ModelConfig, Transformer, lm_loss, model_loss
from trainer.parallel import expert_mesh, shard_experts

RUNS = ("floor", "fully_shard", "fsdp2", "replicate", "ddp")
# The same contenders with the whole step in a CUDA graph (composable.graphed_step); opt-in, CUDA only.
GRAPHED_RUNS = ("floor_graphed", "fully_shard_graphed", "replicate_graphed")
# fully_shard and FSDP2 with CPU offload (`CPUOffloadPolicy`: sharded parameters, gradients and the
# optimizer step on the host); opt-in, measured beside the same contenders without it.
# fully_shard_offload_on_device also keeps each group's bf16 shard on the GPU between steps
# (`CPUOffloadPolicy(compute_shard_on_device=True)`).
# *_step_in_backward: each group's host step during backward (`composable.optim.step_in_backward`,
# applied by benchmark.py); *_speculative: with --max-norm, its `speculate=True`.
OFFLOAD_RUNS = (
    "fully_shard_offload",
    "fully_shard_offload_on_device",
    "fully_shard_offload_step_in_backward",
    "fully_shard_offload_step_in_backward_speculative",
    "fully_shard_offload_on_device_step_in_backward",
    "fsdp2_offload",
)
# fully_shard with only the optimizer state on the host, stepped on the GPU in buckets
# (`composable.optim.offload_optimizer_state`, applied by benchmark.py); *_prefetch: the state's
# copies in during backward (`prefetch_in_backward=model`).
STATE_OFFLOAD_RUNS = ("fully_shard_state_offload", "fully_shard_state_offload_prefetch")
# DeepSpeed ZeRO-3 with ZeRO-Offload (its optimizer state and step on the host); opt-in, needs the
# deepspeed package. `build` makes its model as the floor's (nothing applied, on the device);
# benchmark.py hands it to DeepSpeed's engine, which shards it (bench_deepspeed.py).
DEEPSPEED_RUNS = ("deepspeed_offload",)
ALL_RUNS = RUNS + GRAPHED_RUNS + OFFLOAD_RUNS + STATE_OFFLOAD_RUNS + DEEPSPEED_RUNS
# Runs whose blocks torch's `checkpoint_wrapper` checkpoints under --ac (PyTorch's and DeepSpeed's
# contenders; composable's take composable.checkpoint), named as `build` strips them.
TORCH_CHECKPOINTED = ("fsdp2", "ddp", "deepspeed")
MODELS = ("own", "hf-llama")
AC_MODES = ("none", "full", "selective")  # activation checkpointing of every block
WRAPS = ("separate-ends", "blocks")  # how fully_shard/FSDP2 group the model: see `sharding_units`
HF_MISSING = "--model hf-llama needs HuggingFace transformers, which is not installed: pip install transformers"


class Contender(NamedTuple):
    model: nn.Module  # what the optimizer steps (the DDP wrapper for "ddp")
    autocast: Callable[[], AbstractContextManager[object]]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, tokens) -> logits
    after_step: Callable[[nn.Module], None] = lambda model: None  # (model) after each optimizer step

    def loss(self, tokens: torch.Tensor, loss_chunk: int = 0) -> torch.Tensor:
        """The forward's mean loss on `tokens` (B, T + 1), under the contender's autocast:
        `lm_loss` of the logits, or with `loss_chunk` > 0 (`--loss-chunk`, our model only) the
        head's chunked loss."""
        x, y = tokens[:, :-1], tokens[:, 1:]
        with self.autocast():
            return model_loss(self.model, x, y, loss_chunk) if loss_chunk else lm_loss(self.logits(self.model, x), y)


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_llama(cfg: ModelConfig) -> nn.Module:
    """HuggingFace transformers' own `LlamaForCausalLM` at the shape of `cfg` (untied head,
    as many KV heads as heads, SDPA attention), built on the current default device."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ImportError(HF_MISSING) from e
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        use_cache=False,
        initializer_range=cfg.init_std,
    )
    config._attn_implementation = "sdpa"  # what it picks on GPUs anyway; explicit for a like-for-like CPU test
    return LlamaForCausalLM(config)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the unit that is compiled and sharded."""
    return list(model.layers) if isinstance(model, Transformer) else list(model.model.layers)


def head(model: nn.Module) -> nn.Module:
    """The output head (kept in high precision under `--float8`)."""
    return model.output if isinstance(model, Transformer) else model.lm_head


def sharding_units(model: nn.Module, wrap: str) -> list[nn.Module]:
    """The modules `fully_shard` (ours or FSDP2) is applied to, bottom-up, the root last.

    'blocks': each block, then the root (embeddings, final norm, head). 'separate-ends': the
    embeddings and the head on their own as well (torchtitan's wrapping), so the head's
    reduce-scatter overlaps the blocks' backward and the root's last one is smaller.
    """
    if wrap not in WRAPS:
        raise ValueError(f"sharding_units: wrap must be one of {WRAPS}, got {wrap!r}")
    if wrap == "blocks":
        ends: list[nn.Module] = []
    elif isinstance(model, Transformer):
        ends = [model.tok_embeddings, head(model)]
    else:
        ends = [model.model.embed_tokens, head(model)]
    return [*ends, *blocks(model), model]


def _init_weights(model: nn.Module, device: torch.device) -> None:
    """Initialise a materialised model, sharded or not (DTensor parameters fill their shards)."""
    if isinstance(model, Transformer):
        model.init_weights(buffer_device=device)
        return
    # HF initialises a module once (flags set while it was built on meta): clear them, then
    # its own `_init_weights` fills every parameter and recomputes the rotary tables.
    for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
        obj.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()


def build(
    run: str,
    cfg: ModelConfig,
    device: torch.device,
    wrap: str = "separate-ends",
    model: str = "own",
    compile_backend: str | None = None,
    float8: bool = False,
    ac: str = "none",
    mesh: BenchMesh | None = None,
) -> Contender:
    """Contender `run` (one of ALL_RUNS) on `device` for model `model` (one of MODELS), with
    torchao float8 training if `float8`; see the module doc. A graphed run builds the same
    contender as its eager one: the benchmark graphs its step. `mesh` (bench_mesh.py; None:
    `--mesh dp`): fully_shard and FSDP2 shard over its data-parallel mesh, after tensor
    parallelism under `--mesh tp`; the floors ignore it."""
    if run not in ALL_RUNS:
        raise ValueError(f"build: run must be one of {ALL_RUNS}, got {run!r}")
    allowed = MESH_RUNS[mesh.kind] if mesh is not None else None
    if allowed is not None and run not in allowed:
        raise ValueError(f"build: run {run!r} does not run on --mesh {mesh.kind}; runs there: {allowed}")
    offload = run in OFFLOAD_RUNS
    on_device = run.removesuffix("_speculative").removesuffix("_step_in_backward").endswith("_on_device")
    run = (
        run.removesuffix("_speculative")
        .removesuffix("_step_in_backward")
        .removesuffix("_graphed")
        .removesuffix("_on_device")
        .removesuffix("_prefetch")
        .removesuffix("_state_offload")
        .removesuffix("_offload")
    )
    if model not in MODELS:
        raise ValueError(f"build: model must be one of {MODELS}, got {model!r}")
    if ac not in AC_MODES:
        raise ValueError(f"build: ac must be one of {AC_MODES}, got {ac!r}")
    with torch.device("meta"):
        net = Transformer(cfg) if model == "own" else hf_llama(cfg)
    if float8:
        bench_float8.to_float8(net, head(net), run)
    wrapped = ac != "none" and run in TORCH_CHECKPOINTED  # their blocks become checkpoint wrappers
    if compile_backend is not None and not wrapped:
        for block in blocks(net):
            block.compile(backend=compile_backend)
    if ac != "none":
        _checkpoint_blocks(net, run, ac, compile_backend)
    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    if run in ("fully_shard", "fsdp2"):
        if run == "fully_shard":
            shard, mpp = composable.fully_shard, composable.MixedPrecisionPolicy(**bf16)
            policy = (
                composable.CPUOffloadPolicy(compute_shard_on_device=on_device)
                if offload
                else composable.OffloadPolicy()
            )
        else:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

            shard, mpp = fully_shard, MixedPrecisionPolicy(**bf16)
            # FSDP2 pins the host shards, which needs an accelerator; composable skips pinning without one.
            policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
        if mesh is not None:
            tensor_parallel(net, mesh)  # --mesh tp: the TP recipe first, as train.py
        dp_mesh = None if mesh is None else mesh.dp_mesh  # None: the API's default world mesh
        if cfg.n_experts:  # --moe: expert parallelism, the experts sharded over the rest first
            shard_experts(net, expert_mesh(device.type, cfg.n_experts), shard, mp_policy=mpp)  # type: ignore[arg-type]
        for module in sharding_units(net, wrap):
            shard(module, mesh=dp_mesh, mp_policy=mpp, offload_policy=policy)
    elif run == "replicate":
        composable.replicate(net, mp_policy=composable.MixedPrecisionPolicy(**bf16))
    # Offloaded shards live on the host from the start (as torchtitan materialises them); the
    # rotary tables, buffers, on the device (`init_weights(buffer_device=...)`).
    net.to_empty(device="cpu" if offload else device)
    _init_weights(net, device)
    if run == "ddp":
        net = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    if run in ("floor", "ddp"):

        def autocast() -> AbstractContextManager[object]:
            return torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        autocast = nullcontext
    logits = _own_logits if model == "own" else _hf_logits
    if float8 and run in bench_float8.FSDP_RUNS:
        after = bench_float8.after_step_in_place if run == "fully_shard" else bench_float8.after_step
        return Contender(net, autocast, logits, after)
    return Contender(net, autocast, logits)


def _checkpoint_blocks(net: nn.Module, run: str, ac: str, compile_backend: str | None) -> None:
    """Every block checkpointed: ours by `composable.checkpoint` (after `.compile()`: the
    checkpoint goes into the block's graph); FSDP2's, DDP's and DeepSpeed's as torchtitan does, each block
    replaced by torch's `checkpoint_wrapper`, then the wrapper compiled, so the checkpoint is in
    the graph there too (torch's composable checkpoint with a `context_fn` trips over FSDP2's
    backward prefetch on torch 2.15: the recompute meets ops the forward did not record)."""
    options = {"context_fn": composable.checkpoint.save_matmuls()} if ac == "selective" else {}
    if run not in TORCH_CHECKPOINTED:
        for block in blocks(net):
            composable.checkpoint(block, **options)
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = net.layers if isinstance(net, Transformer) else net.model.layers
    for name, block in list(layers.named_children()):
        wrapper = checkpoint_wrapper(block, **options)
        if compile_backend is not None:
            wrapper.compile(backend=compile_backend)
        layers.register_module(name, wrapper)


def _own_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens)


def _hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False).logits
