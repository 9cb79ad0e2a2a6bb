"""ShardedGradScaler: each unscale path (plain, fp16, sparse, DTensor, offloaded), agreement of
inf/NaN over ranks with one all_reduce, skip/backoff/growth, state_dict, argument errors, and
fp16 training with the scaler tracking fp32 training.
"""

from __future__ import annotations

import math

import pytest
import torch
from _harness import assert_close_tensors, count_collectives, requires_gpus, run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from composable.grad_scaler import ShardedGradScaler


def _params_with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype, device=g.device)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return params


def _skipped(scaler: ShardedGradScaler, opt: torch.optim.Optimizer) -> bool:
    """Whether the step of this iteration found inf/NaN (before update())."""
    return sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0


# --- arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"init_scale": "big"}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 1.5}, "growth_interval"),
        ({"enabled": "yes"}, "enabled"),
        ({"process_group": "world"}, "process_group"),
    ],
)
def test_bad_arguments(kwargs: dict, name: str) -> None:
    value = next(iter(kwargs.values()))
    exc = TypeError if name in ("enabled", "process_group") else ValueError
    with pytest.raises(exc, match=rf"ShardedGradScaler: {name} .*{value!r}"):
        ShardedGradScaler(**kwargs)


# --- scale ------------------------------------------------------------------------------


def test_scale_nested_outputs_keeps_structure_and_dtype() -> None:
    scaler = ShardedGradScaler(init_scale=4.0)
    a, b = torch.tensor(1.0), torch.tensor([2.0, 3.0], dtype=torch.float16)
    out = scaler.scale([a, (b, [a, (a,)])])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1][1], tuple)
    assert out[0].item() == 4.0 and out[1][1][1][0].item() == 4.0
    assert out[1][0].dtype == torch.float16 and out[1][0].tolist() == [8.0, 12.0]
    assert scaler.get_scale() == 4.0
    with pytest.raises(ValueError, match="ShardedGradScaler.scale"):
        scaler.scale([a, 3.0])


def test_disabled_scaler_is_transparent() -> None:
    scaler = ShardedGradScaler(enabled=False)
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss
    (p,) = _params_with_grads([torch.ones(2)])
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert p.tolist() == [-1.0, -1.0] and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_step_before_scale_raises() -> None:
    (p,) = _params_with_grads([torch.ones(2)])
    opt = torch.optim.SGD([p], lr=1.0)
    for call in (ShardedGradScaler().unscale_, ShardedGradScaler().step):
        with pytest.raises(RuntimeError, match=r"ShardedGradScaler\.\w+\(\) was called before"):
            call(opt)


