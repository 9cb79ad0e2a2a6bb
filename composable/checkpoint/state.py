"""`CheckpointState`: what `checkpoint` installs on a module (its options and the per-call
switches its hooks and its in-graph forward share)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator


class CheckpointState:
    """What `checkpoint.state(module)` returns: `preserve_rng_state`, `context_fn`,
    `determinism_check`, `debug`, `early_stop` (as given) and `enabled`."""

    def __init__(
        self,
        preserve_rng_state: bool,
        context_fn: Callable[[], tuple[Any, Any]] | None,
        determinism_check: str,
        debug: bool,
        early_stop: bool,
    ) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.context_fn = context_fn
        self.determinism_check = determinism_check
        self.debug = debug
        self.early_stop = early_stop
        self.enabled = True
        # Set by the pre-hook for each call: checkpoint inside the compiled graph (in_graph.py).
        self.in_graph = False
        self._generator: Iterator[None] | None = None

    @contextmanager
    def _disabled(self) -> Iterator[None]:
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous
