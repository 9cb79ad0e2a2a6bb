"""The DeepSpeed ZeRO-Offload contender (`--runs deepspeed_offload`): the same model, data and
AdamW trained by DeepSpeed's engine, beside composable's CPU offload and FSDP2's.

- ZeRO stage 3: fully_shard and FSDP2 shard the parameters as well as the gradients and the
  optimizer state, and so does stage 3 alone (stages 1 and 2 keep every parameter whole on every
  GPU). DeepSpeed gathers each module's parameters around its forward and backward and
  reduce-scatters its gradients, as they gather and reduce each group's.
- ZeRO-Offload (`offload_optimizer: {device: cpu, pin_memory: true}`): the fp32 master weights,
  the AdamW moments and the step on the host, stepped by DeepSpeed's own `DeepSpeedCPUAdam`
  (what its users take; AdamW mode, with `torch.optim.AdamW`'s betas, eps and weight decay,
  which the other contenders' fused AdamW runs with); the bf16 parameter shards stay on the GPU
  (as `fully_shard_offload_on_device`'s compute shards), the fp32 gradients go to the host.
- bf16 compute (`bf16: {enabled: true}`: the engine casts the parameters, not the buffers, so the
  rotary tables stay fp32), gradients reduced in fp32 (`communication_data_type`), as the other
  sharded contenders' `reduce_dtype`; `--max-norm` as `gradient_clipping`; the micro-batch is
  the benchmark's local batch, one micro-batch a step.
- `--ac` checkpoints its blocks as FSDP2's (torch's `checkpoint_wrapper`, bench_build.py) and
  `--loss-chunk` gives it the same chunked loss; `--wrap` does not apply (ZeRO-3 gathers each
  module that holds parameters, its own prefetch grouping them); the rest of DeepSpeed's
  settings are its defaults.

The engine joins the process group the benchmark made (DeepSpeed wraps an initialised
torch.distributed instead of making its own). `deepspeed` is imported only when the run is built;
`deepspeed_problem` is the flag check that needs no import, for parse time.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
from typing import Any

import torch

from benchmarks.bench_build import DEEPSPEED_RUNS, Contender

DEEPSPEED_MISSING = (
    "--runs deepspeed_offload needs the deepspeed package, which is not installed: pip install deepspeed"
)


def deepspeed_available() -> bool:
    """Whether `deepspeed` can be imported (found, not imported: importing it is slow and loud)."""
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_problem(args: argparse.Namespace) -> str | None:
    """Why `--runs` cannot run its DeepSpeed contender with these flags (one line), None when it
    can or none is asked for. Read after `--compile`'s default is derived. The model, mesh,
    optimizer, --float8 and --moe are checked with the other offload runs (bench_args.py)."""
    asked = [run for run in args.runs.split(",") if run in DEEPSPEED_RUNS]
    if not asked or args.cpu_overhead:
        return None
    if not deepspeed_available():
        return DEEPSPEED_MISSING
    if args.compile:
        # A compiled block's call takes its module hooks in, ZeRO-3's gather and release hooks
        # among them: dynamo recompiles those for every module until its recompile limit and
        # runs the rest eagerly (seen on the CPU, torch 2.13), a mix measured as neither.
        # DeepSpeed compiles its own way (engine.compile), not measured here.
        return f"--runs {asked[0]} runs eagerly: drop --compile"
    return None


def adamw_hyperparameters() -> dict[str, Any]:
    """`torch.optim.AdamW`'s betas, eps and weight decay: what the other contenders' fused AdamW
    (bench_optim.py, given only the learning rate) runs with."""
    defaults = inspect.signature(torch.optim.AdamW).parameters
    return {name: defaults[name].default for name in ("betas", "eps", "weight_decay")}


def deepspeed_config(batch_size: int, max_norm: float) -> dict[str, Any]:
    """The engine's configuration: ZeRO-3 with its optimizer on the host, bf16, `batch_size`
    sequences a step on each rank, gradients clipped to `max_norm` (0: not clipped)."""
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_norm,
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "steps_per_print": 2**31 - 1,  # the benchmark prints its own lines
        "wall_clock_breakdown": False,
    }


class DeepSpeedStep:
    """The `deepspeed_offload` contender's engine and its training step.

    Built from the contender `build` made (its model materialised and initialised on the device,
    nothing applied): `contender` is the same with the engine as its model, `optimizer` the
    `DeepSpeedCPUAdam` inside it. Calling it on tokens (B, T + 1) runs one step, the engine's
    forward, `engine.backward(loss)` and `engine.step()` (the clipping and the host step), and
    returns the loss before the step; `loss_chunk` > 0: the head's chunked loss. `close()` releases the engine's hooks and
    buffers before the next contender is built."""

    def __init__(self, c: Contender, lr: float, batch_size: int, max_norm: float, loss_chunk: int = 0) -> None:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        deepspeed.utils.logger.setLevel(logging.WARNING)  # its configuration dump, every rank
        optimizer = DeepSpeedCPUAdam(c.model.parameters(), lr=lr, adamw_mode=True, **adamw_hyperparameters())
        # dist_init_required=False: the benchmark's process group, already initialised, is the one.
        engine, *_ = deepspeed.initialize(
            model=c.model, optimizer=optimizer, config=deepspeed_config(batch_size, max_norm), dist_init_required=False
        )
        self.engine, self.optimizer, self.loss_chunk = engine, optimizer, loss_chunk
        self.contender = c._replace(model=engine)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = self.contender.loss(tokens, self.loss_chunk)  # its model is the engine
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def close(self) -> None:
        """Release the engine: its hooks and buffers (`destroy`), and the two references to the
        model that DeepSpeed 0.19.8 keeps past it. Without them the model, and through its hooks
        the engine with its optimizer, GPU shards and pinned host buffers, outlive the run (seen
        on the CPU: the engine is never collected), charged to every later contender."""
        from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

        self.engine.destroy()
        # ZeRO-3 pushes the model onto a module-level stack when it wraps it, and never pops it.
        stack = parameter_offload.FWD_MODULE_STACK
        stack[:] = [module for module in stack if module is not self.engine.module]
        # Its parameter coordinator caches which parameters each module releases in an
        # lru_cache on the class, keyed by the coordinator and the module (filled from the
        # second forward on, once the modules' order is traced); under an NVTX wrapper.
        coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
        release = vars(coordinator).get("_PartitionedParameterCoordinator__params_to_release")
        cached = inspect.getclosurevars(release).nonlocals.get("func", release) if release else None
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
