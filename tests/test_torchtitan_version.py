"""composable.integrations.torchtitan targets torchtitan 0.2.x: another version is refused at
the call, naming the supported range (checked with a faked installed version)."""

from __future__ import annotations

import importlib.metadata

import pytest

from composable.integrations import torchtitan as adapter


@pytest.mark.parametrize("version", ["0.2.0", "0.2.2", "0.2.1.dev20250601+cu128"])
def test_supported(version: str) -> None:
    adapter.check_torchtitan_version(version)


@pytest.mark.parametrize("version", ["0.3.0", "0.1.0", "1.0.0"])
def test_refused(version: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"supports torchtitan >= 0.2, < 0.3 .*found torchtitan {version}"):
        adapter.check_torchtitan_version(version)


def test_entry_points_refuse_torchtitan_0_3(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.0" if name == "torchtitan" else real(name))
    with pytest.raises(NotImplementedError, match="found torchtitan 0.3.0"):
        adapter.register_llama3()
    with pytest.raises(NotImplementedError, match="found torchtitan 0.3.0"):
        adapter.parallelize_llama(None, None, None)  # type: ignore[arg-type]
