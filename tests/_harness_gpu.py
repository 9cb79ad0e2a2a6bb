"""GPU test marks, re-exported by `_harness`: a test or parameter marked ``gpu`` (``pytest -m gpu``
runs the GPU suite) and skipped unless enough CUDA devices are visible; and inductor's async-TP
switch put back after a test that turns it on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

__all__ = ["requires_gpus", "gpu_worlds", "on_gpus", "async_tp_restored"]


def _gpu_marks(n: int) -> list[Any]:
    """``gpu`` (``pytest -m gpu`` runs the GPU suite) and a skip unless ``n`` CUDA devices are visible."""
    return [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPU(s)")]


def requires_gpus(n: int) -> Callable[[Any], Any]:
    """Mark a test ``gpu`` and skip it unless at least ``n`` CUDA devices are visible."""

    def mark(test: Any) -> Any:
        for m in _gpu_marks(n):
            test = m(test)
        return test

    return mark


def gpu_worlds(*sizes: int) -> list[Any]:
    """World sizes for a GPU test's ``world`` parameter (ids ``world1``, ``world2``, ...), each
    with `requires_gpus`' marks for its size, so that one GPU runs the world-1 form and two GPUs
    run both."""
    return [pytest.param(n, id=f"world{n}", marks=_gpu_marks(n)) for n in sizes]


def on_gpus(value: Any, n: int, id: str | None = None) -> Any:
    """A test parameter ``value`` with `requires_gpus`' marks for ``n`` GPUs, beside CPU forms
    of the same test: ``parametrize("device", ["cpu", on_gpus("cuda", 4, id="nccl")])``."""
    return pytest.param(value, id=id, marks=_gpu_marks(n))


@contextlib.contextmanager
def async_tp_restored() -> Iterator[None]:
    """Inductor's micro-pipeline (async TP) switch as it was on entry, again on exit: the examples'
    `enable_async_tp` turns it on for the whole process, and a harness worker outlives its test."""
    import torch._inductor.config as inductor_config

    before = inductor_config._micro_pipeline_tp
    try:
        yield
    finally:
        inductor_config._micro_pipeline_tp = before
