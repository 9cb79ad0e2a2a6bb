"""Named ranges in profiles and traces, paid for only while a profiler runs."""

from __future__ import annotations

import functools
from typing import Callable, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def labelled(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: calls of the function show as a `record_function` range `name` in
    `torch.profiler` traces. Without a profiler it costs one flag check: a range would cost
    microseconds per call, on every hook of every group of every step."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if not torch.autograd.profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return wrapper

    return decorate
