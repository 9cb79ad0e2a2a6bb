"""Dtypes: mixed-precision and offload policies, and torchao float8 weights cast per group.

policies       `MixedPrecisionPolicy`, `OffloadPolicy`, `CPUOffloadPolicy` (re-exported by
               `composable`), `check_policies`
float8_cast    a group's float8 weights cast for their all-gather in one batch
float8_kernel  that cast on CUDA as one Triton launch per group
"""
