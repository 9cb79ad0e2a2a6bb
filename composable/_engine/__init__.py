"""The engine `fully_shard` and `replicate` share (front ends -> engine -> collectives).

One folder per concern; each folder's __init__ maps its files. From the top floor down (a
folder imports only folders below it; tests/test_engine_structure.py holds the order):

module_state  per-module state: forward/backward hooks, root context, the end of backward (one owner), reset
groups        parameter groups: the construction path (one group per mesh), flat sharded storage
unshard       all-gathering shards into unsharded parameters (direct, flat, mixed dtypes, the
              all-gather extension of subclass weights)
grads         gradient reduction (reduce-scatter, all-reduce, replicate's buckets, no-sync sums)
optimizer     the optimizer step's pre-hook: step counters on the parameters' mesh, checks
whole_model   every rank built the same model (replicate: made equal); no parameters added later
params        which parameters a call manages; one parameter's layouts; SPMD meshes
dtypes        mixed-precision and offload policies, float8 casts
hooks         installing and finding state on a module, autograd plumbing, the compile boundary
meshes        meshes and data-parallel layouts
comm          collectives on plain tensors, streams, profiler ranges (knows nothing of modules)
"""