# --- unscale_ paths ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_plain_grads(dtype: torch.dtype) -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    scaler.scale(torch.tensor(1.0))
    grads = [torch.tensor([1.0, -2.0], dtype=dtype), torch.tensor([[0.5]], dtype=dtype)]
    params = _params_with_grads([g * 8 for g in grads])
    opt = torch.optim.SGD(params, lr=1.0)
    scaler.unscale_(opt)
    assert_close_tensors([p.grad for p in params], grads, exact=True)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)  # no second unscale inside step
    assert_close_tensors([p.detach() for p in params], [-g for g in grads], exact=True)
    scaler.update()
    assert scaler.get_scale() == 8.0 and scaler.state_dict()["_growth_tracker"] == 1


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch 2.11 warns anyway
def test_sparse_grads_fp32_and_fp16_overflow_when_coalesced() -> None:
    idx = torch.tensor([[1, 1, 3]])  # index 1 twice: coalescing adds those values
    # fp32: unscaled correctly, duplicates or not.
    scaler = ShardedGradScaler(init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    (p,) = _params_with_grads(
        [torch.sparse_coo_tensor(idx, torch.tensor([4.0, 8.0, 12.0]), (5,), check_invariants=True)]
    )
    opt = torch.optim.SGD([p], lr=1.0)
    assert scaler.step(opt) is None and not _skipped(scaler, opt)
    assert p.detach().tolist() == [0.0, -3.0, 0.0, -3.0, 0.0]

    # fp16: each value is finite, their sum at index 1 is not (40000 + 40000 > 65504).
    scaler = ShardedGradScaler(init_scale=1.0)
    scaler.scale(torch.tensor(1.0))
    vals = torch.tensor([40000.0, 40000.0, 1.0], dtype=torch.float16)
    (p,) = _params_with_grads([torch.sparse_coo_tensor(idx, vals, (5,), check_invariants=True)])
    opt = torch.optim.SGD([p], lr=1.0)
    before = p.detach().clone()
    assert scaler.step(opt) is None and _skipped(scaler, opt)
    assert torch.equal(p.detach(), before)
    scaler.update()
    assert scaler.get_scale() == 0.5


def test_grads_on_another_device_than_the_scale() -> None:
    """CPU-offloaded gradients while the loss (hence the scale) is on an accelerator."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    scaler = ShardedGradScaler(init_scale=2.0)
    scaler.scale(torch.ones((), device="cuda"))
    params = _params_with_grads([torch.tensor([2.0, math.inf]), torch.tensor([4.0])])
    opt = torch.optim.SGD(params, lr=1.0)
    assert scaler.step(opt) is None and _skipped(scaler, opt)
    assert params[1].grad.item() == 2.0 and params[1].item() == 0.0  # unscaled, not stepped
    scaler.update()
    assert scaler.get_scale() == 1.0


# --- skip, backoff, growth, state_dict ----------------------------------------------------


def test_backoff_on_inf_and_growth_after_interval() -> None:
    scaler = ShardedGradScaler(init_scale=16.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    (p,) = _params_with_grads([torch.zeros(2)])
    opt = torch.optim.SGD([p], lr=1.0)
    history = []
    for bad in (False, False, True, False, False, False, False):
        scaler.scale(torch.tensor(1.0))
        p.grad = torch.tensor([math.nan if bad else 16.0, 0.0])
        before = p.detach().clone()
        scaler.step(opt)
        assert torch.equal(p.detach(), before) == bad  # skipped exactly when bad
        scaler.update()
        history.append(scaler.get_scale())
    # 2 clean, backoff to 4, 3 clean -> grow to 16, 1 clean.
    assert history == [16.0, 16.0, 4.0, 4.0, 4.0, 16.0, 16.0]
    assert scaler.state_dict()["_growth_tracker"] == 1


def test_state_dict_round_trip_and_torch_compatibility() -> None:
    scaler = ShardedGradScaler(init_scale=32.0, growth_interval=5)
    (p,) = _params_with_grads([torch.ones(1)])
    opt = torch.optim.SGD([p], lr=0.1)
    for bad in (True, False, False):
        scaler.scale(torch.tensor(1.0))
        p.grad = torch.tensor([math.inf if bad else 1.0])
        scaler.step(opt)
        scaler.update()
    state = scaler.state_dict()
    assert state == {
        "scale": 16.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 5,
        "_growth_tracker": 2,
    }
    fresh = ShardedGradScaler()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and fresh.get_scale() == 16.0
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)
    assert theirs.state_dict() == state


_GOOD_STATE = {"scale": 16.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5, "_growth_tracker": 2}


@pytest.mark.parametrize(
    "state,exc,match",
    [
        # This one raised KeyError 'growth_factor'
        ({"scale": "x"}, TypeError, r"state_dict\['scale'\] must be a finite number > 0, got 'x' \(str\)"),
        (
            {"scale": 8.0},
            ValueError,
            (
                r"state_dict is missing key\(s\) 'growth_factor', 'backoff_factor', "
                r"'growth_interval', '_growth_tracker' \(it has \['scale'\]\)"
            ),
        ),
        (
            {**_GOOD_STATE, "growth_interval": 2.5},
            TypeError,
            r"state_dict\['growth_interval'\] must be an int > 0, got 2.5",
        ),
        ({**_GOOD_STATE, "_growth_tracker": None}, TypeError, r"state_dict\['_growth_tracker'\] .*got None"),
        ({**_GOOD_STATE, "scale": True}, TypeError, r"state_dict\['scale'\] .*got True"),
        ({**_GOOD_STATE, "scale": math.nan}, ValueError, r"state_dict\['scale'\] must be a finite number > 0, got nan"),
        (
            {**_GOOD_STATE, "growth_factor": 0.5},
            ValueError,
            r"state_dict\['growth_factor'\] must be a finite number > 1, got 0.5",
        ),
        (
            {**_GOOD_STATE, "backoff_factor": 2},
            ValueError,
            r"state_dict\['backoff_factor'\] must be a number in \(0, 1\), got 2",
        ),
        (
            {**_GOOD_STATE, "_growth_tracker": -1},
            ValueError,
            r"state_dict\['_growth_tracker'\] must be an int >= 0, got -1",
        ),
        ([("scale", 1.0)], TypeError, r"state_dict must be a dict .*got \[\('scale', 1.0\)\] \(list\)"),
        ({}, RuntimeError, r"state_dict is empty"),
    ],
)
def test_load_state_dict_names_the_bad_key_and_value(state: object, exc: type, match: str) -> None:
    scaler = ShardedGradScaler(init_scale=4.0)
    scaler.scale(torch.tensor(1.0))  # the scale tensor exists: a failed load must not touch it
    before = scaler.state_dict()
    with pytest.raises(exc, match=rf"^ShardedGradScaler\.load_state_dict: {match}"):
        scaler.load_state_dict(state)  # type: ignore[arg-type]
    assert scaler.state_dict() == before


def test_load_state_dict_takes_numbers_of_any_kind_and_ignores_extra_keys() -> None:
    scaler = ShardedGradScaler()
    scaler.load_state_dict({**_GOOD_STATE, "scale": torch.tensor(16), "growth_factor": 2, "note": "extra"})
    assert scaler.state_dict() == _GOOD_STATE
    assert all(type(v) is type(_GOOD_STATE[k]) for k, v in scaler.state_dict().items())


# --- several ranks --------------------------------------------------------------------------


def _inf_on_one_rank(rank: int, world_size: int, n_params: int) -> list[float]:
    """DTensor (fp32 and fp16) and plain grads; rank 1 alone gets an inf in its shard."""
    mesh = init_device_mesh("cpu", (world_size,))
    params = []
    for i in range(n_params):
        dtype = torch.float16 if i % 2 else torch.float32
        p = torch.nn.Parameter(distribute_tensor(torch.randn(6, 2, dtype=dtype), mesh, [Shard(0)], src_data_rank=None))
        params.append(p)
    params.append(torch.nn.Parameter(torch.randn(3)))
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = ShardedGradScaler(init_scale=1024.0, growth_interval=1)
    scales = []
    for step in range(3):
        loss = sum(p.float().sum() for p in params[:-1]).full_tensor() + params[-1].sum()
        scaler.scale(loss).backward()
        if step == 1 and rank == 1:
            params[0].grad._local_tensor[0, 0] = math.inf
        before = [p.detach().clone() for p in params]
        with count_collectives() as comms:
            assert scaler.step(opt) is None
        # One all_reduce for found_inf, whatever the number of parameters and dtypes.
        assert comms.counts["all_reduce"] == comms.total == 1, comms.events
        stepped = [
            not torch.equal(
                b._local_tensor if isinstance(b, DTensor) else b,
                p._local_tensor if isinstance(p, DTensor) else p.detach(),
            )
            for b, p in zip(before, params)
        ]
        assert all(stepped) if step != 1 else not any(stepped), (step, stepped)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return scales


def test_inf_on_one_rank_makes_every_rank_skip_and_back_off() -> None:
    results = run_on_ranks(_inf_on_one_rank, 2, n_params=10)
    assert results[0] == results[1] == [2048.0, 1024.0, 2048.0]


def _fused_adam_inf_on_one_rank(rank: int, world_size: int) -> float:
    """Optimizers that unscale themselves (fused Adam) also get the agreed found_inf."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([p], lr=0.1, fused=True)
    scaler = ShardedGradScaler(init_scale=8.0)
    scaler.scale(p.sum()).backward()
    if rank == 1:
        p.grad[0] = math.nan
    before = p.detach().clone()
    scaler.step(opt)
    assert torch.equal(p.detach(), before)
    scaler.update()
    return scaler.get_scale()


def test_fused_optimizer_skips_on_every_rank() -> None:
    assert run_on_ranks(_fused_adam_inf_on_one_rank, 2) == [4.0, 4.0]


# --- fp16 training tracks fp32 training ---------------------------------------------------


def test_fp16_training_with_scaler_tracks_fp32() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    half = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    half.load_state_dict(ref.state_dict())
    half.half()
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_half = torch.optim.SGD(half.parameters(), lr=0.1)
    # 2**24 overflows fp16 at once: the first steps are skipped until the scale settles.
    scaler = ShardedGradScaler(init_scale=2.0**24, growth_interval=3)
    taken = skipped = 0
    while taken < 6:
        assert skipped < 20
        loss_half = torch.nn.functional.mse_loss(half(x.half()).float(), y)
        scaler.scale(loss_half).backward()
        scaler.step(opt_half)
        if _skipped(scaler, opt_half):
            skipped += 1
        else:
            taken += 1
            loss_ref = torch.nn.functional.mse_loss(ref(x), y)
            loss_ref.backward()
            opt_ref.step()
            assert_close_tensors(loss_half.detach(), loss_ref.detach(), rtol=1e-2, atol=1e-3)
        scaler.update()
        opt_half.zero_grad()
        opt_ref.zero_grad()
    assert skipped >= 1  # the backoff path ran
    for (name, a), b in zip(half.named_parameters(), ref.parameters()):
        assert_close_tensors(a.detach().float(), b.detach(), rtol=1e-2, atol=5e-3, msg=name)


@requires_gpus(1)
def test_offloaded_grads_with_a_gpu_loss_on_two_ranks() -> None:
    assert run_on_ranks(_offloaded, 2) == [1.0, 1.0]


def _offloaded(rank: int, world_size: int) -> float:
    """Scale on the GPU, gradients on the CPU, gloo across ranks; inf on rank 0 only. The GPU
    is kept busy as the step starts, so copies of the scale to the CPU that do not wait for the
    GPU arrive after the CPU has used them (the inf went unseen, the gradients were unscaled by
    whatever the buffer held)."""
    scaler = ShardedGradScaler(init_scale=2.0)
    scaler.scale(torch.ones((), device="cuda"))
    params = _params_with_grads([torch.tensor([math.inf if rank == 0 else 2.0]), torch.tensor([4.0])])
    opt = torch.optim.SGD(params, lr=1.0)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the scaler's copies
    with count_collectives() as comms:
        scaler.step(opt)
    assert comms.counts["all_reduce"] == 1 and params[1].item() == 0.0  # skipped
    assert params[1].grad.item() == 2.0  # unscaled by 1/2 on every rank
    scaler.update()
    return scaler.get_scale()
