"""Per-step fault tolerance with torchft: HSDP whose replicate dimension is a torchft `Manager`
(or `replicate` within each replica group, the groups averaged by it).

Each replica group is a torch.distributed world of its own (its own `torchrun`), sharding the
model with composable's `fully_shard` on a 2D `(replicate, shard)` mesh of its ranks (the
replicate dimension inside a group is usually 1). `fault_tolerant(model, optimizer, manager)`
extends that replicate dimension across the groups the torchft `Manager` keeps in its quorum:

- each reduced gradient is averaged over the live groups by `manager.allreduce` (run from
  `set_all_reduce_hook`, after the group's own reduce-scatter and replicate all-reduce);
- `zero_grad()` starts the step's quorum, `step()` steps the optimizer only where
  `manager.should_commit()` says every live group reduced cleanly;
- the Manager's checkpoint transport serves this rank's shards of the parameters, buffers and
  optimizer state, so a group that (re)joins loads them from a live group's same rank and steps
  on with the same bits.

A group that dies drops out of the quorum; the others keep stepping with the gradients averaged
over those left; a restarted group heals from a live one and rejoins.

    from torchft import Manager, ProcessGroupGloo  # or ProcessGroupNCCL / ProcessGroupBabyNCCL
    from composable.integrations.torchft import fault_tolerant

    mesh = init_device_mesh("cuda", (1, group_size), mesh_dim_names=("replicate", "shard"))
    fully_shard(block, mesh=mesh) for each block; fully_shard(model, mesh=mesh)
    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None,
                      min_replica_size=1, replica_id=f"group_{i}", lighthouse_addr=...)
    optimizer = fault_tolerant(model, torch.optim.AdamW(model.parameters()), manager)
    for batch in data:
        optimizer.zero_grad()        # before the forward: joins the step's quorum
        loss_fn(model(batch)).backward()
        optimizer.step()             # True where the step was committed

The core package never imports torchft; this module imports it when `fault_tolerant` runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from composable import fully_shard, replicate
from composable.fsdp import ShardingStrategy

from .torchft_manager import create_manager, import_torchft_manager

__all__ = ["create_manager", "fault_tolerant", "FaultTolerantOptimizer"]

_API = "fault_tolerant"
_KEY = "composable"  # the name of this state in the Manager's state dict
_TESTED_TORCHFT = "0.2.0"  # the torchft whose private Manager._quorum_id `_quorum_id` reads


def _torchft_version() -> str:
    try:
        return importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree
        return "(version unknown)"


def _quorum_id(manager: Any) -> Any:
    """The id of `manager`'s current quorum (torchft gives a new one whenever the membership
    changes). Raises `RuntimeError` in one line naming the installed torchft when its Manager no
    longer has it.

    The one private torchft attribute composable reads: torchft 0.2.0's Manager keeps the id in
    `_quorum_id` and offers no public accessor nor a callback on a new quorum. Its public
    `num_participants()` and `participating_rank()` stay the same when a group is replaced by one
    of another size, and checking the sizes every step instead would add two collectives to
    each. A public quorum id (or reconfiguration callback) on the Manager would replace this."""
    try:
        return manager._quorum_id
    except AttributeError:
        raise RuntimeError(
            f"{_API}: torchft {_torchft_version()}'s Manager has no '_quorum_id', the private attribute "
            f"composable reads to tell a new quorum (torchft {_TESTED_TORCHFT} has it); install torchft "
            f"{_TESTED_TORCHFT}"
        ) from None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _replica_dim_states(model: nn.Module) -> list[Any]:
    """The states whose data-parallel reduction the replica groups extend: `fully_shard`'s, each
    checked to shard on a mesh with a replicate dimension (HSDP), and `replicate`'s."""
    states = [s for m in model.modules() if (s := fully_shard.state(m)) is not None]
    replicated = [r for m in model.modules() if (r := replicate.state(m)) is not None]
    if not states and not replicated:
        raise ValueError(
            f"{_API}: 'model' has no module sharded by composable's fully_shard or replicated by replicate"
        )
    for state in states:
        if state.strategy is not ShardingStrategy.HYBRID_SHARD:
            mesh = state.mesh
            raise ValueError(
                f"{_API}: 'model' is sharded on a mesh without a replicate dimension "
                f"(shape {tuple(mesh.shape)}, dims {mesh.mesh_dim_names}, strategy {state.strategy.name}); "
                "the replica groups extend HSDP's replicate dimension: shard on a 2D (replicate, shard) mesh"
            )
    return states + replicated


