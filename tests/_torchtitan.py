"""Importing torchtitan 0.2.x's llama3 train path on a machine without triton (CPU).

torchtitan imports `torchtitan.models.moe.kernels` (GPU Triton kernels for mixture-of-experts
token permutation) on every model import, and that module imports triton at its top. llama3 never
calls those kernels. Without triton, `import_torchtitan()` puts a module in its place whose
functions raise, so llama3 imports; with triton installed nothing is replaced."""

from __future__ import annotations

import importlib.util
import sys
import types

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
    stub_moe_kernels_without_triton()
    try:
        import torchtitan.components.loss  # noqa: F401
        import torchtitan.components.optimizer  # noqa: F401
        import torchtitan.distributed.pipeline_parallel  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as e:  # a dependency of torchtitan missing (datasets, tyro, tensorboard, ...)
        pytest.skip(f"torchtitan's llama3 train path does not import here: {e}", allow_module_level=True)
