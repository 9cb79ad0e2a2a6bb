"""pytest setup: make tests/ importable (`from _harness import ...`), quiet hypothesis."""

from __future__ import annotations

import os
import sys

# pytest's default import mode already does this; `--import-mode=importlib` does not.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

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


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    """Stop the worker pool now rather than at interpreter exit, so pytest exits promptly."""
    harness = sys.modules.get("_harness")
    if harness is not None:
        harness.shutdown_pool()
