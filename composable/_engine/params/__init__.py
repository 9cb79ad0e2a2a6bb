"""Parameters: which ones a call manages and how each one is laid out.

claim             which parameters a call manages (bottom-up), with every slot they are registered under
param             `ManagedParam`: one parameter's sharded DTensor and its unsharded twin
spmd              `dp_mesh_dims`: the whole SPMD mesh and its data-parallel dims
annotated         spmd_types-annotated plain tensors (torchtitan's default backend) stored as DTensors
placement_result  `shard_placement_fn` results (`Shard`, None, FSDP2's `ShardPlacementResult`)
wrappers          cheap, picklable DTensor wrappers around local shards; state_dict values re-wrapped
"""
