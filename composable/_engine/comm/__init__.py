"""Communication: knows nothing of modules, parameters or groups (the engine's ground floor).

collectives    flat and coalesced all-gather / reduce-scatter / all-reduce on plain tensors and
               process groups, the copies around them; over a group of one rank a copy (`Done`)
custom_comms   FSDP2's `AllGather` / `ReduceScatter` interface: buffers from the process group or
               symmetric memory, a user's own collective through the same path
streams        CUDA streams (all-gather at high priority, reduce) and event-based buffer lifetimes
profiling      `composable::<name>` ranges in profiler traces, free while no profiler runs
"""
