"""Unshard: all-gathering a group's shards into its unsharded parameters.

gather           direct (coalesced, into the parameters' own storages) or flat (+ one copy-out)
mixed_dtypes     groups whose parameters compute in different dtypes: gather once, cast each
extension        FSDP2's all-gather extension: subclass weights (float8, NF4) decide what travels
extension_batch  a group's extension inputs in one collective, riding in the flat gather or alone
device_copy      an offloaded shard's copy kept on the device, refreshed only after the host's changed
"""
