"""Importing torchtitan 0.2.x's llama3 train path on a machine without triton (CPU).

torchtitan imports `torchtitan.models.moe.kernels` (GPU Triton kernels for mixture-of-experts
token permutation) on every model import, and that module imports triton at its top. llama3 never
calls those kernels. Without triton, `import_torchtitan()` puts a module in its place whose
functions raise, so llama3 imports; with triton installed nothing is replaced."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest


def _kernels_unavailable(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("torchtitan's MoE Triton kernels need triton, which is not installed")


def stub_moe_kernels_without_triton() -> None:
    """Without triton, put a stand-in for torchtitan's MoE kernels module (functions that
    raise), so that the rest of torchtitan imports; with triton, nothing."""
    if importlib.util.find_spec("triton") is None and "torchtitan.models.moe.kernels" not in sys.modules:
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = _kernels_unavailable  # type: ignore[attr-defined]
        kernels.fill_indices_wrapper = _kernels_unavailable  # type: ignore[attr-defined]
        sys.modules["torchtitan.models.moe.kernels"] = kernels


def import_torchtitan() -> None:
    """Import torchtitan's llama3 model, pipelining, loss and optimizer modules, or skip the
    calling test module with the reason."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed (pip install 'composable[torchtitan]')", allow_module_level=True)
    found = torchtitan_version()
    if found is not None and found[:2] != (0, 2):
        pytest.skip(f"these tests are for torchtitan 0.2, found {found}", allow_module_level=True)
    stub_moe_kernels_without_triton()
    try:
        import torchtitan.components.loss  # noqa: F401
        import torchtitan.components.optimizer  # noqa: F401
        import torchtitan.distributed.pipeline_parallel  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as e:  # a dependency of torchtitan missing (datasets, tyro, tensorboard, ...)
        pytest.skip(f"torchtitan's llama3 train path does not import here: {e}", allow_module_level=True)


# ----------------------------------------------------------------------------- torchtitan 0.3


def torchtitan_version() -> tuple[int, ...] | None:
    """The installed torchtitan's (major, minor), or None without it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("torchtitan")
    except PackageNotFoundError:
        return None
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())


def import_torchtitan_v03() -> None:
    """Import torchtitan 0.3's models and distributed modules, or skip the calling test module
    with the reason (torchtitan missing, another version, a torch older than it needs)."""
    found = torchtitan_version()
    if found is None:
        pytest.skip("torchtitan is not installed (pip install 'composable[torchtitan]')", allow_module_level=True)
    if found[:2] != (0, 3):
        pytest.skip(f"these tests are for torchtitan 0.3, found {found}", allow_module_level=True)
    try:
        import torchtitan.distributed.fsdp  # noqa: F401
        import torchtitan.distributed.full_dtensor  # noqa: F401
        import torchtitan.models.deepseek_v3  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
        import torchtitan.models.qwen3  # noqa: F401
    except ImportError as e:  # torchtitan 0.3 needs torch 2.15's FSDP2 names (DataParallelMeshDims, ...)
        pytest.skip(f"torchtitan 0.3 does not import with torch {_torch_version()}: {e}", allow_module_level=True)


def _causal_sdpa(config: Any) -> Any:
    """`config` with every attention's inner attention torch's causal SDPA: torchtitan's language
    models default to FlexAttention, which has no backward on CPU (the same math on CPU)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _torch_version() -> str:
    import torch

    return torch.__version__


def tiny_llama3() -> Any:
    """torchtitan 0.3's llama3 (its own building blocks and initialisers) at a tiny size."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, vocab, heads = 32, 64, 4
    config = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=heads,
            hidden_dim=64,
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    return _causal_sdpa(config)


def tiny_qwen3_moe(num_experts: int = 2) -> Any:
    """torchtitan 0.3's qwen3 mixture-of-experts model at a tiny size (with fewer experts than
    ranks torchtitan shards the experts on their dim 1, through a shard_placement_fn)."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    dim, vocab, head_dim = 32, 64, 8
    config = qwen3.Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            moe_hidden_dim=16,
            num_experts=num_experts,
            top_k=2,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0),
            moe_comm_backend="standard",
        ),
    )
    return _causal_sdpa(config)


def tiny_deepseek_v3() -> Any:
    """torchtitan 0.3's deepseek_v3 (MLA attention, one dense block, then MoE blocks with a
    shared expert) at a tiny size."""
    import torchtitan.models.deepseek_v3 as dsv3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, vocab, rope_dim = 32, 64, 8
    layers = dsv3._build_dsv3_layers(
        n_layers=2,
        n_dense_layers=1,
        dim=dim,
        n_heads=2,
        q_lora_rank=0,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=rope_dim,
        v_head_dim=8,
        mscale=0.70,
        dense_hidden_dim=64,
        moe_hidden_dim=16,
        num_experts=4,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_seq_len=256,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=64,
        ),
    )
    config = dsv3.DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=dsv3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=dsv3._output_linear_init(dim)),
        layers=layers,
        mtp_layers=[],
    )
    return _causal_sdpa(config)


def v03_build_kwargs(dims: Any, training: Any, parallelism: Any) -> dict[str, Any]:
    """The keyword arguments torchtitan 0.3's `parallelize_fn` and `pipelining_fn` both take
    from its trainer, as the tests build them: no compile, no activation checkpointing, no dump
    folder."""
    from torchtitan.config import CompileConfig

    return dict(
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )


def fsdp2_sums_on_gloo(modules: Any) -> None:
    """Every FSDP2 module under `modules` reduces with a plain sum: gloo has no PREMUL_SUM,
    which FSDP2 uses for a divide factor of 1.0."""
    from torch.distributed.fsdp import FSDPModule

    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
