"""The engine `fully_shard` and `replicate` share (front ends -> engine -> collectives).

build        claim -> layout -> managed params -> group (the one construction path)
replicas     replicate's start: metadata check across ranks, coalesced broadcast of rank 0's values
state        per-module state: forward/backward hooks, root context, final callback;
             unshard_handle: what its unshard(async_op=True) returns
autograd     the autograd functions and hooks the state attaches to inputs and outputs
group        a parameter group: sharded storage, unshard / reshard / reduce_grads
extension    FSDP2's all-gather extension (subclass weights: float8, NF4); extension_batch: a
             group's extension inputs in one collective (riding in the flat gather, or alone)
param        one parameter's layouts (sharded DTensor, unsharded twin) and bookkeeping
spmd         dp_mesh_dims: the whole SPMD mesh, its data-parallel dims; annotated: parameters
             carrying spmd_types annotations (torchtitan's default), stored as DTensors on it
layout       the data-parallel layout (mesh, placements, shard/replicate groups, ranks)
reduce       gradient reduction (reduce-scatter, all-reduce); buckets: replicate's buckets;
             no_sync: the sums no-sync micro-steps keep
optim_state  optimizer step counters of managed parameters on their mesh (cheap DTensor steps)
collectives  flat collectives that know nothing of modules (over one rank: a copy, no collective);
             streams: CUDA streams/events
contract     how an API installs and finds its state; claim: which parameters a call manages
mesh         mesh validation, the default mesh, the compute device
"""
