"""How an API attaches to a module: its state, autograd plumbing, the compile boundary.

contract          install and find an API's state on a module (no class swap, no renamed
                  parameters); which APIs own parameters; argument checks the front ends share
autograd          the function whose backward ends a module's backward, the pre-backward hook,
                  traversal and casting of nested inputs and outputs, `run_eagerly`
compile_boundary  torch.compile's graph starts at `forward`, after the eager hooks
pipeline_guard    refuses a pipeline stage that would reduce once per microbatch
"""
