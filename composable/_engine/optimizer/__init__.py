"""The optimizer's step as the engine meets it: counters and checks before each step.

optim_state  optimizer step pre-hook: step counters on the parameters' mesh, no replaced parameters
"""
