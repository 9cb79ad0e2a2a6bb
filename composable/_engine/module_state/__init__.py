"""Module state: the hooks that drive groups through a training step.

state           `ModuleState`: forward/backward hooks, root detection, lazy init, the
                end-of-backward callback; one state may serve several modules
root_context    the hooks' training state and what the root keeps for the whole tree
finalize        the end of backward (and manual finalization: `finalize_backward`)
reset           ending an iteration outside autograd (`reset_iter_state`, pipeline schedules)
unshard_handle  what `unshard(async_op=True)` returns
"""
