"""composable.integrations.torchtitan serves torchtitan 0.2.x (register_llama3 / parallelize_llama
/ pipeline_llama) and 0.3.x (composable_model_spec / use_composable_in_torchtitan): another version is refused
at the call, naming the supported range, and each release's entry points refuse the other
release, naming the ones to use (checked with a faked installed version)."""

from __future__ import annotations

import importlib.metadata

import pytest

from composable.integrations import torchtitan as adapter


@pytest.mark.parametrize("version", ["0.2.0", "0.2.2", "0.2.1.dev20250601+cu128", "0.3.0", "0.3.1+cu130"])
def test_supported(version: str) -> None:
    adapter.check_torchtitan_version(version)


@pytest.mark.parametrize("version", ["0.4.0", "0.1.0", "1.0.0"])
def test_refused(version: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"supports torchtitan >= 0.2, < 0.4 .*found torchtitan {version}"):
        adapter.check_torchtitan_version(version)


def _fake_installed(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "torchtitan" else real(name))


def test_0_2_entry_points_refuse_torchtitan_0_3(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, "0.3.0")
    match = r"register_llama3 / parallelize_llama / pipeline_llama are for torchtitan 0.2.x, found torchtitan 0.3.0; use composable_model_spec"
    with pytest.raises(NotImplementedError, match=match):
        adapter.register_llama3()
    with pytest.raises(NotImplementedError, match=match):
        adapter.parallelize_llama(None, None, None)  # type: ignore[arg-type]


def test_0_3_entry_points_refuse_torchtitan_0_2(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, "0.2.2")
    match = r"composable_model_spec / use_composable_in_torchtitan are for torchtitan 0.3.x, found torchtitan 0.2.2; use register_llama3"
    with pytest.raises(NotImplementedError, match=match):
        adapter.composable_model_spec(None)
    with pytest.raises(NotImplementedError, match=match):
        adapter.use_composable_in_torchtitan()
    with pytest.raises(NotImplementedError, match=match), adapter.sharding_with_composable():
        pass


def test_every_entry_point_refuses_torchtitan_0_4(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, "0.4.0")
    for call in (
        adapter.register_llama3,
        adapter.use_composable_in_torchtitan,
        lambda: adapter.composable_model_spec(None),
    ):
        with pytest.raises(NotImplementedError, match=r"supports torchtitan >= 0.2, < 0.4 .*found torchtitan 0.4.0"):
            call()
