"""What a failed `run_on_ranks` call raises: `RankError` and its message (root causes first, a
dead worker's crashing thread first), re-exported by `_harness`."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["RankError", "rank_error", "crashing_thread_first"]


class RankError(AssertionError):
    """Ranks raised, died, or hung after another failed; ``errors``: rank -> remote traceback."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def rank_error(
    errors: dict[int, str], results: dict[int, Any], stuck: list[int], stacks: str, grace: float
) -> RankError:
    """The RankError of a failed call: the ranks' last lines, root causes first (a peer's failure
    shows up as a gloo/NCCL error on the others), then their tracebacks and the hung ranks' stacks."""
    errors = {r: errors[r] for r in sorted(errors, key=lambda r: (_is_peer_failure(errors[r]), r))}
    lines = [f"rank {r} failed: {tb.strip().splitlines()[-1]}" for r, tb in errors.items()]
    if stuck:
        lines.append(f"ranks {stuck} did not finish within {grace} s after that (killed)")
    if results and all(_is_peer_failure(tb) for tb in errors.values()):
        lines.append(f"ranks {sorted(results)} returned normally: did they skip a collective the others issued?")
    lines += [f"\n----- traceback of rank {r} -----\n{tb.rstrip()}" for r, tb in errors.items()]
    return RankError("\n".join(lines) + stacks, errors)


# torch's fatal-signal handler prints one block per thread: "SIGSEGV(11), PID: 7, Thread 9: "
# and its frames, then a blank line.
_NATIVE_STACK_HEADER = re.compile(r"^[A-Z0-9]+\(\d+\), PID: \d+, Thread \d+: *$", re.MULTILINE)


def crashing_thread_first(text: str) -> str:
    """Put the native stack of the thread that crashed (the one running the handler,
    `fatalSignalHandler`, in its frames) before the other threads' stacks."""
    for m in _NATIVE_STACK_HEADER.finditer(text):
        end = text.find("\n\n", m.start())
        block = text[m.start() : len(text) if end < 0 else end]
        if "fatalSignalHandler" in block:
            rest = text[: m.start()] + text[m.start() + len(block) :].lstrip("\n")
            return f"----- native stack of the crashing thread -----\n{block}\n\n----- all threads -----\n{rest}"
    return text


def _is_peer_failure(tb: str) -> bool:
    last = tb.strip().splitlines()[-1]
    return any(
        s in last
        for s in (
            "Connection closed by peer",
            "Connection reset by peer",
            "remote worker",
            "NCCL communicator was aborted",
        )
    )
