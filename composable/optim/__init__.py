"""Optimizers whose step needs more than the local shard of a parameter, the whole-matrix
mechanism they share (`whole_matrices`), for any other function of whole matrices, and an
optimizer's state kept in host memory between steps (`offload_optimizer_state`)."""

from ._whole_matrices import whole_matrices
from .muon import Muon
from .state_offload import OptimizerStateOffload, offload_optimizer_state

__all__ = ["Muon", "OptimizerStateOffload", "offload_optimizer_state", "whole_matrices"]
