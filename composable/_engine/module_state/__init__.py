"""Module state: the hooks that drive groups through a training step.

state           `ModuleState`: forward/backward hooks, root detection, lazy init; one state
                may serve several modules
root_context    the hooks' training state and what the root keeps for the whole tree
finalize        `BackwardEnd`: the end of backward of one tree (the final callback, manual
                finalization: `finalize_backward`, a backward autograd did not end)
reset           `reset_iter_state`: ending an iteration an exception aborted
unshard_handle  what `unshard(async_op=True)` returns
"""
