"""Which torchtitan releases `composable.integrations.torchtitan` serves, and the check each
entry point runs: 0.2.x and 0.3.x, each release with its own entry points."""

from __future__ import annotations

SUPPORTED = ((0, 2), (0, 4))  # torchtitan versions this adapter targets: >= 0.2, < 0.4
_FOR_0_2 = "register_llama3 / parallelize_llama / pipeline_llama"
_FOR_0_3 = "composable_model_spec / use_composable_in_torchtitan"


def installed_torchtitan_version() -> str | None:
    """The installed torchtitan's version string, or None where it cannot be told."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("torchtitan")
    except PackageNotFoundError:  # a source checkout without metadata: its own attribute
        import torchtitan

        return getattr(torchtitan, "__version__", None)


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


def check_torchtitan_version(version: str | None = None, *, api: str | None = None) -> None:
    """`NotImplementedError` naming the supported range unless torchtitan (the installed one, or
    `version`) is 0.2.x or 0.3.x; with `api` ("0.2" or "0.3"), also unless it is the release
    that API is for (0.3 reorganised the model and parallelism modules: 0.2's entry points
    replace llama3's `parallelize_fn`, 0.3's swap the `fully_shard` its parallelize code calls)."""
    if version is None:
        version = installed_torchtitan_version()
        if version is None:
            return  # nothing to compare: the imports below fail, naming what is missing
    parts = _major_minor(version)
    if not SUPPORTED[0] <= parts < SUPPORTED[1]:
        raise NotImplementedError(
            f"composable.integrations.torchtitan supports torchtitan >= 0.2, < 0.4 (0.2.x: {_FOR_0_2}; "
            f"0.3.x: {_FOR_0_3}), found torchtitan {version}"
        )
    if api is not None and parts[:2] != tuple(int(p) for p in api.split(".")):
        wanted, other = (_FOR_0_2, _FOR_0_3) if api == "0.2" else (_FOR_0_3, _FOR_0_2)
        raise NotImplementedError(
            f"composable.integrations.torchtitan: {wanted} are for torchtitan {api}.x, found torchtitan {version}; "
            f"use {other}"
        )
