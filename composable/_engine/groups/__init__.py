"""Parameter groups: the parameters one API call manages on one module, and how they are built.

build      the one construction path of both front ends: claim -> same model on every rank ->
           layout -> managed parameters -> groups (one per mesh: per-parameter meshes make several)
group      `ParamGroup`: flat sharded storage, `unshard` / `reshard` / `reduce_grads`
"""
