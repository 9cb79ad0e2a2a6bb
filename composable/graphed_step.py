"""`graphed_step`: a whole training step captured once in a CUDA graph and replayed.

At small per-GPU batches the host sets the pace: every step runs the hooks, the autograd
engine, the optimizer's Python and thousands of kernel launches, and the GPU waits for them
(BENCHMARKS.md). A replayed CUDA graph launches the whole step, forward, backward, every
all-gather and reduction and the optimizer step, as one unit, with no Python in between.

What a graph can and cannot see is the contract (`graphed_step`'s docstring); what would
silently go wrong is checked before every replay (`_graphed_checks.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import torch
import torch.utils._pytree as pytree

from ._graphed_checks import Recorder, Snapshot

_API = "graphed_step"
T = TypeVar("T")


def graphed_step(step: Callable[..., T], *, warmup: int = 2) -> "GraphedStep[T]":
    """Wrap `step`, one whole training step, so that it runs as a replayed CUDA graph.

    `step(*args, **kwargs)` does everything one training step does: forward, backward (with
    any `no_sync` micro-batches, `checkpoint`, `clip_grad_norm_`, `ShardedGradScaler`), the
    optimizer step and `zero_grad`, over modules under `fully_shard`/`replicate` (compiled or
    not) or plain ones. Call the returned object as you would call `step`; every call is one
    real training step:

    - the first `warmup` calls run `step` eagerly, on a side stream (lazy initialisation,
      compilation, NCCL communicators and cuBLAS workspaces happen there, outside the graph);
    - the next call captures `step` in a CUDA graph and replays it;
    - later calls copy their tensor arguments into the captured ones and replay.

    It returns what `step` returns, tensors cloned (they stay valid after the next call).

    What must stay as it was at capture (a graph replays the captured kernels, not the Python):
    - the arguments: tensors (CUDA, no autograd history) of the same shapes, dtypes and
      devices; every other argument equal. Else `ValueError` naming the argument.
    - modules the step ran: train/eval mode, `requires_grad`, the settings of their
      `fully_shard`/`replicate` states (`set_requires_gradient_sync`, reshard and prefetch
      settings...); optimizers it stepped: their parameters, state tensors and non-tensor
      hyperparameters. A change raises `RuntimeError` naming it before anything is replayed.
      For a learning-rate schedule give the optimizer `lr` as a tensor on the GPU
      (`torch.tensor(lr, device="cuda")`; `composable.optim.Muon` takes one too) and change it
      in place: tensors are read at every replay. A tensor hyperparameter on the CPU is refused
      before the capture (`ValueError`), one replaced by another tensor before a replay.
    - Python decisions inside `step` (branches, `.item()`, data-dependent shapes) are taken
      once, at capture; a step that synchronises with the CPU cannot be captured and
      raises `RuntimeError`. Optimizers need `capturable=True` (Adam, AdamW...), and every
      parameter must live on the GPU (no CPU offload): `ValueError` before the capture.

    Memory: the graph keeps the step's temporaries in a private pool: peak allocated memory is
    the eager step's; reserved memory is higher (the pool sits beside the caching allocator's).
    """
    if not callable(step):
        raise TypeError(f"{_API}: 'step' must be callable, got {type(step).__name__}: {step!r:.80}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"{_API}: 'warmup' must be an int >= 1 (the eager steps before capture), got {warmup!r}")
    return GraphedStep(step, warmup)


class GraphedStep(Generic[T]):
    """The callable `graphed_step` returns; see there. `graph` is None until captured."""

    def __init__(self, step: Callable[..., T], warmup: int) -> None:
        self.step = step
        self.warmup = warmup
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._inputs: _Inputs | None = None
        self._output: Any = None
        self._snapshot: Snapshot | None = None
        self._recorder: Recorder | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        if self.graph is None:
            _Inputs.check_first((args, kwargs))
            if self.calls < self.warmup:
                last = self.calls == self.warmup - 1
                out = self._eager(args, kwargs, record=last)
                self.calls += 1
                return out
            self._capture(_Inputs((args, kwargs)))
        else:
            assert self._inputs is not None and self._snapshot is not None
            self._inputs.load((args, kwargs))
            self._snapshot.check()
        assert self.graph is not None
        self.graph.replay()
        self.calls += 1
        out = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), self._output)
        return cast(T, out)  # the captured output's structure; torch's pytree types it as Any

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any], record: bool) -> T:
        """One eager step on the side stream (CUDA's rule for work before a capture)."""
        side = _side_stream()
        side.wait_stream(torch.cuda.current_stream())
        recorder = Recorder() if record else None
        try:
            with torch.cuda.stream(side), recorder or contextlib.nullcontext():
                out = self.step(*args, **kwargs)
        finally:
            torch.cuda.current_stream().wait_stream(side)
        if recorder is not None:
            self._recorder = recorder
        return out

    def _capture(self, inputs: "_Inputs") -> None:
        recorder = self._recorder
        assert recorder is not None, "the last warm-up step records the modules and optimizers"
        recorder.check_capturable()
        snapshot = Snapshot(recorder)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # the warm-up steps are done; nothing of theirs runs into the graph
        # A capture that fails leaves the device's default generator in capture mode (torch
        # ends its capture only on success): every later random op would fail. Keep its state.
        generator = torch.cuda.default_generators[torch.cuda.current_device()]
        rng_before = generator.clone_state()
        raised: list[BaseException] = []  # the step's own error: ending the capture raises another over it
        try:
            with torch.cuda.graph(graph, stream=_side_stream()):
                try:
                    out = self.step(*inputs.args, **inputs.kwargs)
                except Exception as err:
                    raised.append(err)
                    raise
        except Exception as err:
            generator.graphsafe_set_state(rng_before)
            _SIDE_STREAMS.pop(torch.cuda.current_device(), None)  # the next steps start on a fresh stream
            raise _capture_error(raised[0] if raised else err) from (raised[0] if raised else err)
        _check_output(out)
        snapshot.check(after_capture=True)  # the captured step itself changed what it reads
        self.graph, self._inputs, self._output, self._snapshot = graph, inputs, out, snapshot
        self._recorder = None


# The warm-up steps and the capture run on one side stream per device, shared by every graphed
# step: cuBLAS and cuBLASLt keep a workspace per stream for the life of the process (32 MiB
# each on an H100, allocated memory), so a new stream per warm-up step left 64 MiB more
# allocated after each one (1b model, batch 1: peak 1.035x FSDP2's instead of the eager step's).
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _capture_error(err: BaseException) -> RuntimeError:
    """The error to raise for a failed capture: the step's own first error, with a hint that
    fits it (a synchronisation with the CPU, or code that runs differently while captured)."""
    text = str(err).strip()
    first = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
    if "capture" in text.lower() or "synchroniz" in text.lower() or "not permitted" in text.lower():
        hint = (
            "a captured step must not synchronise with the CPU (.item(), .tolist(), printing or branching on a "
            "tensor's value)"
        )
    else:
        hint = (
            "the step ran eagerly in the warm-up and raised while captured: code that takes another path during "
            "a capture (HuggingFace models check torch.cuda.is_current_stream_capturing()) or keeps state across "
            "calls (a KV cache: use_cache=False) cannot be captured"
        )
    return RuntimeError(f"{_API}: capturing the step failed ({first}); {hint}")


class _Inputs:
    """The captured arguments: tensor leaves become static buffers, the rest stays as given."""

    def __init__(self, tree: Any) -> None:
        leaves, self.spec = pytree.tree_flatten_with_path(tree)
        self.paths = [_where(path) for path, _ in leaves]
        self.leaves = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for _, leaf in leaves]
        self.args, self.kwargs = pytree.tree_unflatten(self.leaves, self.spec)

    @staticmethod
    def check_first(tree: Any) -> None:
        """Check the arguments of a call before capture: CUDA tensors without autograd history."""
        if not torch.cuda.is_available():
            raise RuntimeError(f"{_API}: CUDA graphs need a CUDA device, and torch.cuda.is_available() is False")
        for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                if leaf.requires_grad:
                    raise ValueError(
                        f"{_API}: argument {_where(path)} requires grad: a graph cannot carry autograd history "
                        "into the step; pass it detached"
                    )
                if leaf.device.type != "cuda":
                    raise ValueError(
                        f"{_API}: argument {_where(path)} is on {leaf.device}: a graphed step's tensors must be on CUDA"
                    )

    def load(self, tree: Any) -> None:
        """Check a replay's arguments against the captured ones and copy its tensors in."""
        leaves, spec = pytree.tree_flatten(tree)
        if spec != self.spec:
            raise ValueError(f"{_API}: the arguments' structure changed since capture: {spec} (captured: {self.spec})")
        for where, new, old in zip(self.paths, leaves, self.leaves):
            if isinstance(old, torch.Tensor):
                if not isinstance(new, torch.Tensor):
                    raise ValueError(f"{_API}: argument {where} must be a tensor as at capture, got {new!r:.80}")
                if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
                    raise ValueError(
                        f"{_API}: argument {where} is {_describe_tensor(new)}, captured as {_describe_tensor(old)}: a graph "
                        "replays fixed shapes (pad the batch, or make one graphed_step per shape)"
                    )
            elif new is not old and not _equal(new, old):
                raise ValueError(
                    f"{_API}: argument {where} is {new!r:.80}, captured as {old!r:.80}: non-tensor arguments are "
                    "frozen at capture"
                )
        for new, old in zip(leaves, self.leaves):
            if isinstance(old, torch.Tensor) and new is not old:
                old.copy_(new, non_blocking=True)


def _check_output(out: Any) -> None:
    """A Python number returned by the step would be the capture's value forever after."""
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            raise TypeError(
                f"{_API}: the step returned a Python number at output{pytree.keystr(path)} ({leaf!r}); it "
                "would be frozen at capture: return a tensor"
            )


def _where(path: tuple[Any, ...]) -> str:
    """`args[0]`, `kwargs['batch']`, ... for a pytree key path of (args, kwargs)."""
    text = pytree.keystr(path)
    if text.startswith("[0]"):
        return "args" + text[3:]
    if text.startswith("[1]"):
        return "kwargs" + text[3:]
    return text


def _describe_tensor(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _equal(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False
