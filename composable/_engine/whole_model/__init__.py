"""The model as a whole, across ranks and over time: every rank built the same one, and nothing
is added to a managed module after the call.

replicas     every rank built the same model; `replicate` broadcasts rank 0's values
late_params  parameters registered on a managed module after the call are refused by name
"""
