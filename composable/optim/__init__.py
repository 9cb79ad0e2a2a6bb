"""Optimizers whose step needs more than the local shard of a parameter, and the whole-matrix
mechanism they share (`whole_matrices`), for any other function of whole matrices."""

from ._whole_matrices import whole_matrices
from .muon import Muon

__all__ = ["Muon", "whole_matrices"]