class FaultTolerantOptimizer:
    """`optimizer` stepped under a torchft `Manager` (what `fault_tolerant` returns): `zero_grad`
    starts the step's quorum, `step` steps only a committed step. `state_dict`/`load_state_dict`
    are the wrapped optimizer's (for periodic checkpoints, with `manager.state_dict()`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, manager: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.manager = manager
        self.group_world_size = dist.get_world_size()
        # Taken now, between steps: the Manager reads them from its quorum thread while the
        # forward runs, when the module attributes hold the gathered (unsharded) parameters.
        self._named_params = list(model.named_parameters())
        self._named_buffers = list(model.named_buffers())
        self._checked_quorum: Any = None  # the quorum whose group sizes were checked

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's (an lr schedule sets them here as usual)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step's quorum (asynchronously: it overlaps the forward; a recovering group
        fetches the live state meanwhile) and zero the gradients. Call it before the forward."""
        self.manager.start_quorum()
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> bool:
        """Step the optimizer if every live replica group reduced this step's gradients cleanly
        (`manager.should_commit()`, which also loads the state a recovering group fetched);
        return whether it stepped. A step not committed leaves parameters and optimizer state
        as they were; the next `zero_grad` retries with a fresh quorum."""
        if not self.manager.should_commit():
            return False
        self.optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (a checkpoint's; healing does not use it)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state dict (from a checkpoint)."""
        self.optimizer.load_state_dict(state_dict)

    # -- the Manager's hooks ----------------------------------------------------------------
    def _all_reduce(self, grads: torch.Tensor) -> None:
        manager = self.manager
        manager.wait_quorum()
        # The quorum's id changes with its membership, the only time a group of another size
        # can appear: the sizes are checked once per quorum, not every step.
        quorum = _quorum_id(manager)
        if quorum != self._checked_quorum and self._check_group_sizes(grads.device):
            self._checked_quorum = quorum
        # The Manager averages over the groups in the quorum (a recovering group contributes
        # zeros and is not counted); an error is recorded by the Manager and makes
        # `should_commit` false, so the step is skipped rather than raised here.
        manager.allreduce(grads).wait()

    def _check_group_sizes(self, device: torch.device) -> bool:
        """Raise if the groups in this quorum have another number of ranks than this one (their
        shards would not line up). Every group has a rank 0, so only ranks 0 meet over the
        Manager and each tells its group: the other ranks of a larger group have no peer there.
        Returns whether the check ran (not when this step's Manager errored: it is not committed,
        and the next one checks again)."""
        t = torch.zeros(3, device=device)
        if dist.get_rank() == 0:
            t[0], t[1] = self.group_world_size, 1.0  # a recovering group sends zeros: not counted
            self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
            t[2] = self.manager.errored() is not None
        dist.broadcast(t, src=0)  # one verdict for the group, from its rank 0
        ranks, groups, errored = t.tolist()
        if errored:
            return False
        if groups and ranks != self.group_world_size * groups:
            raise ValueError(
                f"{_API}: replica groups of different sizes in one quorum: this group has "
                f"{self.group_world_size} ranks, the {int(groups)} live groups {int(ranks)} in all; "
                "every replica group must have the same number of ranks"
            )
        return True

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _live_state(self) -> dict[str, Any]:
        """This rank's shards: what a recovering group's same rank loads. The tensors are the
        live ones, not copies: the Manager serves them only until this step's `should_commit`,
        before the optimizer changes them."""
        states, dtensors = [], []
        for p in self._params():
            st = self.optimizer.state.get(p, {})
            states.append({k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()})
            dtensors.append(
                {k: (list(v.placements), tuple(v.shape), v.stride()) for k, v in st.items() if isinstance(v, DTensor)}
            )
        return {
            "group_world_size": self.group_world_size,
            "params": {n: _local(p.detach()) for n, p in self._named_params},
            "buffers": {n: _local(b) for n, b in self._named_buffers},
            "optim_state": states,
            "optim_dtensors": dtensors,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }

    @torch.no_grad()
    def _load_live_state(self, sd: dict[str, Any]) -> None:
        """Take a live group's state (its same rank's shards) in place of this rank's."""
        if sd["group_world_size"] != self.group_world_size:
            raise ValueError(
                f"{_API}: this replica group has {self.group_world_size} ranks, the live group it heals "
                f"from has {sd['group_world_size']}; every replica group must have the same number of ranks"
            )
        for n, param in self._named_params:
            _local(param).copy_(sd["params"][n])
        for n, b in self._named_buffers:
            _local(b).copy_(sd["buffers"][n])
        for p, st, dt in zip(self._params(), sd["optim_state"], sd["optim_dtensors"]):
            device = _local(p).device
            new = {}
            for k, v in st.items():
                if k in dt:  # a DTensor on the parameter's mesh: this rank's shard of it
                    placements, shape, stride = dt[k]
                    v = DTensor.from_local(
                        v.to(device),
                        cast(DTensor, p).device_mesh,
                        placements,
                        run_check=False,
                        shape=shape,
                        stride=stride,
                    )
                elif isinstance(v, torch.Tensor):
                    old = self.optimizer.state.get(p, {}).get(k)
                    v = v.to(old.device) if isinstance(old, torch.Tensor) else v
                new[k] = v
            self.optimizer.state[p] = new
        for g, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
            g.update(saved)


def fault_tolerant(model: nn.Module, optimizer: torch.optim.Optimizer, manager: Any) -> FaultTolerantOptimizer:
    """Run `model`'s HSDP replicate dimension through torchft's `manager` and return the
    optimizer to train with (a `FaultTolerantOptimizer`: `zero_grad()` before each forward,
    `step()` after backward).

    `model` is sharded by composable's `fully_shard` on a 2D `(replicate, shard)` mesh of this
    replica group's ranks (its own torch.distributed world), or replicated over them by
    composable's `replicate` (each group a data-parallel group of its own); `optimizer` holds its
    parameters; `manager` is this group's `torchft.Manager` (created with `load_state_dict=None,
    state_dict=None`: this registers composable's state with it). Every module fully_shard or
    replicate manages gets an all-reduce hook that averages its reduced gradients (replicate's:
    each bucket) over the live replica groups (it replaces a hook set before). Raises
    `ValueError` naming the mesh when a module is sharded without a replicate dimension, or when
    `model` has neither; a group that heals from one of another size raises `ValueError` in
    `step()`.
    """
    ft = import_torchft_manager(_API)
    states = _replica_dim_states(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_API}: 'optimizer' must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(manager, ft.Manager):
        raise TypeError(f"{_API}: 'manager' must be a torchft.Manager, got {type(manager).__name__}")
    wrapped = FaultTolerantOptimizer(model, optimizer, manager)
    try:
        manager.register_state_dict_fn(_KEY, wrapped._load_live_state, wrapped._live_state)
    except AssertionError:  # torchft asserts that a key is registered once
        raise ValueError(
            f"{_API}: 'manager' already serves a model's state (fault_tolerant was called with it before); "
            "one Manager per replica group and model"
        ) from None
    for state in states:
        state.set_all_reduce_hook(wrapped._all_reduce)
    return wrapped
