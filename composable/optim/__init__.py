"""Optimizers whose step needs more than the local shard of a parameter."""

from .muon import Muon

__all__ = ["Muon"]
