"""pytest setup: make tests/ importable (`from _harness import ...`), the fake-world mesh fixtures
(`world2`, `world4`), quiet hypothesis."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# pytest's default import mode already does this; `--import-mode=importlib` does not.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from _harness import fake_process_group  # noqa: E402 (needs tests/ on the path, above)


@pytest.fixture
def world2() -> Iterator[DeviceMesh]:
    """Rank 0 of a fake 2-rank world; yields its 1D mesh."""
    with fake_process_group(2):
        yield init_device_mesh("cpu", (2,))


@pytest.fixture
def world4() -> Iterator[tuple[DeviceMesh, DeviceMesh]]:
    """Rank 0 of a fake 4-rank world; yields (1D mesh, 2D (2, 2) mesh)."""
    with fake_process_group(4):
        yield init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))


try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass
else:
    # Multi-process examples take tens of milliseconds each: no deadline, few examples.
    settings.register_profile(
        "composable",
        deadline=None,
        max_examples=20,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "composable"))


def pytest_unconfigure(config: object) -> None:
    """Stop the worker pool when pytest is done rather than at interpreter exit, so pytest
    exits promptly."""
    harness = sys.modules.get("_harness")
    if harness is not None:
        harness.shutdown_pool()
