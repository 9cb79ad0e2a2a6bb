"""What a captured step depends on: recorded in the last warm-up step, refused before the
capture where a graph would replay it wrongly, compared before every replay (graphed_step.py)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._engine.hooks.contract import PARAM_OWNING_APIS, get_state
from ._engine.optimizer.optim_state import STATE_ON_HOST_ATTR
from ._engine.params.wrappers import local_tensor

_API = "graphed_step"
FLOAT8_SCALE = "_precomputed_scale"  # torchao's float8 weights keep the scale of their next cast here
_OFF_GPU = "(CPU offload?): work outside the GPU is not captured in a CUDA graph, so it would never be replayed"


class Recorder:
    """While active (the last warm-up step), records the modules that ran a forward and the
    optimizers that stepped: what the captured step will depend on."""

    def __init__(self) -> None:
        self.modules: dict[int, weakref.ref[nn.Module]] = {}
        self.optimizers: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        self.kv_cache_users: list[str] = []  # models whose forward returned a KV cache

    def __enter__(self) -> None:
        # Global module hooks also run inside compiled blocks, where dynamo traces them. They
        # return at once there (no graph break, nothing of the recorder guarded on), so the
        # blocks' compiled graphs stay those of the eager steps: a graph break or recompile here
        # changed a compiled tensor-parallel block's backward (its tangents' subclass) and
        # failed it. The modules a compiled forward ran are found under the recorded ones.
        self._handles = [
            register_module_forward_pre_hook(self._on_forward),
            register_module_forward_hook(self._on_output),
            register_optimizer_step_pre_hook(self._on_step),
        ]

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _on_forward(self, module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self.modules.setdefault(id(module), weakref.ref(module))

    def _on_output(self, module: nn.Module, _args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        # HuggingFace models return their KV cache as `past_key_values` (a ModelOutput field).
        if getattr(output, "past_key_values", None) is not None:
            self.kv_cache_users.append(type(module).__name__)

    def _on_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.optimizers.setdefault(id(optimizer), weakref.ref(optimizer))

    def live_modules(self) -> list[nn.Module]:
        """The modules whose forward ran eagerly, each with every module under it (a compiled
        forward runs its submodules inside the graph, where the hooks record nothing)."""
        found: dict[int, nn.Module] = {}
        for ref in self.modules.values():
            module = ref()
            if module is not None and id(module) not in found:  # found: its whole subtree is too
                found.update((id(sub), sub) for sub in module.modules())
        return list(found.values())

    def live_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for ref in self.optimizers.values() if (o := ref()) is not None]

    def check_capturable(self) -> None:
        """What a graph would replay wrongly, refused before the capture: parameters outside
        the GPU (CPU offload: the CPU's share of the step, its optimizer step included, would
        run once at capture and never again), optimizers with `capturable=False` (their
        step counters on the CPU would never advance) or a tensor hyperparameter off the GPU
        (a CPU tensor lr: kernels take its value as a scalar, so the graph would keep the
        capture's), and models that keep a KV cache (it grows at every forward, `checkpoint`'s
        recompute included; a graph replays fixed shapes)."""
        if self.kv_cache_users:
            raise ValueError(
                f"{_API}: {self.kv_cache_users[0]}'s forward returned a KV cache (past_key_values): a cache "
                "grows at every call, which a graph cannot replay; train with model.config.use_cache = False "
                "(or pass use_cache=False)"
            )
        for module in self.live_modules():
            for name, p in module._parameters.items():
                local = local_tensor(p) if p is not None else None
                if local is not None and local.device.type != "cuda":
                    raise ValueError(
                        f"{_API}: parameter {name} of {type(module).__name__} is on {local.device} {_OFF_GPU}"
                    )
        for opt in self.live_optimizers():
            if getattr(opt, STATE_ON_HOST_ATTR, False):
                raise ValueError(
                    f"{_API}: {type(opt).__name__}'s state is kept on the host (composable.optim.offload_optimizer_state): "
                    "its copies in and out would run once at capture, never on replay; close() it to step in a CUDA graph"
                )
            for i, group in enumerate(opt.param_groups):
                if group.get("capturable") is False:
                    raise ValueError(
                        f"{_API}: {type(opt).__name__}'s param_groups[{i}] has capturable=False; build the "
                        f"optimizer with capturable=True to step it inside a CUDA graph"
                    )
                # Also where no module was recorded (a model compiled as a whole, in place, runs
                # every module inside its graph, where the recorder's hooks see none of them).
                off = next(
                    (local_tensor(p).device for p in group["params"] if local_tensor(p).device.type != "cuda"), None
                )
                if off is not None:
                    raise ValueError(
                        f"{_API}: {type(opt).__name__}'s param_groups[{i}] steps a parameter on {off} {_OFF_GPU}"
                    )
                for key, value in group.items():
                    if key != "params" and isinstance(value, torch.Tensor) and value.device.type != "cuda":
                        raise ValueError(
                            f"{_API}: {type(opt).__name__}'s param_groups[{i}] has its {key} tensor on "
                            f"{value.device}: kernels would take its value once, at capture; put it on the GPU "
                            f"(torch.tensor(..., device='cuda')) and change it in place"
                        )


# Settings of a fully_shard/replicate state that change what a step does.
_STATE_SETTINGS = ("requires_gradient_sync", "reshard_after_forward", "reshard_after_backward", "is_last_backward")
_REDUCER_SETTINGS = ("requires_all_reduce", "divide_factor")


class Snapshot:
    """What the captured step depends on and Python could change between replays, as one
    tuple per module and per optimizer, compared before every replay."""

    def __init__(self, recorder: Recorder) -> None:
        self.modules = recorder.live_modules()
        self.optimizers = recorder.live_optimizers()
        self.module_values = [_module_settings(m) for m in self.modules]
        self.optimizer_values = [_optimizer_settings(o) for o in self.optimizers]

    def check(self, after_capture: bool = False) -> None:
        """Raise `RuntimeError` naming the first setting that differs from the snapshot's
        (`after_capture`: the capture itself, one step, changed it)."""
        when = "while it was captured" if after_capture else "since capture"
        for module, old in zip(self.modules, self.module_values):
            new = _module_settings(module)
            if new != old:
                raise RuntimeError(f"{_API}: {type(module).__name__} changed {when}: {_first_difference(old, new)}")
        for opt, old in zip(self.optimizers, self.optimizer_values):
            new = _optimizer_settings(opt)
            if new != old:
                hint = ""
                if any(name == "lr" and not isinstance(now, _TensorAt) for name, _, now in _differences(old, new)):
                    hint = " (for a schedule, give lr as a tensor and change it in place)"
                raise RuntimeError(f"{_API}: {type(opt).__name__} changed {when}: {_first_difference(old, new)}{hint}")


def _module_settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    items: list[tuple[str, Any]] = [("training", module.training)]
    for name, p in module._parameters.items():  # checked before every replay: kept cheap
        if p is not None:
            items += ((f"{name}.requires_grad", p.requires_grad), (f"parameter {name}", _storage_id(p)))
            scale = getattr(local_tensor(p), FLOAT8_SCALE, None)  # torchao float8 weights: the next cast's scale
            if scale is not None:
                items.append((f"float8 scale of {name}", _storage_id(scale)))
    for api in PARAM_OWNING_APIS:
        state = get_state(module, api)
        if state is None:
            continue
        items += [(f"{api} {s}", getattr(state, s, None)) for s in _STATE_SETTINGS]
        for s in ("forward_prefetch", "backward_prefetch"):
            items.append((f"{api} {s}", tuple(id(x) for x in getattr(state, s, None) or ())))
        for group in state.groups:  # per-parameter meshes: each group's reducer has its own settings
            items += [(f"{api} {s}", getattr(group.reducer.options, s)) for s in _REDUCER_SETTINGS]
    return tuple(items)


def _optimizer_settings(opt: torch.optim.Optimizer) -> tuple[tuple[str, Any], ...]:
    items: list[tuple[str, Any]] = []
    for i, group in enumerate(opt.param_groups):
        params = group["params"]
        items.append((f"param_groups[{i}] parameters", tuple(_storage_id(p) for p in params)))
        for key, value in group.items():
            if key == "params":
                continue
            # A tensor is read at every replay: it may change in place, not be replaced.
            items.append((key, _TensorAt(_storage_id(value)) if isinstance(value, torch.Tensor) else value))
        for p in params:
            state = opt.state.get(p, {})
            items.append(("state", tuple(_storage_id(v) for v in state.values() if isinstance(v, torch.Tensor))))
    return tuple(items)


class _TensorAt(int):
    """A tensor hyperparameter in a snapshot: the memory the graph reads it from."""

    def __repr__(self) -> str:
        return "a tensor"


def _storage_id(t: torch.Tensor) -> int:
    """Which memory a parameter or state tensor is: a graph reads and writes addresses (the
    Python object may be rewrapped, as a DTensor optimizer step counter is every step)."""
    return local_tensor(t).data_ptr()


def _differences(old: tuple[Any, ...], new: tuple[Any, ...]) -> list[tuple[str, Any, Any]]:
    if len(old) != len(new):
        return [("number of settings", len(old), len(new))]
    return [(a[0], a[1], b[1]) for a, b in zip(old, new) if a != b]


def _first_difference(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    name, was, now = _differences(old, new)[0]
    if name.startswith("float8 scale"):
        return (
            f"{name} replaced by another tensor: torchao's precompute_float8_dynamic_scale_for_fsdp makes new "
            "scale tensors at every call, which a graph cannot follow; use "
            "composable.integrations.float8.precompute_float8_dynamic_scale_for_fsdp (the same scales, in place)"
        )
    if isinstance(was, _TensorAt) and isinstance(now, _TensorAt):
        return f"{name} replaced by another tensor (a graph reads the captured one at every replay: change it in place)"
    if name.startswith(("parameter", "param_groups", "state")):
        return f"{name} replaced by other tensors (a graph keeps using the captured ones; build a new graphed_step)"
    return f"{name} was {was!r}, is {now!r} (a graph replays what was captured; build a new graphed_step)"
