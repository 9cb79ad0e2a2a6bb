"""Parameter groups: the parameters one API call manages on one module, and how they are built.

build      the one construction path of both front ends: claim -> same model on every rank ->
           layout -> managed parameters -> group(s)
group      `ParamGroup`: flat sharded storage, `unshard` / `reshard` / `reduce_grads`
group_set  several groups of one state (per-parameter meshes: MoE experts on their own mesh)
"""
