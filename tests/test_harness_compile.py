"""The harness's processes never fall back to eager in silence: past dynamo's recompile limit a
compiled frame raises, in pytest's process and in every pool worker. Both outlive their tests,
and without this a test of compiled blocks that ran after others had compiled the same code up
to the limit would pass having compiled nothing."""

from __future__ import annotations

import pytest
import torch
from _harness import RankError, run_on_ranks


def _compile_past_the_recompile_limit() -> None:
    """Calls a compiled function with more distinct (specialized) integers than dynamo's limit."""

    def add(x: torch.Tensor, n: int) -> torch.Tensor:
        return x + n

    compiled = torch.compile(add, backend="eager", dynamic=False)
    x = torch.zeros(2)
    for n in range(torch._dynamo.config.recompile_limit + 2):
        compiled(x, n)


def _on_rank(rank: int, world: int) -> None:
    torch.compiler.reset()
    _compile_past_the_recompile_limit()


def test_the_recompile_limit_raises_in_pytests_process() -> None:
    torch.compiler.reset()
    with pytest.raises(Exception, match="recompile_limit") as error:
        _compile_past_the_recompile_limit()
    assert type(error.value).__name__ == "FailOnRecompileLimitHit"
    torch.compiler.reset()


def test_the_recompile_limit_raises_in_a_worker() -> None:
    with pytest.raises(RankError, match="FailOnRecompileLimitHit"):
        run_on_ranks(_on_rank, 2)
