"""Meshes and data-parallel layouts: where a group's shards live.

mesh           mesh validation, the default mesh, the compute device a mesh implies
layout         `DataParallelLayout`: which mesh dims shard and which replicate (SHARD, HSDP,
               REPLICATE), their process groups, worlds and ranks, decided once at the call
shard_dims     parameters sharded on a dim > 0: each rank region's natural layout in the flat buffers
"""
