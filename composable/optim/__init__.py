"""Optimizers whose step needs more than the local shard of a parameter, the whole-matrix
mechanism they share (`whole_matrices`), for any other function of whole matrices, and an
optimizer's state kept in host memory between steps (`offload_optimizer_state`), and the host step
of CPU-offloaded parameters run during backward (`step_in_backward`)."""

from ._whole_matrices import whole_matrices
from .host_step import HostStepInBackward, step_in_backward
from .muon import Muon
from .state_offload import OptimizerStateOffload, offload_optimizer_state

__all__ = [
    "HostStepInBackward",
    "Muon",
    "OptimizerStateOffload",
    "offload_optimizer_state",
    "step_in_backward",
    "whole_matrices",
]
