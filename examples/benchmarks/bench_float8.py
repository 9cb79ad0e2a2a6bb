"""The benchmark's `--float8`: torchao float8 training for every contender.

Every `nn.Linear` of the blocks becomes torchao's `Float8Linear` (tensorwise dynamic scaling:
inputs, weights and output gradients cast to float8 for the matmuls), on the meta-device model
before compilation and before any API is applied, as torchao and torchtitan do. Left in high
precision: the output head (`output` / `lm_head`; its logits feed the loss, and torchao's
recipes keep it out) and any linear whose dimensions are not multiples of 16 (`_scaled_mm`'s
requirement). For the FSDP-style contenders (fully_shard, FSDP2) the weights also all-gather
in float8 (`enable_fsdp_float8_all_gather`: half the bf16 bytes), and the next step's weight
scales are computed after each optimizer step in one all-reduce
(`precompute_float8_dynamic_scale_for_fsdp`: torchao's for FSDP2, composable's in-place twin
for fully_shard, the same scales bit for bit, which a CUDA graph can capture and which costs
less host time). The floor, replicate and DDP gather nothing, so their weights stay plain
tensors and are cast in each forward.
"""

from __future__ import annotations

from torch import nn

FLOAT8_MISSING = "--float8 needs torchao (float8 training), which is not installed: pip install torchao"
FSDP_RUNS = ("fully_shard", "fsdp2")  # the contenders that all-gather weights


def float8_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def convertible(module: nn.Module, head: nn.Module) -> bool:
    """Whether `module` is a linear that trains in float8: not the head, every dim a multiple of 16."""
    return (
        isinstance(module, nn.Linear)
        and module is not head
        and all(d % 16 == 0 for d in (module.in_features, module.out_features))
    )


def to_float8(model: nn.Module, head: nn.Module, run: str) -> nn.Module:
    """Swap `model`'s convertible linears for `Float8Linear`s in place, with float8 all-gather
    for the FSDP-style runs; returns `model`."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(FLOAT8_MISSING) from e
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=run in FSDP_RUNS)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: convertible(m, head))


def after_step_in_place(model: nn.Module) -> None:
    """`after_step` for fully_shard, eager or graphed: composable's twin of torchao's, the same
    scales written into the tensors the weights hold (torchao's makes new ones at every call,
    which a CUDA graph cannot follow), from the local shards' plain data."""
    from composable.integrations.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def after_step(model: nn.Module) -> None:
    """After each optimizer step of a FSDP-style run: every float8 weight's scale for the next
    forward, from its sharded weights, in one all-reduce (a no-op for weights that do not
    all-gather in float8)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
