"""Opt-in glue between composable and the training frameworks that expect PyTorch FSDP2.

Nothing in the core imports this package; import the module for your framework:

- `composable.integrations.accelerate`: HF accelerate / Trainer's FSDP2 path (`fsdp_version=2`)
  shards with composable's `fully_shard`.
- `composable.integrations.torchtitan`: torchtitan's parallelize code with composable's
  `fully_shard` in place of FSDP2's (0.3: every decoder model; 0.2: llama3's `parallelize_fn`).
- `composable.integrations.torchft`: torchft's per-step fault tolerance: HSDP's replicate
  dimension across replica groups through a torchft `Manager` (a group dies, the others step on;
  a restarted group heals from a live one).
- `composable.integrations.fsdp2_module`: the shared adapter both build on: gives a module that
  `fully_shard` manages PyTorch FSDP2's module interface (`isinstance(m, FSDPModule)`,
  `m.set_requires_gradient_sync(...)`, ...), for code that calls FSDP2's methods on modules.

Each framework is imported lazily, so this package imports without any of them.
"""
