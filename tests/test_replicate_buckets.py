"""replicate beyond plain parity with DDP: unused parameters (DDP's find_unused_parameters
semantics), a replicate nested under another sending each bucket once per backward, and the
persistent replica buffer that mixed precision casts into."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import assert_close_tensors, count_collectives, run_on_ranks
from test_replicate import Chain, Tree, data, loss_fn, params_of
from torch.nn.parallel import DistributedDataParallel as DDP

from composable import MixedPrecisionPolicy, replicate


class Branchy(nn.Module):
    """`extra` is used only on the ranks (and steps) the caller asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Chain()
        self.extra = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.body(x)
        return self.extra(out) if use_extra else out


def _unused_parameters(rank: int, world_size: int, used_on: str) -> None:
    torch.manual_seed(5)
    model = Branchy()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    replicate(model, bucket_cap_mb=1e-9)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        use = {"none": False, "rank1": rank == 1}[used_on]
        x, y = data(step, rank)
        F.mse_loss(model(x, use), y).backward()
        F.mse_loss(ref(x, use), y).backward()
        for (n, p), q in zip(model.named_parameters(), ref.module.parameters()):
            assert (p.grad is None) == (q.grad is None), (n, step, p.grad, q.grad)
            if q.grad is not None:
                assert_close_tensors(p.grad, q.grad, exact=True, msg=f"grad {n} step {step}")
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        assert_close_tensors(params_of(model), dict(ref.module.named_parameters()), exact=True, msg=f"step {step}")


@pytest.mark.parametrize(
    "used_on",
    [
        "none",  # unused everywhere: gradients stay None, as with DDP
        "rank1",
    ],
)
def test_unused_parameters_match_ddp_find_unused(used_on: str) -> None:
    run_on_ranks(_unused_parameters, 2, used_on=used_on)


def _replicated_child_counts(rank: int, world_size: int) -> list[int]:
    """replicate on an inner module whose inputs require grad: its post-backward and the end of
    backward both flush; the second flush must not re-send the buckets."""
    model = Tree()
    model.b.register_parameter("unused", nn.Parameter(torch.zeros(2)))  # its bucket waits for a flush
    replicate(model.b, bucket_cap_mb=1e-9)  # weight, bias, unused: one bucket each
    counts = []
    for step in range(3):
        with count_collectives() as comm:
            loss_fn(model, data(step, rank)).backward()
        counts.append(comm.counts["all_reduce"])
    return counts


def test_inner_replicate_sends_each_bucket_once_per_backward() -> None:
    assert run_on_ranks(_replicated_child_counts, 2) == [[3, 3, 3]] * 2


def _replica_buffer(rank: int, world_size: int) -> dict:
    """bf16 compute: the unsharded parameters are views of one buffer (one cast, no per-
    parameter copies), the same objects every step, freed after backward; two forwards
    before one backward still work, and match two separate steps' gradient sum."""
    torch.manual_seed(0)
    model = Chain()
    ref = copy.deepcopy(model)
    replicate(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    group = replicate.state(model).groups[0]
    seen = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        out1 = model(x)
        ups = [mp.unsharded_param for mp in group.params]
        seen.append([id(p) for p in ups])
        storages = {p.untyped_storage().data_ptr() for p in ups}
        assert len(storages) == 1, "unsharded parameters should share one replica buffer"
        assert all(p.dtype == torch.bfloat16 for p in ups)
        out2 = model(x.flip(0))  # a second forward refills the buffer before any backward
        (out1.float().sum() + out2.float().sum()).backward()
        assert group._replica_flat.untyped_storage().size() == 0, "the replica buffer is freed after backward"
    assert seen[0] == seen[1], "the unsharded parameter objects (and their hooks) are kept across steps"
    # The reference: the same two forwards in bf16 on a plain copy, gradients averaged over ranks.
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
    (ref_bf16(x).float().sum() + ref_bf16(x.flip(0)).float().sum()).backward()
    grads = {n: p.grad.float() for n, p in ref_bf16.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
        g.div_(world_size)
    ours = {n: p.grad.to_local() for n, p in model.named_parameters()}
    return {n: ((ours[n] - grads[n]).abs().max() / grads[n].abs().max().clamp_min(1e-6)).item() for n in grads}


def test_replicate_casts_into_one_persistent_replica_buffer() -> None:
    for relative_errors in run_on_ranks(_replica_buffer, 2):
        # Both sides compute in bf16 (a few ulps apart: where the sums are rounded differs).
        assert max(relative_errors.values()) < 2e-2, relative_errors
