"""Gradients: what happens to them between backward and the optimizer.

reduce          `GradReducer`: a group's reduce-scatter (+ HSDP all-reduce) or all-reduce,
                launched async at post-backward, finished into sharded `.grad`s
reduction       one launched reduction, its flat buffer's offsets, which parameters had a gradient
reduce_options  `ReduceOptions`: FSDP2's reduction knobs and the user's all-reduce hook
grad_dtype      the dtype gradients are made, summed and reduced in (as the installed FSDP2)
no_sync         `NoSyncSums`: the sums no-sync micro-steps keep out of sight, dropped by `zero_grad`
buckets         `replicate`'s DDP-style buckets, all-reduced from post-accumulate-grad hooks
local_norms     a rank's part of a gradient norm (clip_grad_norm_), per device and dtype
host_norms      host tensors' norms on a pool of threads, with the foreach norm's bits
"""
