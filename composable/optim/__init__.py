"""Optimizers whose step needs more than the local shard of a parameter, and the host step of
a CPU-offloaded model run behind the next forward."""

from .host_step import HostStepOverlap, overlap_host_step
from .muon import Muon

__all__ = ["HostStepOverlap", "Muon", "overlap_host_step"]
